"""reduce_sum / reduce_max over any ``dims`` (keepdim or not), as generated Triton.

The input is viewed as a matrix through its strides, without copies: the kept
dims, flattened in order, are the rows (= the contiguous output), the reduced
dims, flattened in order, are the columns. One program owns BLOCK_R rows and
walks the columns in BLOCK_C chunks, accumulating a [BLOCK_R, BLOCK_C] tile that
it reduces once at the end.

Design choices, and why:

* The tile's fast axis is the input's contiguous one: the columns when the last
  input dim is reduced ("inner", e.g. a row sum), else the rows ("outer", e.g. a
  bias gradient summed over tokens). ``cfg.block`` sizes that fast axis; the
  other one gets TILE / block, so every program holds ~TILE accumulators.
* Split reduction (deterministic, two passes): when the rows alone give too few
  programs to fill the GPU (an outer reduction of [65536, 768] has 768 rows), the
  columns are split S ways; pass 1 writes S partial results per row to an fp32
  (fp64) workspace [S, R], pass 2 is the same template reducing that over S.
  Atomics would skip the workspace but make sums depend on scheduling order.
* Accumulation is fp32 for bf16/f16/f32 and fp64 for f64 (int64 for i64), and the
  result is rounded once, as torch does.
* reduce_max propagates NaN like ``torch.amax`` through a custom combine (Triton's
  ``tl.max`` / default ``maximum`` drop NaN on the GPU); masked lanes read -inf.
* ``IDX64`` (constexpr at launch): int64 offsets when the input's span could pass
  2**31 - 1.
* A prologue (nova.fused "reduction", ``Chain``): the input elements computed in
  registers from the chain's operands, each loaded at the tile's elements through
  its own strides, then converted and accumulated exactly as the loaded input
  would be (masked lanes the neutral value), under the same plan: the same sums in
  the same order as the unfused kernels, bit for bit. Every pass compiles without
  floating-point contraction, so a prologue's multiply never merges with its add
  or with the accumulation into an fma.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nova.codegen.triton.elementwise import (
    INT32_MAX, Chain, Fusion, UnsupportedError, convert, copy_kernel, load, next_pow2, numel, only_out, result_tensor,
    sanitize, shape_name, span, storage_view, tag,
)  # fmt: skip
from nova.codegen.triton.lowering import Kernel, lowers
from nova.ir import dialect as nv
from nova.ir.types import elem_of, shape_of, to_torch_dtype
from nova.schedule.config import LoweringConfig
from nova.schedule.configurator import COLUMN_TILE

TILE = COLUMN_TILE  # accumulators per program: 16 per thread at 4 warps (the configurator sizes splits by it)
DEFAULT_INNER_BLOCK = 1024  # columns per chunk when the reduced axis is contiguous
DEFAULT_OUTER_BLOCK = 128  # rows per program when the kept axis is contiguous (512 B of fp32 per row)
# 2 programs per SM on an H200 (132 SMs): below this the rows alone leave SMs idle
TARGET_PROGRAMS = 264
# Programs of a split reduction's second pass over its [S, R] workspace: at 128 rows
# a program, a [205, 768] workspace (a 768-wide bias gradient) took 6 programs
# walking 13 dependent steps, 6.7 us a launch on the H200; at 16 rows, 48 programs in 2.
FINAL_PROGRAMS = 48
MIN_SPLIT_CHUNKS = 4  # a split must walk at least this many BLOCK_C chunks to pay for its workspace row
# Software-pipeline stages of a column reduction's chunk loop (the kept axis contiguous: a
# bias gradient, GELU's backward with the c_fc one): above 1, ``tl.range(num_stages=...)``
# has Triton issue the next chunks' loads while this one computes. The same chunks in the
# same order, so the same sums. 1 (a plain loop) as shipped: not measured yet
# (scripts/epilogue_variants.py "colstages:S").
COLUMN_STAGES = 1

_ACC = {"f32": "f32", "bf16": "f32", "f16": "f32", "f64": "f64", "i64": "i64"}
_TL = {"f32": "tl.float32", "f64": "tl.float64", "i64": "tl.int64"}
_ACC_TORCH = {"f32": torch.float32, "f64": torch.float64, "i64": torch.int64}

_MAX_COMBINE = """
@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)
"""
_MAX_COMBINE_INT = """
@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b)
"""


@dataclass(frozen=True)
class Plan:
    """How one reduction maps onto programs (all static)."""

    shape: tuple[int, ...]  # input shape
    rows: tuple[int, ...]  # kept input dims, in order
    cols: tuple[int, ...]  # reduced input dims, in order
    R: int
    C: int
    inner: bool  # the last (moving) input dim is reduced: columns are the fast axis
    block_r: int
    block_c: int
    split: int  # column splits (1: one pass)
    chunk: int  # columns per split, a multiple of block_c


def plan(shape: Sequence[int], dims: Sequence[int], cfg: LoweringConfig | None) -> Plan:
    shape = tuple(int(s) for s in shape)
    cols = tuple(sorted(int(d) for d in dims))
    rows = tuple(d for d in range(len(shape)) if d not in cols)
    R, C = numel([shape[d] for d in rows]), numel([shape[d] for d in cols])
    moving = [d for d in range(len(shape)) if shape[d] > 1]
    inner = bool(moving) and moving[-1] in cols
    if cfg is not None and cfg.block:
        fast = cfg.block
        if fast & (fast - 1):
            raise ValueError(f"reduce: block={fast} must be a power of two")
    else:
        fast = DEFAULT_INNER_BLOCK if inner else DEFAULT_OUTER_BLOCK
    if inner:
        block_c = min(fast, next_pow2(C))
        block_r = min(next_pow2(R), max(1, TILE // block_c))
    else:
        block_r = min(fast, next_pow2(R))
        block_c = min(next_pow2(C), max(1, TILE // block_r))
    row_programs = -(-R // block_r)
    chunks = -(-C // block_c)
    if cfg is not None and cfg.kind == "reduction":
        split = max(1, cfg.split_k)
    elif row_programs < TARGET_PROGRAMS:
        split = max(1, min(-(-TARGET_PROGRAMS // row_programs), chunks // MIN_SPLIT_CHUNKS))
    else:
        split = 1
    split = min(split, chunks) if chunks else 1
    chunk = -(-chunks // split) * block_c
    split = -(-C // chunk) if C else 1  # drop splits that would get no columns
    return Plan(shape, rows, cols, R, C, inner, block_r, block_c, split, chunk)


def _decompose(var: str, dims: Sequence[int], shape: Sequence[int], prefix: str) -> list[str]:
    """Lines turning the flat index ``var`` over ``dims`` (row-major) into ``<prefix><d>``."""
    moving = [d for d in dims if shape[d] > 1]
    if not moving:
        return []
    lines = [f"{prefix}rem = {var}"]
    for d in reversed(moving):
        if d == moving[0]:
            lines.append(f"{prefix}{d} = {prefix}rem")
        else:
            lines += [f"{prefix}{d} = {prefix}rem % {shape[d]}", f"{prefix}rem = {prefix}rem // {shape[d]}"]
    return lines


def _prologue_lines(p: Plan, chain: Chain, neutral: str, acc: str, read: int = 0,
                    stores: Sequence[tuple[int, str]] = ()) -> list[str]:  # fmt: skip
    """Inside the column loop: each prologue operand loaded at the tile's elements
    (through its own strides; its shape right-aligned to the input's), the chain,
    the stores of the chain's values ``stores`` ((value index, stored type) each,
    into ``pout<j>``, contiguous of the input's shape, at the tile's elements), then
    ``x``: the head's input (the chain's value ``read``) as the unfused kernel would
    have loaded it, the masked lanes the reduction's neutral value (as the unfused
    load's ``other``)."""
    rank = len(p.shape)
    lines = []
    for k, op in enumerate(chain.operands):
        terms = op.terms(rank)
        if not terms:
            lines.append(f"px{k} = tl.load(pptr{k})")  # one element for every lane
            continue
        rows = [f"r{d} * ps{k}_{kd}" for kd, d, _ in terms if d in p.rows]
        cols = [f"c{d} * ps{k}_{kd}" for kd, d, _ in terms if d in p.cols]
        off = f"({' + '.join(rows) or 'rows * 0'})[:, None] + ({' + '.join(cols) or 'cols * 0'})[None, :]"
        lines.append(f"px{k} = tl.load(pptr{k} + {off}, mask=m, other=0)")
    lines += chain.body.splitlines()
    if stores:
        step = [1] * rank  # the contiguous strides of the input's shape
        for d in range(rank - 2, -1, -1):
            step[d] = step[d + 1] * p.shape[d + 1]
        rows = [f"r{d} * {step[d]}" for d in p.rows if p.shape[d] > 1]
        cols = [f"c{d} * {step[d]}" for d in p.cols if p.shape[d] > 1]
        lines.append(f"pout_off = ({' + '.join(rows) or 'rows * 0'})[:, None] + ({' + '.join(cols) or 'cols * 0'})[None, :]")
        for j, (k, out_tag) in enumerate(stores):
            var, vtag = chain.values[k]
            lines.append(f"tl.store(pout{j} + pout_off, {convert(var, vtag, out_tag)}, mask=m)")
    var, vtag = chain.values[read]
    return [*lines, f"x = tl.where(m, {convert(var, vtag, acc)}, {neutral})"]


