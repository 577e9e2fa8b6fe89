"""Reward functions for the Python worker tests (crates/miles-rewards/src/python/worker_tests.rs)."""

import asyncio
import os
import subprocess
import sys
import time

# slime's own import, provided by the worker where slime is not installed.
from slime.utils.types import Sample


def scalar(sample):
    return 1.0 if sample["response"].strip() == sample["label"] else 0.0


def named(sample):
    return {"acc": float(sample.response == sample.label), "len": len(sample.response)}


def slime_style(args, sample: Sample, **kwargs):
    # A status compares with slime's enum, as slime's functions test it.
    assert sample.status in (Sample.Status.PENDING, Sample.Status.COMPLETED), sample.status
    return args.bonus + (1 if sample.response == sample.label else 0)


def verl_style(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0 if solution_str == ground_truth and data_source == "unit" else 0.0


def raises_on_bad(sample):
    if sample.response == "bad":
        raise ValueError(f"cannot score sample {sample.index}")
    return 1.0


def not_a_number(sample):
    return {
        "str": "abc",
        "none": None,
        "nan": float("nan"),
        "list": [1],
        "true": True,
        "dict_of_str": {"acc": "x"},
        "empty_dict": {},
    }[sample.response]


def unicode_echo(sample):
    print("saw", sample.response)
    meta = sample.metadata
    same = sample.response == meta["response"] and sample.prompt == meta["prompt"]
    return 1.0 if same else 0.0


def noisy(sample):
    print("print() goes to stderr")
    sys.stdout.write("so does sys.stdout\n")
    os.write(1, b"and a raw write to fd 1\n")
    return 1.0


def crash_once(sample):
    marker = sample.metadata["marker"]
    if sample.response == "CRASH" and not os.path.exists(marker):
        open(marker, "w").close()
        os._exit(3)
    return 1.0


def always_crash(sample):
    if sample.response == "CRASH":
        print(f"about to crash on sample {sample.index}", file=sys.stderr)
        os._exit(7)
    return 1.0


def crash_every_time(sample):
    print(f"crashing on sample {sample.index}", file=sys.stderr)
    os._exit(9)


def spawn_and_crash(sample):
    # A process the worker starts (a sandbox, a tool), left behind when the worker dies.
    child = subprocess.Popen(["sleep", "300"])
    with open(sample.metadata["pidfile"], "w") as f:
        f.write(str(child.pid))
    os._exit(5)


def hang_once(sample):
    marker = sample.metadata["marker"]
    if sample.response == "HANG" and not os.path.exists(marker):
        open(marker, "w").close()
        time.sleep(60)
    return 1.0


def always_hang(sample):
    if sample.response == "HANG":
        time.sleep(60)
    return 1.0


def length_mod_7(sample):
    return len(sample["response"]) % 7


async def slow_length(sample):
    await asyncio.sleep(0.2)
    if sample.response == "bad":
        raise KeyError("bad")
    return len(sample.response)


def longest_in_group(samples):
    lengths = [len(s["response"]) for s in samples]
    best = max(lengths)
    return [1.0 if n == best else 0.0 for n in lengths]


def group_raises(samples):
    raise RuntimeError(f"group {samples[0].group_index} failed")


def group_too_short(samples):
    return [1.0]
