#!/usr/bin/env python3
"""A multi-tensor AdamW update from a pointer table, before Nova's fuse stage merges the
large updates (an experiment). Merging the GPT-2 124M step's 48 large updates into one
fused kernel per shape keeps the plan's peak (8.654 GiB at batch 32) but the fused
kernel holds every tensor's loads at once (ptxas: 244-255 registers, spills from two
elements a thread; docs/performance.md). Here each program updates one chunk of one
tensor, found through tables (the tensor of each chunk, its first element, and per
tensor the addresses of p, g, m, v): 7 streams a program whatever the tensor count.

    python scripts/multi_tensor_adamw.py --offline           # sm_90a registers and spills (no GPU)
    python scripts/multi_tensor_adamw.py --check             # the update against torch's formula (any device)
    python scripts/multi_tensor_adamw.py [--reps 50] [--out DIR]  # H200: one launch for the 48 tensors of the
                                                             # step's shapes, against one launch per tensor
                                                             # and torch's fused AdamW
Writes multi_tensor_adamw.json to --out (commit from NOVA_COMMIT)."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.timing import time_events  # noqa: E402

# GPT-2 124M's large matrices: 12 layers x (qkv, attention projection, fc, fc projection)
SHAPES = [(2304, 768)] * 12 + [(768, 768)] * 12 + [(3072, 768)] * 12 + [(768, 3072)] * 12
BLOCK = 1024
LR, B1, B2, EPS, WD = 1e-3, 0.9, 0.95, 1e-8, 0.1


@triton.jit
def adamw_chunks(p_tab, g_tab, m_tab, v_tab, numels, chunk_tensor, chunk_start, step, lr, b1, b2, eps, wd,
                 BLOCK: tl.constexpr):
    """Program i updates elements [chunk_start[i], + BLOCK) of tensor chunk_tensor[i]."""
    pid = tl.program_id(0)
    t = tl.load(chunk_tensor + pid)
    start = tl.load(chunk_start + pid)
    n = tl.load(numels + t)
    p_ptr = tl.load(p_tab + t).to(tl.pointer_type(tl.float32))
    g_ptr = tl.load(g_tab + t).to(tl.pointer_type(tl.float32))
    m_ptr = tl.load(m_tab + t).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(v_tab + t).to(tl.pointer_type(tl.float32))
    offs = start + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(p_ptr + offs, mask=mask)
    g = tl.load(g_ptr + offs, mask=mask)
    m = tl.load(m_ptr + offs, mask=mask)
    v = tl.load(v_ptr + offs, mask=mask)
    p = p * (1.0 - lr * wd)
    m = b1 * m + (1.0 - b1) * g
    v = b2 * v + (1.0 - b2) * g * g
    c1 = 1.0 - tl.exp2(step * tl.log2(b1))
    c2 = 1.0 - tl.exp2(step * tl.log2(b2))
    p = p - lr / c1 * m / (tl.sqrt(v / c2) + eps)
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)


def tables(ps, gs, ms, vs, device):
    """The pointer tables and the chunk map of one launch over the tensors ``ps`` (with ``gs``,
    ``ms``, ``vs``): built once per binding (the addresses do not change between steps)."""
    ptr = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64, device=device)  # noqa: E731
    numels = torch.tensor([t.numel() for t in ps], dtype=torch.int64, device=device)
    owner, first = [], []
    for i, t in enumerate(ps):
        for s in range(0, t.numel(), BLOCK):
            owner.append(i)
            first.append(s)
    return (ptr(ps), ptr(gs), ptr(ms), ptr(vs), numels, torch.tensor(owner, dtype=torch.int32, device=device),
            torch.tensor(first, dtype=torch.int64, device=device))


def launch(tabs, step: int):
    adamw_chunks[(tabs[5].numel(),)](*tabs, float(step), LR, B1, B2, EPS, WD, BLOCK=BLOCK, num_warps=4)


def reference(p, g, m, v, step: int):
    """torch's AdamW (decoupled weight decay), in float64, the update ``adamw_chunks`` computes."""
    p, g, m, v = (x.double() for x in (p, g, m, v))
    p = p * (1 - LR * WD)
    m = B1 * m + (1 - B1) * g
    v = B2 * v + (1 - B2) * g * g
    p = p - LR / (1 - B1 ** step) * m / ((v / (1 - B2 ** step)).sqrt() + EPS)
    return p, m, v