def reduce_source(
    name: str, p: Plan, kind: str, in_dtype: torch.dtype, out_tag: str, chain: Chain | None = None,
    read: int = 0, stores: Sequence[tuple[int, str]] = (),
) -> str:  # fmt: skip
    """Triton source of one pass. Arguments: input, output, the strides of every
    moving input dim, then IDX64. With ``p.split > 1`` the output is the [S, R]
    workspace in the accumulator type and program (r, s) covers columns
    [s * chunk, (s + 1) * chunk). With a prologue ``chain`` (nova.fused
    "reduction") the input elements are computed in registers instead of loaded
    (the chain's value ``read``): the arguments are the chain's operands, the
    output, the prologue's stored values' outputs (``stores``: value index and
    stored type each; every element is one lane of one program, so each is written
    once), each operand's strides (of its moving dims), then IDX64."""
    src = tag(in_dtype)
    if src not in _ACC:
        raise UnsupportedError(f"{name}: cannot reduce {in_dtype} tensors")
    acc = _ACC[src]
    is_float = acc != "i64"
    if kind == "sum":
        neutral, combine, final = "0", "acc + x", "tl.sum(acc, 1)"
    else:
        neutral = 'float("-inf")' if is_float else str(-(2**63))
        combine, final = "_max_nan(acc, x)", "tl.reduce(acc, 1, _max_nan)"
    moving = [d for d in range(len(p.shape)) if p.shape[d] > 1]
    if chain is None:
        params = ["x_ptr", "out_ptr"] + [f"s{d}" for d in moving] + ["IDX64: tl.constexpr"]
        loads = [f"x = tl.load(x_ptr + row_off[:, None] + col_off[None, :], mask=m, other={neutral})",
                 f"x = {convert('x', src, acc)}"]  # fmt: skip
    else:
        rank = len(p.shape)
        params = [f"pptr{k}" for k in range(len(chain.operands))] + ["out_ptr"]
        params += [f"pout{j}" for j in range(len(stores))]
        params += [f"ps{k}_{kd}" for k, op in enumerate(chain.operands) for kd, _, _ in op.terms(rank)]
        params.append("IDX64: tl.constexpr")
        loads = _prologue_lines(p, chain, neutral, acc, read, stores)
    row_off = " + ".join(f"r{d} * s{d}" for d in p.rows if p.shape[d] > 1) or "rows * 0"
    col_off = " + ".join(f"c{d} * s{d}" for d in p.cols if p.shape[d] > 1) or "cols * 0"
    lines = [
        "pid_r = tl.program_id(0)",
        "pid_s = tl.program_id(1)",
        f"rows = pid_r * {p.block_r} + tl.arange(0, {p.block_r})",
        "if IDX64:",
        "    rows = rows.to(tl.int64)",
        f"rmask = rows < {p.R}",
        *_decompose("rows", p.rows, p.shape, "r"),
        *([f"row_off = {row_off}"] if chain is None else []),
        f"acc = tl.full([{p.block_r}, {p.block_c}], {neutral}, {_TL[acc]})",
        f"c_start = pid_s * {p.chunk}",
        f"c_end = tl.minimum(c_start + {p.chunk}, {p.C})",
        # (the loop's index is not c0: _decompose names the reduced dims' indices c0, c1, ...)
        (f"for chunk in tl.range(c_start, c_end, {p.block_c}, num_stages={COLUMN_STAGES}):"
         if COLUMN_STAGES > 1 and not p.inner else f"for chunk in range(c_start, c_end, {p.block_c}):"),
        f"    cols = chunk + tl.arange(0, {p.block_c})",
        "    if IDX64:",
        "        cols = cols.to(tl.int64)",
        "    cmask = cols < c_end",
        *("    " + ln for ln in _decompose("cols", p.cols, p.shape, "c")),
        *([f"    col_off = {col_off}"] if chain is None else []),
        "    m = rmask[:, None] & cmask[None, :]",
        *("    " + ln for ln in loads),
        f"    acc = {combine}",
        f"r = {final}",
        f"tl.store(out_ptr + pid_s * {p.R} + rows, {convert('r', acc, out_tag)}, mask=rmask)",
    ]
    body = "\n".join("    " + ln for ln in lines)
    return f"@triton.jit\ndef {name}({', '.join(params)}):\n{body}\n"


