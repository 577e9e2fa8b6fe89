#!/usr/bin/env python3
"""NCCL's own all-reduce bandwidth through PyTorch, beside `miles bench allreduce` (issue 14):
the same f32 buffer sizes, the same count of timed sums after two untimed ones, one JSON line
per size from rank 0 (bus bandwidth as nccl-tests defines it: 2(N-1)/N of the data per link).

  torchrun --nproc_per_node 2 tests/device/nccl_allreduce_peer.py --sizes-mb 1,16,64,256
"""
import argparse, json, os, time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off (KINDS.md)
import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--sizes-mb", default="1,16,64,256")
p.add_argument("--iters", type=int, default=20)
args = p.parse_args()

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl")
for mb in (float(s) for s in args.sizes_mb.split(",")):
    n = max(1, round(mb * (1 << 20) / 4))
    x = torch.full((n,), float(rank + 1), device="cuda")
    dist.all_reduce(x)
    assert x[0].item() == world * (world + 1) / 2, x[0].item()
    dist.all_reduce(x)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.iters):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - t0) / args.iters
    if rank == 0:
        algbw = 4 * n / seconds / 1e9
        print(json.dumps({"peer": f"torch-{torch.__version__}-nccl", "ranks": world, "bytes": 4 * n,
                          "seconds": seconds, "algbw_gb_s": algbw,
                          "busbw_gb_s": algbw * 2 * (world - 1) / world}), flush=True)
dist.destroy_process_group()
