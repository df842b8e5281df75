#!/usr/bin/env bash
# A/B of two kosmos trees on one GPU: runs a benchmark script from each checkout in alternation, ROUNDS times, each
# tree with its own Inductor and Triton caches (a shared Inductor cache hands one tree the other's compiled graphs:
# in the tenth session the old tree loaded the new tree's backward, a call with an argument its op did not have).
#   bash benchmarks/ab_trees.sh OLD_DIR NEW_DIR ROUNDS benchmarks/moe.py --ts 16384 --only deepseek --modes kosmos_default
# OLD_DIR / NEW_DIR: checkouts (e.g. `git worktree add ../old <rev>`); the script path is relative to each.
# Each run's output goes to $OUT/ab_<tree>_<round>.log (OUT default /tmp/kosmos_ab); the table rows of benchmarks/
# moe.py and the "AB" lines of benchmarks/moe_kernel_time.py are printed with the tree and round.
set -o pipefail
if [ $# -lt 4 ]; then
    echo "usage: $0 OLD_DIR NEW_DIR ROUNDS SCRIPT [ARGS...]" >&2
    exit 2
fi
old=$(cd "$1" && pwd) new=$(cd "$2" && pwd) rounds=$3
shift 3
OUT=${OUT:-/tmp/kosmos_ab}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
rc=0
for r in $(seq 1 "$rounds"); do
    for tree in old new; do
        dir=$old
        [ $tree = new ] && dir=$new
        log="$OUT/ab_${tree}_${r}.log"
        (cd "$dir" && TORCHINDUCTOR_CACHE_DIR="$OUT/inductor_$tree" TRITON_CACHE_DIR="$OUT/triton_$tree" \
            PYTHONPATH="$dir:$dir/benchmarks${PYTHONPATH:+:$PYTHONPATH}" python3 "$@") > "$log" 2>&1 || rc=1
        grep -E "^ +[a-z0-9_]+ +[0-9]+ \| fwd ms|^AB " "$log" | sed "s/^/$tree round $r: /" \
            || echo "$tree round $r: no result lines, see $log"
    done
done
exit $rc
