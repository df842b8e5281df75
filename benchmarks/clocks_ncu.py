"""One call of a clocks.py workload between cudaProfilerStart/Stop, for `ncu --profile-from-start off` (the hardware
counters of exactly that call):

    ncu --clock-control none --profile-from-start off --section SpeedOfLight python3 benchmarks/clocks_ncu.py \
        deepseek_v3 16384 kosmos_m
"""
import sys
sys.path.insert(0, "benchmarks")
from clocks import workloads
from measure import profile_one

layer, T, impl = sys.argv[1], int(sys.argv[2]), sys.argv[3]
fn, flops = workloads(layer, T)[impl]
for _ in range(3):
    fn()
profile_one(fn)
print(layer, T, impl, "TFLOP", flops / 1e12)
