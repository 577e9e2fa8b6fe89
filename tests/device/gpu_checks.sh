#!/bin/sh
# The GPU checks (run from the repository root, with the device bundle and
# target/gpu/{miles,hf_baseline.py} carried): the kernel, model and engine tests, Qwen3-0.6B
# bf16 against HF, the benchmarks beside HF transformers, the real SmolLM2 on the GPU engine,
# and where a decode step's time goes. Results under $OUT.
#   sh tests/device/gpu_checks.sh [tests|parity|sft|bench|kernels|rollout|smollm2|decode-profile|
#                                  trl|addition|gsm8k|resume|resume-random|moe-fixture|moe-bench|moe-state|ds-bench|
#                                  dp|fp8|fp8-bench|fp8-addition|int4-addition|families|families-bench|
#                                  spec-addition|spec-gsm8k|spec-bench|int4-bench|partial-gsm8k|
#                                  serve-load|all]
# Prepare here: `sh tests/device/pack.sh` builds the device bundle and the release `miles` and
# packs them with the peers and data into target/pack/all.tar.xz (carry ["target/pack"]), which
# is unpacked here first; SmolLM2 comes in two parts (tests/device/smollm2_parts.sh).
set -u
[ -f target/pack/all.tar.xz ] && { tar xJf target/pack/all.tar.xz || exit 1; }
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
if [ "$what" = rollout ] || [ "$what" = all ]; then
  # The GPU engine (issue 12): decode throughput at several batch sizes beside HF generate.
  preset=${PRESET:-qwen3-0.6b}
  for b in ${BATCHES:-1 8 64 256}; do
    timeout 300 $miles bench rollout --device cuda --preset $preset --batch $b --prompt-len 64 \
      --new-tokens 256 | tee -a "$OUT/rollout.jsonl"
  done
  timeout 300 $miles bench rollout --device cuda --preset smollm2-135m --batch 64 --prompt-len 64 \
    --new-tokens 256 | tee -a "$OUT/rollout.jsonl"
  if [ -z "${SKIP_HF:-}" ]; then
    for m in $preset smollm2-135m; do
      timeout 300 python3 target/gpu/hf_baseline.py --model $m --gen-batch 64 --prompt-len 64 \
        --new-tokens 256 --train-batch 1 --train-len 16 2>/dev/null | grep generate \
        | tee -a "$OUT/rollout.jsonl"
    done
  fi
fi
if [ "$what" = smollm2 ]; then
  # The real SmolLM2-135M-Instruct on the GPU engine. Its GGUF (98 MB) comes in two calls, as
  # target/smollm2-a/part and target/smollm2-b/part (tests/device/smollm2_parts.sh), the second
  # made while the machine is still warm; target/gpu/miles and gsm8k.jsonl from an earlier call.
  cat target/smollm2-a/part target/smollm2-b/part > /tmp/smollm2.gguf || exit 1
  $miles convert gguf /tmp/smollm2.gguf --out /tmp/smollm2 | tail -1
  printf '{"input": [{"role": "user", "content": "What is the capital of France?"}]}\n' > /tmp/paris.jsonl
  $miles generate --hf-checkpoint /tmp/smollm2 --prompt-data /tmp/paris.jsonl --apply-chat-template \
    --rollout-top-k 1 --rollout-max-response-len 24 --device cuda --output "$OUT/paris.jsonl"
  python3 -c "import json,sys; s=json.loads(open(sys.argv[1]).readline()); print('greedy answer:', repr(s['response'])); print('PARIS', 'Paris' in s['response'])" "$OUT/paris.jsonl"
  # Sampled GSM8K rollouts, then scored on the GPU: rollout logprobs against the scorer's.
  $miles generate --hf-checkpoint /tmp/smollm2 --prompt-data target/gpu/gsm8k.jsonl --input-key question \
    --label-key answer --apply-chat-template --n-samples-per-prompt 8 --rollout-max-response-len 256 \
    --rollout-temperature 0.8 --rollout-top-p 0.95 --device cuda --output "$OUT/gsm8k.jsonl" \
    --check-logprobs
  $miles score --hf-checkpoint /tmp/smollm2 --input "$OUT/gsm8k.jsonl" --rollout-temperature 0.8 \
    --device cuda --output /tmp/gsm8k-scored.jsonl
  python3 - "$OUT/gsm8k.jsonl" /tmp/gsm8k-scored.jsonl <<'PY' | tee "$OUT/gsm8k-check.txt"
import json, sys
samples = [json.loads(l) for l in open(sys.argv[1])]
scored = [json.loads(l) for l in open(sys.argv[2])]
same = sum(s["rollout_log_probs"] == r["log_probs"] for s, r in zip(samples, scored))
valid = sum(s["status"] in ("completed", "truncated") and s["response_length"] > 0 for s in samples)
print(f"{len(samples)} samples, {valid} valid, {same} with rollout logprobs == scorer's bit for bit")
print("first response:", repr(samples[0]["response"][:300]))
PY
  timeout 300 $miles bench rollout --device cuda --hf-checkpoint /tmp/smollm2 --batch 64 --prompt-len 64 \
    --new-tokens 256 | tee -a "$OUT/rollout.jsonl"
