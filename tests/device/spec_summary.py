#!/usr/bin/env python3
"""Plain and speculative runs of one example side by side (gpu_checks.sh spec-addition): the
engine's generated tokens per second of generate time, per block of 10 iterations, with the
draft's acceptance (rollout/spec_accept_rate, spec_accept_length) and MTP loss, held-out
accuracy where evaluated, and the rollout/trainer logprob gap.

  python3 tests/device/spec_summary.py plain/metrics.jsonl spec/metrics.jsonl
"""
import json, sys


def load(path):
    return [r for r in map(json.loads, open(path)) if "perf/rollout_generate_time" in r]


def block_stats(rows):
    gen = sum(r["perf/rollout_generate_time"] for r in rows)
    toks = sum(r["rollout/generated_tokens"] for r in rows)
    mean = lambda k: (sum(r[k] for r in rows if k in r) / max(1, sum(k in r for r in rows)))
    evals = [r["eval/pass@1"] for r in rows if "eval/pass@1" in r]
    return toks / max(gen, 1e-9), mean, evals


plain, spec = load(sys.argv[1]), load(sys.argv[2])
print("iters     plain tok/s  spec tok/s  ratio  accept_rate  accept_len  mtp_loss  eval plain/spec")
for start in range(0, min(len(plain), len(spec)), 10):
    p, s = plain[start:start + 10], spec[start:start + 10]
    tp, _, ep = block_stats(p)
    ts, m, es = block_stats(s)
    ev = f"{ep[-1]:.3f}/{es[-1]:.3f}" if ep and es else "-"
    print(f"{start + 1:4d}-{start + len(s):<4d}  {tp:11.0f}  {ts:10.0f}  {ts / tp:5.2f}"
          f"  {m('rollout/spec_accept_rate'):11.3f}  {m('rollout/spec_accept_length'):10.2f}"
          f"  {m('train/mtp_loss'):8.3f}  {ev}")
for name, rows in (("plain", plain), ("spec", spec)):
    tp, _, _ = block_stats(rows)
    gaps = [r["train/train_rollout_logprob_abs_diff"] for r in rows
            if "train/train_rollout_logprob_abs_diff" in r]
    print(f"{name}: {len(rows)} iterations, {tp:.0f} generated tok/s of generate time, "
          f"logprob gap exactly 0 on {sum(g == 0 for g in gaps)} of {len(gaps)}")
