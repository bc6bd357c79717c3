"""Elementwise lowerings: one generator for every op that maps output elements to
input elements one by one (arithmetic, compares, where, activations, casts,
constants, dropout masks, and the data-movement ops broadcast_to / transpose /
reshape / slice / pad / cat as materializing copies).

``pointwise_source`` writes one N-D kernel over the output's index space: a
program owns BLOCK consecutive flat output indices, turns them into a
multi-index through the static output shape (divisions by constants), and reads
each operand through its own strides, passed at launch. So a broadcast operand
(stride 0, or a size-1 dim that simply has no term), a transposed or sliced view
(strides and storage offset of the tensor itself) is read in place: no copies.
The output is always written contiguously at the flat index (coalesced): a new
tensor, or the ``out`` the launch is given (a view into the step's arena). The
same-index ops may write over one of their own operands (an in-place parameter
update): each lane loads its elements before it stores, and the only lane that
reads element i of such an operand is the one that writes element i.

Design choices, and why:

* Shapes are static (baked into the text); strides are runtime arguments. Triton
  specialises integer arguments equal to 1, so the contiguous axis of an operand
  is known to the compiler and its loads vectorize.
* ``DENSE<k>`` (constexpr, chosen at launch): operand k has the output's shape and
  is contiguous, so it is read at the flat index itself, skipping the index math.
* ``IDX64`` (constexpr, chosen at launch): index math in int64 when the output or
  any operand's span could pass 2**31 - 1; int32 otherwise (cheaper).
* Float math runs in fp32 for bf16/f16/f32 and fp64 for f64, then rounds once to
  the result type, as torch does for reduced-precision elementwise ops. Constants
  of fp64 math are created as fp64 (a bare literal would be an fp32 constant).
* fp32 division is ``div_rn`` (Triton's ``/`` is ``div.full.f32``, ~2 ulp), sqrt is
  ``sqrt_rn``. libdevice cannot run under the interpreter, so tanh and pow are
  written out (Cephes tanh; pow through exp2/log2 in fp64 with C's special
  cases): the text that is tested on the CPU is the text that runs on the GPU.
* log1p and expm1 are Goldberg's and Kahan's forms over the core log and exp, computed in
  fp64 (fp32 too, as pow: the GPU's fp32 log and exp are approximations whose absolute
  error near log(1) would undo the forms), then rounded once.
* cos and sin are Triton's core ``tl.cos`` / ``tl.sin`` (no explicit libdevice call
  in the text): the GPU build links libdevice's ``__nv_cosf`` / ``__nv_cos`` (with
  the full Payne-Hanek reduction for large arguments), the interpreter uses numpy;
  both are within an ulp of the true value.
* add, sub, mul and maximum on i64 are integer arithmetic in int64 (wrapping on
  overflow, as torch does); compares and where take i64 and bool operands too.
* maximum propagates NaN explicitly (Triton's default ``maximum`` is maxnum).
* Bool tensors are stored as bytes: they are passed as ``uint8`` views and
  written as 0/1 bytes, never through ``*i1`` pointers.
* dropout_mask reproduces ``nova.rng`` bit for bit in uint32 arithmetic; the
  keep test ``u >= p`` is the exact integer test ``(x >> 8) >= ceil(p * 2**24)``,
  and the kept value is the reference's own rounding of 1/(1-p) to the dtype.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from nova import rng
from nova.codegen.triton.lowering import Kernel, lowers
from nova.codegen.triton.source import interpreting, load_kernel
from nova.ir import dialect as nv
from nova.ir.types import elem_of, shape_of, to_torch_dtype
from nova.schedule.config import LoweringConfig

DEFAULT_BLOCK = 1024  # elements per program: 8 fp32 per thread at 4 warps, 16-byte vectors
DEFAULT_WARPS = 4
INT32_MAX = 2**31 - 1

# register type tags -> Triton types; bool values live as int1 ("i1") after
# compares and as 0/1 bytes ("u8") when loaded or stored
_TL = {
    "f32": "tl.float32", "f64": "tl.float64", "bf16": "tl.bfloat16", "f16": "tl.float16",
    "i64": "tl.int64", "i1": "tl.int1", "u8": "tl.uint8",
}  # fmt: skip
_TAG = {
    torch.float32: "f32", torch.float64: "f64", torch.bfloat16: "bf16", torch.float16: "f16",
    torch.int64: "i64", torch.bool: "u8",
}  # fmt: skip
_FLOATS = ("f32", "f64", "bf16", "f16")


class UnsupportedError(NotImplementedError):
    """A case the Triton lowerings do not handle (the message names the op)."""


def tag(dtype: torch.dtype) -> str:
    try:
        return _TAG[dtype]
    except KeyError:
        raise UnsupportedError(f"Triton lowerings do not support dtype {dtype}") from None


def compute_tag(dtype: torch.dtype) -> str:
    """The register type float math on ``dtype`` runs in (fp64 for f64, else fp32)."""
    t = tag(dtype)
    if t == "f64":
        return "f64"
    return "f32" if t in _FLOATS else t


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def numel(shape: Sequence[int]) -> int:
    return math.prod(int(s) for s in shape)


def span(t: torch.Tensor) -> int:
    """The largest element offset a kernel forms for ``t`` from its data pointer."""
    return sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()) if s > 1)


def storage_view(t: torch.Tensor) -> torch.Tensor:
    """What a kernel receives for ``t``: bools as their 0/1 bytes."""
    return t.view(torch.uint8) if t.dtype == torch.bool else t


def default_device() -> torch.device:
    """Where ops without operands (full, arange) allocate when not told."""
    return torch.device("cuda" if torch.cuda.is_available() and not interpreting() else "cpu")


def result_tensor(what: str, out: torch.Tensor | None, shape, dtype: torch.dtype, device) -> torch.Tensor:
    """Where a launch writes one result: ``out`` when given (checked: contiguous, of
    the result's shape and dtype; typically a view into the step's arena), else a
    new tensor on ``device``."""
    if out is None:
        return torch.empty(tuple(shape), dtype=dtype, device=device)
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(
            f"{what}: out is {tuple(out.shape)} {out.dtype} with strides {tuple(out.stride())}, "
            f"expected a contiguous {tuple(shape)} {dtype} tensor"
        )
    return out


def only_out(outs: Sequence[torch.Tensor] | None) -> torch.Tensor | None:
    """The result tensor of a one-result kernel's ``outs`` (None: allocate one)."""
    if outs is None:
        return None
    (out,) = outs
    return out