fi
if [ "$what" = decode-profile ]; then
  # Where a Qwen3-0.6B decode step's GPU time goes (B = 64): every kernel of a short eager run
  # under ncu, and each GEMM class's pinned algorithms. Carry target/gpu.
  MILES_GEMM_LOG=1 timeout 200 $miles bench rollout --device cuda --preset qwen3-0.6b --batch 64 \
    --prompt-len 64 --new-tokens 8 2> "$OUT/gemm-pins.txt" | tee -a "$OUT/rollout.jsonl"
  grep -c "small none" "$OUT/gemm-pins.txt"; grep -c "gemm Class" "$OUT/gemm-pins.txt"
  timeout 400 sh tests/device/profile.sh rollout --preset qwen3-0.6b --batch 64 --prompt-len 64 \
    --new-tokens 4 --disable-cuda-graph
fi
if [ "$what" = trl ]; then
  # Per-step time against TRL's GRPOTrainer on the same shape in one command (issue 13): the
  # SmolLM2-135M shape with random weights and SmolLM2's tokenizer, 8 prompts × 8 samples, 256
  # new tokens. Carry target/gpu (with trl_grpo_peer.py and smollm2-tokenizer/ from
  # ../shared/bench), .cache/addition and .cache/whl (TRL's wheels: the peer's docstring).
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .cache/whl/*.whl 2>&1 | tail -1
  (cd target/gpu && PYTHONPATH=/tmp/site timeout 400 python3 trl_grpo_peer.py --tok smollm2-tokenizer \
    --prompts-per-step 8 --n 8 --max-new 256 --steps 5 2>/dev/null | tail -1) | tee "$OUT/trl.json"
  $miles init-model --preset smollm2-135m --out /tmp/s135 | tail -1
  cp target/gpu/smollm2-tokenizer/* /tmp/s135/
  $miles train --device cuda --hf-checkpoint /tmp/s135 --prompt-data .cache/addition/train.jsonl \
    --input-key prompt --label-key label --apply-chat-template --rm-type math \
    --rollout-batch-size 8 --n-samples-per-prompt 8 --rollout-max-response-len 256 \
    --num-rollout 8 --lr 1e-6 --run-dir /tmp/speed | tail -1
  python3 tests/device/curve.py /tmp/speed/metrics.jsonl | tee "$OUT/miles-speed.txt"
fi
if [ "$what" = addition ]; then
  # examples/addition-smollm2.toml on the real SmolLM2 (converted by the smollm2 section, or
  # here from the two parts): held-out greedy accuracy against training time.
  [ -d /tmp/smollm2 ] || { cat target/smollm2-a/part target/smollm2-b/part > /tmp/smollm2.gguf &&
    $miles convert gguf /tmp/smollm2.gguf --out /tmp/smollm2 | tail -1; }
  timeout ${LIMIT:-420} $miles train --config examples/addition-smollm2.toml --hf-checkpoint /tmp/smollm2 \
    --num-rollout ${ROLLOUTS:-400} ${ADDITION_FLAGS:-} | tail -2
  cp runs/addition-smollm2/metrics.jsonl "$OUT/addition-metrics.jsonl"
  python3 tests/device/curve.py runs/addition-smollm2/metrics.jsonl | tee "$OUT/addition.txt"
fi
if [ "$what" = fp8 ]; then
  # Unified FP8 (issue 28): the FP8 device tests; the kernel probe (tests/device/
  # fp8_gemm_probe.cu: bits across tiles and row counts, times beside cuBLAS); and a training
  # run of a tiny Qwen3-MoE (heads of 64) in unified FP8 with Rollout Routing Replay, whose
  # rollout and training logprobs must agree exactly on every iteration.
  target/device-bundle/run.sh fp8 > "$OUT/fp8-tests.txt" 2>&1
  grep -E "test result|FAILED|panicked" "$OUT/fp8-tests.txt" | grep -v " 0 passed"
  $(command -v nvcc || echo /usr/local/cuda-13.0/bin/nvcc) -arch=sm_90a -O3 -std=c++17 -I kernels \
    tests/device/fp8_gemm_probe.cu \
    -L/usr/local/cuda-13.0/targets/x86_64-linux/lib -lcublas -lcuda -o /tmp/probe \
    && /tmp/probe | tee "$OUT/fp8-probe.txt"
  $miles init-model --preset tiny-h64 --arch qwen3-moe --out /tmp/moe | tail -1
  $miles train --device cuda --hf-checkpoint /tmp/moe --prompt-data .cache/addition/train.jsonl \
    --input-key prompt --label-key label --rm-type math --rollout-max-response-len 8 \
    --num-rollout ${MOE_ROLLOUTS:-40} --rollout-batch-size 8 --n-samples-per-prompt 4 \
    --fp8-format e4m3 --fp8-recipe blockwise --use-rollout-routing-replay \
    --run-dir /tmp/moe-fp8 | tail -1
  python3 - /tmp/moe-fp8/metrics.jsonl <<'PY' | tee "$OUT/fp8-moe-r3.txt"
import json, sys
gaps = [r["train/train_rollout_logprob_abs_diff"] for r in map(json.loads, open(sys.argv[1]))
        if "train/train_rollout_logprob_abs_diff" in r]
print(f"tiny Qwen3-MoE, unified FP8 + r3 on the GPU: {len(gaps)} iterations, "
      f"{sum(g == 0 for g in gaps)} with logprob gap exactly 0, largest {max(gaps)}")
PY
fi
if [ "$what" = fp8-bench ]; then
  # Unified FP8 beside bf16 in one call: the kernel benches (FP8 products against our bf16
  # route), decode at the Qwen3-8B shape (36 layers, random weights; B = 1 and 64) and the
  # Qwen3-0.6B training step at 32 × 512. KERNELS=0 skips the kernel benches.
  if [ "${KERNELS:-1}" = 1 ]; then
    target/device-bundle/benches/cuda_ops --bench --noplot "fp8|matmul_bf16_invariant/x_wT" \
      > "$OUT/fp8-kernels.txt" 2>&1
    grep -E "^[a-z].*/|time:" "$OUT/fp8-kernels.txt" | paste - - | awk '{print $1, $5, $6}'
  fi
  for batch in 1 64; do
    for fp8 in "" "--fp8-format e4m3"; do
      timeout 300 $miles bench rollout --device cuda --preset qwen3-8b --batch $batch \
        --prompt-len 128 --new-tokens 64 $fp8 | tee -a "$OUT/fp8-bench.jsonl"
    done
  done
  for fp8 in "" "--fp8-format e4m3"; do
    timeout 300 $miles bench train --device cuda --preset qwen3-0.6b --batch 32 --seq-len 512 \
      --steps 5 --warmup 2 $fp8 | tee -a "$OUT/fp8-bench.jsonl"
  done
