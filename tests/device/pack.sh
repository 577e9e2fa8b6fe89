#!/bin/sh
# Everything a device call needs, in one archive a call can carry: the device bundle (CUDA
# tests, kernel benches), the release `miles` with CUDA, the peers and data from ../shared
# (hf_baseline.py, trl_grpo_peer.py, SmolLM2's tokenizer, GSM8K), TRL's wheels and the addition
# data, as target/pack/all.tar.xz (~20 MiB), which gpu_checks.sh unpacks there. Carry
# ["target/pack"] (with "target/smollm2-a" beside it where SmolLM2 is needed: smollm2_parts.sh).
# `miles` packs only the release `miles` and its data (~8 MiB), for calls that run it beside a
# SmolLM2 part too large to ride with the whole archive.
#   sh tests/device/pack.sh [miles]
set -eu
cargo xtask cuda-setup > /dev/null
cargo xtask device-bundle
cargo build --release -p miles-cli --features cuda
cargo xtask addition-data > /dev/null
mkdir -p target/gpu/gsm8k target/pack
cp target/release/miles ../shared/bench/hf_baseline.py ../shared/bench/trl_grpo_peer.py target/gpu/
cp -r ../shared/bench/smollm2-tokenizer target/gpu/
cp ../shared/data/gsm8k/*.jsonl target/gpu/gsm8k/
chmod -R u+w target/gpu
strip target/gpu/miles target/device-bundle/tests/* target/device-bundle/benches/*
wheels=$(ls -d .cache/whl 2>/dev/null || true)
[ -n "$wheels" ] || echo "pack.sh: no .cache/whl (TRL's wheels, see trl_grpo_peer.py): gpu_checks.sh trl needs them" >&2
if [ "${1:-}" = miles ]; then
  tar cf - target/gpu .cache/addition | xz -T2 -3 > target/pack/all.tar.xz
else
  tar cf - target/device-bundle/tests target/device-bundle/run.sh target/device-bundle/benches \
    target/gpu $wheels .cache/addition | xz -T2 -3 > target/pack/all.tar.xz
fi
bytes=$(stat -c %s target/pack/all.tar.xz)
echo "target/pack/all.tar.xz: $((bytes / 1048576)) MiB (a call carries 64 MiB, the checkout's files included)"
