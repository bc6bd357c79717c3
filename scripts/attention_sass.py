#!/usr/bin/env python3
"""The attention forward's machine code counted offline (no GPU): the kernel Nova
generates for GPT-2's shape (T 1024, head dim 64, bf16, causal; 12 heads) without and
with SDPA's dropout, compiled for sm_90a by Triton's own ptxas and read back by its
nvdisasm, one line each: its SASS instructions and the most frequent opcodes. A proxy
for the dropout hash's cost beside the plain kernel, not a timing
(``gpu_check.sh attn-dropout`` times it).

    python scripts/attention_sass.py [--p 0.1]
    python scripts/attention_sass.py --precision tf32 [--batch 16]

``--precision tf32``: f32 attention under the tf32 policy instead, the forward and both backward
kernels at the configure stage's H100 configs, each with the integer tf32 rounding and with
``matmul.TF32_RN_CVT`` (one ``cvt.rn.tf32.f32``): what the rounding costs in instructions.
``--tma-kv``: the forward with k and v through TMA descriptors (the ``tma_kv`` source flag) beside
the pointer loads. The kernels are built with the arguments specialized as a launch specializes
them (unit strides constant, the rest known divisible by 16: ``build_for_sm90(specialize=True)``);
until 2026-12-07's twenty-third session they were not, and the counts were of the less
vectorized code no launch runs (the tf32 forward 5,744 instructions against 4,168 specialized).

Runs without TRITON_INTERPRET (the real compiler)."""
from __future__ import annotations

import argparse
import collections
import os
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "kernels")]
os.environ.pop("TRITON_INTERPRET", None)

OPCODE = re.compile(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")


def counts(sass: str) -> tuple[int, collections.Counter]:
    lines = [ln for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", ln)]
    ops = collections.Counter(m.group(1).split(".")[0] for m in map(OPCODE.search, lines) if m)
    return len(lines), ops


def report(label: str, cases, only: tuple[str, ...] | None = None) -> None:
    """One line per kernel the launches of ``cases`` ([(lower, inputs)]) start (or those named
    in ``only``): its SASS instruction count and its most frequent opcodes."""
    from test_rowwise import build_for_sm90  # the kernel tests' sm_90a build

    from nova.codegen.triton.wgmma_check import sass_of

    kernels: dict = {}
    build_for_sm90(cases, kernels, specialize=True)
    for name, (compiled, _) in kernels.items():
        if only is None or name in only:
            n, ops = counts(sass_of(compiled.asm["cubin"]))
            print(f"{label} {name}: {n} SASS instructions; {dict(ops.most_common(12))}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--p", type=float, default=0.1)
    ap.add_argument("--precision", choices=("bf16", "tf32"), default="bf16")
    ap.add_argument("--batch", type=int, default=16, help="tf32: the batch the configs are for")
    ap.add_argument("--tma-kv", action="store_true",
                    help="only the forward at the configure stage's H100 config, bf16 (batch 32) and tf32 "
                         "(--batch), with and without the tma_kv source flag")
    args = ap.parse_args()

    import torch
    from test_rowwise import build  # the kernel tests' op builder

    from nova.codegen.triton import attention
    from nova.codegen.triton import matmul as mm
    from nova.ir import dialect as nv
    from nova.schedule.devices import DEVICES
    from nova.transforms.configure import configure_op

    causal = {"causal": True, "scale": 64**-0.5}
    if args.tma_kv:
        for dtype, precision, b in ((torch.bfloat16, "bf16", 32), (torch.float32, "tf32", args.batch)):
            x = torch.empty(b, 12, 1024, 64, dtype=dtype)
            op = build(nv.AttentionOp, [x, x, x], causal)
            cfg = configure_op(op, DEVICES["H100"], precision)
            for flags in ((), ("tma_kv",)):
                report(f"{precision} forward {cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages} "
                       f"{'+'.join(flags) or 'pointer loads'}",
                       [(lambda: attention.lower_attention(op, cfg, precision=precision, source_flags=flags),
                         [x, x, x])], only=("attention_fwd",))  # fmt: skip
    elif args.precision == "tf32":
        x, lse = torch.empty(args.batch, 12, 1024, 64), torch.empty(args.batch, 12, 1024)
        fwd, bwd = build(nv.AttentionOp, [x, x, x], causal), build(nv.AttentionBackwardOp, [x, x, x, x, x, lse], causal)
        cases = [(lambda: attention.lower_attention(fwd, configure_op(fwd, DEVICES["H100"], "tf32"), precision="tf32"),
                  [x, x, x]),
                 (lambda: attention.lower_attention_backward(bwd, configure_op(bwd, DEVICES["H100"], "tf32"),
                                                             precision="tf32"), [x, x, x, x, x, lse])]  # fmt: skip
        for cvt in (False, True):
            mm.TF32_RN_CVT = cvt
            report(f"TF32_RN_CVT={cvt}", cases)
    else:
        q = torch.empty(2, 12, 1024, 64, dtype=torch.bfloat16)
        for p in (0.0, args.p):
            props, z = dict(causal), []
            if p:
                props |= {"dropout": p, "salt": 1}
                z = [torch.tensor(5, dtype=torch.int64)]
            op = build(nv.AttentionOp, [q, q, q, *z], props)
            report(f"p={p}", [(lambda op=op: attention.lower_attention(op, None, precision="bf16"), [q, q, q, *z])])


if __name__ == "__main__":
    main()
