#!/usr/bin/env python3
"""Plain and speculative runs of one example side by side (gpu_checks.sh spec-addition): the
engine's generated tokens per second of generate time, per block of 10 iterations, with the
online draft's acceptance (rollout/spec_accept_rate, spec_accept_length) and MTP loss, a frozen
draft's acceptance when its run is given, held-out accuracy where evaluated, and the
rollout/trainer logprob gap of each run.

  python3 tests/device/spec_summary.py plain.jsonl spec.jsonl [frozen.jsonl]
"""
import json, sys


def load(path):
    return [r for r in map(json.loads, open(path)) if "perf/rollout_generate_time" in r]


def tokens_per_s(rows):
    gen = sum(r["perf/rollout_generate_time"] for r in rows)
    return sum(r["rollout/generated_tokens"] for r in rows) / max(gen, 1e-9)


def mean(rows, key):
    vals = [r[key] for r in rows if key in r]
    return sum(vals) / len(vals) if vals else float("nan")


def last_eval(rows):
    evals = [r["eval/pass@1"] for r in rows if "eval/pass@1" in r]
    return f"{evals[-1]:.3f}" if evals else "-"


runs = [load(p) for p in sys.argv[1:]]
plain, spec = runs[0], runs[1]
frozen = runs[2] if len(runs) > 2 else []
print("iters      plain tok/s  spec tok/s  ratio  accept  accept_len  mtp_loss  frozen accept"
      "  eval plain/spec/frozen")
for start in range(0, min(len(plain), len(spec)), 10):
    p, s, f = plain[start:start + 10], spec[start:start + 10], frozen[start:start + 10]
    tp, ts = tokens_per_s(p), tokens_per_s(s)
    print(f"{start + 1:4d}-{start + len(s):<4d}  {tp:11.0f}  {ts:10.0f}  {ts / tp:5.2f}"
          f"  {mean(s, 'rollout/spec_accept_rate'):6.3f}  {mean(s, 'rollout/spec_accept_length'):10.2f}"
          f"  {mean(s, 'train/mtp_loss'):8.3f}  {mean(f, 'rollout/spec_accept_rate'):13.3f}"
          f"  {last_eval(p)}/{last_eval(s)}/{last_eval(f)}")
for name, rows in zip(("plain", "spec", "frozen"), runs):
    gaps = [r["train/train_rollout_logprob_abs_diff"] for r in rows
            if "train/train_rollout_logprob_abs_diff" in r]
    print(f"{name}: {len(rows)} iterations, {tokens_per_s(rows):.0f} generated tok/s of generate "
          f"time, logprob gap exactly 0 on {sum(g == 0 for g in gaps)} of {len(gaps)}")
