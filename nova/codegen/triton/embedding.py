"""embedding (a row gather) and embedding_backward (a row scatter-add), as
generated Triton source.

Both kernels tile [BLOCK_N ids x BLOCK_D columns]; rows are read and written
along D, the contiguous axis (coalesced). Any id value is memory-safe: an id
outside [0, num_embeddings) (the -1 a captured gather uses for an out-of-range
index included) never addresses memory, its loads and stores are masked off:
the gather writes a row of zeros for it and the scatter-add adds nothing. The
kernels do not report such ids: the guard stage's check ops count them on the
device (``nova.transforms.guard``), so a launch never waits for the device.

The gather moves stored values, so the table may be of any element type (f32,
f64, bf16, f16, i64, bool as 0/1 bytes): integer gathers and advanced indexing
are captured as embedding on [N, 1] or [N, C] tables.

embedding_backward is deterministic, bit for bit, run to run and with or
without the CUDA graph (no atomics): the flattened ids are stably sorted on the
device (``torch.sort(..., stable=True)`` of the ids clamped to [-1, V] as
int32 keys: deterministic, no host sync, capturable), so the positions of each
row form one run of the sorted order, in token order. A [BLOCK_T sorted positions x BLOCK_D columns] program owns the
rows whose run starts in its block: it sums that run's grad rows one by one,
in token order (continuing past its block end while the sorted id stays the
same), in fp32 (fp64 for f64 grads), and writes the row once, rounded to the
grad's dtype; positions whose run started in an earlier block are skipped.
The result is zeroed first (the rows no id hits), so no [V, D] fp32 table is
needed for bf16 / f16 grads. Out-of-range ids and ``padding_idx`` sort into
runs of their own that nobody owns: they add nothing and address nothing, and
the padding row stays zero as in torch. The serial part of a launch is the
longest run (the most frequent id's count), one BLOCK_D row load per step.
Ids an increasing ``nova.arange`` makes (position ids) are sorted and distinct
as they are: no sort (on an H100 torch.sort of GPT-2's 1024 position ids took
0.028 ms, the kernel 0.002), the permutation is the identity.
"""

from __future__ import annotations

import torch

from nova.codegen.triton.elementwise import (
    INT32_MAX, UnsupportedError, load, next_pow2, only_out, result_tensor, sanitize, shape_name, span,
    storage_view, tag,
)  # fmt: skip
from nova.codegen.triton.lowering import Kernel, lowers
from nova.ir import dialect as nv
from nova.ir.types import elem_of, numel, shape_of, to_torch_dtype
from nova.schedule.config import LoweringConfig

TILE = 2048  # elements per program: 16 per thread at 4 warps
DEFAULT_BLOCK_D = 512  # columns per program: 2 KiB of fp32 per row segment
_TL_FLOAT = {"f32": "tl.float32", "f64": "tl.float64", "bf16": "tl.bfloat16", "f16": "tl.float16"}

# the gather: a [bn rows, bd columns] tile of the [n, d] rows the ids select
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

_SEGMENT_SUM = """import triton
import triton.language as tl


@triton.jit
def {name}(g_ptr, sorted_ptr, perm_ptr, out_ptr):
    pid_t = tl.program_id(0)
    pid_d = tl.program_id(1)
    pos = pid_t.to(tl.int64) * {bt} + tl.arange(0, {bt})
    cols = pid_d * {bd} + tl.arange(0, {bd})
    cmask = cols < {d}
    inb = pos < {n}
    row = tl.load(sorted_ptr + pos, mask=inb, other=0).to(tl.int64)
    prev = tl.load(sorted_ptr + pos - 1, mask=inb & (pos > 0), other=0).to(tl.int64)
    # this program owns the rows whose run of equal sorted ids starts in its block
    own = inb & ((pos == 0) | (prev != row)) & (row >= 0) & (row < {v}) & (row != {pad})
    acc = tl.zeros([{bt}, {bd}], {acc})
    j = pos
    live = own
    while tl.max(live.to(tl.int32), axis=0) != 0:  # the longest run owned here
        src = {token}  # the token, in token order within the run
        g = tl.load(g_ptr + src[:, None] * {d} + cols[None, :], mask=live[:, None] & cmask[None, :], other=0)
        acc += g.to({acc})
        j += 1
        live = live & (j < {n})
        live = live & (tl.load(sorted_ptr + j, mask=live, other=0).to(tl.int64) == row)
    dst = out_ptr + tl.where(own, row, 0)[:, None] * {d} + cols[None, :]
    tl.store(dst, acc.to({out}), mask=own[:, None] & cmask[None, :])
"""


