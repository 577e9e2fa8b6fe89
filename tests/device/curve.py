#!/usr/bin/env python3
"""A run's metrics.jsonl as one line per iteration: the cumulative training time (rollout +
train + weight sync, eval excluded), the step time and its rollout (of which the engine's
generate) and train parts, the
rollout/trainer logprob gap, reward, response length and held-out accuracy where evaluated.

  python3 tests/device/curve.py runs/x/metrics.jsonl
"""
import json, sys

rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
clock = 0.0
print("step  train_s  step_s  rollout_s  generate_s  train_s  logp_gap  reward  resp_len  eval_pass@1  tok/s")
for r in rows:
    if "perf/rollout_time" in r:
        clock += r["perf/rollout_time"] + r["perf/train_time"] + r.get("perf/update_weights_time", 0)
    fmt = lambda k, f="{:.3f}": f.format(r[k]) if k in r else "-"
    print(f"{r['step']:4d}  {clock:7.1f}  {fmt('perf/step_time'):>6}  {fmt('perf/rollout_time'):>9}"
          f"  {fmt('perf/rollout_generate_time'):>10}  {fmt('perf/train_time'):>7}  {fmt('train/train_rollout_logprob_abs_diff', '{:.1e}'):>8}"
          f"  {fmt('rollout/raw_reward'):>6}  {fmt('rollout/response_len/mean', '{:.0f}'):>8}"
          f"  {fmt('eval/pass@1'):>11}  {fmt('perf/tokens_per_s', '{:.0f}'):>5}")
gaps = [r["train/train_rollout_logprob_abs_diff"] for r in rows if "train/train_rollout_logprob_abs_diff" in r]
if gaps:
    print(f"logprob gap: {sum(g == 0 for g in gaps)} of {len(gaps)} iterations exactly 0")
