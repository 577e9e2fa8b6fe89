#!/usr/bin/env python3
"""Per-kernel totals from `ncu --print-summary per-kernel --metrics gpu__time_duration.sum`
output (tests/device/profile.sh): one line per kernel name, largest first.

  python3 tests/device/ncu_summary.py ncu-train.txt
"""
import re, sys

text = open(sys.argv[1]).read()
head = re.compile(r"^  (\S+?)(?:\(.*?\))? \(\d+, \d+, \d+\)x\(\d+, \d+, \d+\).*Invocations (\d+)", re.M)
metric = re.compile(r"gpu__time_duration\.sum\s+(\w+)\s+([\d.,]+)\s+([\d.,]+)\s+([\d.,]+)")
scale = {"ns": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0, "s": 1e3}
totals = {}
for m in head.finditer(text):
    rest = text[m.end():m.end() + 2000]
    v = metric.search(rest)
    if not v:
        continue
    avg_ms = float(v.group(4).replace(",", "")) * scale.get(v.group(1), 1e-3)
    t = totals.setdefault(m.group(1), [0.0, 0])
    t[0] += avg_ms * int(m.group(2))
    t[1] += int(m.group(2))
all_ms = sum(t for t, _ in totals.values())
print(f"{all_ms:9.2f} ms in {sum(n for _, n in totals.values())} launches")
for name, (t, n) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:25]:
    print(f"{t:9.2f} ms {100 * t / max(all_ms, 1e-9):5.1f}% {n:6d}  {name[:100]}")
