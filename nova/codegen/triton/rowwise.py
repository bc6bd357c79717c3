"""Row-wise lowerings: softmax, log_softmax and their backwards, layer_norm and its
backward, cross_entropy and its backward, as generated Triton source.

Design choices, and why:

* Static shapes are baked into the text (row length, row count, the sizes that
  turn a program id into a row), strides are launch arguments: every operand is
  read through its own strides, so a softmax over a non-last dim, a transposed or
  a broadcast view needs no copy (``needs_contiguous`` is empty for every op
  here). Row offsets are int64 (rows x row stride can pass 2**31); offsets inside
  a row are int32, and the launcher checks that they fit.
* One program per row. Statistics are computed in fp32 (fp64 for f64 inputs) and
  the results cast to the result dtype, as the reference executor does.
* A row whose padded length ``next_power_of_2(n)`` fits the in-register limit is
  loaded once and kept in registers; a longer row (a 50304-entry vocabulary) is
  walked in column blocks: an online max/sum pass, then a pass that writes.
* Reductions across rows (layer_norm's weight/bias gradients, the cross-entropy
  loss and its row count) are two-stage: programs write partials into a buffer
  (fp32, fp64 for f64), and a second small kernel sums them in a fixed order. No atomics, so a
  result is the same bit for bit from run to run.
* cross_entropy follows ``torch.nn.functional.cross_entropy``: label smoothing
  mixes in each row's mean of -log p over the classes (the row's plain sum rides
  along the max/sum pass), reduction "none" writes one loss per row, and the
  backward of a mean over no rows is 0 (its count is clamped to 1).
* Out-of-range class ids never address memory (the loads are masked): their
  row's loss is NaN and their gradient row the plain softmax. The launcher does
  not look at them (that would wait for the device): the guard stage counts them
  on the device and keeps the step from taking effect (nova.transforms.guard).
* layer_norm and its backward take a prologue and an epilogue (nova.fused
  "reduction", ``RowFusion``): the row operands computed in registers where they
  would be loaded, the elementwise ops on the first result applied to the row
  before the store (its f32 form stored only where the group yields it). Both
  compile without floating-point contraction (``_NO_CONTRACT``), fused or not, so
  the two forms round alike, bit for bit.
* ``launch(inputs, outs)`` writes into ``outs`` when given (``results``);
  ``Kernel.scratch_bytes`` is exact: the cross-row partials, the row sums of a
  looping layer_norm backward, the cross-entropy loss rows or its scale.
"""

from __future__ import annotations

import dataclasses
import math
import textwrap

import torch

from nova.codegen.triton.elementwise import Fusion, UnsupportedError, convert, storage_view, tag
from nova.codegen.triton.lowering import Kernel, lowers
from nova.codegen.triton.source import load_kernel
from nova.ir import dialect as nv
from nova.ir.types import elem_of, shape_of, to_torch_dtype
from nova.schedule.config import LoweringConfig

# Longest padded row kept in registers: 16384 fp32 over 16 warps is 32 registers
# per thread per live row tensor; a softmax row (x, exp(x)) then fits the 255
# registers of an SM90 thread without spilling.
ROW_BLOCK_LIMIT = 16384
# layer_norm_backward keeps about six row tensors live (x, g, w, xhat and two
# partial sums carried across rows): at 8192 fp32 the sm_90 build spills (ptxas
# -v: 128 registers, ~300 bytes of spill stores at 16 warps); 4096 does not.
LN_BWD_BLOCK_LIMIT = 4096
# Column block of the looping path: 16 KiB of fp32 per load, 16 elements per
# thread at 8 warps: enough bytes in flight per program to stream at HBM rate.
LOOP_BLOCK = 4096
# Partial-sum programs of a cross-row reduction per SM: a few resident programs
# per SM hide load latency; the fp32 partial buffer grows with the count.
PARTIALS_PER_SM = 4
# A layer_norm_backward program walks its rows one after another, each row's loads,
# two row sums and stores in turn: unpipelined, the loads of the next row wait for
# this row's sums. ``tl.range(num_stages=2)`` has Triton issue the next row's loads
# (x, g, mean, rstd and the prologue's operands) as asynchronous copies into shared
# memory while this row computes (the sm_90a build of the [32768, 768] f32 kernel:
# 8 async copies, 8 KiB of shared memory, 72 registers against 70). Measured on the
# H200 before (GPT-2 124M, batch 32): 0.19 ms a LayerNorm backward at ~2.2 TB/s. Three
# stages (two rows' loads in flight): the 2-layer GPT-2 step at batch 32, every launch timed
# (scripts/step_launches.py --set, bench/results/runs/step_launches_2l_bf16_b32_*_9168703.json),
# its five fused LayerNorm backwards 0.584 ms against 0.696 at two stages (~3.4 against
# ~2.9 TB/s); more partial-sum programs per SM did not help (6: 0.779, 8: 0.765 ms).
LN_BWD_ROW_STAGES = 3
# A layer_norm_backward row's two sums (c1 = sum(g w), c2 = sum(g w xhat)) as one two-operand
# reduction: one cross-warp exchange a row instead of two, the same combine tree per sum
# (``tl.sum`` is ``tl.reduce`` with an add), so the same bits on the GPU. Off: measured on
# the H200 (11b6733, scripts/epilogue_variants.py "ln-pair-sums"), bit-identical but no
# faster (the step 63.80 against 63.86 ms; with the hoisted loads 62.96 against 62.91 in
# two runs). The Triton interpreter runs a generic reduce element by element, so there the
# bits are not tl.sum's.
LN_BWD_PAIR_SUMS = False
# The chain operands of a fused layer_norm_backward that are the same on every row (the
# projection's bias and the LayerNorm's weight and bias its prologue reads to recompute the
# residual and the LayerNorm's output) loaded once before the program's rows, not once a
# row (GPT-2's 13-op kernel: 3 of its 8 row loads, pipelined through shared memory with
# the rest; sm_90a: 28.7 KB of shared memory a program against 53.3, 128 registers against
# 108, still 4 programs an SM). Measured on the H200 (11b6733, scripts/epilogue_variants.py
# "ln-hoist", the 12-layer bf16 step's graph, bench/results/runs/epilogue_variants_graph_12l_
# lnhoist_11b6733.json): the 12 13-op kernels 2.343 -> 1.730 ms, the 11 10-op ones 1.858 ->
# 1.446, the step 63.86 -> 62.91 ms, losses bit-identical.
LN_BWD_HOIST_INVARIANTS = True
# A LayerNorm forward whose row fits in registers as programs walking rows, this many
# programs an SM, each loading the row-invariant vectors (w, b, and the prologue's bias)
# once and the next rows' loads pipelined (LN_FWD_ROW_STAGES), not one program a row
# loading them every row: GPT-2's 24 prologue LayerNorms load 9 KB of those a row from L2
# beside their 9 KB of row traffic. 0: one program a row (as shipped; not measured yet:
# scripts/epilogue_variants.py "ln-fwd-rows:P").
LN_FWD_PROGRAMS_PER_SM = 0
LN_FWD_ROW_STAGES = 3
_PAIR_ADD = '''
@triton.jit
def _pair_add(a1, a2, b1, b2):
    return a1 + b1, a2 + b2
'''
# Fewest warps a layer_norm_backward program gets (more for longer rows: ~8 elements per
# thread per row tensor)
LN_BWD_MIN_WARPS = 4
H200_SMS = 132  # the interpreter stands in for the H200 the kernels are built for
_FINAL_BLOCK = 1024  # rows per step of a single-program final reduction
# Tile (partials x columns) of the column-sum kernel: one program per 16 columns
# (48 for a 768-wide LayerNorm), each adding 256 partial rows a step. At 128 columns
# a program (6 of them for 768) walked 528 partials 16 at a time, 33 dependent steps:
# 48 us a launch on the H200, for 3 MB.
_COLSUM_P, _COLSUM_N = 256, 16
_INT32_MAX = 2**31 - 1
_NEG_INF = '-float("inf")'

_TL = {torch.float32: "tl.float32", torch.bfloat16: "tl.bfloat16", torch.float16: "tl.float16", torch.float64: "tl.float64"}


# --------------------------------------------------------------------------- helpers


def torch_dtype(t) -> torch.dtype:
    return to_torch_dtype(elem_of(t))


def acc_type(dtype: torch.dtype) -> str:
    """The statistics type: fp64 for f64 data, fp32 for everything narrower."""
    if dtype not in _TL:
        raise ValueError(f"row-wise kernels support float32, bfloat16, float16 and float64, not {dtype}")
    return "tl.float64" if dtype == torch.float64 else "tl.float32"


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _warps(block: int) -> int:
    # at most 8-16 row elements per thread per live tensor (see ROW_BLOCK_LIMIT)
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


