#!/usr/bin/env python3
"""What SDPA's dropout_p costs in Nova's attention kernels, beside torch SDPA's flash
backend with the same dropout: bf16, causal, one shape (GPT-2 124M's by default), random
inputs. Rows: Nova's forward and its whole backward (delta, dK/dV, dQ) at the schedule
the configure stage picks, and SDPA's forward and autograd backward, each at dropout 0
and ``--p``. Timing: ``bench/timing.time_events``, the median of ``--repeats`` launches
each between CUDA events, after warm-up. Nova's rows are checked against the reference
executor (max relative error on o and dq, dk, dv) before they are timed.

    python scripts/attention_dropout.py [--batch 32] [--heads 12] [--seq 1024] [--dim 64] [--p 0.1] [--out DIR]

writes DIR/attention_dropout_<commit>.json ($NOVA_COMMIT, else git's short HEAD).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.timing import time_events  # noqa: E402


def commit() -> str:
    if os.environ.get("NOVA_COMMIT"):
        return os.environ["NOVA_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def nova_rows(q, k, v, do, p: float, repeats: int) -> list[dict]:
    from nova.backends.reference import IMPLS
    from nova.codegen.triton import attention
    from nova.ir import dialect as nv
    from nova.ir.builder import OpBuilder
    from nova.ir.module import Slot, new_step
    from nova.ir.types import from_torch_dtype, tensor
    from nova.schedule.devices import from_torch_device
    from nova.transforms.configure import configure_op

    seed = torch.tensor(1234567, dtype=torch.int64, device=q.device)
    props = {"causal": True, "scale": q.shape[-1] ** -0.5} | ({"dropout": p, "salt": 3} if p else {})
    extra = [seed] if p else []

    def build(op_cls, inputs):
        _, fn = new_step([Slot("batch", f"x{i}", tensor(t.shape, from_torch_dtype(t.dtype))) for i, t in enumerate(inputs)])
        return OpBuilder(fn.body.block).create(op_cls, list(fn.body.block.args), props)

    device = from_torch_device(q.device)
    fwd_in = [q, k, v, *extra]
    fwd_op = build(nv.AttentionOp, fwd_in)
    fwd = attention.lower_attention(fwd_op, configure_op(fwd_op, device, "bf16"), precision="bf16")
    out, lse = fwd.launch(fwd_in)
    ref_o, ref_lse = IMPLS[nv.AttentionOp](fwd_op, fwd_in)
    bwd_in = [do, q, k, v, out, lse, *extra]
    bwd_op = build(nv.AttentionBackwardOp, bwd_in)
    bwd = attention.lower_attention_backward(bwd_op, configure_op(bwd_op, device, "bf16"), precision="bf16")
    grads = bwd.launch(bwd_in)
    refs = IMPLS[nv.AttentionBackwardOp](bwd_op, bwd_in)
    err_f = rel(out, ref_o)
    err_b = max(rel(a, b) for a, b in zip(grads, refs))
    outs = [torch.empty_like(t) for t in (out, lse)]
    gouts = [torch.empty_like(t) for t in grads]
    return [
        {"engine": "nova", "pass": "fwd", "p": p, "rel_err": err_f,
         "ms": time_events(lambda: fwd.launch(fwd_in, outs), repeats)},
        {"engine": "nova", "pass": "bwd", "p": p, "rel_err": err_b,
         "ms": time_events(lambda: bwd.launch(bwd_in, gouts), repeats)},
    ]  # fmt: skip


def sdpa_rows(q, k, v, do, p: float, repeats: int) -> list[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import torch.nn.functional as F

    rows = []
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

        def fwd():
            return F.scaled_dot_product_attention(qg, kg, vg, dropout_p=p, is_causal=True)

        o = fwd()

        def bwd():
            torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True)

        with torch.no_grad():
            rows.append({"engine": "sdpa_flash", "pass": "fwd", "p": p, "ms": time_events(fwd, repeats)})
        rows.append({"engine": "sdpa_flash", "pass": "bwd", "p": p, "ms": time_events(bwd, repeats)})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--p", type=float, default=0.1)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "runs")
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    shape = (a.batch, a.heads, a.seq, a.dim)
    q, k, v, do = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    rows = []
    for p in (0.0, a.p):
        rows += nova_rows(q, k, v, do, p, a.repeats)
        rows += sdpa_rows(q, k, v, do, p, a.repeats)
    for r in rows:
        err = f"  rel err {r['rel_err']:.1e}" if "rel_err" in r else ""
        print(f"{r['engine']:>10} {r['pass']} p={r['p']:<4} {r['ms']:.4f} ms{err}")
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / f"attention_dropout_{commit()}.json"
    path.write_text(json.dumps({
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": commit(),
        "shape": shape, "dtype": "bf16", "causal": True, "rows": rows,
    }, indent=1))  # fmt: skip
    print("wrote", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