fi
if [ "$what" = fp8-addition ] || [ "$what" = int4-addition ]; then
  # The addition example on the real SmolLM2 in FP8 (issue 28), both of miles' modes: unified
  # (rollout and training on the same E4M3 weights: the logprob gap stays 0) and rollout-only
  # (an FP8 checkpoint from `miles convert fp8`: the gap is reported and TIS corrects it), beside
  # the bf16 run they are measured against. int4-addition: with INT4 QAT (issue 31; groups of
  # 32, as SmolLM2's 576 inputs are no multiple of 128), MODES="bf16 int4" to see both.
  [ -d /tmp/smollm2 ] || { cat target/smollm2-a/part target/smollm2-b/part > /tmp/smollm2.gguf &&
    $miles convert gguf /tmp/smollm2.gguf --out /tmp/smollm2 | tail -1; }
  if [ "$what" = fp8-addition ]; then
    $miles convert fp8 /tmp/smollm2 --out /tmp/smollm2-fp8 | tail -1
    modes=${FP8_MODES:-bf16 unified rollout-only}
  else
    modes=${MODES:-int4}
  fi
  q=${what%-addition}
  for mode in $modes; do
    case $mode in
      bf16) flags="--hf-checkpoint /tmp/smollm2" ;;
      unified) flags="--hf-checkpoint /tmp/smollm2 --fp8-format e4m3 --fp8-recipe blockwise" ;;
      int4) flags="--hf-checkpoint /tmp/smollm2 --int4-qat --int4-group-size 32" ;;
      *) flags="--hf-checkpoint /tmp/smollm2-fp8 --use-tis" ;;
    esac
    start=$(date +%s)
    timeout ${LIMIT:-250} $miles train --config examples/addition-smollm2.toml $flags \
      --num-rollout ${ROLLOUTS:-400} --run-dir /tmp/$q-$mode --save /tmp/$q-$mode/checkpoints \
      --save-hf /tmp/$q-$mode/hf | tail -2
    echo "$mode: $(( $(date +%s) - start )) s wall" | tee "$OUT/$q-$mode.txt"
    cp /tmp/$q-$mode/metrics.jsonl "$OUT/$q-$mode.jsonl"
    python3 tests/device/curve.py /tmp/$q-$mode/metrics.jsonl >> "$OUT/$q-$mode.txt"
    awk '$10 != "-" || /gap/' "$OUT/$q-$mode.txt" | tail -8
  done
fi
if [ "$what" = gsm8k ]; then
  # examples/gsm8k-smollm2.toml on the real SmolLM2 (after `addition` or `smollm2`, which
  # convert it), with GSM8K from target/gpu/gsm8k/ (copied from ../shared/data/gsm8k). Longer
  # than one call: each call trains for LIMIT seconds and the next resumes from the checkpoint.
  [ -d /tmp/smollm2 ] || { cat target/smollm2-a/part target/smollm2-b/part > /tmp/smollm2.gguf &&
    $miles convert gguf /tmp/smollm2.gguf --out /tmp/smollm2 | tail -1; }
  timeout ${LIMIT:-500} $miles train --config examples/gsm8k-smollm2.toml --hf-checkpoint /tmp/smollm2 \
    --prompt-data target/gpu/gsm8k/train.jsonl --eval-prompt-data target/gpu/gsm8k/test.jsonl \
    --load runs/gsm8k-smollm2/checkpoints ${GSM8K_FLAGS:-} 2>&1 | tail -4
  cp runs/gsm8k-smollm2/metrics.jsonl "$OUT/gsm8k-metrics.jsonl"
  python3 tests/device/curve.py runs/gsm8k-smollm2/metrics.jsonl | tail -25 | tee "$OUT/gsm8k.txt"