def sanitize(text: str) -> str:
    return re.sub(r"[^0-9A-Za-z_]", "_", text)


def shape_name(shape: Sequence[int]) -> str:
    return "x".join(str(s) for s in shape) if shape else "scalar"


def convert(expr: str, src: str, dst: str) -> str:
    """Code converting ``expr`` (register type ``src``) to register type ``dst``, with
    torch's rounding: f64 and i64 reach bf16/f16 through fp32 (c10's conversions),
    bool results are 0/1 bytes, and any nonzero (NaN included) is True."""
    if src == dst:
        return expr
    if dst == "u8":  # a bool result
        if src == "i1":
            return f"({expr}).to(tl.uint8)"
        return f"(({expr}) != 0).to(tl.uint8)"
    if dst == "i1":
        return f"(({expr}) != 0)"
    if src == "i1":  # through uint8: int1 converts as signed (True -> -1) otherwise
        return convert(f"({expr}).to(tl.uint8)", "u8", dst)
    if dst in ("bf16", "f16") and src in ("f64", "i64", "u8"):  # (and the interpreter has no int -> bf16)
        return f"({expr}).to(tl.float32).to({_TL[dst]})"
    return f"({expr}).to({_TL[dst]})"


def const(value: float, ct: str) -> str:
    """A float constant in compute type ``ct`` (a bare literal is an fp32 constant)."""
    if ct == "f64":
        return f"tl.full([], {float(value)!r}, tl.float64)"
    return repr(float(value))


def load(source: str, name: str):
    return load_kernel(source, name)[0]


# --------------------------------------------------------------------------- source