def module_text(kind: str, acc_tag: str, kernels: Sequence[str], helpers: str = "") -> str:
    """One source file: imports, the max combine (if any), a prologue's helpers, the kernels."""
    parts = ["import triton\nimport triton.language as tl\n"]
    if kind == "max":
        parts.append((_MAX_COMBINE if acc_tag != "i64" else _MAX_COMBINE_INT).strip("\n") + "\n")
    if helpers:
        parts.append(helpers.strip("\n") + "\n")
    return "\n\n".join([*parts, *kernels])


@dataclass
class Reduction:
    name: str
    source: str
    plan: Plan
    fns: tuple  # (pass 1, pass 2 or None)
    second: Plan | None
    in_dtype: torch.dtype
    out_dtype: torch.dtype
    out_shape: tuple[int, ...]
    acc_dtype: torch.dtype
    num_warps: int
    chain: Chain | None = None  # a prologue (nova.fused "reduction"): the input computed from these operands
    stores: tuple[tuple[int, torch.dtype], ...] = ()  # the prologue's values it stores: (value index, dtype)

    @property
    def scratch_bytes(self) -> int:
        """The split reduction's [S, R] workspace (none in one pass)."""
        if self.plan.split == 1:
            return 0
        return self.plan.split * self.plan.R * self.acc_dtype.itemsize

    def _inputs(self, x) -> tuple[list[torch.Tensor], list[int], bool, torch.device]:
        """(tensors, strides, whether any span needs int64 offsets, device) of the
        first pass's inputs: ``x`` itself, or with a prologue the list of its operands."""
        p = self.plan
        if self.chain is None:
            if tuple(x.shape) != p.shape or x.dtype != self.in_dtype:
                raise ValueError(f"{self.name}: input is {tuple(x.shape)} {x.dtype}, "
                                 f"expected {p.shape} {self.in_dtype}")
            return [x], [x.stride(d) for d in range(x.dim()) if x.shape[d] > 1], span(x) > INT32_MAX, x.device
        ops = self.chain.operands
        if len(x) != len(ops):
            raise ValueError(f"{self.name}: {len(x)} prologue operands, expected {len(ops)}")
        strides, big = [], False
        for k, (t, op) in enumerate(zip(x, ops)):
            if tuple(t.shape) != tuple(op.shape) or t.dtype != op.dtype:
                raise ValueError(f"{self.name}: prologue operand {k} is {tuple(t.shape)} {t.dtype}, "
                                 f"expected {tuple(op.shape)} {op.dtype}")
            strides += [t.stride(kd) for kd, _, _ in op.terms(len(p.shape))]
            big = big or span(t) > INT32_MAX
        return [storage_view(t) for t in x], strides, big, x[0].device

    def __call__(self, x, out: torch.Tensor | None = None, side: list | None = None) -> torch.Tensor:
        """Reduces ``x`` (with a prologue: the list of its operands) into ``out``;
        the prologue's stored values into ``side`` (one tensor or None each, of the
        input's shape; None entries are allocated in place in the list)."""
        p = self.plan
        xs, strides, big, device = self._inputs(x)
        out = result_tensor(self.name, out, self.out_shape, self.out_dtype, device)
        if len(side or ()) != len(self.stores):
            raise ValueError(f"{self.name}: takes {len(self.stores)} prologue outputs, got {len(side or ())}")
        for j, (_, dtype) in enumerate(self.stores):
            side[j] = result_tensor(f"{self.name} (prologue output {j})", side[j], p.shape, dtype, device)
        side = list(side or ())
        big = big or bool(side) and numel(p.shape) > INT32_MAX
        if out.numel() == 0:
            return out
        big = big or p.R + p.block_r > INT32_MAX or p.C + p.chunk > INT32_MAX
        grid = (-(-p.R // p.block_r), p.split)
        # no contraction of a prologue's mul with its add (or the accumulation) into an fma:
        # the fused kernel rounds as the unfused ones do
        opts = {"num_warps": self.num_warps, "enable_fp_fusion": False}
        if p.split == 1:
            self.fns[0][grid](*xs, out, *side, *strides, IDX64=big, **opts)
            return out
        ws = torch.empty((p.split, p.R), dtype=self.acc_dtype, device=device)
        self.fns[0][grid](*xs, ws, *side, *strides, IDX64=big, **opts)
        q = self.second
        ws_strides = [ws.stride(d) for d in range(2) if ws.shape[d] > 1]
        ws_big = ws.numel() + q.block_r > INT32_MAX
        self.fns[1][(-(-q.R // q.block_r), 1)](ws, out, *ws_strides, IDX64=ws_big, **opts)
        return out


def reduction(
    kind: str, shape: Sequence[int], dims: Sequence[int], keepdim: bool, dtype: torch.dtype,
    cfg: LoweringConfig | None = None, chain: Chain | None = None, name: str | None = None,
    read: int = 0, stores: Sequence[tuple[int, torch.dtype]] = (),
) -> Reduction:  # fmt: skip
    """The kernels of ``sum``/``max`` of a ``dtype`` tensor of ``shape`` over ``dims``;
    with a prologue ``chain`` (its value ``read``: the input element, of ``dtype``),
    the input computed from the chain's operands (named ``name``), and the chain's
    values ``stores`` ((value index, dtype) each) stored at every element."""
    shape = tuple(int(s) for s in shape)
    p = plan(shape, dims, cfg)
    if kind == "max" and p.C == 0:
        raise UnsupportedError(f"nova.reduce_max: cannot reduce over zero elements (shape {shape}, dims {tuple(dims)})")
    out_shape = tuple(1 if i in p.cols else s for i, s in enumerate(shape)) if keepdim else tuple(shape[d] for d in p.rows)
    acc = _ACC.get(tag(dtype))
    if acc is None:
        raise UnsupportedError(f"nova.reduce_{kind}: cannot reduce {dtype} tensors")
    base = name or f"nova_reduce_{kind}_{shape_name(shape)}_d{'_'.join(map(str, p.cols))}_{tag(dtype)}"
    warps = cfg.num_warps if cfg is not None else 4
    acc_dtype = _ACC_TORCH[acc]
    helpers = chain.helpers if chain is not None else ""
    stores = tuple(stores)
    if stores and chain is None:
        raise UnsupportedError(f"{base}: stores prologue values without a prologue")
    tagged = tuple((k, tag(d)) for k, d in stores)
    if p.split == 1:
        n1 = sanitize(base)
        src = module_text(kind, acc, [reduce_source(n1, p, kind, dtype, tag(dtype), chain, read, tagged)], helpers)
        return Reduction(base, src, p, (load(src, n1), None), None, dtype, dtype, out_shape, acc_dtype, warps, chain,
                         stores)  # fmt: skip
    q = plan((p.split, p.R), (0,), None)  # pass 2: the [S, R] workspace over S, in one pass
    # rows narrow enough for FINAL_PROGRAMS programs (the workspace is small: its pass is latency-bound)
    block_r = min(q.block_r, max(16, next_pow2(-(-p.R // FINAL_PROGRAMS)))) if not q.inner else q.block_r
    block_c = q.block_c if q.inner else min(next_pow2(q.C), max(1, TILE // block_r))
    q = Plan(q.shape, q.rows, q.cols, q.R, q.C, q.inner, block_r, block_c, 1, -(-q.C // block_c) * block_c)
    n1, n2 = sanitize(f"{base}_split{p.split}"), sanitize(f"{base}_split{p.split}_final")
    src = module_text(
        kind, acc, [reduce_source(n1, p, kind, dtype, acc, chain, read, tagged),
                    reduce_source(n2, q, kind, acc_dtype, tag(dtype))],
        helpers,
    )  # fmt: skip
    return Reduction(base, src, p, (load(src, n1), load(src, n2)), q, dtype, dtype, out_shape, acc_dtype, warps, chain,
                     stores)  # fmt: skip


@lowers(nv.ReduceSumOp, nv.ReduceMaxOp)
def lower_reduce(
    op, cfg: LoweringConfig | None = None, fusion: Fusion | None = None, name: str | None = None
) -> Kernel:
    """Any input strides (needs_contiguous is empty); ``dims=()`` is a copy. With a
    ``fusion`` (nova.fused "reduction": a prologue computing the input, no
    epilogue), ``launch`` takes the group's operands."""
    shape = shape_of(op.operands[0].type)
    dtype = to_torch_dtype(elem_of(op.operands[0].type))
    p = op.props()
    kind = "sum" if isinstance(op, nv.ReduceSumOp) else "max"
    chain, read, stores = None, 0, ()
    if fusion is not None:
        if fusion.epilogue is not None or ("head", 0) not in fusion.outputs or any(
                how not in ("head", "prologue") for how, _ in fusion.outputs):  # fmt: skip
            raise UnsupportedError(f"{op.name}: the reduce template takes a prologue only, no epilogue")
        if fusion.prologue is not None and fusion.reads[0][0] == "prologue":
            chain, read, stores = fusion.prologue, fusion.reads[0][1], fusion.prologue_stores
        elif fusion.prologue_stores:
            raise UnsupportedError(f"{op.name}: stores prologue values but reads its input as it is")
    if not p["dims"]:
        if chain is not None:
            raise UnsupportedError(f"{op.name}: a prologue before a reduction over no dims (a copy)")
        return copy_kernel(shape, dtype, cfg)
    r = reduction(kind, shape, p["dims"], p["keepdim"], dtype, cfg, chain, name, read, stores)

    def launch(xs, outs=None, device=None):
        if chain is None:
            return [r(xs[fusion.direct(0)] if fusion is not None else xs[0], only_out(outs))]
        if not stores:
            return [r([xs[k] for k in chain.inputs], only_out(outs))]
        given = list(outs) if outs is not None else [None] * len(fusion.outputs)
        side = [given[fusion.outputs.index(("prologue", j))] for j in range(len(stores))]
        head = r([xs[k] for k in chain.inputs], given[fusion.head_output(0)], side)
        return [head if how == "head" else side[j] for how, j in fusion.outputs]

    return Kernel(name=r.name, source=r.source, launch=launch, config=cfg, extra={"split": r.plan.split},
                  scratch_bytes=r.scratch_bytes)  # fmt: skip


__all__ = ["Plan", "plan", "reduce_source", "reduction", "Reduction", "lower_reduce"]
