"""The fused MoE forward (training form, saved up rows) of one layer on moe_trace.layer_inputs: `clock` runs it
under clocks.run_window (ms, SM MHz, W, TF/s of its expert GEMMs); `ncu` runs one call between
cudaProfilerStart/Stop, for `ncu --profile-from-start off`.

    PYTHONPATH=.:benchmarks python3 benchmarks/moe_forward_clock.py clock deepseek_v3 16384
"""
import sys
import torch
sys.path.insert(0, "benchmarks")
from clocks import run_window
from measure import heat, profile_one
from moe_trace import layer_inputs
from kosmos.kernels import moe

mode, layer, T = sys.argv[1], sys.argv[2], int(sys.argv[3])
(hidden, rw, rb, corr, gu, down, k), kw = layer_inputs(layer, T)
cfg = moe.forward_configs(hidden, gu, k)[0]
fn = lambda: moe.moe_forward(hidden, rw, rb, corr, gu, down, k, **kw, config=cfg, save_up=True)
for _ in range(3):
    fn()
torch.cuda.synchronize()
H = hidden.shape[1]
I2 = gu.shape[1] if gu.shape[2] == H else gu.shape[2]
flops = 2 * T * k * H * I2 + 2 * T * k * (I2 // 2) * H
if mode == "clock":
    heat(fn)
    ms, mhz, watts, n = run_window(fn, 3.0)
    print(f"{layer} T={T} fused forward: {ms:.3f} ms, expert GEMMs {flops / ms / 1e9:.0f} TF/s, SM {mhz:.0f} MHz, "
          f"{watts:.0f} W, {flops / ms / 1e9 / (mhz / 1000):.1f} TF/s/GHz ({n} samples; gate_up {tuple(gu.shape)})")
else:
    profile_one(fn)