fi
if [ "$what" = resume ]; then
  # Exact resume on the GPU (issue 13): 6 iterations straight, against killed after iteration 5
  # (checkpoint at 4) and resumed; the iteration-6 checkpoints must be byte for byte the same.
  # RESUME_FLAGS adds flags (the dp section passes --nproc-per-node).
  # The real SmolLM2 on the addition example (after `addition`, which converts it).
  for model in smollm2; do
    flags="--device cuda --num-rollout 6 --save-interval 2 --rollout-batch-size 8 --n-samples-per-prompt 4 --num-steps-per-rollout 2 --eval-interval 100 ${RESUME_FLAGS:-}"
    [ $model = smollm2 ] && flags="--config examples/addition-smollm2.toml --hf-checkpoint /tmp/smollm2 $flags --save-hf /tmp/resume-hf"
    run() { $miles train $flags --save /tmp/resume-$model/$1 --load /tmp/resume-$model/$1 --run-dir /tmp/resume-$model/$1 > /tmp/resume-$model-$1.log 2>&1; }
    rm -rf /tmp/resume-$model; run straight; MILES_FAULT=abort-after-rollout:5 run resumed; run resumed
    for f in model.safetensors optimizer.safetensors trainer_state.json; do
      cmp -s /tmp/resume-$model/straight/iter_0000006/$f /tmp/resume-$model/resumed/iter_0000006/$f \
        && echo "$model $f: identical" || echo "$model $f: DIFFERS"
    done
    grep -h "resumed from" /tmp/resume-$model-resumed.log | head -1
  done | tee "$OUT/resume.txt"
fi
if [ "$what" = families ]; then
  # Issue 29, acceptance 2: random-init Qwen2.5-0.5B and Gemma-3-1B shapes train on the GPU with
  # rollout logprobs equal to training's (the gap exactly 0 at every iteration) and resume
  # exactly: 4 iterations straight against killed after iteration 3 (checkpoint at 2) and
  # resumed. (The straight run's iteration-2 checkpoint is dropped: a 1B model's is 12 GB.)
  for preset in ${FAMILIES:-qwen2.5-0.5b gemma3-1b}; do
    d=/tmp/fam-$preset
    rm -rf $d
    $miles init-model --preset $preset --dtype bf16 --out $d/hf | tail -1
    cp target/gpu/smollm2-tokenizer/* $d/hf/
    flags="--device cuda --hf-checkpoint $d/hf --prompt-data .cache/addition/train.jsonl \
      --input-key prompt --label-key label --apply-chat-template --rm-type math \
      --rollout-max-response-len 32 --num-rollout 4 --save-interval 2 --rollout-batch-size 8 \
      --n-samples-per-prompt 4 --num-steps-per-rollout 2"
    run() { $miles train $flags --save $d/$1 --load $d/$1 --run-dir $d/$1 > $d/$1.log 2>&1; }
    run straight; rm -rf $d/straight/iter_0000002
    MILES_FAULT=abort-after-rollout:3 run resumed; run resumed
    for f in model.safetensors optimizer.safetensors trainer_state.json; do
      cmp -s $d/straight/iter_0000004/$f $d/resumed/iter_0000004/$f \
        && echo "$preset $f: identical" || echo "$preset $f: DIFFERS"
    done
    python3 - $d/straight/metrics.jsonl $preset <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
gaps = [r["train/train_rollout_logprob_abs_diff"] for r in rows
        if "train/train_rollout_logprob_abs_diff" in r]
print(f"{sys.argv[2]}: logprob gap {gaps} (exactly 0 on {sum(g == 0 for g in gaps)}/{len(gaps)})")
PY
    tail -1 $d/straight.log; grep -h "resumed from" $d/resumed.log | head -1
    rm -rf $d
  done 2>&1 | tee "$OUT/families.txt"
fi
if [ "$what" = spec-addition ] || [ "$what" = spec-gsm8k ]; then
  # Issue 30: the addition (or GSM8K) example plainly and with speculative rollouts (an MTP
  # draft trained online from scratch, --sglang-speculative-num-steps STEPS), ROLLOUTS
  # iterations each, in one call: the engine's throughput, the draft's acceptance along the
  # run, held-out accuracy and the rollout/trainer logprob gap (0 on every iteration in both).
  # MTP_LR and MTP_WARMUP set the draft's --mtp-lr and --mtp-warmup-steps.
  [ -d /tmp/smollm2 ] || { cat target/smollm2-a/part target/smollm2-b/part > /tmp/smollm2.gguf &&
    $miles convert gguf /tmp/smollm2.gguf --out /tmp/smollm2 | tail -1; }
  example="--config examples/addition-smollm2.toml"
  [ "$what" = spec-gsm8k ] && example="--config examples/gsm8k-smollm2.toml \
    --prompt-data target/gpu/gsm8k/train.jsonl --eval-prompt-data target/gpu/gsm8k/test.jsonl"
  # ARMS picks the runs; `frozen` speculates with the spec run's draft as it was at iteration
  # FROZEN_AT (the spec run saves every 10 iterations), untrained after.
  spec="--sglang-speculative-algorithm EAGLE --sglang-speculative-num-steps ${STEPS:-3}"
  for arm in ${ARMS:-plain spec}; do
    case $arm in
      plain) flags="" ;;
      spec) flags="$spec --enable-mtp-training --mtp-loss-scaling-factor 0.2 --save-interval 10 \
        ${MTP_LR:+--mtp-lr $MTP_LR} ${MTP_WARMUP:+--mtp-warmup-steps $MTP_WARMUP}" ;;
      frozen) flags="$spec --sglang-speculative-draft-model-path \
        /tmp/$what-spec/ckpt/iter_$(printf %07d ${FROZEN_AT:-20})/draft" ;;
    esac
    rm -rf /tmp/$what-$arm
    timeout ${LIMIT:-270} $miles train $example --hf-checkpoint /tmp/smollm2 \
      --num-rollout ${ROLLOUTS:-100} --run-dir /tmp/$what-$arm --save /tmp/$what-$arm/ckpt \
      --save-hf /tmp/$what-$arm/hf ${SPEC_FLAGS:-} $flags | tail -1
    cp /tmp/$what-$arm/metrics.jsonl "$OUT/$what-$arm.jsonl"
  done
  # (Arms run by an earlier call on this warm machine are read from /tmp.)
  python3 tests/device/spec_summary.py /tmp/$what-plain/metrics.jsonl \
    /tmp/$what-spec/metrics.jsonl $(ls /tmp/$what-frozen/metrics.jsonl 2>/dev/null) \
    | tee "$OUT/$what.txt"
  # The speed in one command's terms: the spec run's final policy generates for held-out
  # prompts without and with its draft (the same distribution, so the same lengths expected).
  hf=$(dirname "$(find /tmp/$what-spec/hf -name config.json | sort | tail -1)")
  draft=$(ls -d /tmp/$what-spec/ckpt/iter_*/draft | tail -1)
  gen="--input-key prompt --prompt-data .cache/addition/test.jsonl --n-samples-per-prompt 16 \
    --rollout-max-response-len 64"
  [ "$what" = spec-gsm8k ] && gen="--input-key question --prompt-data \
    target/gpu/gsm8k/test.jsonl@[0:64] --n-samples-per-prompt 4 --rollout-max-response-len 512"
  for arm in plain spec plain spec; do
    extra=""
    [ $arm = spec ] && extra="$spec --sglang-speculative-draft-model-path $draft"
    echo "$arm: $($miles generate --device cuda --hf-checkpoint $hf $gen --apply-chat-template \
      --rollout-max-running 128 --output /tmp/gen-$arm.jsonl --check-logprobs $extra | tr '\n' ' ')" \
      | tee -a "$OUT/$what-generate.txt"
  done