def offline() -> None:
    import contextlib
    import io
    import re

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {"p_tab": "*i64", "g_tab": "*i64", "m_tab": "*i64", "v_tab": "*i64", "numels": "*i64",
           "chunk_tensor": "*i32", "chunk_start": "*i64", "step": "fp32", "lr": "fp32", "b1": "fp32", "b2": "fp32",
           "eps": "fp32", "wd": "fp32", "BLOCK": "constexpr"}
    log = io.StringIO()
    triton.knobs.nvidia.dump_ptxas_log = True
    with contextlib.redirect_stdout(log):
        triton.compile(ASTSource(adamw_chunks, sig, {"BLOCK": BLOCK}, {}), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=4))
    print("adamw_chunks, block", BLOCK, "4 warps, sm_90a:", re.findall(r"Used \d+ registers|\d+ bytes spill stores", log.getvalue()))


def check(device) -> None:
    torch.manual_seed(0)
    shapes = [(37, 19), (1030,), (5, 300)]  # ragged: chunks end inside tensors
    ps = [torch.randn(s, device=device) for s in shapes]
    gs = [torch.randn(s, device=device) for s in shapes]
    ms = [torch.randn(s, device=device) * 0.1 for s in shapes]
    vs = [torch.rand(s, device=device) * 0.1 for s in shapes]
    want = [reference(*x, step=3) for x in zip(ps, gs, ms, vs)]
    launch(tables(ps, gs, ms, vs, device), 3)
    worst = max(float((a.double() - b).abs().max()) for got, exp in zip(zip(ps, ms, vs), want) for a, b in zip(got, exp))
    print(f"multi-tensor AdamW over {len(shapes)} ragged tensors: worst |diff| against float64 {worst:.2e}")
    assert worst < 1e-5, worst


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--offline", action="store_true")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", type=Path, default=Path("."))
    opts = ap.parse_args()
    if opts.offline:
        offline()
        return
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    check(device)
    if opts.check or device.type != "cuda":
        return
    torch.manual_seed(0)
    ps = [torch.randn(s, device=device) for s in SHAPES]
    gs = [torch.randn(s, device=device) for s in SHAPES]
    ms = [torch.randn(s, device=device) * 0.01 for s in SHAPES]
    vs = [torch.rand(s, device=device) * 0.01 for s in SHAPES]
    one = tables(ps, gs, ms, vs, device)
    each = [tables([p], [g], [m], [v], device) for p, g, m, v in zip(ps, gs, ms, vs)]
    steps = [torch.tensor(5.0, device=device) for _ in ps]
    rows = {"one launch (pointer table)": time_events(lambda: launch(one, 5), opts.reps),
            "one launch per tensor": time_events(lambda: [launch(t, 5) for t in each], opts.reps),
            "torch._fused_adamw_": time_events(lambda: torch._fused_adamw_(ps, gs, ms, vs, [], steps, lr=LR, beta1=B1, beta2=B2,
                                                                      weight_decay=WD, eps=EPS, amsgrad=False,
                                                                      maximize=False), opts.reps)}
    nbytes = sum(p.numel() for p in ps) * 4 * 7
    for k, t in rows.items():
        print(f"{k:28s} {t:.4f} ms  ({nbytes / t / 1e9:.2f} TB/s)")
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / "multi_tensor_adamw.json").write_text(json.dumps(
        {"commit": os.environ.get("NOVA_COMMIT", "unknown"), "device": torch.cuda.get_device_name(),
         "tensors": len(ps), "bytes": nbytes, "ms": rows}, indent=1))


if __name__ == "__main__":
    main()
