"""embedding (a row gather) and embedding_backward (a row scatter-add), as
generated Triton source.

Both kernels tile [BLOCK_N ids x BLOCK_D columns]; rows are read and written
along D, the contiguous axis (coalesced). Ids are checked on the device in the
same launch: out-of-range ids never address memory (their loads and atomics are
masked off), and the programs of the first D tile fold their ids into a 2-entry
int64 flag tensor with two atomics each:

    flags[0] = min(0, smallest id)           < 0  iff some id < 0
    flags[1] = max(0, largest id - (V - 1))  > 0  iff some id >= V

It starts as zeros (a memset, so the launch stays CUDA-graph capturable). The
host reads it back and raises IndexError naming the op and the range. Reading it
is a device sync; ``Kernel.extra["launch_unchecked"]`` returns ``(outputs, flags)``
without it, and ``Kernel.extra["check"](flags)`` raises later (e.g. once per
replayed step).

The gather moves stored values, so the table may be of any element type (f32,
f64, bf16, f16, i64, bool as 0/1 bytes): integer gathers and advanced indexing
are captured as embedding on [N, 1] or [N, C] tables.

embedding_backward accumulates with ``tl.atomic_add`` into a zero fp32 table
(fp64 for f64 grads), then rounds it once to the grad dtype with the elementwise
cast kernel. Atomics make fp32 sums depend on the order of arrival (not bitwise
reproducible run to run on the GPU); a sort + segmented sum would be the
deterministic alternative. Rows of ``padding_idx`` receive nothing, so they stay
zero as in torch.
"""

from __future__ import annotations

import torch

from nova.codegen.triton.elementwise import (
    INT32_MAX, UnsupportedError, cast_kernel, load, next_pow2, sanitize, shape_name, span, storage_view, tag,
)  # fmt: skip
from nova.codegen.triton.lowering import Kernel, lowers
from nova.ir import dialect as nv
from nova.ir.types import elem_of, numel, shape_of, to_torch_dtype
from nova.schedule.config import LoweringConfig

TILE = 2048  # elements per program: 16 per thread at 4 warps
DEFAULT_BLOCK_D = 512  # columns per program: 2 KiB of fp32 per row segment

_CHECK = """
    if pid_d == 0:  # one D tile folds its ids into the flags
        tl.atomic_min(flags_ptr, tl.min(tl.where(nmask, ids, 0), 0))
        tl.atomic_max(flags_ptr + 1, tl.max(tl.where(nmask, ids - {last}, 0), 0))"""

# both kernels: a [bn rows, bd columns] tile of the [n, d] rows the ids select
_ROWS = """    pid_n = tl.program_id(0)
    pid_d = tl.program_id(1)
    rows = pid_n * {bn} + tl.arange(0, {bn})
    cols = pid_d * {bd} + tl.arange(0, {bd})
    if IDX64:
        rows = rows.to(tl.int64)
    nmask = rows < {n}
    ids = tl.load(ids_ptr + rows, mask=nmask, other=0).to(tl.int64)
"""

_GATHER = """import triton
import triton.language as tl


@triton.jit
def {name}(w_ptr, ids_ptr, out_ptr, flags_ptr, stride_wv, stride_wd, IDX64: tl.constexpr):
""" + _ROWS + """    ok = nmask & (ids >= 0) & (ids < {v}){check}
    cmask = cols < {d}
    src = tl.where(ok, ids, 0)[:, None] * stride_wv + cols[None, :] * stride_wd
    vals = tl.load(w_ptr + src, mask=ok[:, None] & cmask[None, :], other=0)
    tl.store(out_ptr + rows[:, None] * {d} + cols[None, :], vals, mask=nmask[:, None] & cmask[None, :])
"""

_SCATTER = """import triton
import triton.language as tl


@triton.jit
def {name}(g_ptr, ids_ptr, table_ptr, flags_ptr, IDX64: tl.constexpr):
""" + _ROWS + """    ok = nmask & (ids >= 0) & (ids < {v}) & (ids != {pad}){check}
    cmask = cols < {d}
    g = tl.load(g_ptr + rows[:, None] * {d} + cols[None, :], mask=nmask[:, None] & cmask[None, :], other=0)
    dst = table_ptr + tl.where(ok, ids, 0)[:, None] * {d} + cols[None, :]
    tl.atomic_add(dst, g.to({acc}), mask=ok[:, None] & cmask[None, :])
"""