fi
if [ "$what" = families-bench ]; then
  # Issue 29, acceptance 4: train, logprob and rollout of the family presets beside HF.
  for preset in ${FAMILIES:-qwen2.5-0.5b llama3.2-1b}; do
    # (GLM-4-9B's training state, 150 GB with AdamW in f32, fits on no single GPU here.)
    works="logprob train"; [ $preset = glm4-9b ] && works=logprob
    for w in $works; do
      timeout 300 $miles bench $w --device cuda --preset $preset --batch 32 --seq-len 512 \
        --steps 5 --warmup 2 | tee -a "$OUT/families-bench.jsonl"
    done
    timeout 300 $miles bench rollout --device cuda --preset $preset --batch 64 --prompt-len 64 \
      --new-tokens 256 | tee -a "$OUT/families-bench.jsonl"
    timeout 400 python3 tests/device/hf_families.py --model $preset --gen-batch 64 \
      --prompt-len 64 --new-tokens 256 2>/dev/null | tee -a "$OUT/families-bench.jsonl"
  done
fi
if [ "$what" = resume-random ]; then
  # Exact resume on the GPU without SmolLM2's GGUF (issue 27): a random SmolLM2-shaped model on
  # the addition prompts, with the SFT warm-up (on the GPU) and a KL reference, 6 iterations
  # straight against killed after iteration 5 (checkpoint at 4) and resumed.
  $miles init-model --preset smollm2-135m --out /tmp/s135 | tail -1
  cp target/gpu/smollm2-tokenizer/* /tmp/s135/
  flags="--device cuda --hf-checkpoint /tmp/s135 --prompt-data .cache/addition/train.jsonl \
    --input-key prompt --label-key label --apply-chat-template --rm-type math \
    --rollout-max-response-len 32 --num-rollout 6 --save-interval 2 --rollout-batch-size 8 \
    --n-samples-per-prompt 4 --num-steps-per-rollout 2 --sft-warmup-steps 3 --use-kl-loss"
  run() { $miles train $flags --save /tmp/rr/$1 --load /tmp/rr/$1 --run-dir /tmp/rr/$1 > /tmp/rr-$1.log 2>&1; }
  rm -rf /tmp/rr; run straight; MILES_FAULT=abort-after-rollout:5 run resumed; run resumed
  for f in model.safetensors optimizer.safetensors ref.safetensors trainer_state.json; do
    cmp -s /tmp/rr/straight/iter_0000006/$f /tmp/rr/resumed/iter_0000006/$f \
      && echo "random $f: identical" || echo "random $f: DIFFERS"
  done | tee "$OUT/resume-random.txt"
  tail -1 /tmp/rr-straight.log | tee -a "$OUT/resume-random.txt"
  grep -c '"phase":"sft"' /tmp/rr/straight/metrics.jsonl | tee -a "$OUT/resume-random.txt"
fi
if [ "$what" = moe-fixture ]; then
  # The Qwen3-MoE parity fixture, written by this machine's transformers (issue 16); it comes
  # back under $OUT/qwen3_moe for tests/fixtures/hf/qwen3_moe.
  python3 tests/fixtures/make_hf_moe_parity.py 2>&1 | grep -v -i warn | tail -4
  cp -r tests/fixtures/hf/qwen3_moe "$OUT/"
fi
if [ "$what" = spec-bench ]; then
  # What a speculative step costs against a plain decode step (issue 30): `miles bench rollout`
  # on random SmolLM2-shaped weights with a random draft, plain and with 3 draft tokens per step,
  # per batch size; with target/gpu-old/miles (an earlier build) beside it when carried. SYNC=1:
  # the phases' device times (--spec-phase-sync).
  for m in $miles target/gpu-old/miles; do
    [ -x "$m" ] || continue
    for batch in ${BATCHES:-1 64 256}; do
      for steps in 0 3; do
        flags=""; [ "$steps" = 0 ] || flags="--sglang-speculative-num-steps $steps ${SYNC:+--spec-phase-sync}"
        timeout 120 $m bench rollout --device cuda --preset ${PRESET:-smollm2-135m} --batch $batch \
          --prompt-len 64 --new-tokens 64 $flags 2>&1 | tail -1 | sed "s|^{|{\"binary\":\"$m\",|" \
          | tee -a "$OUT/spec-bench.jsonl"
      done
    done
  done
  python3 - "$OUT/spec-bench.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
plain = {(r["binary"], r["batch"]): r for r in rows if r["spec_steps"] == 0}
for r in rows:
    if r["spec_steps"] == 0:
        continue
    p = plain.get((r["binary"], r["batch"]))
    ratio = r["decode_step_ms"] / p["decode_step_ms"] if p else float("nan")
    print(f'{r["binary"]} batch {r["batch"]}: plain step {p and p["decode_step_ms"]:.3f} ms, '
          f'spec step {r["decode_step_ms"]:.3f} ms ({ratio:.2f}x), accept {r["spec_accept_rate"]:.2f}, '
          f'{r["spec_tokens_per_verification"]:.2f} tokens/verification, '
          f'tok/s {p and p["tokens_per_s"]:.0f} -> {r["tokens_per_s"]:.0f}; device: plain graph '
          f'{p.get("decode_graph_ms")} ms, verify graph {r.get("spec_verify_graph_ms")} ms, '
          f'draft round graph {r.get("spec_draft_graph_ms")} ms; host phases per step '
          f'{r.get("spec_phases_ms")}')
PY
fi
if [ "$what" = serve-load ]; then
  # Issue 33, acceptance 2: CLIENTS concurrent /generate clients against the engine's HTTP
  # server, beside the in-process rollout of the same prompts at the same batch (one process).
  clients=${CLIENTS:-1000}
  timeout ${LIMIT:-300} $miles bench rollout --device cuda --preset ${PRESET:-smollm2-135m} \
    --batch $clients --prompt-len 64 --new-tokens ${NEW_TOKENS:-128} --serve-clients $clients \
    2>&1 | tail -1 | tee "$OUT/serve-load.jsonl"
  python3 - "$OUT/serve-load.jsonl" <<'PY'
import json, sys
r = json.loads(open(sys.argv[1]).read())
s = r["serve"]
print(f'{s["clients"]} clients: served {s["tokens_per_s"]:.0f} tok/s, in process '
      f'{r["tokens_per_s"]:.0f} tok/s ({s["vs_in_process"]:.3f}x), lost {s["lost"]}')
PY
fi
if [ "$what" = partial-gsm8k ]; then
  # Issue 32, acceptance 1: GSM8K with over-sampling (dynamic sampling aborts the engine once
  # the batch is full), without and with --partial-rollout, ROLLOUTS iterations each in one
  # call: trained tokens per second of the iteration (perf/tokens_per_gpu_per_sec), reward,
  # the aborted and continued samples and their staleness.
  [ -d /tmp/smollm2 ] || { cat target/smollm2-a/part target/smollm2-b/part > /tmp/smollm2.gguf &&
    $miles convert gguf /tmp/smollm2.gguf --out /tmp/smollm2 | tail -1; }
  for arm in ${ARMS:-plain partial}; do
    flags="--over-sampling-batch-size ${OVER:-32}"
    [ $arm = partial ] && flags="$flags --partial-rollout"
    rm -rf /tmp/partial-$arm
    timeout ${LIMIT:-270} $miles train --config examples/gsm8k-smollm2.toml --hf-checkpoint /tmp/smollm2 \
      --prompt-data target/gpu/gsm8k/train.jsonl --eval-prompt-data target/gpu/gsm8k/test.jsonl@[0:256] \
      --num-rollout ${ROLLOUTS:-30} --eval-interval 1000 --run-dir /tmp/partial-$arm --save /tmp/partial-$arm/ckpt \
      --save-interval 1000 $flags | tail -1
    cp /tmp/partial-$arm/metrics.jsonl "$OUT/partial-gsm8k-$arm.jsonl"
  done
  python3 - /tmp/partial-plain/metrics.jsonl /tmp/partial-partial/metrics.jsonl <<'PY' | tee "$OUT/partial-gsm8k.txt"
import json, sys
for path in sys.argv[1:]:
    rows = [json.loads(l) for l in open(path)]
    rows = [r for r in rows if "rollout/raw_reward" in r][1:]  # the first iteration warms up
    if not rows:
        continue
    mean = lambda k: sum(r.get(k, 0) for r in rows) / len(rows)
    step = sum(r["perf/step_time"] for r in rows)
    print(f'{path}: {len(rows)} iterations, {step:.1f} s, trained tok/s {mean("perf/tokens_per_gpu_per_sec"):.0f}, '
          f'rollout tok/s {mean("perf/tokens_per_s"):.0f}, reward {mean("rollout/raw_reward"):.3f}, '
          f'aborted {mean("rollout/aborted"):.1f}/iteration, continued {mean("rollout/partial_ratio"):.3f}, '
          f'staleness max {max(r.get("rollout/staleness/max", 0) for r in rows)}')
PY
fi
if [ "$what" = int4-bench ]; then
  # W4A16 decode (issue 31): `miles bench rollout` on random weights of PRESET (qwen3-8b), bf16
  # against INT4 QAT's packed weights (groups of 128), per batch size, one process each.
  for batch in ${BATCHES:-1 16 64}; do
    for group in none 128; do
      flags=""; [ "$group" = none ] || flags="--int4-group-size $group"
      timeout ${LIMIT:-240} $miles bench rollout --device cuda --preset ${PRESET:-qwen3-8b} \
        --batch $batch --prompt-len 64 --new-tokens ${NEW_TOKENS:-64} $flags 2>&1 | tail -1 \
        | tee -a "$OUT/int4-bench.jsonl"
    done
  done
  python3 - "$OUT/int4-bench.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
for r in rows:
    print(f'batch {r["batch"]} int4 {r["int4_group_size"]} w4a16 {r["w4a16"]}: decode step '
          f'{r["decode_step_ms"]:.3f} ms ({r["decode_tokens_per_s"]:.0f} tok/s), graph '
          f'{r["decode_graph_ms"]} ms, rollout weights read {r["rollout_weight_gib"]:.2f} GiB, held {r["weights_resident_gib"]:.2f} GiB')
PY
fi
if [ "$what" = moe-bench ]; then
  # The Qwen3-30B-A3B-shaped layers (4 of 48) on the device beside HF transformers' Qwen3-MoE
  # (issue 16): the train step, the logprob forward and decode, in one call.
  for what in train logprob; do
    timeout 200 $miles bench $what --device cuda --preset qwen3-30b-a3b-4l --batch 8 --seq-len 512 \
      2>&1 | tail -1 | tee -a "$OUT/moe-bench.jsonl"
  done
  timeout 200 $miles bench rollout --device cuda --preset qwen3-30b-a3b-4l --batch 64 --prompt-len 64 \
    --new-tokens 64 2>&1 | tail -1 | tee -a "$OUT/moe-bench.jsonl"
  timeout 300 python3 tests/device/hf_moe_baseline.py --batch 8 --seq-len 512 --gen-batch 64 \
    2>/dev/null | tee -a "$OUT/moe-bench.jsonl"
fi
if [ "$what" = moe-state ]; then
  # Issue 35: the Qwen3-30B-A3B-shaped train step with the optimizer state in f32 (f32 masters
  # beside bf16 copies, f32 moments) and in bf16 (--main-params-dtype bf16 --exp-avg-dtype bf16
  # --exp-avg-sq-dtype bf16), beside HF transformers' bf16 AdamW: speed and peak memory.
  for state in fp32 bf16; do
    timeout 200 $miles bench train --device cuda --preset qwen3-30b-a3b-4l --batch 8 --seq-len 512 \
      --main-params-dtype $state --exp-avg-dtype $state --exp-avg-sq-dtype $state \
      2>&1 | tail -1 | tee -a "$OUT/moe-state.jsonl"
  done
  timeout 250 python3 tests/device/hf_moe_baseline.py --batch 8 --seq-len 512 --skip-generate \
    2>/dev/null | tee -a "$OUT/moe-state.jsonl"
fi
if [ "$what" = ds-bench ]; then
  # DeepSeek-V3's published shapes with 4 of its 61 layers (15.1 B) beside HF transformers'
  # DeepseekV3 (issue 37): the logprob forward and decode (the train step fits neither one card).
  timeout 250 $miles bench logprob --device cuda --preset deepseek-v3-4l --batch 4 --seq-len 512 \
    2>&1 | tail -1 | tee -a "$OUT/ds-bench.jsonl"
  timeout 250 $miles bench rollout --device cuda --preset deepseek-v3-4l --batch 64 --prompt-len 64 \
    --new-tokens 64 2>&1 | tail -1 | tee -a "$OUT/ds-bench.jsonl"
  timeout 250 python3 tests/device/hf_moe_baseline.py --model deepseek-v3-4l --skip-train --batch 4 \
    --seq-len 512 --gen-batch 64 2>/dev/null | tee -a "$OUT/ds-bench.jsonl"
fi
if [ "$what" = dp ]; then
  # Several processes (issue 14): the addition example on NPROC processes beside one, same
  # config, the held-out curves side by side and the throughput per GPU; the overlap of the
  # bucketed sums; then a rank killed mid-run (every rank must stop with an error, not hang)
  # and exact resume over NPROC processes; then the gradient sum's
  # bandwidth through our NCCL path beside NCCL's own (PyTorch, torchrun). On a multi-GPU kind
  # the ranks take a GPU each and sum through NCCL; on one GPU, DP_FLAGS="--device cuda:0
  # --distributed-backend tcp" puts every rank on GPU 0 and sums through host memory (no
  # bandwidth figures then: SKIP_ALLREDUCE=1).
  [ -d /tmp/smollm2 ] || { cat target/smollm2-a/part target/smollm2-b/part > /tmp/smollm2.gguf &&
    $miles convert gguf /tmp/smollm2.gguf --out /tmp/smollm2 | tail -1; }
  n=${NPROC:-2}
  dp_flags=${DP_FLAGS:-}
  for k in 1 $n; do
    timeout ${LIMIT:-240} $miles train --config examples/addition-smollm2.toml --hf-checkpoint \
      /tmp/smollm2 --num-rollout ${ROLLOUTS:-200} --nproc-per-node $k $dp_flags --run-dir /tmp/dp-$k \
      --save /tmp/dp-$k/checkpoints 2>&1 | tail -2
    cp /tmp/dp-$k/metrics.jsonl "$OUT/dp-$k-metrics.jsonl"
    python3 tests/device/curve.py /tmp/dp-$k/metrics.jsonl | tail -12 | tee "$OUT/dp-$k.txt"
  done
  # Throughput per GPU (rank 0's trained tokens over its iteration time, eval excluded):
  # medians over the iterations after the first 5, N processes against one.
  python3 - "$OUT" $n <<'PY' | tee "$OUT/dp-throughput.txt"
import json, statistics, sys
out, n = sys.argv[1], int(sys.argv[2])
def median(k, key):
    rows = [json.loads(l) for l in open(f"{out}/dp-{k}-metrics.jsonl")]
    return statistics.median(r[key] for r in rows if key in r and r["step"] > 5)
one, many = (median(k, "perf/tokens_per_gpu_per_sec") for k in (1, n))
print(f"tokens/s per GPU: 1 process {one:.0f}, {n} processes {many:.0f} ({100 * many / one:.0f}%); "
      f"step {median(1, 'perf/step_time'):.3f} s vs {median(n, 'perf/step_time'):.3f} s")
PY
  # The overlap: the same N-process run with one bucket (the sum after the whole backward)
  # against 25 MiB buckets started during it; the medians of perf/train_time.
  for b in 26214400 1000000000000; do
    MILES_GRAD_BUCKET_BYTES=$b timeout ${LIMIT:-240} $miles train --config examples/addition-smollm2.toml \
      --hf-checkpoint /tmp/smollm2 --num-rollout 30 --eval-interval 1000 --nproc-per-node $n $dp_flags \
      --run-dir /tmp/dp-bucket-$b > /dev/null 2>&1
    python3 -c "import json, statistics, sys; r = [json.loads(l) for l in open(sys.argv[1])]; \
print(sys.argv[2], 'byte buckets: train', round(statistics.median(x['perf/train_time'] for x in r \
if 'perf/train_time' in x and x['step'] > 5), 4), 's')" /tmp/dp-bucket-$b/metrics.jsonl $b \
      | tee -a "$OUT/dp-overlap.txt"
  done
  start=$(date +%s)
  MILES_FAULT=abort-after-rollout:2 MILES_FAULT_RANK=1 timeout 300 $miles train --config \
    examples/addition-smollm2.toml --hf-checkpoint /tmp/smollm2 --num-rollout 6 --nproc-per-node $n \
    $dp_flags --run-dir /tmp/dp-kill --save /tmp/dp-kill/checkpoints > /tmp/dp-kill.log 2>&1
  echo "rank 1 killed after iteration 2: exit $?, every rank stopped after $(( $(date +%s) - start )) s" \
    | tee "$OUT/dp-kill.txt"
  grep -E "error|worker" /tmp/dp-kill.log | tail -4 | tee -a "$OUT/dp-kill.txt"
  RESUME_FLAGS="--nproc-per-node $n $dp_flags" sh tests/device/gpu_checks.sh resume
  if [ -z "${SKIP_ALLREDUCE:-}" ]; then
    timeout 200 $miles bench allreduce --device cuda --nproc-per-node $n | tee "$OUT/allreduce.jsonl"
    timeout 200 torchrun --nproc_per_node $n tests/device/nccl_allreduce_peer.py 2>/dev/null \
      | tee -a "$OUT/allreduce.jsonl"
  fi
fi