@dataclass(frozen=True)
class Operand:
    """One input of a pointwise kernel.

    ``shape`` is right-aligned against the iteration shape; a size-1 dim under a
    larger iteration dim broadcasts. ``load``: "compute" widens floats to their
    compute type and turns bools into int1; "raw" keeps the stored type (bools as
    0/1 bytes). ``index`` overrides the index expression of some iteration dims
    (``i<d>`` names iteration dim d) and ``mask`` restricts the load (masked-off
    lanes read 0): together they express pad."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    load: str = "compute"
    index: tuple[tuple[int, str], ...] = ()
    mask: str = ""

    def terms(self, rank: int) -> list[tuple[int, int, str]]:
        """(operand dim, iteration dim, index expression) of the dims that move."""
        lead = rank - len(self.shape)
        custom = dict(self.index)
        return [(k, k + lead, custom.get(k + lead, f"i{k + lead}")) for k, s in enumerate(self.shape) if s > 1]

    def dense_capable(self, shape: tuple[int, ...]) -> bool:
        return tuple(self.shape) == tuple(shape) and not self.index and not self.mask and numel(shape) > 1

    def loaded_tag(self) -> str:
        t = tag(self.dtype)
        if self.load == "raw":
            return t
        return "i1" if t == "u8" else compute_tag(self.dtype)


def pointwise_source(
    name: str,
    shape: Sequence[int],
    operands: Sequence[Operand],
    body: str,
    y_tag: str,
    out_dtype: torch.dtype,
    block: int,
    helpers: str = "",
    stores: Sequence[tuple[str, str, torch.dtype]] | None = None,
    segments: Sequence[tuple[Sequence[int], str, Sequence[int]]] | None = None,
) -> str:
    """Triton source of one pointwise kernel named ``name``.

    Iterates over ``shape`` (row-major flat index = the output offset); loads
    operand k into ``x<k>``; ``body`` (statements, may use ``offs`` and ``mask``)
    assigns ``y`` of register type ``y_tag``, which is stored as ``out_dtype``.
    ``stores`` instead: (variable, register type, dtype) per output, written to
    ``out0``, ``out1``, ... (a multi-output kernel; every load comes before the
    first store). Kernel arguments: operand pointers, the output pointers, the
    strides of every operand dim that moves (in operand order), then DENSE<k> per
    dense-capable operand and IDX64 (constexprs).

    ``segments`` (with ``stores``): a multi-tensor kernel of independent parts, each
    (its operands' indices, its body, its outputs' indices), part j run by the
    programs of grid axis 1 index j over the whole shape: its loads, body and stores
    in a branch of their own, so that a program holds one part's values only (the
    parts of one straight-line kernel would all be live at once). ``body`` is then
    what every part reads first (the one-element values), from the operands no part
    names (which must each be of one element)."""
    shape = tuple(int(s) for s in shape)
    rank = len(shape)  # any rank: one division per moving dim
    n = numel(shape)
    even = n % block == 0
    if stores is None:
        outs = [("out", "y", y_tag, out_dtype)]
    else:
        outs = [(f"out{j}", v, t, d) for j, (v, t, d) in enumerate(stores)]
    params = [f"in{k}" for k in range(len(operands))] + [o[0] for o in outs]
    flags = []
    part_of: dict[int, int] = {}  # operand -> its segment
    if segments is not None:
        if stores is None:
            raise ValueError(f"{name}: a segmented kernel names its outputs (stores)")
        for j, (ks, _, _) in enumerate(segments):
            part_of.update({k: j for k in ks})
        if any(k not in part_of and (op.terms(rank) or op.mask) for k, op in enumerate(operands)):
            raise ValueError(f"{name}: an operand of more than one element belongs to no segment")
    seg_lines: list[list[str]] = [[] for _ in segments or ()]
    lines = [
        "pid = tl.program_id(0)",
        "if IDX64:",
        f"    offs = pid.to(tl.int64) * {block} + tl.arange(0, {block})",
        "else:",
        f"    offs = pid * {block} + tl.arange(0, {block})",
        "mask = None" if even else f"mask = offs < {n}",
    ]
    used_dims = sorted({d for op in operands for _, d, _ in op.terms(rank)} | {d for op in operands for d, _ in op.index})
    if used_dims:  # multi-index of the dims some operand needs; size-1 dims are always 0
        outer = min(used_dims)
        lines.append("rem = offs")
        for d in range(rank - 1, outer - 1, -1):
            if d == outer and numel(shape[:outer]) == 1:
                lines.append(f"i{d} = rem")
            elif shape[d] == 1:
                lines.append(f"i{d} = 0")
            else:
                lines += [f"i{d} = rem % {shape[d]}", f"rem = rem // {shape[d]}"]
    for k, op in enumerate(operands):
        terms = op.terms(rank)
        for kd, _, _ in terms:
            params.append(f"s{k}_{kd}")
        raw, loaded = tag(op.dtype), op.loaded_tag()
        at = seg_lines[part_of[k]] if k in part_of else lines  # a segment's operand loads in its branch
        if not terms and not op.mask:
            at.append(f"x{k} = {convert(f'tl.load(in{k})', raw, loaded)}")  # one element for every lane
            continue
        off = " + ".join(f"({expr}) * s{k}_{kd}" for kd, _, expr in terms) or "offs * 0"
        if op.dense_capable(shape):
            flags.append(f"DENSE{k}")
            at += [f"if DENSE{k}:", f"    o{k} = offs", "else:", f"    o{k} = {off}"]
        else:
            at.append(f"o{k} = {off}")
        m = "mask"
        if op.mask:
            at.append(f"m{k} = {op.mask}" if even else f"m{k} = mask & ({op.mask})")
            m = f"m{k}"
        other = ", other=0" if op.mask else ""
        at.append(f"x{k} = {convert(f'tl.load(in{k} + o{k}, mask={m}{other})', raw, loaded)}")
    lines += body.strip("\n").splitlines()
    if segments is None:
        for ptr, var, vtag, dtype in outs:
            lines.append(f"tl.store({ptr} + offs, {convert(var, vtag, tag(dtype))}, mask=mask)")
    else:
        lines.append("seg = tl.program_id(1)")
        for j, (_, part, js) in enumerate(segments):
            lines.append(f"{'if' if j == 0 else 'elif'} seg == {j}:")
            branch = seg_lines[j] + part.strip("\n").splitlines()
            for ptr, var, vtag, dtype in (outs[i] for i in js):
                branch.append(f"tl.store({ptr} + offs, {convert(var, vtag, tag(dtype))}, mask=mask)")
            lines += ["    " + ln for ln in branch or ["pass"]]
    params += [f"{f}: tl.constexpr" for f in flags] + ["IDX64: tl.constexpr"]
    text = "\n".join("    " + ln for ln in lines)
    return (
        "import triton\nimport triton.language as tl\n\n"
        + (helpers.strip("\n") + "\n\n\n" if helpers else "")
        + f"@triton.jit\ndef {name}({', '.join(params)}):\n{text}\n"
    )


@dataclass
class Pointwise:
    """A loaded pointwise kernel and how to launch it."""

    fn: object
    name: str
    source: str
    shape: tuple[int, ...]
    operands: tuple[Operand, ...]
    out_dtype: torch.dtype
    block: int
    num_warps: int
    out_dtypes: tuple[torch.dtype, ...] = ()  # a multi-output kernel's (``stores``); () = (out_dtype,)
    segments: int = 1  # a multi-tensor kernel's parts (``pointwise_source``): grid axis 1

    def __call__(self, xs: Sequence[torch.Tensor], device=None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Runs the kernel on ``xs``, writing ``out`` (contiguous, the result's shape
        and dtype; a new tensor when None). ``out`` may be one of ``xs`` itself: lane
        i loads every operand's element i before it stores element i, and no other
        lane reads it (the in-place update of the same-index ops)."""
        return self.run(xs, device, None if out is None else [out])[0]

    def run(self, xs: Sequence[torch.Tensor], device=None,
            outs: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:  # fmt: skip
        """``__call__`` for any number of outputs (``outs``: one per output, or None)."""
        rank = len(self.shape)
        dtypes = self.out_dtypes or (self.out_dtype,)
        if outs is None:
            device = xs[0].device if xs else device or default_device()
            outs = [None] * len(dtypes)
        if len(outs) != len(dtypes):
            raise ValueError(f"{self.name}: {len(outs)} outs for {len(dtypes)} results")
        outs = [result_tensor(self.name, o, self.shape, d, device) for o, d in zip(outs, dtypes, strict=True)]
        n = numel(self.shape)
        if n == 0:
            return outs
        args, flags = [], {}
        big = n + self.block > INT32_MAX
        for k, (op, x) in enumerate(zip(self.operands, xs, strict=True)):
            if tuple(x.shape) != tuple(op.shape) or x.dtype != op.dtype:
                raise ValueError(
                    f"{self.name}: operand {k} is {tuple(x.shape)} {x.dtype}, expected {tuple(op.shape)} {op.dtype}"
                )
            args.append(storage_view(x))
            big = big or span(x) > INT32_MAX
            if op.dense_capable(self.shape):
                flags[f"DENSE{k}"] = x.is_contiguous()
        args += [storage_view(o) for o in outs]
        for op, x in zip(self.operands, xs):
            args += [x.stride(kd) for kd, _, _ in op.terms(rank)]
        grid = (-(-n // self.block), self.segments)
        # no contraction of a mul and an add into an fma: each op rounds as written,
        # so a fused kernel computes what the unfused ones do, bit for bit
        self.fn[grid](*args, **flags, IDX64=big, num_warps=self.num_warps, enable_fp_fusion=False)
        return outs


def block_and_warps(n: int, cfg: LoweringConfig | None) -> tuple[int, int]:
    """BLOCK (a power of two, no larger than the tensor needs) and num_warps."""
    if cfg is not None and cfg.block:
        block = cfg.block
        if block & (block - 1):
            raise ValueError(f"elementwise: block={block} must be a power of two")
    else:
        block = DEFAULT_BLOCK
    block = max(16, min(block, next_pow2(n)))
    if cfg is not None:
        return block, cfg.num_warps
    return block, max(1, min(DEFAULT_WARPS, block // 256))  # >= 8 elements per thread


def pointwise(
    name: str,
    shape: Sequence[int],
    operands: Sequence[Operand],
    body: str,
    y_tag: str,
    out_dtype: torch.dtype,
    cfg: LoweringConfig | None = None,
    helpers: str = "",
) -> Pointwise:
    shape = tuple(int(s) for s in shape)
    block, warps = block_and_warps(numel(shape), cfg)
    fname = sanitize(name)
    src = pointwise_source(fname, shape, operands, body, y_tag, out_dtype, block, helpers)
    fn = load(src, fname)
    return Pointwise(fn, name, src, shape, tuple(operands), out_dtype, block, warps)


def kernel_of(pw: Pointwise, cfg, launch=None, needs_contiguous=()) -> Kernel:
    def run(xs, outs=None, device=None):
        return [pw(xs, device, only_out(outs))]

    return Kernel(
        name=pw.name, source=pw.source, launch=launch or run,
        needs_contiguous=tuple(needs_contiguous), config=cfg,
    )


# --------------------------------------------------------------------------- chains inside other templates


@dataclass(frozen=True)
class Chain:
    """Elementwise ops composed in registers inside another template's loop: a
    reduction's prologue, a row-wise op's epilogue (``nova.codegen.triton.fused``
    builds them from a nova.fused "reduction" group, with the same expressions and
    roundings as the fused elementwise kernels).

    The template loads operand k (``operands[k]``: the stored type, bools as 0/1
    bytes; shape right-aligned to the template's iteration shape, so a broadcast
    is read in place) into ``<prefix>x<k>`` at the element it is at, then runs
    ``body``; ``values`` are the (variable, register type) pairs it reads back.
    An epilogue's body reads the head's first result, as stored, from
    ``<prefix>in`` (register type ``in_tag``). ``inputs[k]``: which of the group's
    operands ``operands[k]`` is."""

    prefix: str
    operands: tuple[Operand, ...]
    inputs: tuple[int, ...]
    body: str
    values: tuple[tuple[str, str], ...]
    helpers: str = ""
    in_tag: str = ""


@dataclass(frozen=True)
class Fusion:
    """A reduction template's work around its own (nova.fused "reduction"): where
    each of the head's operands comes from, ``reads[j]`` = ("input", k) the
    group's operand k as it is, or ("prologue", i) value i of ``prologue``; the
    ``epilogue`` on the head's first result, its value j stored as ``stores[j]``;
    and which of the group's results each one is, ``outputs[r]`` = ("head", i) the
    head's result i (stored as the unfused op stores it), ("epilogue", j), or
    ("prologue", j): the prologue's value ``prologue_stores[j]`` = (index into
    ``prologue.values``, dtype), stored at every element the prologue computes (a
    template that computes each once: ``NovaOp.PROLOGUE_STORES``), or ("sum", j): the
    column sum ``sums[j]`` = (index into ``epilogue.values``, dtype) of an epilogue
    value over the rows (``NovaOp.EPILOGUE_SUMS``).
    ``plain(n_operands, n_results)``: the unfused op."""

    reads: tuple[tuple[str, int], ...]
    outputs: tuple[tuple[str, int], ...]
    prologue: Chain | None = None
    epilogue: Chain | None = None
    stores: tuple[torch.dtype, ...] = ()
    prologue_stores: tuple[tuple[int, torch.dtype], ...] = ()
    sums: tuple[tuple[int, torch.dtype], ...] = ()

    @staticmethod
    def plain(n_operands: int, n_results: int) -> Fusion:
        return Fusion(tuple(("input", j) for j in range(n_operands)), tuple(("head", i) for i in range(n_results)))

    def direct(self, j: int) -> int | None:
        """The group operand the head's operand ``j`` is, or None (a prologue value)."""
        how, k = self.reads[j]
        return k if how == "input" else None

    def stored(self, i: int) -> bool:
        """Whether the head's result ``i`` is a result of the group."""
        return ("head", i) in self.outputs

    def head_output(self, i: int) -> int:
        return self.outputs.index(("head", i))

    @property
    def helpers(self) -> str:
        return merge_helpers([c.helpers for c in (self.prologue, self.epilogue) if c is not None and c.helpers])


# --------------------------------------------------------------------------- helpers in the text

# Cephes tanhf (|x| < 0.625: odd polynomial, else 1 - 2 / (exp(2|x|) + 1)): ~2 ulp.
# Horner's steps are explicit fmas (the kernels compile without fp contraction, so
# that separate ops round as written; inside one op that is the op's own rounding),
# and exp(2|x|) is one exp2 (the same bits: 2 log2(e) is exact in fp32). (GELU's tanh
# approximation does not use it: ``_gelu_code``.)
_TANH_F32 = """
@triton.jit
def _tanh_f32(x):
    ax = tl.abs(x)
    z = x * x
    p = tl.fma(z, -5.70498872745e-3, 2.06390887954e-2)
    p = tl.fma(p, z, -5.37397155531e-2)
    p = tl.fma(p, z, 1.33314422036e-1)
    p = tl.fma(p, z, -3.33332819422e-1)
    p = tl.fma(p * z, x, x)
    big = 1.0 - 2.0 / (tl.exp2(ax * 2.885390081777927) + 1.0)
    big = tl.where(x < 0, -big, big)
    return tl.where(ax < 0.625, p, big)
"""

# Cephes tanh (double): rational approximation below 0.625
_TANH_F64 = """
@triton.jit
def _tanh_f64(x):
    ax = tl.abs(x)
    z = x * x
    num = (tl.full([], -9.64399179425052238628e-1, tl.float64) * z
           + tl.full([], -9.92877231001918586564e1, tl.float64)) * z + tl.full([], -1.61468768441708447952e3, tl.float64)
    den = ((z + tl.full([], 1.12811678491632931402e2, tl.float64)) * z
           + tl.full([], 2.23548839060100448583e3, tl.float64)) * z + tl.full([], 4.84406305325125486048e3, tl.float64)
    p = x + x * z * (num / den)
    big = 1.0 - 2.0 / (tl.exp(2.0 * ax) + 1.0)
    big = tl.where(x < 0, -big, big)
    return tl.where(ax < 0.625, p, big)
"""

# C pow in fp64: exp2(b * log2|a|), sign for odd integer b, NaN for a < 0 with
# non-integer b, and pow(x, 0) = pow(1, y) = pow(-1, +-inf) = 1
_POW = """
@triton.jit
def _pow(a, b):
    aa = tl.abs(a)
    r = tl.exp2(b * tl.log2(aa))
    fb = tl.floor(b)
    b_int = fb == b
    b_odd = b_int & ((b - 2.0 * tl.floor(b * 0.5)) == 1.0)
    neg = a < 0
    r = tl.where(neg & b_odd, -r, r)
    r = tl.where(neg & (fb != b) & (aa != float("inf")), float("nan"), r)
    one = (b == 0) | (a == 1) | ((a == -1) & (tl.abs(b) == float("inf")))
    return tl.where(one, 1.0, r)
"""

_SQRT1_2 = 0.70710678118654752440  # M_SQRT1_2
_GELU_BETA = math.sqrt(2.0) * (2.0 / math.sqrt(math.pi)) * 0.5  # M_SQRT2 * M_2_SQRTPI * 0.5
_GELU_ALPHA = (2.0 / math.sqrt(math.pi)) * _SQRT1_2 * 0.5  # M_2_SQRTPI * M_SQRT1_2 * 0.5
_KAPPA = 0.044715


def _div(a: str, b: str, ct: str) -> str:
    return f"tl.math.div_rn({a}, {b})" if ct == "f32" else f"({a}) / ({b})"


def _log1p(x: str, y: str, ct: str) -> str:
    """log(1 + x) from the core log without libdevice (which the interpreter lacks): with
    u = 1 + x rounded, log(u) * x / (u - 1) cancels u's rounding error (Goldberg, "What every
    computer scientist should know about floating-point arithmetic", theorem 4): within a few
    ulp of log1p; x where u rounds to 1, and u itself where it is inf."""
    one = const(1.0, ct)
    return (f"{y}_u = {one} + {x}\n"
            f"{y} = tl.where({y}_u == {one}, {x}, tl.where({y}_u == float('inf'), {y}_u, "
            + _div(f"tl.log({y}_u) * {x}", f"{y}_u - {one}", ct) + "))")


def _in_f64(form, x: str, y: str, ct: str) -> str:
    if ct == "f64":
        return form(x, y, ct)
    return form(f"{y}_x", f"{y}_d", "f64").join([f"{y}_x = {x}.to(tl.float64)\n", f"\n{y} = {y}_d.to(tl.float32)"])


def _expm1(x: str, y: str, ct: str) -> str:
    """exp(x) - 1 from the core exp and log (Kahan's form): with u = exp(x) rounded,
    (u - 1) * (x / log(u)) (that order: (u - 1) * x overflows near exp's own overflow); x
    where u rounds to 1, -1 where u - 1 does, u where it is inf."""
    one = const(1.0, ct)
    return (f"{y}_u = tl.exp({x})\n"
            f"{y}_m = {y}_u - {one}\n"
            f"{y} = tl.where({y}_u == {one}, {x}, tl.where({y}_m == -{one}, -{one}, tl.where({y}_u == float('inf'), "
            f"{y}_u, {y}_m * (" + _div(x, f"tl.log({y}_u)", ct) + "))))")


# --------------------------------------------------------------------------- expressions


@dataclass(frozen=True)
class Expr:
    """One elementwise op as code, the unit that single-op kernels and fused
    kernels (``nova.codegen.triton.fused``) are both made of.

    ``loads[k]``: how operand k is read ("compute": floats widened to their
    compute type, bools as int1; "raw": the stored type, bools as 0/1 bytes);
    ``code(args, y)``: statements assigning variable ``y`` from the operand
    variables ``args`` (temporaries are named ``<y>_...``); ``tag``: ``y``'s
    register type, rounded to the result's dtype by the store (or, inside a fused
    kernel, by the same conversion where the store would have been). Code may read
    ``offs``, the flat index of the iteration space (arange, dropout_mask)."""

    loads: tuple[str, ...]
    tag: str
    code: Callable[[Sequence[str], str], str]
    helpers: tuple[str, ...] = ()


EXPRESSIONS: dict[type, Callable[[nv.NovaOp], Expr]] = {}


def expression(*op_classes):
    def register(fn):
        for c in op_classes:
            if c in EXPRESSIONS:
                raise ValueError(f"{c.name} already has an expression")
            EXPRESSIONS[c] = fn
        return fn

    return register


def expression_of(op) -> Expr:
    """The op's expression; a missing one is an error naming the op."""
    fn = EXPRESSIONS.get(type(op))
    if fn is None:
        raise UnsupportedError(f"{op.name}: no elementwise expression in the Triton codegen")
    return fn(op)


def _dtypes(op) -> tuple[list[torch.dtype], torch.dtype]:
    return [to_torch_dtype(elem_of(v.type)) for v in op.operands], to_torch_dtype(elem_of(op.results[0].type))


def scalar_const(value: torch.Tensor) -> str:
    """The 0-d tensor ``value`` as a 0-d Triton constant, exactly (NaN, inf, any dtype)."""
    t = tag(value.dtype)
    if t == "u8":
        return f"tl.full([], {int(bool(value))}, tl.uint8)"
    if t == "i64":
        return f"tl.full([], {int(value)}, tl.int64)"
    itype = {"f64": torch.int64, "f32": torch.int32, "bf16": torch.int16, "f16": torch.int16}[t]
    ibits = int(value.reshape(1).view(itype)[0])
    itl = {torch.int64: "tl.int64", torch.int32: "tl.int32", torch.int16: "tl.int16"}[itype]
    return f"tl.full([], {ibits}, {itl}).to({_TL[t]}, bitcast=True)"


def tf32_rn_bits(bits: str) -> str:
    """Round-to-nearest-even of fp32 bits to tf32, as an expression on the uint32 ``bits``: add
    half a tf32 ulp (0xFFF) and the lowest kept bit (ties to even), clear the 13 dropped bits
    (``matmul.TF32_RN`` says why that is the IEEE rounding, infinities and NaNs included)."""
    return f"({bits} + 0xFFF + (({bits} >> 13) & 1)) & 0xFFFFE000"


# float bodies: (args, y, compute type) -> code
_BINARY: dict[type, Callable[[Sequence[str], str, str], str]] = {
    nv.AddOp: lambda a, y, ct: f"{y} = {a[0]} + {a[1]}",
    nv.SubOp: lambda a, y, ct: f"{y} = {a[0]} - {a[1]}",
    nv.MulOp: lambda a, y, ct: f"{y} = {a[0]} * {a[1]}",
    nv.DivOp: lambda a, y, ct: f"{y} = " + _div(a[0], a[1], ct),
    nv.MaximumOp: lambda a, y, ct: f"{y} = tl.maximum({a[0]}, {a[1]}, propagate_nan=tl.PropagateNan.ALL)",
    nv.PowOp: lambda a, y, ct: (
        f"{y} = _pow({a[0]}, {a[1]})" if ct == "f64"
        else f"{y} = _pow({a[0]}.to(tl.float64), {a[1]}.to(tl.float64)).to(tl.float32)"
    ),
}  # fmt: skip
_COMPARE = {nv.EqOp: "==", nv.NeOp: "!=", nv.LtOp: "<", nv.LeOp: "<=", nv.GtOp: ">", nv.GeOp: ">="}
_UNARY: dict[type, Callable[[Sequence[str], str, str], str]] = {
    nv.NegOp: lambda a, y, ct: f"{y} = -{a[0]}",
    nv.ExpOp: lambda a, y, ct: f"{y} = tl.exp({a[0]})",
    nv.LogOp: lambda a, y, ct: f"{y} = tl.log({a[0]})",
    nv.SqrtOp: lambda a, y, ct: f"{y} = tl.sqrt_rn({a[0]})" if ct == "f32" else f"{y} = tl.sqrt({a[0]})",
    nv.RsqrtOp: lambda a, y, ct: f"{y} = tl.math.rsqrt({a[0]})",
    nv.TanhOp: lambda a, y, ct: f"{y} = _tanh_{ct}({a[0]})",
    nv.SigmoidOp: lambda a, y, ct: f"{y} = " + _div(const(1.0, ct) if ct == "f64" else "tl.full([], 1.0, tl.float32)",
                                                    f"1.0 + tl.exp(-{a[0]})", ct),
    nv.ReluOp: lambda a, y, ct: f"{y} = tl.where({a[0]} < 0, 0.0, {a[0]})",
    # core ops: libdevice's __nv_cos(f)/__nv_sin(f) (full range reduction) on the GPU,
    # numpy's under the interpreter; both within an ulp of the true value
    nv.CosOp: lambda a, y, ct: f"{y} = tl.cos({a[0]})",
    nv.SinOp: lambda a, y, ct: f"{y} = tl.sin({a[0]})",
    nv.AbsOp: lambda a, y, ct: f"{y} = tl.abs({a[0]})",
    # in fp64 for fp32 too (as pow): the GPU's fp32 log and exp are approximations whose
    # absolute error near log(1) would undo the forms' accuracy
    nv.Log1pOp: lambda a, y, ct: _in_f64(_log1p, a[0], y, ct),
    nv.Expm1Op: lambda a, y, ct: _in_f64(_expm1, a[0], y, ct),
    # matmul.TF32_RN in one expression
    nv.RoundTf32Op: lambda a, y, ct: f"{y} = ({tf32_rn_bits(a[0] + '.to(tl.uint32, bitcast=True)')}).to(tl.float32, bitcast=True)",
}  # fmt: skip
# integer arithmetic (position ids, index math): i64 in, i64 out, wrapping like torch
_INTEGER_BINARY: dict[type, str] = {nv.AddOp: "+", nv.SubOp: "-", nv.MulOp: "*"}


# The tanh approximation's 0.5 x (1 + tanh(u)), u = beta (x + kappa x^3), written as
# x sigmoid(2u) = x s, s = 1 / (1 + exp(-2u)) (1 + tanh(u) = 2 sigmoid(2u), exactly): one
# exp2 and one reciprocal an element, no tanh (whose two branches and division made
# GELU's backward ~40 FP instructions an element, the GPT-2 step's c_fc bias-gradient
# kernel issue-bound: scripts' offline sm_90a compile). It also drops 1 + tanh(u)'s
# cancellation for x << 0 (torch's form loses relative accuracy there; the two agree
# within an fp32 rounding of |x|). The backward's derivative,
# s + x s (1 - s) 2 beta (1 + 3 kappa x^2), reuses s: a kernel holding GELU and its
# backward (the fuse stage's c_fc backward) computes u, the exp2 and s once.
_GELU_2U = 2.0 * _GELU_BETA
_NEG_2U_LOG2E = -2.0 * _GELU_BETA * math.log2(math.e)


def _gelu_sigmoid(x: str, y: str, ct: str) -> str:
    """Lines setting ``<y>_x_sq`` and ``<y>_s`` = sigmoid(2u) of ``x``."""
    c = lambda v: const(v, ct)  # noqa: E731
    neg_2u = (f"tl.exp2({c(_NEG_2U_LOG2E)} * tl.fma({c(_KAPPA)} * {y}_x_sq, {x}, {x}))" if ct == "f32"
              else f"tl.exp({c(-_GELU_2U)} * tl.fma({c(_KAPPA)} * {y}_x_sq, {x}, {x}))")  # fmt: skip
    return f"{y}_x_sq = {x} * {x}\n{y}_s = {c(1.0)} / ({c(1.0)} + {neg_2u})\n"


def _gelu_code(approximate: str, ct: str):
    c = lambda v: const(v, ct)  # noqa: E731
    if approximate == "none":
        return lambda a, y: f"{y} = {a[0]} * {c(0.5)} * ({c(1.0)} + tl.math.erf({a[0]} * {c(_SQRT1_2)}))"
    return lambda a, y: _gelu_sigmoid(a[0], y, ct) + f"{y} = {a[0]} * {y}_s"


def _gelu_backward_code(approximate: str, ct: str):
    c = lambda v: const(v, ct)  # noqa: E731
    if approximate == "none":  # a[0] = grad, a[1] = input
        return lambda a, y: (
            f"{y}_cdf = {c(0.5)} * ({c(1.0)} + tl.math.erf({a[1]} * {c(_SQRT1_2)}))\n"
            f"{y}_pdf = {c(_GELU_ALPHA)} * tl.exp({a[1]} * {a[1]} * {c(-0.5)})\n"
            f"{y} = {a[0]} * ({y}_cdf + {a[1]} * {y}_pdf)"
        )
    # grad * (s + x s (1 - s) 2 beta (1 + 3 kappa x^2))
    return lambda a, y: _gelu_sigmoid(a[1], y, ct) + (
        f"{y}_slope = tl.fma({c(3.0 * _KAPPA * _GELU_2U)}, {y}_x_sq, {c(_GELU_2U)})\n"
        f"{y} = {a[0]} * tl.fma({a[1]} * {y}_s * ({c(1.0)} - {y}_s), {y}_slope, {y}_s)"
    )


def _tanh_helper(ct: str) -> str:
    return _TANH_F64 if ct == "f64" else _TANH_F32


@expression(*_BINARY, *_COMPARE, *_UNARY, nv.WhereOp, nv.GeluOp, nv.GeluBackwardOp)
def _arith(op) -> Expr:
    """Arithmetic, compares, where and activations; float math in the compute type."""
    ins, out = _dtypes(op)
    n = len(ins)
    ct = compute_tag(ins[-1])
    if isinstance(op, nv.WhereOp):
        return Expr(("raw",) * 3, tag(out), lambda a, y: f"{y} = tl.where({a[0]} != 0, {a[1]}, {a[2]})")
    if type(op) in _COMPARE:
        load = "raw" if ins[0] == torch.bool else "compute"  # bools compare as 0/1 bytes
        sym = _COMPARE[type(op)]
        return Expr((load, load), "i1", lambda a, y: f"{y} = {a[0]} {sym} {a[1]}")
    if tag(ins[0]) == "i64" and (type(op) in _INTEGER_BINARY or isinstance(op, nv.MaximumOp)):
        if isinstance(op, nv.MaximumOp):
            return Expr(("compute",) * 2, "i64", lambda a, y: f"{y} = tl.maximum({a[0]}, {a[1]})")
        sym = _INTEGER_BINARY[type(op)]
        return Expr(("compute",) * 2, "i64", lambda a, y: f"{y} = {a[0]} {sym} {a[1]}")
    if tag(ins[0]) not in _FLOATS:
        raise UnsupportedError(f"{op.name}: needs float operands, got {ins[0]}")
    if type(op) in _BINARY:
        body = _BINARY[type(op)]
        return Expr(("compute",) * n, ct, lambda a, y: body(a, y, ct), (_POW,) if isinstance(op, nv.PowOp) else ())
    if type(op) in _UNARY:
        body = _UNARY[type(op)]
        return Expr(("compute",), ct, lambda a, y: body(a, y, ct), (_tanh_helper(ct),) if isinstance(op, nv.TanhOp) else ())
    approx = op.props()["approximate"]
    code = _gelu_code(approx, ct) if isinstance(op, nv.GeluOp) else _gelu_backward_code(approx, ct)
    return Expr(("compute",) * n, ct, code)


@expression(nv.CastOp)
def _cast(op) -> Expr:
    """The value as stored, converted by the store (``convert``: torch's rounding)."""
    ins, _ = _dtypes(op)
    return Expr(("raw",), tag(ins[0]), lambda a, y: f"{y} = {a[0]}")


@expression(nv.FullOp)
def _full(op) -> Expr:
    _, out = _dtypes(op)
    value = torch.full((), op.props()["value"], dtype=out)  # the reference's own conversion
    return Expr((), tag(out), lambda a, y: f"{y} = {scalar_const(value)}")


@expression(nv.ArangeOp)
def _arange(op) -> Expr:
    """``start + step * i`` in int64, then converted like ``Tensor.to``."""
    p = op.props()
    return Expr((), "i64", lambda a, y: f"{y} = offs.to(tl.int64) * {int(p['step'])} + {int(p['start'])}")


@expression(nv.DropoutMaskOp)
def _dropout_mask(op) -> Expr:
    """Bit-exact with ``nova.rng.dropout_scale`` (the seed operand is a 0-d int64)."""
    _, out = _dtypes(op)
    p = op.props()
    prob, salt = float(p["p"]), int(p["salt"])
    threshold = rng.keep_threshold(prob)
    kept = rng.kept_value(prob, out)  # as the reference rounds it
    zero = torch.zeros((), dtype=out)
    salt_term = (salt * rng.SALT_MUL) & rng.M32

    def code(a, y):
        return f"""{y}_s = {a[0]}.to(tl.uint32)
{rng.triton_hash(f"{y}_x", "offs.to(tl.uint32)", f"{y}_s * {rng.SEED_MUL} + {salt_term}")}
{y} = tl.where(({y}_x >> 8) >= {threshold}, {scalar_const(kept)}, {scalar_const(zero)})"""

    return Expr(("raw",), tag(out), code)


# --------------------------------------------------------------------------- lowerings


def _types(op):
    ins = [(shape_of(v.type), to_torch_dtype(elem_of(v.type))) for v in op.operands]
    res = op.results[0].type
    return ins, shape_of(res), to_torch_dtype(elem_of(res))


def _short(dtype: torch.dtype) -> str:
    return tag(dtype) if dtype != torch.bool else "i1"


def _name(op, out_shape, out_dtype) -> str:
    return f"nova_{op.name.removeprefix('nova.')}_{shape_name(out_shape)}_{_short(out_dtype)}"


def merge_helpers(helpers: Sequence[str]) -> str:
    """The helper functions some expressions call, each once, in first-use order."""
    return "\n\n".join(h.strip("\n") for h in dict.fromkeys(helpers))


def lower_expression(op, cfg: LoweringConfig | None = None) -> Kernel:
    """One elementwise op as one kernel: its expression over operands read through
    their strides (any view works: needs_contiguous is empty). Ops without operands
    (full, arange) take ``launch([], outs)`` or ``launch([], device=...)`` (device
    defaults to CUDA when present)."""
    ins, out_shape, out_dtype = _types(op)
    e = expression_of(op)
    operands = [Operand(s, d, load=e.loads[k]) for k, (s, d) in enumerate(ins)]
    name = _name(op, out_shape, out_dtype)
    if isinstance(op, nv.DropoutMaskOp):
        name += f"_salt{int(op.props()['salt']) & rng.M32}"
    body = e.code([f"x{k}" for k in range(len(ins))], "y")
    pw = pointwise(name, out_shape, operands, body, e.tag, out_dtype, cfg, merge_helpers(e.helpers))
    return kernel_of(pw, cfg)


lower_elementwise = lowers(*_BINARY, *_COMPARE, *_UNARY, nv.WhereOp, nv.GeluOp, nv.GeluBackwardOp)(lower_expression)
lower_full = lowers(nv.FullOp)(lower_expression)
lower_arange = lowers(nv.ArangeOp)(lower_expression)
lower_dropout_mask = lowers(nv.DropoutMaskOp)(lower_expression)


def cast_pointwise(shape: Sequence[int], src: torch.dtype, dst: torch.dtype, cfg: LoweringConfig | None = None):
    name = f"nova_cast_{shape_name(shape)}_{_short(src)}_to_{_short(dst)}"
    return pointwise(name, shape, [Operand(tuple(shape), src, load="raw")], "y = x0", tag(src), dst, cfg)


def copy_pointwise(shape: Sequence[int], dtype: torch.dtype, cfg: LoweringConfig | None = None) -> Pointwise:
    name = f"nova_copy_{shape_name(shape)}_{_short(dtype)}"
    return pointwise(name, shape, [Operand(tuple(shape), dtype, load="raw")], "y = x0", tag(dtype), dtype, cfg)


def cast_kernel(shape: Sequence[int], src: torch.dtype, dst: torch.dtype, cfg: LoweringConfig | None = None) -> Kernel:
    """``launch([x])``: a ``src`` tensor of ``shape`` (any strides) converted to a new
    contiguous ``dst`` one, rounding like torch's ``Tensor.to``."""
    return kernel_of(cast_pointwise(shape, src, dst, cfg), cfg)


def copy_kernel(shape: Sequence[int], dtype: torch.dtype, cfg: LoweringConfig | None = None) -> Kernel:
    """``launch([x])``: a tensor of ``shape`` (any strides, offset, zero strides)
    copied into a new contiguous one."""
    return kernel_of(copy_pointwise(shape, dtype, cfg), cfg)


@lowers(nv.CastOp)
def lower_cast(op, cfg: LoweringConfig | None = None) -> Kernel:
    ins, out_shape, out_dtype = _types(op)
    return cast_kernel(out_shape, ins[0][1], out_dtype, cfg)


@lowers(nv.BroadcastToOp)
def lower_broadcast_to(op, cfg: LoweringConfig | None = None) -> Kernel:
    """A materialized broadcast (the backend normally uses a stride-0 view)."""
    ins, out_shape, out_dtype = _types(op)
    operand = Operand(ins[0][0], ins[0][1], load="raw")
    pw = pointwise(_name(op, out_shape, out_dtype), out_shape, [operand], "y = x0", tag(out_dtype), out_dtype, cfg)
    return kernel_of(pw, cfg)


@lowers(nv.TransposeOp)
def lower_transpose(op, cfg: LoweringConfig | None = None) -> Kernel:
    """A materialized permutation: the input is read through its permuted strides."""
    _, out_shape, out_dtype = _types(op)
    perm = op.props()["perm"]
    pw = copy_pointwise(out_shape, out_dtype, cfg)
    return kernel_of(pw, cfg, lambda xs, outs=None, device=None: [pw([xs[0].permute(perm)], out=only_out(outs))])


@lowers(nv.SliceOp)
def lower_slice(op, cfg: LoweringConfig | None = None) -> Kernel:
    """A strided copy: the input is read through the sliced view (offset, step * stride)."""
    _, out_shape, out_dtype = _types(op)
    p = op.props()
    pw = copy_pointwise(out_shape, out_dtype, cfg)

    def launch(xs, outs=None, device=None):
        idx = [slice(None)] * xs[0].dim()
        idx[p["dim"]] = slice(p["start"], p["end"], p["step"])
        return [pw([xs[0][tuple(idx)]], out=only_out(outs))]

    return kernel_of(pw, cfg, launch)


@lowers(nv.ReshapeOp)
def lower_reshape(op, cfg: LoweringConfig | None = None) -> Kernel:
    """A copy in the input's row-major order (iterating over the input's shape, the
    flat index is the output offset); the result is a view of that copy."""
    ins, out_shape, out_dtype = _types(op)
    pw = copy_pointwise(ins[0][0], out_dtype, cfg)

    def launch(xs, outs=None, device=None):
        out = only_out(outs)
        if out is None:
            return [pw([xs[0]]).view(out_shape)]
        pw([xs[0]], out=result_tensor(pw.name, out, out_shape, out_dtype, None).view(ins[0][0]))
        return [out]

    return kernel_of(pw, cfg, launch)


@lowers(nv.PadOp)
def lower_pad(op, cfg: LoweringConfig | None = None) -> Kernel:
    """Zeros with the input at start, start+step, ... along dim: each output element
    reads input index (i - start) / step where that is an integer in range."""
    ins, out_shape, out_dtype = _types(op)
    p = op.props()
    d, start, step = p["dim"], p["start"], p["step"]
    n = ins[0][0][d]
    if step == 1:
        index, mask = f"i{d} - {start}", f"(i{d} >= {start}) & (i{d} < {start + n})"
    else:
        index = f"(i{d} - {start}) // {step}"
        mask = f"(i{d} >= {start}) & (i{d} < {start + n * step}) & ((i{d} - {start}) % {step} == 0)"
    operand = Operand(ins[0][0], ins[0][1], load="raw", index=((d, index),), mask=mask)
    pw = pointwise(_name(op, out_shape, out_dtype), out_shape, [operand], "y = x0", tag(out_dtype), out_dtype, cfg)
    return kernel_of(pw, cfg)


@lowers(nv.CatOp)
def lower_cat(op, cfg: LoweringConfig | None = None) -> Kernel:
    """One kernel over the output: each element reads the one input whose window
    along dim holds it (masked loads of the others fetch nothing), through that
    input's own strides (a transposed or sliced view is read in place), and
    stores it unchanged: no zero-filled pads, no sum (which would turn -0.0 into
    +0.0), one pass over the bytes."""
    ins, out_shape, out_dtype = _types(op)
    d = op.props()["dim"]
    operands, start = [], 0
    for shape, dtype in ins:
        n = shape[d]
        mask = f"(i{d} >= {start}) & (i{d} < {start + n})" if len(ins) > 1 else ""
        operands.append(Operand(shape, dtype, load="raw", index=((d, f"i{d} - {start}"),) if start else (), mask=mask))
        start += n
    # every lane lies in exactly one window: the last input is the default, the others
    # replace it where their window is (m<k>: the masks of the loads; a masked-off
    # lane of a load reads 0, never used)
    lines = [f"y = x{len(ins) - 1}"] + [f"y = tl.where(m{k}, x{k}, y)" for k in range(len(ins) - 2, -1, -1)]
    name = f"nova_cat_{shape_name(out_shape)}_d{d}_{len(ins)}_{_short(out_dtype)}"
    pw = pointwise(name, out_shape, operands, "\n".join(lines), tag(out_dtype), out_dtype, cfg)
    return kernel_of(pw, cfg)


__all__ = [
    "Expr", "EXPRESSIONS", "expression", "expression_of", "lower_expression", "merge_helpers", "scalar_const",
    "Operand", "Pointwise", "pointwise", "pointwise_source", "copy_kernel", "cast_kernel", "copy_pointwise",
    "cast_pointwise", "UnsupportedError", "result_tensor", "only_out", "Chain", "Fusion",
    "lower_elementwise", "lower_cast", "lower_full", "lower_arange", "lower_dropout_mask", "lower_broadcast_to",
    "lower_transpose", "lower_slice", "lower_reshape", "lower_pad", "lower_cat",
]  # fmt: skip
