#!/usr/bin/env python3
"""Offline sm_90a compile of the row-wise reduction groups of a GPT-2 124M step (the
fuse stage's ``nova.fused "reduction"`` groups headed by a LayerNorm or its backward,
at the configs the configure stage wrote): each distinct group's kernels as its
launch would call them, registers, spill bytes and compile seconds from Triton's
bundled ptxas. No GPU needed.

    python scripts/rowwise_sm90_check.py [--batch 32] [--precision bf16]

How: each group is lowered as the Triton backend lowers it; its launch runs with CPU
tensors of the group's operand types while every ``@triton.jit`` call is recorded
instead of run (argument types: a tensor is a pointer of its dtype, an int is i32
or i64 as Triton types it, 1 a constant as Triton specializes it, launch options as
given); each recorded call is then compiled for sm_90a with 16-byte divisibility on
pointers (as the arena's buffers are). Run it after a change to the row templates
or to what fuse puts in them: a failed compile or a spill shows here before the GPU
does."""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

_PTR = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float64: "*fp64",
        torch.bool: "*u8", torch.int64: "*i64", torch.int32: "*i32"}  # fmt: skip


class _Recorded:
    """A ``@triton.jit`` function whose launches are recorded: ``kernel[grid](*args, **opts)``."""

    def __init__(self, fn, calls: list):
        self.fn, self.calls = fn, calls

    def __getitem__(self, grid):
        def call(*args, **opts):
            self.calls.append((self.fn, args, opts))

        return call


def _compile(fn, args, opts) -> tuple[str, float]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, consts, attrs = {}, {}, {}
    for i, (a, v) in enumerate(zip(fn.arg_names, args, strict=True)):  # (the row templates take no defaults)
        if isinstance(v, torch.Tensor):
            sig[a] = _PTR[v.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, bool):
            sig[a], consts[a] = "constexpr", v
        elif isinstance(v, int):
            if v == 1:
                sig[a], consts[a] = "constexpr", 1
            else:
                sig[a] = "i64" if abs(v) >= 2**31 else "i32"
                if v % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            sig[a] = "fp32"
        else:
            raise SystemExit(f"rowwise_sm90_check: {fn.__name__}: argument {a} of type {type(v).__name__}")
    options = {k: v for k, v in opts.items() if k in ("num_warps", "num_stages", "enable_fp_fusion")}
    log = io.StringIO()
    triton.knobs.nvidia.dump_ptxas_log = True
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(log):
            triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32), options=options)
    finally:
        triton.knobs.nvidia.dump_ptxas_log = False
    return log.getvalue(), time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--precision", default="bf16")
    args = ap.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ.setdefault("NOVA_STEP_CACHE", "0")
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="rowwise_sm90_")  # a cached kernel prints no ptxas log
    sys.path.insert(0, str(Path(__file__).resolve().parent))

    from epilogue_sm90_check import _ptxas
    from gpt2_h200 import compile_gpt2_h200
    from nova.backends.triton import config_of
    from nova.codegen.triton import fused as fk, rowwise
    from nova.ir import dialect as nv
    from nova.ir.module import step_func
    from nova.ir.types import elem_of, shape_of, to_torch_dtype

    c = compile_gpt2_h200(args.batch, args.precision)
    calls: list = []
    real = rowwise.load_kernel
    rowwise.load_kernel = lambda src, name, *a, **k: (_Recorded(real(src, name, *a, **k)[0], calls), None)
    groups: dict = {}
    for op in step_func(c.module).body.block.ops:
        if isinstance(op, nv.FusedOp) and isinstance(op.reduction(), (nv.LayerNormOp, nv.LayerNormBackwardOp)):
            groups.setdefault(fk.structure(op, config_of(op)), []).append(op)
    print(f"GPT-2 124M {args.precision} batch {args.batch}: {sum(map(len, groups.values()))} LayerNorm groups, "
          f"{len(groups)} distinct")
    failed = False
    for ops in groups.values():
        op = ops[0]
        kernel = fk.lower_reduction_group(op, config_of(op))
        inputs = [torch.zeros(shape_of(v.type), dtype=to_torch_dtype(elem_of(v.type))) for v in op.operands]
        calls.clear()
        kernel.launch(inputs)
        inner = [o.name.removeprefix("nova.") for o in op.inner_ops()]
        sides = len(op.prologue_sides())
        print(f"- {len(ops)} x {op.reduction().name} {list(op.iteration_shape())}: {len(inner)} ops, "
              f"{sides} side ops, {len(op.results)} results")
        for fn, a, opts in calls:
            try:
                log, secs = _compile(fn, a, opts)
            except Exception as e:  # a failed compile is the finding: report it, go on
                failed = True
                print(f"    {fn.fn.__name__}: FAILED {type(e).__name__}: {str(e)[:300]}")
                continue
            regs, spills = _ptxas(log)
            print(f"    {fn.fn.__name__}: {opts.get('num_warps')} warps, registers {','.join(regs)}, "
                  f"spill stores {','.join(spills) or '0'} bytes, {secs:.1f} s")
    rowwise.load_kernel = real
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