def sort_scratch_bytes(n: int, id_itemsize: int) -> int:
    """The most device bytes the stable sort of ``n`` ids takes besides the result:
    its outputs (sorted ids + int64 permutation, ours), and what torch allocates
    inside ``torch.sort`` on CUDA (read from ATen's SortStable.cu and CUB's
    onesweep radix sort, not measured: no GPU here): an int64 arange of
    positions fed to the sort as values, CUB's alternate key / value buffers,
    and its per-tile lookback counters (< 4 bytes per id: 256 4-byte digits per
    tile of >= 256 ids), plus 64 KiB for its histograms and the allocator's
    rounding. Sorts of <= 4096 ids run in place in the outputs (less)."""
    if n == 0:
        return 0
    outputs = n * (id_itemsize + 8)
    return outputs + n * 8 + outputs + n * 4 + 65536


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
    """Scatter-add of grad rows into [num_embeddings, D], deterministically (sort +
    segmented sum, see the module docstring); grad and ids contiguous
    (needs_contiguous=(0, 1))."""
    g_shape, g_dtype = shape_of(op.operands[0].type), to_torch_dtype(elem_of(op.operands[0].type))
    ids_shape = shape_of(op.operands[1].type)
    p = op.props()
    V, pad = p["num_embeddings"], p["padding_idx"]
    D = g_shape[-1]
    t = tag(g_dtype)
    if t not in ("f32", "f64", "bf16", "f16"):
        raise UnsupportedError(f"nova.embedding_backward: grad must be a float tensor, got {g_dtype}")
    n = numel(ids_shape)
    bt, bd, warps = tiles(n, D, cfg)
    name = f"nova_embedding_backward_{V}x{D}_{shape_name(ids_shape)}_{t}_pad{pad}"
    fname = sanitize(name)
    # ids made by an increasing arange (position ids) are sorted and distinct as they are:
    # no sort, the permutation is the identity (sorted position j is token j)
    ids_op = op.operands[1].owner
    ascending = isinstance(ids_op, nv.ArangeOp) and ids_op.props()["step"] > 0
    src = _SEGMENT_SUM.format(
        name=fname, bt=bt, bd=bd, n=n, v=V, d=D, pad=pad if pad >= 0 else -1,
        acc="tl.float64" if t == "f64" else "tl.float32", out=_TL_FLOAT[t],
        token="j" if ascending else "tl.load(perm_ptr + j, mask=live, other=0)",
    )  # fmt: skip
    fn = load(src, fname)
    source = ("# launched after out.zero_(), on ids an increasing arange made (sorted as they are)\n" if ascending
              else "# launched after out.zero_() and torch.sort(ids.reshape(-1).clamp(-1, V).int(), stable=True)\n") + src

    def launch(xs, outs=None, device=None):
        g, ids = xs
        if tuple(g.shape) != tuple(g_shape) or g.dtype != g_dtype:
            raise ValueError(f"{name}: grad is {tuple(g.shape)} {g.dtype}, expected {tuple(g_shape)} {g_dtype}")
        _check_ids(ids, ids_shape, name)
        out = result_tensor(name, only_out(outs), (V, D), g_dtype, g.device)
        out.zero_()  # the rows no id hits (a memset: capturable, no host sync)
        if n and D and ascending:
            flat = ids.contiguous().reshape(-1)
            fn[(-(-n // bt), -(-D // bd))](g.contiguous(), flat, flat, out, num_warps=warps)
        elif n and D:
            g, flat = g.contiguous(), ids.contiguous().reshape(-1)
            # sorted as 32-bit keys (CUB's radix sort makes one pass a byte of the key: 4, not
            # 8), clamped into [-1, V] first so that no id wraps into the table's range: every
            # id outside [0, V) stays outside it, in a run nobody owns
            keys = torch.clamp(flat, -1, V).to(torch.int32) if V < INT32_MAX else flat
            # torch's stable sort: deterministic (stability fixes the permutation),
            # device-side and capturable; it keeps each row's tokens in token order
            sorted_ids = torch.empty((n,), dtype=keys.dtype, device=flat.device)
            perm = torch.empty((n,), dtype=torch.int64, device=flat.device)
            torch.sort(keys, stable=True, out=(sorted_ids, perm))
            fn[(-(-n // bt), -(-D // bd))](g, sorted_ids, perm, out, num_warps=warps)
        return [out]

    scratch = n * 12 + sort_scratch_bytes(n, 4) if D and not ascending else 0  # the clamped keys, their sort
    return Kernel(name=name, source=source, launch=launch, needs_contiguous=(0, 1), config=cfg, scratch_bytes=scratch)


__all__ = ["lower_embedding", "lower_embedding_backward", "sort_scratch_bytes", "tiles"]
