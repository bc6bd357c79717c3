#!/usr/bin/env python3
"""Which matmul kernel structure reaches cuBLAS on the GPT-2 124M bf16 step's shapes
(an experiment, before a change to the template): for every large matmul of the step
at batch 32, cuBLAS (torch.matmul on the same layouts), Nova's configured template
kernel, and a persistent kernel with A, B and C all through TMA descriptors (C stored
through a descriptor, in two column halves), with and without ``tl.range(flatten=True)``
(one software pipeline over the tiles and their K loop, so it does not drain between
tiles), over a few tile configs. Median of CUDA-event-timed launches, random data.

    python scripts/matmul_variants.py [--reps 30] [--out DIR]

Writes matmul_variants.json to --out (the commit from NOVA_COMMIT; the run at 3f4314c is
bench/results/runs/matmul_variants_3f4314c.json). Needs CUDA (Hopper: TMA)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

# (M, N, K, A layout, B layout, uses per step): row = last dim contiguous, col = transposed storage
SHAPES = [
    (32768, 2304, 768, "row", "col", 12), (32768, 768, 768, "row", "col", 12),
    (32768, 3072, 768, "row", "col", 12), (32768, 768, 3072, "row", "col", 12),
    (2048, 50304, 768, "row", "col", 16),
    (32768, 3072, 768, "row", "row", 12), (32768, 768, 3072, "row", "row", 12),
    (32768, 768, 768, "row", "row", 12), (32768, 768, 2304, "row", "row", 12),
    (2048, 768, 50304, "row", "row", 16),
    (3072, 768, 32768, "col", "row", 12), (768, 3072, 32768, "col", "row", 12),
    (768, 2304, 32768, "col", "row", 12), (50304, 768, 2048, "col", "row", 16),
]
CONFIGS = [(128, 256, 64, 3, 8), (128, 256, 64, 4, 8), (128, 128, 64, 4, 8), (128, 128, 64, 5, 4),
           (256, 128, 64, 3, 8), (128, 128, 128, 3, 8)]


@triton.jit
def _tile(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    group = tile_id // (GROUP_M * num_pid_n)
    first_m = group * GROUP_M
    rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile_id % (GROUP_M * num_pid_n)) % rows
    pid_n = (tile_id % (GROUP_M * num_pid_n)) // rows
    return pid_m, pid_n


@triton.jit
def persistent_tma(a_desc, b_desc, c_desc, M, N, K, NUM_SMS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr, GROUP_M: tl.constexpr, A_T: tl.constexpr, B_T: tl.constexpr,
                   FLATTEN: tl.constexpr):
    start = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    tiles = num_pid_m * num_pid_n
    tile_c = start - NUM_SMS
    for tile_id in tl.range(start, tiles, NUM_SMS, flatten=FLATTEN):
        pid_m, pid_n = _tile(tile_id, num_pid_m, num_pid_n, GROUP_M)
        om = pid_m * BM
        on = pid_n * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(k_tiles):
            ok = ki * BK
            if A_T:
                a = a_desc.load([ok, om]).T
            else:
                a = a_desc.load([om, ok])
            if B_T:
                b = b_desc.load([on, ok]).T
            else:
                b = b_desc.load([ok, on])
            acc = tl.dot(a, b, acc)
        tile_c += NUM_SMS
        pid_m, pid_n = _tile(tile_c, num_pid_m, num_pid_n, GROUP_M)
        acc = tl.reshape(acc, (BM, 2, BN // 2))
        acc = tl.permute(acc, (0, 2, 1))
        c0, c1 = tl.split(acc)
        c_desc.store([pid_m * BM, pid_n * BN], c0.to(c_desc.dtype))
        c_desc.store([pid_m * BM, pid_n * BN + BN // 2], c1.to(c_desc.dtype))


def _operands(M, N, K, la, lb, out_dtype):
    g = torch.Generator(device="cuda").manual_seed(M * 7 + N * 3 + K)
    a = torch.randn((M, K) if la == "row" else (K, M), device="cuda", dtype=torch.bfloat16, generator=g)
    b = torch.randn((K, N) if lb == "row" else (N, K), device="cuda", dtype=torch.bfloat16, generator=g)
    a = a if la == "row" else a.t()
    b = b if lb == "row" else b.t()
    return a, b, torch.empty((M, N), device="cuda", dtype=out_dtype)


def _time(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        ts.append((s, e))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in ts)


def _graphed(fn):
    """``fn`` captured once in a CUDA graph: its replay times the device alone (the
    template's launcher does Python work per call that events would otherwise time)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def _cfg_name(c) -> str:
    return (f"{c.block_m}x{c.block_n}x{c.block_k} w{c.num_warps} s{c.num_stages} g{c.group_m}"
            + (f" sk{c.split_k}" if c.split_k > 1 else "") + (" persistent" if c.persistent else ""))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", type=Path, default=Path("."))
    opts = ap.parse_args()
    from nova.codegen.triton import matmul as mm

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows, totals = [], {"cublas": 0.0, "nova": 0.0, "best_variant": 0.0}
    for M, N, K, la, lb, uses in SHAPES:
        out_dtype = torch.float32 if N == 768 and K == 2048 else torch.bfloat16
        a, b, c = _operands(M, N, K, la, lb, out_dtype)
        ref = torch.matmul(a, b)
        c16 = torch.empty((M, N), device="cuda", dtype=torch.bfloat16)
        t_cublas = _time(lambda: torch.matmul(a, b, out=c16), opts.reps)  # bf16 out (an f32 out: cuBLAS's bf16 time)
        cfg = mm.configure(M, N, K, 1, a.dtype, out_dtype, "bf16", mm.layout(a), mm.layout(b), False, mm.device_spec(a.device))
        t_nova = _time(_graphed(lambda: mm.matmul(a, b, cfg=cfg, precision="bf16", out=c)), opts.reps)
        row = {"M": M, "N": N, "K": K, "a": la, "b": lb, "out": str(out_dtype), "uses": uses,
               "cublas_ms": t_cublas, "nova_ms": t_nova, "nova_config": _cfg_name(cfg), "variants": {}}
        # the template itself at other configs (persistent with split-K, other tiles)
        others = [dataclasses.replace(cfg, persistent=not cfg.persistent)]
        if cfg.split_k > 1:
            others += [dataclasses.replace(cfg, split_k=1, persistent=True),
                       dataclasses.replace(cfg, block_m=128, block_n=128, num_warps=4, num_stages=5, split_k=1, persistent=True)]
        for other in others:
            try:
                row["variants"]["nova " + _cfg_name(other)] = {
                    "ms": _time(_graphed(lambda: mm.matmul(a, b, cfg=other, precision="bf16", out=c)), opts.reps), "ok": True}
            except Exception as e:  # recorded, not timed
                row["variants"]["nova " + _cfg_name(other)] = {"error": f"{type(e).__name__}: {str(e)[:120]}"}
        for bm, bn, bk, stages, warps in CONFIGS:
            a_desc = TensorDescriptor.from_tensor(a.t() if la == "col" else a, [bk, bm] if la == "col" else [bm, bk])
            b_desc = TensorDescriptor.from_tensor(b.t() if lb == "col" else b, [bn, bk] if lb == "col" else [bk, bn])
            c_desc = TensorDescriptor.from_tensor(c, [bm, bn // 2])
            tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
            for flat in (False, True):
                name = f"{bm}x{bn}x{bk} s{stages} w{warps}{' flat' if flat else ''}"
                grid = (min(sms, tiles),)

                def run():
                    persistent_tma[grid](a_desc, b_desc, c_desc, M, N, K, NUM_SMS=grid[0], BM=bm, BN=bn, BK=bk,
                                         GROUP_M=8, A_T=la == "col", B_T=lb == "col", FLATTEN=flat,
                                         num_stages=stages, num_warps=warps)
                try:
                    t = _time(run, opts.reps)
                    ok = True
                    run()
                    ok = bool(torch.allclose(c.float(), ref.float(), rtol=2e-2, atol=2e-1))
                    row["variants"][name] = {"ms": t, "ok": ok}
                except Exception as e:  # an out-of-resources config: recorded, not timed
                    row["variants"][name] = {"error": f"{type(e).__name__}: {str(e)[:120]}"}
        good = {k: v["ms"] for k, v in row["variants"].items() if v.get("ok")}
        best = min(good, key=good.get) if good else None
        row["best"] = best
        totals["cublas"] += uses * t_cublas
        totals["nova"] += uses * t_nova
        totals["best_variant"] += uses * (min(good[best], t_nova) if best else t_nova)
        print(f"{M:6d}x{N:6d}x{K:6d} {la}/{lb} x{uses}: cublas {t_cublas:.4f} nova {t_nova:.4f} "
              f"[{row['nova_config']}] best {best} {good.get(best, float('nan')):.4f}  (nova/cublas {t_cublas / t_nova:.2f}, "
              f"best/cublas {t_cublas / good[best] if best else 0:.2f})", flush=True)
        for k, v in sorted(row["variants"].items(), key=lambda kv: kv[1].get("ms", 1e9)):
            print(f"      {k:26s} {v.get('ms', float('nan')):.4f} {'' if v.get('ok', False) else v.get('error', 'MISMATCH')}")
        rows.append(row)
    print("step totals (ms):", {k: round(v, 3) for k, v in totals.items()})
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / "matmul_variants.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
         "commit": os.environ.get("NOVA_COMMIT", "unknown"),
         "rows": rows, "totals_ms": totals}, indent=1))


if __name__ == "__main__":
    main()