def row_plan(n: int, cfg: LoweringConfig | None, limit: int) -> tuple[int, bool, int]:
    """(BLOCK, looping, num_warps) for rows of ``n`` elements: the whole padded row
    in one block when it fits ``limit`` (or ``cfg.block`` when given), else column
    blocks of ``min(LOOP_BLOCK, limit)`` (or ``cfg.block``)."""
    if cfg is not None and cfg.block:
        block = cfg.block
        if block & (block - 1):
            raise ValueError(f"row-wise kernel: cfg.block={block} must be a power of two")
    elif next_pow2(n) <= limit:
        block = next_pow2(n)
    else:
        block = min(LOOP_BLOCK, next_pow2(limit + 1) // 2)
    looping = next_pow2(n) > block
    block = min(block, next_pow2(n))
    warps = cfg.num_warps if cfg is not None and cfg.num_warps else _warps(block)
    return block, looping, warps


def _effective(cfg: LoweringConfig | None, block: int, warps: int) -> LoweringConfig:
    """The schedule a kernel runs with: ``cfg`` with the block and warps actually used."""
    if cfg is not None:
        return dataclasses.replace(cfg, block=block, num_warps=warps)
    return LoweringConfig(kind="reduction", block=block, num_warps=warps, regime="memory-bound")


# layer_norm and its backward compile without floating-point contraction, as the
# pointwise kernels: with an epilogue the last multiply of their own math would
# otherwise merge with the epilogue's add into an fma the unfused kernels cannot
# form, so the fused and unfused forms round alike only when neither contracts
_NO_CONTRACT = {"enable_fp_fusion": False}


def _launch_options(cfg: LoweringConfig | None, warps: int) -> dict:
    """num_warps, and cfg's num_stages when it sets one (Triton's default otherwise)."""
    return {"num_warps": warps, **({"num_stages": cfg.num_stages} if cfg is not None and cfg.num_stages else {})}


def _contiguous_strides(shape) -> list[int]:
    strides, s = [], 1
    for n in reversed(shape):
        strides.append(s)
        s *= n
    return strides[::-1]


class Rows:
    """The rows of a tensor of ``shape`` along ``dim``: every index of the other
    dims in row-major order. Generates the code that turns the row number ``row``
    into the row's element offset through per-dim strides (one div/mod per dim
    and program: a strided view is read where it lies, with no copy)."""

    def __init__(self, shape: tuple[int, ...], dim: int):
        self.shape, self.dim = tuple(shape), dim
        self.n = shape[dim]
        others = [k for k in range(len(shape)) if k != dim]
        self.count = math.prod(shape[k] for k in others)
        self.live = [k for k in others if shape[k] > 1]  # size-1 dims never move the offset

    def decode(self) -> str:
        """Lines that set ``i<k>`` for every live dim from the int64 ``row``."""
        lines, rem = [], "row"
        for j, k in enumerate(reversed(self.live)):
            if j == len(self.live) - 1:
                lines.append(f"i{k} = {rem}")
            else:
                lines += [f"i{k} = {rem} % {self.shape[k]}", f"rem = {rem} // {self.shape[k]}"]
                rem = "rem"
        return "\n".join(lines)

    def offset(self, prefix: str) -> str:
        """The row's offset through the stride arguments ``<prefix><k>``."""
        return " + ".join(f"i{k} * {prefix}{k}" for k in self.live) or "0"

    def contiguous_offset(self) -> str:
        strides = _contiguous_strides(self.shape)
        return " + ".join(f"i{k} * {strides[k]}" for k in self.live) or "0"

    def params(self, prefix: str) -> list[str]:
        return [f"{prefix}{k}" for k in self.live] + [f"{prefix}c"]

    def args(self, t: torch.Tensor) -> list[int]:
        return [t.stride(k) for k in self.live] + [t.stride(self.dim)]


def _lines(text: str, level: int = 0) -> str:
    return textwrap.indent(textwrap.dedent(text).strip("\n"), "    " * level)


def _code(*parts) -> str:
    """Join code parts: text at level 0, or (level, text)."""
    return "\n".join(_lines(*(p if isinstance(p, tuple) else (p, 0))) for p in parts)


def _kernel(name: str, params: list[str], body: str) -> str:
    return f"\n\n@triton.jit\ndef {name}(\n    " + ",\n    ".join(params) + ",\n):\n" + _lines(body, 1) + "\n"


def _header(kind: str, line: str, constants: dict) -> str:
    consts = "".join(f"{k} = tl.constexpr({v!r})\n" for k, v in constants.items())
    return (
        f"# Generated by nova.codegen.triton.rowwise ({kind}); do not edit.\n# {line}\n"
        f"import triton\nimport triton.language as tl\n\n{consts}"
    )


def _mask(n: int, block: int, var: str = "cols") -> str:
    """The mask of a row of ``n`` in one block; "None" when the row fills it."""
    return "None" if n == block else f"{var} < {n}"


def _masked(n: int, block: int):
    """(load suffix for an ``other`` value, store suffix) of a row of ``n`` held in
    one block: no mask at all when the row fills the block."""
    if n == block:
        return (lambda other: ""), ""
    return (lambda other: f", mask=cols < {n}, other={other}"), f", mask=cols < {n}"


def _check_inputs(name: str, op, inputs) -> None:
    if len(inputs) != len(op.operands):
        raise ValueError(f"{name}: expected {len(op.operands)} inputs, got {len(inputs)}")
    for i, (t, v) in enumerate(zip(inputs, op.operands)):
        if tuple(t.shape) != shape_of(v.type) or t.dtype != torch_dtype(v.type):
            raise ValueError(
                f"{name}: input {i} is {tuple(t.shape)} {t.dtype}, the op needs {shape_of(v.type)} {torch_dtype(v.type)}"
            )


def _check_span(name: str, n: int, block: int, *strides: int) -> None:
    """Offsets inside a row are int32: make sure the farthest lane fits."""
    for s in strides:
        if (n + block) * abs(s) > _INT32_MAX:
            raise ValueError(f"{name}: one row spans more than 2**31 elements (stride {s}); not supported")


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return H200_SMS


def row_programs(count: int, programs: int) -> tuple[int, int]:
    """(programs, rows each) for ``count`` rows walked by at most ``programs`` programs of
    consecutive rows (the templates' ROWS_PER_PROG); no program without rows."""
    per = -(-count // max(1, min(count, programs))) if count else 0
    return (-(-count // per) if count else 0), per


def _walk_head(count: int) -> str:
    """A row-walking program's first lines: its rows [row_start, row_end)."""
    return f"""
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        row_start = pid.to(tl.int64) * ROWS_PER_PROG
        row_end = tl.minimum(row_start + ROWS_PER_PROG, {count})
    """


def lowering_device() -> torch.device:
    """The device the kernels are built for: the current GPU, or the CPU under the
    interpreter (standing in for the H200)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def result_specs(op) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of every result of ``op``, computed once at lowering time."""
    return [(shape_of(r.type), torch_dtype(r.type)) for r in op.results]


def results(name: str, specs, outs, device: torch.device) -> list[torch.Tensor]:
    """The tensors one launch writes its results into: ``outs`` themselves when
    given (checked: the kernels write through raw pointers, so a wrong shape,
    dtype or layout would write past the tensor), else new ones."""
    if outs is None:
        return [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in specs]
    if len(outs) != len(specs):
        raise ValueError(f"{name}: expected {len(specs)} outputs, got {len(outs)}")
    for i, (t, (shape, dtype)) in enumerate(zip(outs, specs)):
        if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"{name}: output {i} is {tuple(t.shape)} {t.dtype} (contiguous: {t.is_contiguous()}), "
                             f"the op needs a contiguous {shape} {dtype}")
    return list(outs)


def nbytes(shape, dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _shape_name(shape) -> str:
    return "x".join(map(str, shape)) or "scalar"


def _plan_line(dtype, block: int, looping: bool) -> str:
    return f"{str(dtype).removeprefix('torch.')}, block {block}, {'column loop' if looping else 'row in registers'}"


# --------------------------------------------------------------------------- prologues and epilogues


class RowFusion:
    """The code a row kernel runs around its own math for a nova.fused "reduction"
    group (``Fusion``; the plain op when None): the head's row operands loaded as
    they are or computed by the prologue chain, the epilogue chain on the head's
    first result, and which head results are stored. A chain operand is read at
    the row's elements through its own strides (its shape right-aligned to the row
    tensor's: a broadcast bias, a per-row scalar, a 0-d value read in place); the
    epilogue's values are written contiguously at the row's flat index, as the
    head's own first result."""

    def __init__(self, fusion: Fusion | None, n_operands: int, n_results: int, rows: Rows, acc: str,
                 hoist: bool = False):
        self.f = fusion or Fusion.plain(n_operands, n_results)
        self.rows, self.acc, self.n = rows, acc, rows.n
        self.rank = len(rows.shape)
        self.hoist = hoist  # a template walking rows over one column range: ``invariant_loads``

    def direct(self, j: int) -> bool:
        return self.f.direct(j) is not None

    def stored(self, i: int) -> bool:
        return self.f.stored(i)

    def _chains(self):
        return [c for c in (self.f.prologue, self.f.epilogue) if c is not None]

    def params(self) -> list[str]:
        """Pointers: each chain's operands, then the epilogue's outputs, then the
        partial rows [P, n] of its column sums (``Fusion.sums``), then the stored
        prologue values (``Fusion.prologue_stores``)."""
        out = [f"{c.prefix}ptr{k}" for c in self._chains() for k in range(len(c.operands))]
        return (out + [f"qout{j}" for j in range(len(self.f.stores))] + [f"qsum{j}" for j in range(len(self.f.sums))]
                + [f"pout{j}" for j in range(len(self.f.prologue_stores))])  # fmt: skip

    def sum_init(self) -> str:
        """Before a program's rows (per column block): the column sums' accumulators."""
        return "\n".join(f"qacc{j} = tl.zeros((BLOCK,), {self.acc})" for j in range(len(self.f.sums)))

    def sum_store(self, cvar: str, mask: str | None) -> str:
        """After a program's rows: its partial row of each column sum, at columns ``cvar``."""
        m = f", mask={mask}" if mask else ""
        return "\n".join(f"tl.store(qsum{j} + pid.to(tl.int64) * {self.n} + {cvar}, qacc{j}{m})"
                         for j in range(len(self.f.sums)))  # fmt: skip

    def stride_params(self) -> list[str]:
        return [f"{c.prefix}s{k}_{kd}" for c in self._chains() for k, op in enumerate(c.operands)
                for kd, _, _ in op.terms(self.rank)]  # fmt: skip

    def args(self, xs) -> tuple[list, list[int]]:
        """(pointer arguments, stride arguments) from the group's operands ``xs``."""
        ptrs, strides = [], []
        for c in self._chains():
            for k, op in zip(c.inputs, c.operands, strict=True):
                t = xs[k]
                ptrs.append(storage_view(t))
                strides += [t.stride(kd) for kd, _, _ in op.terms(self.rank)]
        return ptrs, strides

    def row_lines(self) -> str:
        """Per row (after the decode): each chain operand's row pointer."""
        lines = []
        for c in self._chains():
            for k, op in enumerate(c.operands):
                terms = [f"i{d} * {c.prefix}s{k}_{kd}" for kd, d, _ in op.terms(self.rank) if d < self.rank - 1]
                lines.append(f"{c.prefix}row{k} = {c.prefix}ptr{k} + ({' + '.join(terms) or '0'})")
        return "\n".join(lines)

    def _invariant(self, op) -> bool:
        """A chain operand the same on every row (a bias, a LayerNorm weight, a 0-d value)."""
        return all(d == self.rank - 1 for _, d, _ in op.terms(self.rank))

    def _load(self, c, k: int, op, base: str, cvar: str, mask: str | None) -> str:
        m = f", mask={mask}, other=0" if mask else ""
        col = [kd for kd, d, _ in op.terms(self.rank) if d == self.rank - 1]
        if col:
            return f"{c.prefix}x{k} = tl.load({base} + {cvar} * {c.prefix}s{k}_{col[0]}{m})"
        return f"{c.prefix}x{k} = tl.load({base})"  # one value per row (or per step)

    def invariant_loads(self, cvar: str, mask: str | None) -> str:
        """Before a program's rows (``hoist``; the whole row at columns ``cvar``): the
        loads of the chain operands the same on every row, which ``prologue`` and
        ``epilogue`` then leave out."""
        if not self.hoist:
            return ""
        return "\n".join(self._load(c, k, op, f"{c.prefix}ptr{k}", cvar, mask)
                         for c in self._chains() for k, op in enumerate(c.operands) if self._invariant(op))

    def _loads(self, c, cvar: str, mask: str | None) -> list[str]:
        lines = [self._load(c, k, op, f"{c.prefix}row{k}", cvar, mask) for k, op in enumerate(c.operands)
                 if not (self.hoist and self._invariant(op))]
        return lines + c.body.splitlines()

    def operand(self, j: int, name: str, direct: str, cvar: str, mask: str | None) -> str:
        """Lines setting ``name`` (the head's operand ``j`` at columns ``cvar``, in
        the statistics type, masked lanes 0): ``direct`` (the plain load's
        expression) or the prologue's value (the prologue computed here first, once
        for all the operands read at this site: call ``prologue`` before)."""
        if self.direct(j):
            return f"{name} = {direct}"
        var, vtag = self.f.prologue.values[self.f.reads[j][1]]
        value = convert(var, vtag, _TAG_OF[self.acc])
        return f"{name} = tl.where({mask}, {value}, 0.0)" if mask else f"{name} = {value}"

    def prologue(self, cvar: str, mask: str | None, store: bool = False) -> str:
        """The prologue's loads and chain at columns ``cvar`` (nothing without one);
        with ``store`` (the first pass over the row), its stored values written
        contiguously at the row's flat index, as the head's own first result."""
        if self.f.prologue is None:
            return ""
        lines = self._loads(self.f.prologue, cvar, mask)
        m = f", mask={mask}" if mask else ""
        for j, (k, dtype) in enumerate(self.f.prologue_stores if store else ()):
            var, vtag = self.f.prologue.values[k]
            lines.append(f"tl.store(pout{j} + row * {self.n} + {cvar}, {convert(var, vtag, tag(dtype))}{m})")
        return "\n".join(lines)

    def epilogue(self, value: str, out: str, cvar: str, mask: str | None) -> str:
        """After the head computed its first result ``value`` (statistics type) at
        columns ``cvar``: the epilogue on its stored form (as the unfused op stores
        it, type ``out``) and its stores."""
        c = self.f.epilogue
        if c is None:
            return ""
        lines = [f"qin = {convert(value, _TAG_OF[self.acc], c.in_tag)}", *self._loads(c, cvar, mask)]
        m = f", mask={mask}" if mask else ""
        for j, dtype in enumerate(self.f.stores):
            var, vtag = c.values[j]
            lines.append(f"tl.store(qout{j} + row * {self.n} + {cvar}, {convert(var, vtag, tag(dtype))}{m})")
        for j, (k, _) in enumerate(self.f.sums):  # the value as stored, widened as the unfused sum loads it
            var, vtag = c.values[k]
            value = convert(var, vtag, _TAG_OF[self.acc])
            lines.append(f"qacc{j} += tl.where({mask}, {value}, 0.0)" if mask else f"qacc{j} += {value}")
        return "\n".join(lines)

    @property
    def helpers(self) -> str:
        return self.f.helpers


_TAG_OF = {"tl.float32": "f32", "tl.float64": "f64"}


def _fusion_outputs(name: str, fusion: Fusion | None, specs, outs, device) -> tuple[list, list]:
    """(the head's result tensors, None where not stored; every output in the
    group's order) for one launch."""
    if fusion is None:
        res = results(name, specs, outs, device)
        return res, res
    # an epilogue's or a stored prologue's value has the rows' shape, the head's first result's
    out_specs = [specs[i] if how == "head" else ((specs[0][0][-1],), fusion.sums[i][1]) if how == "sum"
                 else (specs[0][0], fusion.prologue_stores[i][1]) if how == "prologue"
                 else (specs[0][0], fusion.stores[i]) for how, i in fusion.outputs]  # fmt: skip
    res = results(name, out_specs, outs, device)
    return [res[fusion.head_output(i)] if fusion.stored(i) else None for i in range(len(specs))], res


def _outs(res: list, fusion: Fusion | None, how: str) -> list:
    """The tensors among a launch's results that ``fusion`` stores as ``how``, in its
    order of them: "epilogue" (``Fusion.stores``), "prologue" (``prologue_stores``),
    "sum" (``sums``)."""
    if fusion is None:
        return []
    count = len({"epilogue": fusion.stores, "prologue": fusion.prologue_stores, "sum": fusion.sums}[how])
    return [res[fusion.outputs.index((how, j))] for j in range(count)]


# --------------------------------------------------------------------------- softmax / log_softmax


def _norm_dim(op) -> int:
    rank = len(shape_of(op.operands[0].type))
    if rank == 0:
        raise ValueError(f"{op.name}: 0-d input has no dim to normalize over")
    return op.props()["dim"] % rank


def _online_max_sum(n: int, acc: str, x: str, indent: int, row_sum: bool = False) -> str:
    """Lines that stream a row of ``n`` at ``x_row`` in BLOCKs (each loaded as ``x``)
    and leave its max in ``m`` and sum(exp(row - m)) in ``s`` (online rescaling; a
    row of -inf so far never computes inf - inf), and with ``row_sum`` the row's
    plain sum in ``sx``. Softmax and cross-entropy share it."""
    init = f"\nsx = tl.zeros((), {acc})" if row_sum else ""
    step = f"\n    sx += tl.sum(tl.where(c < {n}, {x}, 0.0), axis=0)" if row_sum else ""
    return textwrap.indent(textwrap.dedent(f"""\
        m = tl.full((), {_NEG_INF}, {acc})
        s = tl.zeros((), {acc})""") + init + textwrap.dedent(f"""
        for c0 in range(0, {n}, BLOCK):
            c = c0 + cols
            {x} = tl.load(x_row + c * sxc, mask=c < {n}, other={_NEG_INF}).to({acc})
            m_new = tl.maximum(m, tl.max({x}, axis=0))
            m_safe = tl.where(m_new == {_NEG_INF}, 0.0, m_new)  # all -inf so far: no inf - inf
            s = s * tl.exp(m - m_safe) + tl.sum(tl.exp({x} - m_safe), axis=0)""") + step + "\n    m = m_new", " " * indent)


def softmax_source(shape, dim: int, dtype, log: bool, block: int, looping: bool) -> str:
    rows = Rows(shape, dim)
    n, acc, out = rows.n, acc_type(dtype), _TL[dtype]
    out_c = _contiguous_strides(shape)[dim]
    head = f"""
        row = tl.program_id(0).to(tl.int64)
        {{decode}}
        x_row = x_ptr + ({rows.offset('sx')})
        y_row = y_ptr + ({rows.contiguous_offset()})
        cols = tl.arange(0, BLOCK)
    """.replace("{decode}", "\n        ".join(rows.decode().splitlines()) or "pass")
    if not looping:
        ld, stm = _masked(n, block)
        result = "x - m - tl.log(s)" if log else "e / s"
        body = f"""
            x = tl.load(x_row + cols * sxc{ld(_NEG_INF)}).to({acc})
            m = tl.max(x, axis=0)
            e = tl.exp(x - m)
            s = tl.sum(e, axis=0)
            tl.store(y_row + cols * {out_c}, ({result}).to({out}){stm})
        """
    else:
        result = "x - lse" if log else "tl.exp(x - m) / s"
        body = f"""
{_online_max_sum(n, acc, "x", 12)}
            lse = m + tl.log(s)
            for c0 in range(0, {n}, BLOCK):
                c = c0 + cols
                x = tl.load(x_row + c * sxc, mask=c < {n}, other=0.0).to({acc})
                tl.store(y_row + c * {out_c}, ({result}).to({out}), mask=c < {n})
        """
    kind = "log_softmax" if log else "softmax"
    return _header(kind, f"shape {list(shape)}, dim {dim}, {_plan_line(dtype, block, looping)}", {"BLOCK": block}) + _kernel(
        f"{kind}_kernel", ["x_ptr", "y_ptr", *rows.params("sx")], _code(head, body)
    )


def softmax_backward_source(shape, dim: int, dtype, log: bool, block: int, looping: bool) -> str:
    """dx = y * (g - sum(g * y)) after softmax; dx = g - exp(y) * sum(g) after log_softmax."""
    rows = Rows(shape, dim)
    n, acc, out = rows.n, acc_type(dtype), _TL[dtype]
    out_c = _contiguous_strides(shape)[dim]
    stat = "g" if log else "g * y"
    result = "g - tl.exp(y) * t" if log else "y * (g - t)"
    head = f"""
        row = tl.program_id(0).to(tl.int64)
        {{decode}}
        y_row = y_ptr + ({rows.offset('sy')})
        g_row = g_ptr + ({rows.offset('sg')})
        d_row = d_ptr + ({rows.contiguous_offset()})
        cols = tl.arange(0, BLOCK)
    """.replace("{decode}", "\n        ".join(rows.decode().splitlines()) or "pass")
    if not looping:
        ld, stm = _masked(n, block)
        body = f"""
            y = tl.load(y_row + cols * syc{ld(0.0)}).to({acc})
            g = tl.load(g_row + cols * sgc{ld(0.0)}).to({acc})
            t = tl.sum({stat}, axis=0)
            tl.store(d_row + cols * {out_c}, ({result}).to({out}){stm})
        """
    else:
        body = f"""
            part = tl.zeros((BLOCK,), {acc})
            for c0 in range(0, {n}, BLOCK):
                c = c0 + cols
                y = tl.load(y_row + c * syc, mask=c < {n}, other=0.0).to({acc})
                g = tl.load(g_row + c * sgc, mask=c < {n}, other=0.0).to({acc})
                part += {stat}
            t = tl.sum(part, axis=0)
            for c0 in range(0, {n}, BLOCK):
                c = c0 + cols
                y = tl.load(y_row + c * syc, mask=c < {n}, other=0.0).to({acc})
                g = tl.load(g_row + c * sgc, mask=c < {n}, other=0.0).to({acc})
                tl.store(d_row + c * {out_c}, ({result}).to({out}), mask=c < {n})
        """
    kind = "log_softmax_backward" if log else "softmax_backward"
    params = ["y_ptr", "g_ptr", "d_ptr", *rows.params("sy"), *rows.params("sg")]
    return _header(kind, f"shape {list(shape)}, dim {dim}, {_plan_line(dtype, block, looping)}", {"BLOCK": block}) + _kernel(
        f"{kind}_kernel", params, _code(head, body)
    )


def _lower_rowwise(op, cfg, kind: str, source_fn, log: bool, max_row_block: int) -> Kernel:
    shape, dtype = shape_of(op.operands[0].type), torch_dtype(op.operands[0].type)
    dim = _norm_dim(op)
    rows = Rows(shape, dim)
    block, looping, warps = row_plan(rows.n, cfg, max_row_block)
    src = source_fn(shape, dim, dtype, log, block, looping)
    kernel, _ = load_kernel(src, f"{kind}_kernel")
    name = f"nova_{kind}_{_shape_name(shape)}_dim{dim}"
    opts = _launch_options(cfg, warps)
    specs = result_specs(op)

    def launch(inputs, outs=None):
        _check_inputs(name, op, inputs)
        (out,) = results(name, specs, outs, inputs[0].device)
        if out.numel() == 0:
            return [out]
        args = []
        for t in inputs:
            _check_span(name, rows.n, block, t.stride(dim))
            args += rows.args(t)
        kernel[(rows.count,)](*inputs, out, *args, **opts)
        return [out]

    return Kernel(name, src, launch, config=_effective(cfg, block, warps), extra={"looping": looping})


@lowers(nv.SoftmaxOp)
def lower_softmax(op, cfg: LoweringConfig | None = None, *, max_row_block: int = ROW_BLOCK_LIMIT, **_) -> Kernel:
    return _lower_rowwise(op, cfg, "softmax", softmax_source, False, max_row_block)


@lowers(nv.LogSoftmaxOp)
def lower_log_softmax(op, cfg: LoweringConfig | None = None, *, max_row_block: int = ROW_BLOCK_LIMIT, **_) -> Kernel:
    return _lower_rowwise(op, cfg, "log_softmax", softmax_source, True, max_row_block)


@lowers(nv.SoftmaxBackwardOp)
def lower_softmax_backward(op, cfg: LoweringConfig | None = None, *, max_row_block: int = ROW_BLOCK_LIMIT, **_) -> Kernel:
    return _lower_rowwise(op, cfg, "softmax_backward", softmax_backward_source, False, max_row_block)


@lowers(nv.LogSoftmaxBackwardOp)
def lower_log_softmax_backward(
    op, cfg: LoweringConfig | None = None, *, max_row_block: int = ROW_BLOCK_LIMIT, **_
) -> Kernel:
    return _lower_rowwise(op, cfg, "log_softmax_backward", softmax_backward_source, True, max_row_block)


# --------------------------------------------------------------------------- layer_norm


def layer_norm_source(shape, dtype, eps: float, block: int, looping: bool, fusion: Fusion | None = None,
                      row_walk: bool = False) -> str:
    """y = (x - mean) * rstd * w + b over the last dim, with the biased variance and
    rstd = rsqrt(var + eps), as the reference; mean and rstd are outputs too. With
    a ``fusion`` (nova.fused "reduction"): x computed by the prologue, y fed to the
    epilogue, and only the results the group yields stored. ``row_walk`` (a row in
    registers only): program p takes ROWS_PER_PROG consecutive rows, loading w, b and
    the chains' row-invariant operands once; each row's math as one program's."""
    rows = Rows(shape, len(shape) - 1)
    n, acc, out = rows.n, acc_type(dtype), _TL[dtype]
    walk = row_walk and not looping  # programs walking rows (``row_walk``, LN_FWD_PROGRAMS_PER_SM)
    rf = RowFusion(fusion, 3, 3, rows, acc, hoist=walk)
    decode = rows.decode() or "pass"
    # a program a row, or (walking) the row from the loop below
    head = decode if walk else _code("row = tl.program_id(0).to(tl.int64)", decode, "cols = tl.arange(0, BLOCK)")
    ptrs = [("x_row", f"x_ptr + ({rows.offset('sx')})")] if rf.direct(0) else []
    ptrs += [("y_row", f"y_ptr + row * {n}")] if rf.stored(0) else []
    head = _code(head, "\n".join(f"{v} = {e}" for v, e in ptrs), rf.row_lines())

    def x_at(c: str, mask: str | None, first: bool = False) -> str:
        other = f", mask={mask}, other=0.0" if mask else ""
        return _code(rf.prologue(c, mask, store=first),
                     rf.operand(0, "x", f"tl.load(x_row + {c} * sxc{other}).to({acc})", c, mask))

    def y_out(c: str, mask: str | None) -> str:
        m = f", mask={mask}" if mask else ""
        store = f"tl.store(y_row + {c}, y.to({out}){m})" if rf.stored(0) else ""
        return _code(store, rf.epilogue("y", out, c, mask))

    if not looping:
        mask = None if n == block else _mask(n, block)
        ld, _ = _masked(n, block)
        center = "x - mean" if n == block else f"tl.where({mask}, x - mean, 0.0)"
        wb = f"""
            w = tl.load(w_ptr + cols * swc{ld(0.0)}).to({acc})
            b = tl.load(b_ptr + cols * sbc{ld(0.0)}).to({acc})
        """
        body = _code(x_at("cols", mask, first=True), f"""
            mean = tl.sum(x, axis=0) / {n}
            xc = {center}
            rstd = tl.rsqrt(tl.sum(xc * xc, axis=0) / {n} + EPS)
        """, *([] if walk else [wb]), "y = xc * rstd * w + b", y_out("cols", mask))
    else:  # three passes: mean, then the centered variance (exact as the reference), then y
        m = f"c < {n}"
        loop = f"for c0 in range(0, {n}, BLOCK):\n    c = c0 + cols"
        body = _code(f"part = tl.zeros((BLOCK,), {acc})", loop, (x_at("c", m, first=True), 1), ("part += x", 1), f"""
            mean = tl.sum(part, axis=0) / {n}
            part = tl.zeros((BLOCK,), {acc})
        """, loop, (x_at("c", m), 1), (f"""
            xc = tl.where(c < {n}, x - mean, 0.0)
            part += xc * xc
        """, 1), f"rstd = tl.rsqrt(tl.sum(part, axis=0) / {n} + EPS)", loop, (x_at("c", m), 1), (f"""
            w = tl.load(w_ptr + c * swc, mask=c < {n}, other=0.0).to({acc})
            b = tl.load(b_ptr + c * sbc, mask=c < {n}, other=0.0).to({acc})
            y = (x - mean) * rstd * w + b
        """, 1), (y_out("c", m), 1))
    tail = "\n".join([*(["tl.store(mean_ptr + row, mean.to({}))".format(out)] if rf.stored(1) else []),
                      *(["tl.store(rstd_ptr + row, rstd.to({}))".format(out)] if rf.stored(2) else [])])  # fmt: skip
    params = [*(["x_ptr"] if rf.direct(0) else []), "w_ptr", "b_ptr"]
    params += [p for i, p in enumerate(("y_ptr", "mean_ptr", "rstd_ptr")) if rf.stored(i)]
    params += [*rf.params(), *(rows.params("sx") if rf.direct(0) else []), "swc", "sbc", *rf.stride_params()]
    plan = _plan_line(dtype, block, looping) + (", programs walking rows" if walk else "")
    header = _header("layer_norm", f"shape {list(shape)}, eps {eps!r}, {plan}", {"BLOCK": block, "EPS": float(eps)})
    helpers = ("\n" + rf.helpers.strip("\n") + "\n") if rf.helpers else ""
    if walk:  # program p: rows [p ROWS_PER_PROG, (p + 1) ROWS_PER_PROG), the invariant loads once
        loop = f"for row in tl.range(row_start, row_end, num_stages={LN_FWD_ROW_STAGES}):"
        code = _code(_walk_head(rows.count), wb, rf.invariant_loads("cols", mask), loop, (head, 1), (body, 1), (tail, 1))
        return header + helpers + _kernel("layer_norm_kernel", [*params, "ROWS_PER_PROG"], code)
    return header + helpers + _kernel("layer_norm_kernel", params, _code(head, body, tail))


def _fused_head(op, fusion: Fusion | None, row_operands: tuple[int, ...]) -> None:
    """A row template's checks of a ``fusion``: the operands it cannot compute in a
    prologue are the group's own."""
    if fusion is None:
        return
    if fusion.prologue_stores and not op.PROLOGUE_ROW_STORES:
        raise UnsupportedError(f"{op.name}: its row template stores no prologue value")
    for j in range(len(op.operands)):
        if j not in row_operands and fusion.direct(j) is None:
            raise UnsupportedError(f"{op.name}: operand {j} cannot come from a prologue")


@lowers(nv.LayerNormOp)
def lower_layer_norm(op, cfg: LoweringConfig | None = None, *, max_row_block: int = ROW_BLOCK_LIMIT,
                     fusion: Fusion | None = None, name: str | None = None, **_) -> Kernel:
    """With a ``fusion`` (nova.fused "reduction"), ``launch`` takes the group's
    operands and writes its results."""
    _fused_head(op, fusion, (0,))
    shape, dtype = shape_of(op.operands[0].type), torch_dtype(op.operands[0].type)
    rows = Rows(shape, len(shape) - 1)
    block, looping, warps = row_plan(rows.n, cfg, max_row_block)
    walk = bool(LN_FWD_PROGRAMS_PER_SM) and not looping and rows.count > 0
    src = layer_norm_source(shape, dtype, op.props()["eps"], block, looping, fusion, row_walk=walk)
    kernel, _ = load_kernel(src, "layer_norm_kernel")
    progs, per = row_programs(rows.count, LN_FWD_PROGRAMS_PER_SM * _num_sms(lowering_device())) if walk else (0, 0)
    name = name or f"nova_layer_norm_{_shape_name(shape)}"
    opts = {**_launch_options(cfg, warps), **_NO_CONTRACT}
    specs = result_specs(op)
    rf = RowFusion(fusion, 3, 3, rows, acc_type(dtype))

    def launch(inputs, outs=None):
        if fusion is None:
            _check_inputs(name, op, inputs)
            x, w, b = inputs
        else:
            x, w, b = (inputs[k] if k is not None else None for k in (fusion.direct(j) for j in range(3)))
        dev = inputs[0].device
        (y, mean, rstd), res = _fusion_outputs(name, fusion, specs, outs, dev)
        if rows.count and rows.n:
            _check_span(name, rows.n, block, w.stride(0), b.stride(0), *([x.stride(-1)] if x is not None else []))
            ptrs, strides = rf.args(inputs)
            kernel[(progs if walk else rows.count,)](
                *([x] if x is not None else []), w, b, *(t for t in (y, mean, rstd) if t is not None),
                *ptrs, *_outs(res, fusion, "epilogue"), *_outs(res, fusion, "prologue"),
                *(rows.args(x) if x is not None else []), w.stride(0), b.stride(0), *strides,
                *([per] if walk else []), **opts)  # fmt: skip
        elif rows.count:  # rows of no elements: the mean of nothing
            for t in (mean, rstd):
                if t is not None:
                    t.fill_(float("nan"))
        return res

    return Kernel(name, src, launch, config=_effective(cfg, block, warps), extra={"looping": looping})


def layer_norm_backward_source(shape, dtype, block: int, looping: bool, fusion: Fusion | None = None) -> str:
    """Program p takes ROWS_PER_PROG consecutive rows: grad_input row by row, and its
    partial column sums of g * xhat and g into row p of buffers [P, n] (fp32, fp64
    for f64); the ``colsum`` kernel then adds the P partials in order. With a
    ``fusion`` (nova.fused "reduction"): g and x computed by the prologue, grad_input
    fed to the epilogue (stored only where the group yields it), the prologue's values
    the group yields (its side ops' among them) stored in the first pass over a row."""
    rows = Rows(shape, len(shape) - 1)
    n, acc, out = rows.n, acc_type(dtype), _TL[dtype]
    rf = RowFusion(fusion, 5, 3, rows, acc, hoist=LN_BWD_HOIST_INVARIANTS and not looping)
    head = _code(_walk_head(rows.count), f"""
        pw_row = pw_ptr + pid.to(tl.int64) * {n}
        pb_row = pb_ptr + pid.to(tl.int64) * {n}
    """)
    ptrs = [("x_row", f"x_ptr + ({rows.offset('sx')})")] if rf.direct(1) else []
    ptrs += [("g_row", f"g_ptr + ({rows.offset('sg')})")] if rf.direct(0) else []
    ptrs += [("d_row", f"d_ptr + row * {n}")] if rf.stored(0) else []
    row_head = _code(f"""
        {{decode}}
        mean = tl.load(mean_ptr + ({rows.offset('sm')})).to({acc})
        rstd = tl.load(rstd_ptr + ({rows.offset('sr')})).to({acc})
    """.replace("{decode}", "\n        ".join(rows.decode().splitlines()) or "pass"),
        "\n".join(f"{v} = {e}" for v, e in ptrs), rf.row_lines())  # fmt: skip
    grad = f"d = rstd / {n} * ({n} * gxhat - c1 - xhat * c2)"

    def row_sums(e1: str, e2: str) -> str:
        """A line setting c1 and c2, the sums of ``e1`` and ``e2`` over the row
        (``LN_BWD_PAIR_SUMS``: as one reduction)."""
        if LN_BWD_PAIR_SUMS:
            return f"c1, c2 = tl.reduce(({e1}, {e2}), 0, _pair_add)"
        return f"c1, c2 = tl.sum({e1}, axis=0), tl.sum({e2}, axis=0)"

    def xg_at(c: str, mask: str | None, first: bool = False) -> str:
        other = f", mask={mask}, other=0.0" if mask else ""
        return _code(rf.prologue(c, mask, store=first),
                     rf.operand(1, "x", f"tl.load(x_row + {c} * sxc{other}).to({acc})", c, mask),
                     rf.operand(0, "g", f"tl.load(g_row + {c} * sgc{other}).to({acc})", c, mask))

    def d_out(c: str, mask: str | None) -> str:
        m = f", mask={mask}" if mask else ""
        store = f"tl.store(d_row + {c}, d.to({out}){m})" if rf.stored(0) else ""
        return _code(store, rf.epilogue("d", out, c, mask))

    if not looping:
        mask = None if n == block else _mask(n, block)
        ld, stm = _masked(n, block)
        xhat = "(x - mean) * rstd" if n == block else f"tl.where({mask}, (x - mean) * rstd, 0.0)"
        body = _code(f"""
            w = tl.load(w_ptr + cols * swc{ld(0.0)}).to({acc})
            part_w = tl.zeros((BLOCK,), {acc})
            part_b = tl.zeros((BLOCK,), {acc})
        """, rf.sum_init(), rf.invariant_loads("cols", mask), f"""
            for row in tl.range(row_start, row_end, num_stages={LN_BWD_ROW_STAGES}):
        """, (row_head, 1), (xg_at("cols", mask, first=True), 1), (f"""
            xhat = {xhat}
            gxhat = g * w
            {row_sums("gxhat", "gxhat * xhat")}
            {grad}
        """, 1), (d_out("cols", mask), 1), (f"""
            part_w += g * xhat
            part_b += g
        """, 1), f"""
            tl.store(pw_row + cols, part_w{stm})
            tl.store(pb_row + cols, part_b{stm})
        """, rf.sum_store("cols", mask))
    else:
        # Phase A: the row sums c1, c2 of every row, into [rows] buffers. Phase B, per
        # column block: grad_input of every row and the block's partial sums, held in
        # registers across the rows (no read-modify-write of the partial rows).
        m = f"c < {n}"

        def load2(first: bool) -> str:
            return _code(xg_at("c", m, first), f"""
                xhat = tl.where(c < {n}, (x - mean) * rstd, 0.0)
                gxhat = g * w
            """)

        body = _code("for row in range(row_start, row_end):", (row_head, 1), (f"""
            a1 = tl.zeros((BLOCK,), {acc})
            a2 = tl.zeros((BLOCK,), {acc})
            for c0 in range(0, {n}, BLOCK):
                c = c0 + cols
                w = tl.load(w_ptr + c * swc, mask=c < {n}, other=0.0).to({acc})
        """, 1), (load2(True), 2), (f"""
                a1 += gxhat
                a2 += gxhat * xhat
            {row_sums("a1", "a2")}
            tl.store(c1_ptr + row, c1)
            tl.store(c2_ptr + row, c2)
        tl.debug_barrier()  # phase B reads row sums that other threads of the program stored
        for c0 in range(0, {n}, BLOCK):
            c = c0 + cols
            w = tl.load(w_ptr + c * swc, mask=c < {n}, other=0.0).to({acc})
            part_w = tl.zeros((BLOCK,), {acc})
            part_b = tl.zeros((BLOCK,), {acc})
        """, 0), (rf.sum_init(), 1), ("for row in range(row_start, row_end):", 1), (row_head, 2), (load2(False), 2), (f"""
            c1 = tl.load(c1_ptr + row)
            c2 = tl.load(c2_ptr + row)
            {grad}
        """, 2), (d_out("c", m), 2), (f"""
            part_w += g * xhat
            part_b += g
        """, 2), (f"""
            tl.store(pw_row + c, part_w, mask=c < {n})
            tl.store(pb_row + c, part_b, mask=c < {n})
        """, 1), (rf.sum_store("c", m), 1))
    params = [*(["g_ptr"] if rf.direct(0) else []), *(["x_ptr"] if rf.direct(1) else []), "w_ptr", "mean_ptr",
              "rstd_ptr", *(["d_ptr"] if rf.stored(0) else []), "pw_ptr", "pb_ptr"]  # fmt: skip
    params += ["c1_ptr", "c2_ptr"] if looping else []
    params += rf.params()
    # mean and rstd have the leading dims' shape: read through their strides by the same row index
    stat_strides = [f"s{p}{k}" for p in ("m", "r") for k in rows.live]
    params += [*(rows.params("sg") if rf.direct(0) else []), *(rows.params("sx") if rf.direct(1) else []), "swc",
               *stat_strides, *rf.stride_params(), "ROWS_PER_PROG"]  # fmt: skip
    header = _header("layer_norm_backward", f"shape {list(shape)}, {_plan_line(dtype, block, looping)}", {"BLOCK": block})
    helpers = ("\n" + rf.helpers.strip("\n") + "\n") if rf.helpers else ""
    helpers += _PAIR_ADD if LN_BWD_PAIR_SUMS else ""
    sums = [_TL[d] for _, d in rf.f.sums]
    return (header + helpers + _kernel("layer_norm_backward_kernel", params, _code(head, body))
            + colsum_source("layer_norm_backward_colsum", n, acc, [out, out, *sums]))


def colsum_source(name: str, n: int, acc: str, outs: list[str]) -> str:
    """o_k[j] = sum_p p_k[p, j] for each partial buffer k ([P, n]: the weight and bias
    gradients' g * xhat and g, then any epilogue column sums), over p in a fixed
    order; ``outs[k]``: o_k's element type."""
    k = range(len(outs))
    loads = "\n".join(f"            acc{i} += tl.sum(tl.load(p{i}_ptr + offs, mask=m, other=0.0), axis=0)" for i in k)
    return _kernel(name, [*(f"p{i}_ptr" for i in k), *(f"o{i}_ptr" for i in k), "P"], f"""
        cols = tl.program_id(0) * {_COLSUM_N} + tl.arange(0, {_COLSUM_N})
        ps = tl.arange(0, {_COLSUM_P})
        {"; ".join(f"acc{i} = tl.zeros(({_COLSUM_N},), {acc})" for i in k)}
        for p0 in range(0, P, {_COLSUM_P}):
            p = p0 + ps
            m = (p[:, None] < P) & (cols[None, :] < {n})
            offs = p[:, None].to(tl.int64) * {n} + cols[None, :]
{loads}
        {"; ".join(f"tl.store(o{i}_ptr + cols, acc{i}.to({o}), mask=cols < {n})" for i, o in zip(k, outs))}
    """)


@lowers(nv.LayerNormBackwardOp)
def lower_layer_norm_backward(
    op, cfg: LoweringConfig | None = None, *, max_row_block: int = LN_BWD_BLOCK_LIMIT,
    partial_programs: int | None = None, fusion: Fusion | None = None, name: str | None = None, **_,
) -> Kernel:
    """``partial_programs`` fixes the number of partial-sum programs (default
    PARTIALS_PER_SM per SM of the lowering device, at most one per row); the weight
    and bias gradients are deterministic for a given count. The count is fixed here,
    so the partial buffers (the launch's scratch) have a size known before the step.
    With a ``fusion`` (nova.fused "reduction"), ``launch`` takes the group's operands
    and writes its results (a weight or bias gradient it does not yield is written
    to scratch)."""
    _fused_head(op, fusion, (0, 1))
    shape, dtype = shape_of(op.operands[1].type), torch_dtype(op.operands[1].type)
    rows = Rows(shape, len(shape) - 1)
    n = rows.n
    # fp64 statistics take two registers each: half the row fits
    limit = max_row_block // 2 if dtype == torch.float64 else max_row_block
    if cfg is not None and cfg.block > limit:
        # the configurator sizes layer-norm rows for the forward (two row tensors
        # live); this kernel holds three times that: cfg.block is an upper bound
        cfg = dataclasses.replace(cfg, block=next_pow2(limit + 1) // 2, num_warps=0)
    block, looping, warps = row_plan(n, cfg, limit)
    if cfg is None or not cfg.num_warps:
        # ~8 elements per thread per row tensor: with three carried across rows and the
        # pointers of x, g and dx, 16 per thread (8 warps at 4096) needs ~250 registers
        # on sm_90 and leaves one program per SM
        warps = min(16, max(LN_BWD_MIN_WARPS, block // 256))
    src = layer_norm_backward_source(shape, dtype, block, looping, fusion)
    main, _ = load_kernel(src, "layer_norm_backward_kernel")
    colsum, _ = load_kernel(src, "layer_norm_backward_colsum")
    name = name or f"nova_layer_norm_backward_{_shape_name(shape)}"
    opts = {**_launch_options(cfg, warps), **_NO_CONTRACT}
    specs = result_specs(op)
    rf = RowFusion(fusion, 5, 3, rows, acc_type(dtype))
    progs, per = row_programs(rows.count, partial_programs or PARTIALS_PER_SM * _num_sms(lowering_device()))
    stat = torch.float64 if dtype == torch.float64 else torch.float32
    # pw and pb [progs, n]; a looping kernel also keeps two row sums per row; the gradients a group does not yield
    scratch = (2 * nbytes((progs, n), stat) + (2 * nbytes((rows.count,), stat) if looping else 0)) if n else 0
    scratch += len(rf.f.sums) * nbytes((progs, n), stat) if n else 0  # the epilogue column sums' partial rows
    scratch += sum(nbytes(*specs[i]) for i in (1, 2) if not rf.stored(i))

    def launch(inputs, outs=None):
        if fusion is None:
            _check_inputs(name, op, inputs)
        g, x, w, mean, rstd = (inputs[k] if k is not None else None for k in (rf.f.direct(j) for j in range(5)))
        dev = inputs[0].device
        (dx, dw, db), res = _fusion_outputs(name, fusion, specs, outs, dev)
        dw = dw if dw is not None else torch.empty(specs[1][0], dtype=specs[1][1], device=dev)
        db = db if db is not None else torch.empty(specs[2][0], dtype=specs[2][1], device=dev)
        if n == 0:
            return res
        if rows.count == 0:
            dw.zero_(), db.zero_()
            return res
        _check_span(name, n, block, w.stride(0), *(t.stride(-1) for t in (g, x) if t is not None))
        pw = torch.empty((progs, n), dtype=stat, device=dev)
        pb = torch.empty((progs, n), dtype=stat, device=dev)
        psums = [torch.empty((progs, n), dtype=stat, device=dev) for _ in rf.f.sums]
        row_sums = [torch.empty((rows.count,), dtype=stat, device=dev) for _ in range(2)] if looping else []
        stat_strides = [t.stride(k) for t in (mean, rstd) for k in rows.live]
        ptrs, strides = rf.args(inputs)
        main[(progs,)](
            *(t for t in (g, x) if t is not None), w, mean, rstd, *([dx] if dx is not None else []), pw, pb,
            *row_sums, *ptrs, *_outs(res, fusion, "epilogue"), *psums, *_outs(res, fusion, "prologue"),
            *(rows.args(g) if g is not None else []),
            *(rows.args(x) if x is not None else []), w.stride(0), *stat_strides, *strides, per, **opts,
        )  # fmt: skip
        colsum[(-(-n // _COLSUM_N),)](pw, pb, *psums, dw, db, *_outs(res, fusion, "sum"), progs, num_warps=4)
        return res

    return Kernel(name, src, launch, config=_effective(cfg, block, warps), extra={"looping": looping},
                  scratch_bytes=scratch)


# --------------------------------------------------------------------------- cross_entropy


def _ce_const(value: float, acc: str) -> str:
    """A constant of the statistics type (a bare literal is an fp32 constant)."""
    return f"tl.full((), {float(value)!r}, tl.float64)" if acc == "tl.float64" else repr(float(value))


def _ce_lse(n_cls: int, block: int, acc: str, looping: bool, row_sum: bool = False) -> str:
    """Lines that set ``lse`` of the row at ``x_row`` (and ``x``, the row, when it is
    one block); with ``row_sum`` also ``sx``, the row's plain sum (label smoothing)."""
    if not looping:
        ld, _ = _masked(n_cls, block)
        sx = ""
        if row_sum:
            row = "x" if n_cls == block else f"tl.where(cols < {n_cls}, x, 0.0)"
            sx = f"\n            sx = tl.sum({row}, axis=0)"
        return f"""
            x = tl.load(x_row + cols * sxc{ld(_NEG_INF)}).to({acc})
            m = tl.max(x, axis=0)
            m_safe = tl.where(m == {_NEG_INF}, 0.0, m)
            lse = m_safe + tl.log(tl.sum(tl.exp(x - m_safe), axis=0)){sx}
        """
    return f"""
{_online_max_sum(n_cls, acc, "xb", 8, row_sum)}
        lse = tl.where(m == {_NEG_INF}, 0.0, m) + tl.log(s)
    """


def _ce_count(n_rows: int, ignore: int, acc: str) -> str:
    """One program: ``count``, the rows whose target is not ignored (an out-of-range
    id counts, as it would in range: the guard stage, not the loss, reports it)."""
    return f"""
        r = tl.arange(0, {_FINAL_BLOCK})
        count = tl.zeros(({_FINAL_BLOCK},), {acc})
        for r0 in range(0, {n_rows}, {_FINAL_BLOCK}):
            rr = r0 + r
            t = tl.load(t_ptr + rr.to(tl.int64) * st, mask=rr < {n_rows}, other={ignore})
            count += (t != {ignore}).to({acc})
        count = tl.sum(count, axis=0)
    """


def _ce_plan_line(n_rows, n_cls, ignore, reduction, ls, dtype, block, looping) -> str:
    smoothing = f", label_smoothing {ls!r}" if ls else ""
    return (f"logits [{n_rows}, {n_cls}], ignore_index {ignore}, reduction {reduction}{smoothing}, "
            f"{_plan_line(dtype, block, looping)}")


def cross_entropy_source(n_rows, n_cls, dtype, ignore: int, reduction: str, block: int, looping: bool,
                         label_smoothing: float = 0.0) -> str:
    """Per row: loss = (1 - ls) * (lse - x[target]) + ls * (lse - mean(x)) (0 when
    ignored, NaN for an out-of-range id, whose load is masked). "none" writes it as
    the result (one kernel); "mean" and "sum" put it in a buffer that one program
    sums in order (dividing by the number of rows that count: the mean of no rows
    is 0 / 0 = NaN, as in torch)."""
    acc, out = acc_type(dtype), _TL[dtype]
    ls = float(label_smoothing)
    c = lambda v: _ce_const(v, acc)  # noqa: E731
    loss = "lse - xt" if not ls else f"{c(1.0 - ls)} * (lse - xt) + {c(ls)} * (lse - sx * {c(1.0 / n_cls)})"
    store = "tl.store(loss_ptr + row, loss.to({}))".format(out) if reduction == "none" else "tl.store(loss_ptr + row, loss)"
    header = _header("cross_entropy", _ce_plan_line(n_rows, n_cls, ignore, reduction, ls, dtype, block, looping),
                     {"BLOCK": block})
    rows_body = _code(f"""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        x_row = x_ptr + row * sxr
        t = tl.load(t_ptr + row * st)
        valid = t != {ignore}
        inb = (t >= 0) & (t < {n_cls})
    """, _ce_lse(n_cls, block, acc, looping, row_sum=bool(ls)), f"""
        xt = tl.load(x_row + tl.where(inb, t, 0) * sxc, mask=valid & inb, other=0.0).to({acc})
        loss = tl.where(valid, {loss}, 0.0)
        loss = tl.where(valid & ((t < 0) | (t >= {n_cls})), float("nan"), loss)
        {store}
    """)
    src = header + _kernel("cross_entropy_rows", ["x_ptr", "t_ptr", "loss_ptr", "sxr", "sxc", "st"], rows_body)
    if reduction == "none":  # the rows kernel writes the result: nothing to sum
        return src
    final_body = _code(_ce_count(n_rows, ignore, acc), f"""
        total = tl.zeros(({_FINAL_BLOCK},), {acc})
        for r0 in range(0, {n_rows}, {_FINAL_BLOCK}):
            rr = r0 + r
            total += tl.load(loss_ptr + rr, mask=rr < {n_rows}, other=0.0)
        total = tl.sum(total, axis=0)
        tl.store(out_ptr, ({'total / count' if reduction == 'mean' else 'total'}).to({out}))
    """)
    return src + _kernel("cross_entropy_final", ["t_ptr", "loss_ptr", "out_ptr", "st"], final_body)


def cross_entropy_backward_source(n_rows, n_cls, dtype, ignore: int, reduction: str, block: int, looping: bool,
                                  label_smoothing: float = 0.0) -> str:
    """For "mean" and "sum" one program counts the rows that count and writes
    scale = grad / max(count, 1) (mean: a batch of ignored rows gets 0, not NaN, as
    torch's gradient) or grad (sum); then per row d = (softmax(x) - (1 - ls)
    onehot(target) - ls / C) * valid * scale, where "none" reads its scale from
    grad[row] (and has no scale kernel). An out-of-range id matches no column: its
    row is the plain softmax times the scale, and nothing is read at the id."""
    acc, out = acc_type(dtype), _TL[dtype]
    ls = float(label_smoothing)
    c = lambda v: _ce_const(v, acc)  # noqa: E731
    row_scale = "tl.load(scale_ptr + row * ss).to({})".format(acc) if reduction == "none" else "tl.load(scale_ptr)"
    head = f"""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        x_row = x_ptr + row * sxr
        d_row = d_ptr + row * {n_cls}
        t = tl.load(t_ptr + row * st)
        w = tl.where(t != {ignore}, 1.0, 0.0).to({acc}) * {row_scale}
    """

    def target(cvar: str) -> str:
        if not ls:
            return f"tl.where({cvar} == t, 1.0, 0.0)"
        return f"tl.where({cvar} == t, {c(1.0 - ls + ls / n_cls)}, {c(ls / n_cls)})"

    if not looping:
        _, stm = _masked(n_cls, block)
        tail = f"""
            d = (tl.exp(x - lse) - {target("cols")}) * w
            tl.store(d_row + cols, d.to({out}){stm})
        """
    else:
        tail = f"""
            for c0 in range(0, {n_cls}, BLOCK):
                c = c0 + cols
                xb = tl.load(x_row + c * sxc, mask=c < {n_cls}, other=0.0).to({acc})
                d = (tl.exp(xb - lse) - {target("c")}) * w
                tl.store(d_row + c, d.to({out}), mask=c < {n_cls})
        """
    header = _header("cross_entropy_backward",
                     _ce_plan_line(n_rows, n_cls, ignore, reduction, ls, dtype, block, looping), {"BLOCK": block})
    rows_params = ["x_ptr", "t_ptr", "scale_ptr", "d_ptr", "sxr", "sxc", "st"] + (["ss"] if reduction == "none" else [])
    src = header + _kernel("cross_entropy_backward_rows", rows_params, _code(head, _ce_lse(n_cls, block, acc, looping), tail))
    if reduction == "none":
        return src
    scale_body = _code(_ce_count(n_rows, ignore, acc), f"""
        g = tl.load(g_ptr).to({acc})
        tl.store(scale_ptr, {"g / tl.maximum(count, 1.0)" if reduction == "mean" else "g"})
    """)
    return src + _kernel("cross_entropy_backward_scale", ["g_ptr", "t_ptr", "scale_ptr", "st"], scale_body)


def _lower_ce(op, cfg, max_row_block: int, backward: bool) -> Kernel:
    logits_t = op.operands[1 if backward else 0].type
    (n_rows, n_cls), dtype = shape_of(logits_t), torch_dtype(logits_t)
    p = op.props()
    ignore, reduction, ls = p["ignore_index"], p["reduction"], float(p["label_smoothing"])
    block, looping, warps = row_plan(n_cls, cfg, max_row_block)
    stat = torch.float64 if dtype == torch.float64 else torch.float32
    kind = "cross_entropy_backward" if backward else "cross_entropy"
    src = (cross_entropy_backward_source if backward else cross_entropy_source)(
        n_rows, n_cls, dtype, ignore, reduction, block, looping, ls
    )
    rows_k, _ = load_kernel(src, f"{kind}_rows")
    # "mean" / "sum": the scale (backward) or the in-order sum of the rows' losses (forward)
    once_k = None if reduction == "none" else load_kernel(src, "cross_entropy_backward_scale" if backward
                                                          else "cross_entropy_final")[0]
    name = f"nova_{kind}_{n_rows}x{n_cls}" + ("_none" if reduction == "none" else "")
    opts = _launch_options(cfg, warps)
    specs = result_specs(op)
    # the scratch: the backward's one scale, the forward's per-row losses ("none" writes the result)
    writes = n_rows * n_cls if backward else n_rows  # no rows to write: no kernel, no scratch
    scratch = 0 if reduction == "none" or not writes else nbytes((1,) if backward else (n_rows,), stat)

    def backward_rows(g, x, t, out):
        if reduction == "none":  # each row's scale is its own grad entry
            rows_k[(n_rows,)](x, t, g, out, x.stride(0), x.stride(1), t.stride(0), g.stride(0), **opts)
            return
        scale = torch.empty((1,), dtype=stat, device=x.device)
        once_k[(1,)](g, t, scale, t.stride(0), num_warps=4)
        rows_k[(n_rows,)](x, t, scale, out, x.stride(0), x.stride(1), t.stride(0), **opts)

    def forward_rows(x, t, out):
        if reduction == "none":
            rows_k[(n_rows,)](x, t, out, x.stride(0), x.stride(1), t.stride(0), **opts)
            return
        loss = torch.empty((n_rows,), dtype=stat, device=x.device)
        rows_k[(n_rows,)](x, t, loss, x.stride(0), x.stride(1), t.stride(0), **opts)
        once_k[(1,)](t, loss, out, t.stride(0), num_warps=4)

    def launch(inputs, outs=None):
        _check_inputs(name, op, inputs)
        *g, x, t = inputs
        (out,) = results(name, specs, outs, x.device)
        if backward:
            if out.numel():
                _check_span(name, n_cls, block, x.stride(1))
                backward_rows(g[0], x, t, out)
        elif n_rows == 0:
            out.fill_(float("nan") if reduction == "mean" else 0.0)
        else:
            _check_span(name, n_cls, block, x.stride(1))
            forward_rows(x, t, out)
        return [out]

    return Kernel(name, src, launch, config=_effective(cfg, block, warps), extra={"looping": looping},
                  scratch_bytes=scratch)


@lowers(nv.CrossEntropyOp)
def lower_cross_entropy(op, cfg: LoweringConfig | None = None, *, max_row_block: int = ROW_BLOCK_LIMIT, **_) -> Kernel:
    return _lower_ce(op, cfg, max_row_block, backward=False)


@lowers(nv.CrossEntropyBackwardOp)
def lower_cross_entropy_backward(
    op, cfg: LoweringConfig | None = None, *, max_row_block: int = ROW_BLOCK_LIMIT, **_
) -> Kernel:
    return _lower_ce(op, cfg, max_row_block, backward=True)


__all__ = [
    "ROW_BLOCK_LIMIT", "LN_BWD_BLOCK_LIMIT", "LOOP_BLOCK", "Rows", "row_plan", "next_pow2", "acc_type",
    "lower_softmax", "lower_log_softmax", "lower_softmax_backward", "lower_log_softmax_backward",
    "lower_layer_norm", "lower_layer_norm_backward", "lower_cross_entropy", "lower_cross_entropy_backward",
]
