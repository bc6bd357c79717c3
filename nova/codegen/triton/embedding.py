"""embedding (a row gather) and embedding_backward (a row scatter-add), as
generated Triton source.

Both kernels tile [BLOCK_N ids x BLOCK_D columns]; rows are read and written
along D, the contiguous axis (coalesced). Any id value is memory-safe: an id
outside [0, num_embeddings) (the -1 a captured gather uses for an out-of-range
index included) never addresses memory, its loads and atomics are masked off:
the gather writes a row of zeros for it and the scatter-add adds nothing. The
kernels do not report such ids: the guard stage's check ops count them on the
device (``nova.transforms.guard``), so a launch never waits for the device.

The gather moves stored values, so the table may be of any element type (f32,
f64, bf16, f16, i64, bool as 0/1 bytes): integer gathers and advanced indexing
are captured as embedding on [N, 1] or [N, C] tables.

embedding_backward accumulates with ``tl.atomic_add`` into a zeroed fp32 table
(fp64 for f64 grads): the result itself when the grad is fp32 / fp64, else a
scratch table that the elementwise cast kernel then rounds once into the
result. Atomics make fp32 sums depend on the order of arrival (not bitwise
reproducible run to run on the GPU); a sort + segmented sum would be the
deterministic alternative. Rows of ``padding_idx`` receive nothing, so they stay
zero as in torch.
"""

from __future__ import annotations

import torch

from nova.codegen.triton.elementwise import (
    INT32_MAX, UnsupportedError, cast_kernel, load, next_pow2, only_out, result_tensor, sanitize, shape_name, span,
    storage_view, tag,
)  # fmt: skip
from nova.codegen.triton.lowering import Kernel, lowers
from nova.ir import dialect as nv
from nova.ir.types import elem_of, numel, shape_of, to_torch_dtype
from nova.schedule.config import LoweringConfig

TILE = 2048  # elements per program: 16 per thread at 4 warps
DEFAULT_BLOCK_D = 512  # columns per program: 2 KiB of fp32 per row segment

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
def {name}(w_ptr, ids_ptr, out_ptr, stride_wv, stride_wd, IDX64: tl.constexpr):
""" + _ROWS + """    ok = nmask & (ids >= 0) & (ids < {v})
    cmask = cols < {d}
    src = tl.where(ok, ids, 0)[:, None] * stride_wv + cols[None, :] * stride_wd
    vals = tl.load(w_ptr + src, mask=ok[:, None] & cmask[None, :], other=0)
    tl.store(out_ptr + rows[:, None] * {d} + cols[None, :], vals, mask=nmask[:, None] & cmask[None, :])
"""

_SCATTER = """import triton
import triton.language as tl


@triton.jit
def {name}(g_ptr, ids_ptr, table_ptr, IDX64: tl.constexpr):
""" + _ROWS + """    ok = nmask & (ids >= 0) & (ids < {v}) & (ids != {pad})
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


def _check_ids(ids: torch.Tensor, shape, what: str) -> None:
    if tuple(ids.shape) != tuple(shape) or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"{what}: ids are {tuple(ids.shape)} {ids.dtype}, expected integer ids of shape {tuple(shape)}")


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
    src = _GATHER.format(name=fname, bn=bn, bd=bd, n=n, v=V, d=D)
    fn = load(src, fname)

    def launch(xs, outs=None, device=None):
        w, ids = xs
        if tuple(w.shape) != (V, D) or w.dtype != w_dtype:
            raise ValueError(f"{name}: weight is {tuple(w.shape)} {w.dtype}, expected {(V, D)} {w_dtype}")
        _check_ids(ids, ids_shape, name)
        out = result_tensor(name, only_out(outs), out_shape, w_dtype, w.device)
        if out.numel():
            ids = ids.contiguous()
            big = span(w) > INT32_MAX or out.numel() + TILE > INT32_MAX
            grid = (-(-n // bn), -(-D // bd))
            fn[grid](storage_view(w), ids, storage_view(out), w.stride(0), w.stride(1), IDX64=big, num_warps=warps)
        return [out]

    return Kernel(name=name, source=src, launch=launch, needs_contiguous=(1,), config=cfg)


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
        acc="tl.float64" if t == "f64" else "tl.float32",
    )  # fmt: skip
    fn = load(src, fname)
    cast = cast_kernel((V, D), acc_dtype, g_dtype) if acc_dtype != g_dtype else None
    source = src if cast is None else src + "\n\n# then, rounding the table once:\n" + cast.source

    def launch(xs, outs=None, device=None):
        g, ids = xs
        if tuple(g.shape) != tuple(g_shape) or g.dtype != g_dtype:
            raise ValueError(f"{name}: grad is {tuple(g.shape)} {g.dtype}, expected {tuple(g_shape)} {g_dtype}")
        _check_ids(ids, ids_shape, name)
        out = only_out(outs)
        if cast is None:  # the result is the accumulator
            table = result_tensor(name, out, (V, D), g_dtype, g.device)
        else:
            table = torch.empty((V, D), dtype=acc_dtype, device=g.device)
        table.zero_()
        if n and D:
            g, ids = g.contiguous(), ids.contiguous()
            big = table.numel() + TILE > INT32_MAX or g.numel() + TILE > INT32_MAX
            fn[(-(-n // bn), -(-D // bd))](g, ids, table, IDX64=big, num_warps=warps)
        return [table] if cast is None else cast.launch([table], outs)

    scratch = 0 if cast is None else V * D * acc_dtype.itemsize  # the fp32 table before rounding
    return Kernel(name=name, source=source, launch=launch, needs_contiguous=(0, 1), config=cfg, scratch_bytes=scratch)


__all__ = ["lower_embedding", "lower_embedding_backward", "tiles"]
