"""The link constants of the gradient-bucket model (docs/configurator.md, "Gradient
buckets"): times torch.distributed collectives of 8 B .. 1 GiB between the ranks and
fits T(B) = alpha + f(W) B / beta (f = 2 (W-1)/W for all_reduce, (W-1)/W for
reduce_scatter / all_gather).

    torchrun --standalone --nproc-per-node 2 scripts/measure_link.py            # NCCL on GPUs
    torchrun --standalone --nproc-per-node 2 scripts/measure_link.py --gloo     # gloo on CPUs

Rank 0 prints one line per size and the fit (alpha: the median time of the smallest
message; beta: the bus bandwidth of the largest), and with --json PATH writes them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gloo", action="store_true", help="CPU tensors over gloo (default: NCCL, cuda:LOCAL_RANK)")
    p.add_argument("--max-log2", type=int, default=30, help="largest message: 2^N bytes (default 30)")
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if a.gloo:
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    else:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    w, rank = dist.get_world_size(), dist.get_rank()
    rows = []
    for k in range(3, a.max_log2 + 1):
        n = max(1, 2**k // 4)
        x = torch.ones(n, dtype=torch.float32, device=device)
        times = []
        for i in range(a.repeat + 3):
            if device.type == "cuda":
                torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= 3:
                times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        bus = 2 * (w - 1) / w * 4 * n / t
        rows.append({"bytes": 4 * n, "seconds": t, "bus_bandwidth": bus})
        if rank == 0:
            print(f"all_reduce {4 * n:>12} B  {t * 1e6:10.1f} us  bus {bus / 1e9:8.2f} GB/s", flush=True)
    fit = {"alpha": rows[0]["seconds"], "beta": rows[-1]["bus_bandwidth"], "world_size": w,
           "backend": dist.get_backend(), "rows": rows}
    if rank == 0:
        print(f"alpha {fit['alpha'] * 1e6:.1f} us, beta {fit['beta'] / 1e9:.1f} GB/s (bus)")
        if a.json:
            with open(a.json, "w") as f:
                json.dump(fit, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
