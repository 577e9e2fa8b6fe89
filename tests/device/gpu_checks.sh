#!/bin/sh
# The GPU checks of issue 11 in one device call (run from the repository root, with the device
# bundle and target/gpu/{miles,hf_baseline.py} carried): the kernel and model tests, Qwen3-0.6B
# bf16 against HF, and the benchmarks beside HF transformers. Results under $OUT.
#   sh tests/device/gpu_checks.sh [tests|parity|sft|bench|kernels|all]
# Prepare here: cargo xtask device-bundle && cargo build --release -p miles-cli --features cuda &&
#   mkdir -p target/gpu && cp target/release/miles ../shared/bench/hf_baseline.py target/gpu/
# and carry target/device-bundle and target/gpu.
set -u
what=${1:-all}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
miles=target/gpu/miles
if [ "$what" = tests ] || [ "$what" = all ]; then
  target/device-bundle/run.sh > "$OUT/tests.txt" 2>&1
  grep -E "test result|FAILED|panicked" "$OUT/tests.txt"
fi
if [ "$what" = parity ] || [ "$what" = all ]; then
  d=/tmp/qwen3-parity
  mkdir -p $d
  python3 tests/device/qwen3_bf16_parity.py write $d 2>&1 | grep -v -i warn
  $miles score --hf-checkpoint $d --input $d/tokens.jsonl --device cuda --dtype bf16 --output $d/ours.jsonl
  $miles score --hf-checkpoint $d --input $d/tokens.jsonl --device cuda --dtype f32 --output $d/ours_f32.jsonl
  python3 tests/device/qwen3_bf16_parity.py compare $d | tee "$OUT/parity.json"
fi
if [ "$what" = sft ] || [ "$what" = all ]; then
  # The demo's addition table, supervised, on the GPU and on the CPU: the loss curves side by side.
  for dev in cuda cpu; do
    $miles train --device $dev --loss-type sft_loss --sft-warmup-steps 0 --lr 3e-3 \
      --num-rollout 60 --eval-interval 20 --run-dir /tmp/sft-$dev | tail -2
    cp /tmp/sft-$dev/metrics.jsonl "$OUT/sft-$dev.jsonl"
  done
  python3 - "$OUT" <<'PY'
import json, sys
runs = {d: [json.loads(l) for l in open(f"{sys.argv[1]}/sft-{d}.jsonl")] for d in ("cuda", "cpu")}
print("step  loss cuda  loss cpu  eval cuda  eval cpu")
for a, b in zip(runs["cuda"], runs["cpu"]):
    if a["step"] % 10 == 0:
        f = lambda r, k: f"{r[k]:.3f}" if k in r else "-"
        print(f"{a['step']:4d}  {f(a, 'train/loss'):>9}  {f(b, 'train/loss'):>8}  "
              f"{f(a, 'eval/reward'):>9}  {f(b, 'eval/reward'):>8}")
PY
fi
if [ "$what" = kernels ] || [ "$what" = all ]; then
  # Criterion benches of every CUDA op (CUDA events), one line per bench.
  target/device-bundle/benches/cuda_ops --bench --noplot 2>&1 | tee "$OUT/kernels.txt" \
    | grep -E "^[a-z].*/|time:|thrpt:"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  preset=${PRESET:-qwen3-0.6b}
  for gemm in invariant cublas; do
    for w in logprob train; do
      timeout 300 $miles bench $w --device cuda --preset $preset --batch 32 --seq-len 512 \
        --steps 5 --warmup 2 --gemm $gemm | tee -a "$OUT/bench.jsonl"
    done
  done
  # The same tokens in 4× shorter sequences: the difference is attention's share.
  for w in logprob train; do
    timeout 300 $miles bench $w --device cuda --preset $preset --batch 128 --seq-len 128 \
      --steps 5 --warmup 2 | tee -a "$OUT/bench.jsonl"
  done
  timeout 300 python3 target/gpu/hf_baseline.py --model $preset --skip-generate 2>/dev/null \
    | tee -a "$OUT/bench.jsonl"
fi
