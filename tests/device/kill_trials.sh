#!/bin/bash
# Kill -9 at random moments on the GPU (issue 36): `miles train --device cuda` on a random
# SmolLM2-135M-shaped model (the addition prompts, SFT warm-up, KL reference, a checkpoint
# every 2 iterations) runs once straight; then each of TRIALS trials starts the same run,
# SIGKILLs it after a random delay, restarts it with --load, kills again, up to KILLS times,
# and finally lets it end. Odd kills draw the delay uniformly over the straight run's wall time
# (start-up included); even ones wait for the run's first RL step line and draw it over the
# training that follows, so that kills land between and inside saves too.
# Every trial's final checkpoint must be byte for byte the straight run's. One line per
# trial and a summary in $OUT/kill-trials.txt. Run from the repository root after
# gpu_checks.sh has unpacked target/gpu (or with the pack carried):
#   TRIALS=20 KILLS=3 ROLLOUTS=6 bash tests/device/kill_trials.sh
set -u
[ -x "${MILES:-target/gpu/miles}" ] || { tar xJf target/pack/all.tar.xz || exit 1; }
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# MILES and DEVICE=cpu try the script here (slowly) before a device call.
miles=${MILES:-$PWD/target/gpu/miles}
trials=${TRIALS:-20} kills=${KILLS:-3} rollouts=${ROLLOUTS:-6}
root=/tmp/kill-trials
rm -rf $root && mkdir -p $root
$miles init-model --preset smollm2-135m --out $root/model | tail -1
cp target/gpu/smollm2-tokenizer/* $root/model/
flags="--device ${DEVICE:-cuda} --hf-checkpoint $root/model --prompt-data .cache/addition/train.jsonl \
  --input-key prompt --label-key label --apply-chat-template --rm-type math \
  --rollout-max-response-len 32 --num-rollout $rollouts --save-interval 2 --rollout-batch-size 8 \
  --n-samples-per-prompt 4 --num-steps-per-rollout 2 --sft-warmup-steps 3 --use-kl-loss \
  --eval-interval 1000"
# shellcheck disable=SC2086
start() { $miles train $flags --save "$1" --load "$1" --run-dir "$1" >> "$1.log" 2>&1; }

now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.2f", b - a }'; }
steps() { n=$(grep -c '^step ' "$1" 2>/dev/null); echo "${n:-0}"; }
# Waits until log $1 has more step lines than $2, or process $3 ended.
wait_for_step() { while [ "$(steps "$1")" -le "$2" ] && kill -0 "$3" 2>/dev/null; do sleep 0.05; done; }

t0=$(now)
start $root/straight &
wait_for_step $root/straight.log 0 $!
startup=$(since "$t0")
wait $! || { tail -5 $root/straight.log; exit 1; }
wall=$(since "$t0")
training=$(awk -v w="$wall" -v s="$startup" 'BEGIN { printf "%.2f", w - s }')
final=$(printf 'iter_%07d' "$rollouts")
files="model.safetensors optimizer.safetensors ref.safetensors trainer_state.json checksums.json"
echo "straight run: $wall s ($startup s to its first step), $rollouts iterations" \
  | tee "$OUT/kill-trials.txt"

identical=0 total_kills=0
for trial in $(seq 1 "$trials"); do
  dir=$root/t$trial
  killed_at=""
  for attempt in $(seq 1 "$kills"); do
    span=$wall; [ $((attempt % 2)) = 0 ] && span=$training
    delay=$(awk -v w="$span" -v s="$trial$attempt$$" 'BEGIN { srand(s); printf "%.2f", rand() * w }')
    before=$(steps "$dir.log")
    # shellcheck disable=SC2086
    $miles train $flags --save "$dir" --load "$dir" --run-dir "$dir" >> "$dir.log" 2>&1 &
    pid=$!
    [ "$span" = "$wall" ] || { wait_for_step "$dir.log" "$before" $pid; delay="step+$delay"; }
    sleep "${delay#step+}"
    kill -9 $pid 2>/dev/null
    wait $pid 2>/dev/null
    # 137: the kill landed; anything else: the run had ended (a zombie takes a kill too).
    [ $? = 137 ] || break
    latest=$(cat "$dir/latest_checkpointed_iteration.txt" 2>/dev/null || echo -)
    killed_at="$killed_at ${delay}s(ckpt $latest)"
    total_kills=$((total_kills + 1))
  done
  [ -d "$dir/$final" ] || start "$dir" || { echo "trial $trial: the last run failed"; tail -3 "$dir.log"; }
  same=yes
  for f in $files; do
    cmp -s "$root/straight/$final/$f" "$dir/$final/$f" || same="NO ($f differs)"
  done
  [ "$same" = yes ] && identical=$((identical + 1))
  echo "trial $trial: killed at${killed_at:- (never: it ended first)}; final checkpoint identical: $same" \
    | tee -a "$OUT/kill-trials.txt"
  rm -rf "$dir"
done
echo "$identical of $trials trials identical to the straight run, $total_kills kills in all" \
  | tee -a "$OUT/kill-trials.txt"
