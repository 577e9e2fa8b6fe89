#!/bin/sh
# Per-kernel GPU time of one `miles bench` step (nsys when present, else ncu), into $OUT.
#   sh tests/device/profile.sh train|logprob [bench flags…]
#   sh tests/device/profile.sh rollout --preset qwen3-0.6b --batch 64 --new-tokens 4 \
#     --disable-cuda-graph   (every kernel of the warm-up and the run: keep --new-tokens small)
set -u
what=$1; shift
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
if [ "$what" = rollout ]; then
  cmd="target/gpu/miles bench rollout --device cuda $*"
else
  cmd="target/gpu/miles bench $what --device cuda --steps 1 --warmup 1 $*"
fi
nsys=$(command -v nsys || ls /usr/local/cuda*/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1)
if [ -n "$nsys" ]; then
  $nsys profile -o /tmp/prof -f true --stats=false $cmd > /dev/null
  $nsys stats --report cuda_gpu_kern_sum --format csv -o "$OUT/kernels-$what" /tmp/prof.nsys-rep > /dev/null
  head -25 "$OUT/kernels-${what}_cuda_gpu_kern_sum.csv" | cut -c1-220
else
  ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
  $ncu --clock-control none --print-summary per-kernel --metrics gpu__time_duration.sum $cmd > "$OUT/ncu-$what.txt" 2>&1
  python3 tests/device/ncu_summary.py "$OUT/ncu-$what.txt"
fi