def tiles(n: int, d: int, cfg: LoweringConfig | None) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_D, num_warps): D is the fast axis (``cfg.block`` sizes it)."""
    bd = cfg.block if cfg is not None and cfg.block else DEFAULT_BLOCK_D
    if bd & (bd - 1):
        raise ValueError(f"embedding: block={bd} must be a power of two")
    bd = min(bd, next_pow2(d))
    bn = min(next_pow2(n), max(1, TILE // bd))
    warps = cfg.num_warps if cfg is not None else max(1, min(4, bn * bd // 256))
    return bn, bd, warps


def raise_if_out_of_range(flags: torch.Tensor, what: str, num_embeddings: int) -> None:
    """Raise the IndexError the flags of a launch call for (a device sync)."""
    lo, over = flags.tolist()
    if lo < 0 or over > 0:
        found = []
        if lo < 0:
            found.append(f"min {lo}")
        if over > 0:
            found.append(f"max {num_embeddings - 1 + over}")
        raise IndexError(f"{what}: index out of range [0, {num_embeddings}) ({', '.join(found)})")


def _check_ids(ids: torch.Tensor, shape, what: str) -> None:
    if tuple(ids.shape) != tuple(shape) or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"{what}: ids are {tuple(ids.shape)} {ids.dtype}, expected integer ids of shape {tuple(shape)}")


def _kernel(name, source, run, what, num_embeddings, cfg, needs_contiguous) -> Kernel:
    def launch(xs, device=None):
        outs, flags = run(xs)
        raise_if_out_of_range(flags, what, num_embeddings)
        return outs

    return Kernel(
        name=name, source=source, launch=launch, needs_contiguous=needs_contiguous, config=cfg,
        extra={
            "launch_unchecked": run,
            "check": lambda flags: raise_if_out_of_range(flags, what, num_embeddings),
        },
    )  # fmt: skip


@lowers(nv.EmbeddingOp)
def lower_embedding(op, cfg: LoweringConfig | None = None) -> Kernel:
    """``weight[ids]``: weight with any strides; ids contiguous (needs_contiguous=(1,)).
    The table may have any element type (gathers and advanced indexing of integer
    or bool tensors are captured as embedding): rows are moved as they are stored,
    bools as their 0/1 bytes. ``padding_idx`` only matters to the backward."""
    (V, D), w_dtype = shape_of(op.operands[0].type), to_torch_dtype(elem_of(op.operands[0].type))
    ids_shape = shape_of(op.operands[1].type)
    out_shape = shape_of(op.results[0].type)
    tag(w_dtype)  # a supported dtype
    n = numel(ids_shape)
    bn, bd, warps = tiles(n, D, cfg)
    name = f"nova_embedding_{V}x{D}_{shape_name(ids_shape)}_{tag(w_dtype)}"
    fname = sanitize(name)
    src = _GATHER.format(name=fname, bn=bn, bd=bd, n=n, v=V, d=D, check=_CHECK.format(last=V - 1))
    fn = load(src, fname)

    def run(xs):
        w, ids = xs
        if tuple(w.shape) != (V, D) or w.dtype != w_dtype:
            raise ValueError(f"{name}: weight is {tuple(w.shape)} {w.dtype}, expected {(V, D)} {w_dtype}")
        _check_ids(ids, ids_shape, name)
        out = torch.empty(out_shape, dtype=w_dtype, device=w.device)
        flags = torch.zeros(2, dtype=torch.int64, device=w.device)
        if out.numel():
            ids = ids.contiguous()
            big = span(w) > INT32_MAX or out.numel() + TILE > INT32_MAX
            grid = (-(-n // bn), -(-D // bd))
            fn[grid](storage_view(w), ids, storage_view(out), flags, w.stride(0), w.stride(1), IDX64=big,
                     num_warps=warps)
        return [out], flags

    return _kernel(name, src, run, "nova.embedding", V, cfg, (1,))


@lowers(nv.EmbeddingBackwardOp)
def lower_embedding_backward(op, cfg: LoweringConfig | None = None) -> Kernel:
    """Scatter-add of grad rows into [num_embeddings, D]; grad and ids contiguous
    (needs_contiguous=(0, 1))."""
    g_shape, g_dtype = shape_of(op.operands[0].type), to_torch_dtype(elem_of(op.operands[0].type))
    ids_shape = shape_of(op.operands[1].type)
    p = op.props()
    V, pad = p["num_embeddings"], p["padding_idx"]
    D = g_shape[-1]
    t = tag(g_dtype)
    if t not in ("f32", "f64", "bf16", "f16"):
        raise UnsupportedError(f"nova.embedding_backward: grad must be a float tensor, got {g_dtype}")
    acc_dtype = torch.float64 if t == "f64" else torch.float32
    n = numel(ids_shape)
    bn, bd, warps = tiles(n, D, cfg)
    name = f"nova_embedding_backward_{V}x{D}_{shape_name(ids_shape)}_{t}_pad{pad}"
    fname = sanitize(name)
    src = _SCATTER.format(
        name=fname, bn=bn, bd=bd, n=n, v=V, d=D, pad=pad if pad >= 0 else -1,
        acc="tl.float64" if t == "f64" else "tl.float32", check=_CHECK.format(last=V - 1),
    )  # fmt: skip
    fn = load(src, fname)
    cast = cast_kernel((V, D), acc_dtype, g_dtype) if acc_dtype != g_dtype else None
    source = src if cast is None else src + "\n\n# then, rounding the table once:\n" + cast.source

    def run(xs):
        g, ids = xs
        if tuple(g.shape) != tuple(g_shape) or g.dtype != g_dtype:
            raise ValueError(f"{name}: grad is {tuple(g.shape)} {g.dtype}, expected {tuple(g_shape)} {g_dtype}")
        _check_ids(ids, ids_shape, name)
        table = torch.zeros((V, D), dtype=acc_dtype, device=g.device)
        flags = torch.zeros(2, dtype=torch.int64, device=g.device)
        if n and D:
            g, ids = g.contiguous(), ids.contiguous()
            big = table.numel() + TILE > INT32_MAX or g.numel() + TILE > INT32_MAX
            fn[(-(-n // bn), -(-D // bd))](g, ids, table, flags, IDX64=big, num_warps=warps)
        return [table if cast is None else cast.launch([table])[0]], flags

    return _kernel(name, source, run, "nova.embedding_backward", V, cfg, (0, 1))


__all__ = ["lower_embedding", "lower_embedding_backward", "raise_if_out_of_range", "tiles"]
