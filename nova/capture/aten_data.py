"""The op-mapping table, continued: boolean logic, bounds, prefix sums,
concatenation and padding, and indexing (gather, advanced indexing,
index_select), written in terms of the nova ops they decompose into.

These are the core-ATen ops that real model code reaches after PyTorch's own
decompositions (``capture`` runs those for every op without a converter):
masks built with ``&``, ``|`` and ``~``, position ids from ``cumsum``, label
shifting with ``pad``, rotary embeddings with ``cat``, token-type and
padding-mask gathers. Each converter builds only ops that already have a VJP
rule, a reference implementation and a Triton lowering, so none of them needs
backend code of its own:

* logic on i1 is ``where`` (``a & b`` = where(a, b, false)),
* ``cat`` is a sum of zero-padded parts (exact: x + 0 == x),
* gathers and advanced indexing compute a linear row index in i64 and read
  rows with ``embedding`` (whose backward is the scatter-add torch uses), with
  out-of-range indices sent to -1 so that the embedding's range check raises
  instead of reading a neighbouring element.
"""

from __future__ import annotations

import itertools
import math

import torch
from xdsl.dialects.builtin import i1, i64
from xdsl.ir import SSAValue

from nova.capture.aten import (Unsupported, _dim, _dims, _promote, _shape, as_bool, aten, cast_to, converts,
                               scalar_like)
from nova.ir import dialect as nv
from nova.ir.types import elem_of, from_torch_dtype, is_float, numel, tensor, to_torch_dtype

# --- boolean logic -----------------------------------------------------------


def _false(cx):
    return cx.b.full(0.0, (), i1)


def _true(cx):
    return cx.b.full(1.0, (), i1)


def _and(cx, a, b):
    return cx.b.where(a, b, _false(cx))


def _or(cx, a, b):
    return cx.b.where(a, _true(cx), b)


def _xor(cx, a, b):
    return cx.b.one(nv.NeOp, [a, b])


def _not(cx, a):
    return cx.b.one(nv.EqOp, [a, _false(cx)])


def _bitwise(fn, what):
    def convert(cx, a, b):
        for x in (a, b):
            if not isinstance(x, (SSAValue, bool)):
                raise Unsupported(f"bitwise {what} with the number {x!r} (only booleans)")
        a, b = (x if isinstance(x, SSAValue) else cx.b.full(float(x), (), i1) for x in (a, b))
        if elem_of(a.type) != i1 or elem_of(b.type) != i1:
            raise Unsupported(f"bitwise {what} of {a.type} and {b.type} (only booleans)")
        return fn(cx, a, b)

    return convert


def _logical(fn):
    def convert(cx, a, b):
        return fn(cx, as_bool(cx, a), as_bool(cx, b))

    return convert


converts(aten.bitwise_and.Tensor, aten.bitwise_and.Scalar, aten.__and__.Tensor)(_bitwise(_and, "and"))
converts(aten.bitwise_or.Tensor, aten.bitwise_or.Scalar, aten.__or__.Tensor)(_bitwise(_or, "or"))
converts(aten.bitwise_xor.Tensor, aten.bitwise_xor.Scalar, aten.__xor__.Tensor)(_bitwise(_xor, "xor"))
converts(aten.logical_and.default)(_logical(_and))
converts(aten.logical_or.default)(_logical(_or))
converts(aten.logical_xor.default)(_logical(_xor))


@converts(aten.logical_not.default)
def _logical_not(cx, x):
    return _not(cx, as_bool(cx, x))


@converts(aten.bitwise_not.default)
def _bitwise_not(cx, x):
    if elem_of(x.type) != i1:
        raise Unsupported(f"bitwise not of {x.type} (only booleans)")
    return _not(cx, x)


@converts(aten.any.default, aten.any.dim, aten.any.dims)
def _any(cx, x, dim=None, keepdim=False):
    flags = cx.b.cast(as_bool(cx, x), i64)
    dims = _reduce_dims(x, dim)
    m = cx.b.one(nv.ReduceMaxOp, [flags], {"dims": tuple(dims), "keepdim": keepdim}) if dims else flags
    return as_bool(cx, m)


@converts(aten.all.default, aten.all.dim, aten.all.dims)
def _all(cx, x, dim=None, keepdim=False):
    return _not(cx, _any(cx, _not(cx, as_bool(cx, x)), dim, keepdim))


def _reduce_dims(x, dim) -> list[int]:
    r = len(_shape(x))
    if dim is None:
        return list(range(r))
    dims = [dim] if isinstance(dim, int) else list(dim)
    return sorted({_dim(d, r) for d in dims}) if r else []


# --- bounds --------------------------------------------------------------------


def _neg(cx, x):
    return cx.b.neg(x) if is_float(x.type) else cx.b.sub(cx.b.scalar(0.0, x), x)


@converts(aten.minimum.default)
def _minimum(cx, a, b):
    a, b = _promote(cx, a, b)
    if elem_of(a.type) == i1:
        return _and(cx, a, b)
    # -max(-a, -b): NaN-propagating, and ties split the gradient as torch.minimum's do
    return _neg(cx, cx.b.one(nv.MaximumOp, [_neg(cx, a), _neg(cx, b)]))


def _bound(cx, x, bound, below: bool, strict: bool = False):
    if bound is None:
        return x
    bound = cx.b.cast(bound, elem_of(x.type)) if isinstance(bound, SSAValue) else scalar_like(cx, bound, x)
    # torch.clamp: the gradient passes where lo <= x <= hi (ties included);
    # hardtanh (strict): only where lo < x < hi
    cmp = (nv.LeOp if strict else nv.LtOp) if below else (nv.GeOp if strict else nv.GtOp)
    return cx.b.where(cx.b.one(cmp, [x, bound]), bound, x)


@converts(aten.clamp.default, aten.clamp.Tensor)
def _clamp(cx, x, min=None, max=None):
    if isinstance(min, SSAValue) or isinstance(max, SSAValue) or isinstance(min, float) or isinstance(max, float):
        if not is_float(x.type):
            raise Unsupported("clamp of an integer tensor with float or tensor bounds")
    return _bound(cx, _bound(cx, x, min, below=True), max, below=False)


@converts(aten.clamp_min.default, aten.clamp_min.Tensor)
def _clamp_min(cx, x, min):
    return _clamp(cx, x, min, None)


@converts(aten.clamp_max.default, aten.clamp_max.Tensor)
def _clamp_max(cx, x, max):
    return _clamp(cx, x, None, max)


@converts(aten.hardtanh.default)
def _hardtanh(cx, x, min_val=-1.0, max_val=1.0):
    return _bound(cx, _bound(cx, x, min_val, below=True, strict=True), max_val, below=False, strict=True)


@converts(aten.leaky_relu.default)
def _leaky_relu(cx, x, negative_slope=0.01):
    # torch: x > 0 ? x : x * slope, and the same split for the gradient
    positive = cx.b.one(nv.GtOp, [x, cx.b.scalar(0.0, x)])
    return cx.b.where(positive, x, cx.b.mul(x, scalar_like(cx, negative_slope, x)))


@converts(aten.abs.default)
def _abs(cx, x):
    if is_float(x.type):
        return cx.b.one(nv.AbsOp, [x])
    if elem_of(x.type) == i1:
        return x
    return cx.b.where(cx.b.one(nv.LtOp, [x, cx.b.scalar(0.0, x)]), _neg(cx, x), x)


@converts(aten.elu.default)
def _elu(cx, x, alpha=1.0, scale=1.0, input_scale=1.0):
    # torch: x > 0 ? x * scale : expm1(x * input_scale) * alpha * scale (SELU and CELU are ELUs)
    positive = cx.b.one(nv.GtOp, [x, cx.b.scalar(0.0, x)])
    inner = x if input_scale == 1 else cx.b.mul(x, scalar_like(cx, float(input_scale), x))
    neg = cx.b.mul(cx.b.one(nv.Expm1Op, [inner]), scalar_like(cx, float(alpha) * float(scale), x))
    return cx.b.where(positive, x if scale == 1 else cx.b.mul(x, scalar_like(cx, float(scale), x)), neg)


@converts(aten.isnan.default)
def _isnan(cx, x):
    return cx.b.one(nv.NeOp, [x, x]) if is_float(x.type) else cx.b.broadcast_to(_false(cx), _shape(x))


@converts(aten.isinf.default)
def _isinf(cx, x):
    if not is_float(x.type):
        return cx.b.broadcast_to(_false(cx), _shape(x))
    return cx.b.one(nv.EqOp, [cx.b.one(nv.AbsOp, [x]), cx.b.scalar(float("inf"), x)])


@converts(aten.isfinite.default)
def _isfinite(cx, x):
    if not is_float(x.type):
        return cx.b.broadcast_to(_true(cx), _shape(x))
    return _and(cx, cx.b.one(nv.EqOp, [x, x]), _not(cx, _isinf(cx, x)))


@converts(aten.linalg_vector_norm.default)
def _vector_norm(cx, x, ord=2, dim=None, keepdim=False, dtype=None):
    """The 2-norm sqrt(sum(x^2)) and the 1-norm sum(|x|) over ``dim``. torch's 2-norm gradient
    is 0 at a zero vector (``norm_backward`` masks it), where sqrt's would be 0 * inf: the sum
    goes through a where that keeps the zero vector's sqrt off its gradient path."""
    if dtype is not None:
        x = cast_to(cx, x, dtype)
    if not is_float(x.type):
        raise Unsupported(f"vector_norm of {x.type}")
    dims = _dims(x, dim)
    if float(ord) == 1.0:
        return cx.b.reduce_sum(cx.b.one(nv.AbsOp, [x]), dims, keepdim)
    if float(ord) != 2.0:
        raise Unsupported(f"vector_norm with ord={ord} (Nova takes 1 and 2)")
    total = cx.b.reduce_sum(cx.b.mul(x, x), dims, keepdim)
    zero = cx.b.one(nv.EqOp, [total, cx.b.scalar(0.0, total)])
    safe = cx.b.where(zero, cx.b.scalar(1.0, total), total)
    return cx.b.where(zero, cx.b.scalar(0.0, total), cx.b.one(nv.SqrtOp, [safe]))


# --- prefix sums -----------------------------------------------------------------


@converts(aten.cumsum.default)
def _cumsum(cx, x, dim, dtype=None):
    if dtype is not None:
        x = cast_to(cx, x, dtype)
    elif not is_float(x.type):
        x = cx.b.cast(x, i64)  # torch: cumsum of bool or int is int64
    r = len(_shape(x))
    return cx.b.one(nv.CumsumOp, [x], {"dim": _dim(dim, r), "reverse": False})


# --- concatenation and padding -------------------------------------------------------


def concat(cx, parts: list[SSAValue], dim: int) -> SSAValue:
    """torch.cat along ``dim`` (normalized) as a sum of zero-padded parts."""
    parts = [p for p in parts if _shape(p)[dim] != 0] or parts[:1]
    if len(parts) == 1:
        return parts[0]
    size = sum(_shape(p)[dim] for p in parts)
    start, acc = 0, None
    for p in parts:
        n = _shape(p)[dim]
        placed = cx.b.one(nv.PadOp, [p], {"dim": dim, "start": start, "step": 1, "size": size})
        start += n
        if acc is None:
            acc = placed
        elif elem_of(p.type) == i1:
            acc = _or(cx, acc, placed)
        else:
            acc = cx.b.add(acc, placed)
    return acc


@converts(aten.cat.default)
def _cat(cx, tensors, dim=0):
    tensors = list(tensors)
    # torch.cat skips 1-D empty tensors of any shape (legacy behaviour)
    tensors = [t for t in tensors if _shape(t) != (0,)] or tensors[:1]
    elem = tensors[0]
    for t in tensors[1:]:
        elem, _ = _promote(cx, elem, t)
    dtype = elem_of(elem.type)
    tensors = [cx.b.cast(t, dtype) if dtype != i1 else as_bool(cx, t) for t in tensors]
    return concat(cx, tensors, _dim(dim, len(_shape(tensors[0]))))


@converts(aten.constant_pad_nd.default)
def _constant_pad(cx, x, pad, value=0):
    if len(pad) % 2 or len(pad) // 2 > len(_shape(x)):
        raise Unsupported(f"pad {list(pad)} for a tensor of rank {len(_shape(x))}")
    r = len(_shape(x))
    for i in range(len(pad) // 2):
        d = r - 1 - i
        lo, hi = int(pad[2 * i]), int(pad[2 * i + 1])
        n = _shape(x)[d]
        if lo < 0 or hi < 0:  # negative padding crops
            start, end = max(-lo, 0), n - max(-hi, 0)
            x = cx.b.one(nv.SliceOp, [x], {"dim": d, "start": start, "end": max(end, start), "step": 1})
            lo, hi = max(lo, 0), max(hi, 0)
        parts = []
        for width in (lo, None, hi):
            if width is None:
                parts.append(x)
            elif width:
                shape = list(_shape(x))
                shape[d] = width
                parts.append(cx.b.full(float(value), shape, elem_of(x.type)))
        x = concat(cx, parts, d)
    return x


@converts(aten.copy.default)
def _copy(cx, dst, src, non_blocking=False):
    """Functional ``dst.copy_(src)``: ``src`` broadcast to ``dst``'s shape in its dtype
    (every element of ``dst`` is written over, so none is read)."""
    if not isinstance(src, SSAValue):
        src = scalar_like(cx, src, dst)
    v = cast_to(cx, src, to_torch_dtype(elem_of(dst.type)))
    return v if _shape(v) == _shape(dst) else cx.b.broadcast_to(v, list(_shape(dst)))


@converts(aten.slice_scatter.default)
def _slice_scatter(cx, x, src, dim=0, start=None, end=None, step=1):
    """``x`` with ``x[start:end:step]`` along ``dim`` replaced by ``src`` (what
    ``y[..., 1:] = z`` on a fresh tensor becomes): ``src`` padded to ``x``'s dim
    (the slice's adjoint), chosen where a padded mask of ones is set."""
    s = _shape(x)
    d = _dim(dim, len(s))
    start, end, step = slice(start, end, step).indices(s[d])
    n = len(range(start, end, step))
    src = cast_to(cx, src, to_torch_dtype(elem_of(x.type)))
    if len(_shape(src)) != len(s) or _shape(src)[d] != n:
        raise Unsupported(f"slice_scatter of a {list(_shape(src))} source into {n} elements of dim {d} of {list(s)}")
    if n == 0:
        return x
    props = {"dim": d, "start": start, "step": step, "size": s[d]}
    placed = cx.b.one(nv.PadOp, [src], props)
    ones = cx.b.full(1.0, [n if i == d else 1 for i in range(len(s))], i64)
    mask = as_bool(cx, cx.b.one(nv.PadOp, [ones], props))
    return cx.b.where(mask, placed, x)


@converts(aten.select_scatter.default)
def _select_scatter(cx, x, src, dim, index):
    """``x`` with ``x.select(dim, index)`` replaced by ``src`` (``y[..., 0] = v``)."""
    s = _shape(x)
    d = _dim(dim, len(s))
    i = index % s[d]
    return _slice_scatter(cx, x, cx.b.reshape(src, [1 if j == d else n for j, n in enumerate(s)]), d, i, i + 1)


@converts(aten.convolution.default)
def _convolution(cx, x, w, bias, stride, padding, dilation, transposed, output_padding, groups):
    """A convolution (1-, 2- or 3-D, any stride, zero padding, dilation and groups) as
    one matmul over its patches (im2col): the input zero-padded, one strided slice of
    it per kernel offset stacked after the channels, [N * out, C/g * kernel] per group
    times the weight [O/g, C/g * kernel]^T. A patch embedding (kernel == stride, no
    padding or dilation: ViT's, CLIP's) needs no slices: its patches are a reshape.
    A transposed convolution is the convolution it is the input gradient of (below)."""
    if transposed:
        return _transposed_convolution(cx, x, w, bias, stride, padding, dilation, output_padding, groups)
    k = [int(n) for n in _shape(w)[2:]]
    nd, g = len(k), int(groups)
    stride, padding, dilation = ([int(v) for v in t] for t in (stride, padding, dilation))
    n, c, *space = _shape(x)
    o = _shape(w)[0]
    if stride == k and not any(padding) and all(d == 1 for d in dilation):  # patches: a reshape
        out = [s // kk for s, kk in zip(space, k)]
        for d, (s, kk, m) in enumerate(zip(space, k, out)):
            if s != m * kk:  # torch leaves out the pixels past the last whole patch
                x = cx.b.one(nv.SliceOp, [x], {"dim": 2 + d, "start": 0, "end": m * kk, "step": 1})
        x = cx.b.reshape(x, [n, c, *(v for m, kk in zip(out, k) for v in (m, kk))])  # [N, C, m1, k1, m2, k2, ...]
        cols = cx.b.transpose(x, [0, *(2 + 2 * i for i in range(nd)), 1, *(3 + 2 * i for i in range(nd))])
    else:
        out = [(s + 2 * p - d * (kk - 1) - 1) // st + 1 for s, p, d, kk, st in zip(space, padding, dilation, k, stride)]
        if min(out) < 1:
            raise Unsupported(f"convolution with no output (input {space}, kernel {k}, padding {padding})")
        for d, p in enumerate(padding):
            if p:
                x = cx.b.one(nv.PadOp, [x], {"dim": 2 + d, "start": p, "step": 1, "size": space[d] + 2 * p})
        taps = []
        for offset in itertools.product(*(range(kk) for kk in k)):  # the weight's order: row-major over the kernel
            t = x
            for d, i in enumerate(offset):
                start = i * dilation[d]
                t = cx.b.one(nv.SliceOp, [t], {"dim": 2 + d, "start": start,
                                                "end": start + (out[d] - 1) * stride[d] + 1, "step": stride[d]})
            taps.append(cx.b.reshape(t, [n, c, 1, *out]))
        x = concat(cx, taps, 2) if len(taps) > 1 else taps[0]  # [N, C, kernel, out...]
        cols = cx.b.transpose(x, [0, *range(3, 3 + nd), 1, 2])  # [N, out..., C, kernel]
    rows, per = n * numel(out), c // g * numel(k)
    wk = cx.b.reshape(w, [g, o // g, per])
    if g == 1:
        y = cx.b.matmul(cx.b.reshape(cols, [rows, per]), cx.b.transpose(cx.b.reshape(wk, [o, per]), [1, 0]))
    else:  # [g, rows, per] @ [g, per, O/g], the groups' outputs side by side
        cols = cx.b.transpose(cx.b.reshape(cols, [rows, g, per]), [1, 0, 2])
        y = cx.b.reshape(cx.b.transpose(cx.b.matmul(cols, cx.b.transpose(wk, [0, 2, 1])), [1, 0, 2]), [rows, o])
    if bias is not None:
        y = cx.b.add(y, bias)
    return cx.b.transpose(cx.b.reshape(y, [n, *out, o]), [0, nd + 1, *range(1, nd + 1)])  # [N, O, out...]


# --- pooling -------------------------------------------------------------------------


def _pool_geometry(space, k, stride, padding, dilation, ceil_mode: bool) -> tuple[list[int], list[int]]:
    """(output sizes, extra right padding) of a pooling window walk, as ATen's
    ``pooling_output_shape`` computes them: with ``ceil_mode`` the last window may run past
    the padded input (never starting past it), which the extra padding covers."""
    out, extra = [], []
    for s, kk, st, p, d in zip(space, k, stride, padding, dilation):
        if p > kk // 2:
            raise Unsupported(f"pooling with padding {p} past half the kernel {kk} (eager refuses it too)")
        n = (s + 2 * p - d * (kk - 1) - 1 + (st - 1 if ceil_mode else 0)) // st + 1
        if ceil_mode and (n - 1) * st >= s + p:
            n -= 1
        if n < 1:
            raise Unsupported(f"pooling with no output (input {list(space)}, kernel {list(k)}, padding {list(padding)})")
        out.append(n)
        extra.append(max(0, (n - 1) * st + d * (kk - 1) + 1 - (s + 2 * p)))
    return out, extra


def _pool_taps(cx, x, k, stride, dilation, out, left, right) -> list[SSAValue]:
    """One [N, C, out...] strided slice of ``x`` per kernel offset, in row-major order over
    the kernel (the order eager walks a window in), after padding ``x`` by ``left`` and
    ``right`` zeros per spatial dim."""
    space = _shape(x)[2:]
    for d, (lo, hi) in enumerate(zip(left, right)):
        if lo or hi:
            x = cx.b.one(nv.PadOp, [x], {"dim": 2 + d, "start": lo, "step": 1, "size": space[d] + lo + hi})
    taps = []
    for offset in itertools.product(*(range(kk) for kk in k)):
        t = x
        for d, i in enumerate(offset):
            start = i * dilation[d]
            t = cx.b.one(nv.SliceOp, [t], {"dim": 2 + d, "start": start, "end": start + (out[d] - 1) * stride[d] + 1,
                                           "step": stride[d]})  # fmt: skip
        taps.append(t)
    return taps


def _pool_args(x, nd: int, kernel, stride, padding, dilation=1):
    """The input as [N, C, *space] (an unbatched [C, *space] gets a batch of 1) and the
    window's parameters, each a list of ``nd`` ints (eager's defaults: stride = kernel)."""
    def ints(v):
        v = [int(v)] if isinstance(v, int) else [int(e) for e in v]
        return v * nd if len(v) == 1 else v

    if len(_shape(x)) not in (nd + 1, nd + 2):
        raise Unsupported(f"{nd}-D pooling of a rank-{len(_shape(x))} input")
    k = ints(kernel)
    return k, ints(stride) if stride not in (None, [], ()) else k, ints(padding), ints(dilation)


def _batched(cx, x, nd: int):
    return (cx.b.reshape(x, [1, *_shape(x)]), True) if len(_shape(x)) == nd + 1 else (x, False)


def _max_pool(nd: int):
    def convert(cx, x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
        """Max pooling as a chain over the window's taps: a tap replaces the running
        maximum where it is greater or NaN (eager's ``val > max || isnan(val)``: the first
        of equal maxima wins, and so gets the gradient, through each ``where``), its flat
        index in the input's spatial dims carried alongside (the op's second result).
        Padding never wins (-inf)."""
        k, st, pad, dil = _pool_args(x, nd, kernel_size, stride, padding, dilation)
        x, unbatched = _batched(cx, x, nd)
        space = list(_shape(x)[2:])
        out, extra = _pool_geometry(space, k, st, pad, dil, bool(ceil_mode))
        right = [p + e for p, e in zip(pad, extra)]
        elem = elem_of(x.type)
        # which padded positions hold input, and each one's flat index: static, folded at compile time
        inside = cx.b.full(1.0, [1, 1, *space], elem)
        flat = cx.b.reshape(cx.b.one(nv.ArangeOp, [], {"start": 0, "step": 1}, tensor([numel(space)], i64)),
                            [1, 1, *space])  # fmt: skip
        taps = _pool_taps(cx, x, k, st, dil, out, pad, right)
        masks = _pool_taps(cx, inside, k, st, dil, out, pad, right)
        where = _pool_taps(cx, flat, k, st, dil, out, pad, right)
        low = cx.b.full(float("-inf"), (), elem)
        best, at = None, None
        for t, m, i in zip(taps, masks, where, strict=True):
            t = cx.b.where(cx.b.one(nv.GtOp, [m, cx.b.full(0.5, (), elem)]), t, low)
            if best is None:
                best, at = t, cx.b.broadcast_to(i, _shape(t))
                continue
            take = _or(cx, cx.b.one(nv.GtOp, [t, best]), cx.b.one(nv.NeOp, [t, t]))
            best, at = cx.b.where(take, t, best), cx.b.where(take, i, at)
        if unbatched:
            best, at = cx.b.reshape(best, _shape(best)[1:]), cx.b.reshape(at, _shape(at)[1:])
        return best, at

    return convert


def _avg_pool(nd: int):
    def convert(cx, x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True,
                divisor_override=None):  # fmt: skip
        """Average pooling: the window's taps summed in eager's order (zero padding adds
        nothing), divided by eager's count: the window's positions inside the padded input
        (``count_include_pad``), or inside the input, or ``divisor_override``."""
        k, st, pad, dil = _pool_args(x, nd, kernel_size, stride, padding)
        x, unbatched = _batched(cx, x, nd)
        space = list(_shape(x)[2:])
        out, extra = _pool_geometry(space, k, st, pad, dil, bool(ceil_mode))
        right = [p + e for p, e in zip(pad, extra)]
        taps = _pool_taps(cx, x, k, st, dil, out, pad, right)
        total = taps[0]
        for t in taps[1:]:
            total = cx.b.add(total, t)
        elem = elem_of(x.type)
        if divisor_override is not None:
            count = cx.b.full(float(divisor_override), (), elem)
        else:  # static: folded at compile time
            if count_include_pad:
                region = cx.b.full(1.0, [1, 1, *(s + 2 * p for s, p in zip(space, pad))], elem)
                counted = _pool_taps(cx, region, k, st, dil, out, [0] * nd, extra)
            else:
                counted = _pool_taps(cx, cx.b.full(1.0, [1, 1, *space], elem), k, st, dil, out, pad, right)
            count = counted[0]
            for c in counted[1:]:
                count = cx.b.add(count, c)
        y = cx.b.div(total, count)
        return cx.b.reshape(y, _shape(y)[1:]) if unbatched else y

    return convert


def _adaptive_avg_pool(nd: int):
    def convert(cx, x, output_size):
        """Adaptive average pooling: where every output size divides its input size, the
        average pooling of kernel = stride = input / output (eager's windows then are those);
        else eager's windows [floor(i * n / m), ceil((i + 1) * n / m)) of unequal lengths, summed
        one dim at a time from the last (their taps gathered, past a window's end 0) and divided
        by the window's size."""
        out = [int(v) for v in output_size]
        space = _shape(x)[-nd:]
        if any(o < 1 for o in out):
            raise Unsupported(f"adaptive average pooling to {out}")
        if not any(s % o for s, o in zip(space, out)):
            k = [s // o for s, o in zip(space, out)]
            return _avg_pool(nd)(cx, x, k, k)
        r = len(_shape(x))
        size = None
        for d in reversed(range(nd)):
            n, m, dim = space[d], out[d], r - nd + d
            starts = [i * n // m for i in range(m)]
            ends = [-(-(i + 1) * n // m) for i in range(m)]
            total = None
            for j in range(max(e - b for b, e in zip(starts, ends))):
                idx = _index_vector(cx, [min(b + j, e - 1) for b, e in zip(starts, ends)])
                inside = _index_vector(cx, [1 if b + j < e else 0 for b, e in zip(starts, ends)])
                along = [1] * r
                along[dim] = m
                keep = cx.b.reshape(cx.b.one(nv.EqOp, [inside, _i64(cx, 1)]), along)
                tap = cx.b.where(keep, _index_select(cx, x, dim, idx), cx.b.scalar(0.0, x))
                total = tap if total is None else cx.b.add(total, tap)
            count = cx.b.reshape(cx.b.cast(_index_vector(cx, [e - b for b, e in zip(starts, ends)]), elem_of(x.type)),
                                 [m if k == dim else 1 for k in range(r)])  # fmt: skip
            size = count if size is None else cx.b.mul(size, count)
            x = total
        return cx.b.div(x, size)

    return convert


def _index_vector(cx, values: list[int]) -> SSAValue:
    """A static i64 vector: a sum of one-hot pads of 0-d constants (folded at compile time)."""
    n = len(values)
    acc = None
    for k, v in enumerate(values):
        if v == 0:
            continue
        one = cx.b.one(nv.PadOp, [cx.b.reshape(_i64(cx, v), [1])], {"dim": 0, "start": k, "step": 1, "size": n})
        acc = one if acc is None else cx.b.add(acc, one)
    return acc if acc is not None else cx.b.full(0.0, [n], i64)


def _nearest_sources(cx, n_in: int, n_out: int, scale) -> SSAValue:
    """The source index of each of ``n_out`` nearest-upsampled positions where the size
    neither stays nor doubles, as ATen's ``nearest_idx`` computes it: ``min(floor(i * s),
    n_in - 1)`` in f32, s = (float)(1 / scale) where a scale is given, else n_in / n_out in
    float division."""
    if scale:
        s = torch.tensor(1.0 / scale, dtype=torch.float32)
    else:
        s = torch.tensor(float(n_in), dtype=torch.float32) / torch.tensor(float(n_out), dtype=torch.float32)
    f32 = from_torch_dtype(torch.float32)
    i = cx.b.one(nv.ArangeOp, [], {"start": 0, "step": 1}, tensor([n_out], i64))
    src = cx.b.cast(cx.b.mul(cx.b.cast(i, f32), cx.b.full(s.item(), (), f32)), i64)  # i * s >= 0: the cast floors
    top = _i64(cx, n_in - 1)
    return cx.b.where(cx.b.one(nv.GtOp, [src, top]), top, src)


def _upsampled_sizes(space, output_size, scale_factors) -> tuple[list[int], list]:
    """(output sizes, per-dim scale or None) of an upsampling ``.vec`` op: its output_size,
    else floor(input * scale), the scales then passed on to the index math as eager does."""
    if output_size is not None:
        return [int(v) for v in output_size], [None] * len(space)
    scales = [float(f) for f in scale_factors]
    return [int(math.floor(s * f)) for s, f in zip(space, scales)], scales


def _upsample_nearest(nd: int):
    def convert(cx, x, output_size=None, scale_factors=None):
        """Nearest upsampling (``F.interpolate(mode="nearest")``), dim by dim as eager's
        ``nearest_idx``: a size kept is the input, a size doubled each source twice (a
        broadcast), any other size an index_select of the sources above."""
        space = _shape(x)[-nd:]
        out, scales = _upsampled_sizes(space, output_size, scale_factors)
        r = len(_shape(x))
        for d, (n_in, n_out, f) in enumerate(zip(space, out, scales)):
            dim = r - nd + d
            if n_out == n_in:
                continue
            if n_out == 2 * n_in:
                s = list(_shape(x))
                wide = cx.b.broadcast_to(cx.b.reshape(x, [*s[: dim + 1], 1, *s[dim + 1 :]]), [*s[: dim + 1], 2, *s[dim + 1 :]])
                x = cx.b.reshape(wide, [*s[:dim], n_out, *s[dim + 1 :]])
            else:
                x = _index_select(cx, x, dim, _nearest_sources(cx, n_in, n_out, f))
        return x

    return convert


def _linear_taps(cx, n_in: int, n_out: int, align: bool, scale, elem):
    """The two source indices and weights of each of ``n_out`` linearly upsampled positions,
    as ATen's CPU kernel computes them (``compute_source_index_and_lambda``) in the input's
    float type: the ratio (n_in - 1) / (n_out - 1) with ``align_corners``, else 1 / scale or
    n_in / n_out; the source ratio * i, or max(ratio * (i + 0.5) - 0.5, 0); i0 its floor
    (at most n_in - 1), i1 the next index (not past the end), l1 = clamp(src - i0, 0, 1),
    l0 = 1 - l1."""
    dtype = to_torch_dtype(elem)
    if align:
        ratio = (torch.tensor(float(n_in - 1), dtype=dtype) / (n_out - 1)).item() if n_out > 1 else 0.0
    elif scale:
        ratio = torch.tensor(1.0 / scale, dtype=dtype).item()
    else:
        ratio = (torch.tensor(float(n_in), dtype=dtype) / n_out).item()
    i = cx.b.cast(cx.b.one(nv.ArangeOp, [], {"start": 0, "step": 1}, tensor([n_out], i64)), elem)
    if align:
        src = cx.b.mul(cx.b.full(ratio, (), elem), i)
    else:
        src = cx.b.sub(cx.b.mul(cx.b.full(ratio, (), elem), cx.b.add(i, cx.b.full(0.5, (), elem))), cx.b.full(0.5, (), elem))
        src = cx.b.where(cx.b.one(nv.LtOp, [src, cx.b.full(0.0, (), elem)]), cx.b.full(0.0, (), elem), src)
    top = _i64(cx, n_in - 1)
    i0 = cx.b.cast(src, i64)  # src >= 0: the cast floors
    i0 = cx.b.where(cx.b.one(nv.GtOp, [i0, top]), top, i0)
    i1 = cx.b.where(cx.b.one(nv.LtOp, [i0, top]), cx.b.add(i0, _i64(cx, 1)), i0)
    l1 = cx.b.sub(src, cx.b.cast(i0, elem))
    l1 = cx.b.where(cx.b.one(nv.LtOp, [l1, cx.b.full(0.0, (), elem)]), cx.b.full(0.0, (), elem), l1)
    l1 = cx.b.where(cx.b.one(nv.GtOp, [l1, cx.b.full(1.0, (), elem)]), cx.b.full(1.0, (), elem), l1)
    return i0, i1, cx.b.sub(cx.b.full(1.0, (), elem), l1), l1


def _upsample_linear(nd: int):
    def convert(cx, x, output_size=None, align_corners=False, scale_factors=None):
        """Linear, bilinear and trilinear upsampling, one dim at a time from the last (eager's
        nesting: the last dim's two taps interpolated first), each output the sum of its two
        sources' products with their weights (``_linear_taps``)."""
        if not is_float(x.type):
            raise Unsupported(f"linear upsampling of {x.type}")
        space = _shape(x)[-nd:]
        out, scales = _upsampled_sizes(space, output_size, scale_factors)
        r = len(_shape(x))
        elem = elem_of(x.type)
        for d in reversed(range(nd)):
            n_in, n_out, dim = space[d], out[d], r - nd + d
            if n_out == n_in:
                continue
            i0, i1, l0, l1 = _linear_taps(cx, n_in, n_out, bool(align_corners), scales[d], elem)
            along = [1] * r
            along[dim] = n_out
            x = cx.b.add(cx.b.mul(_index_select(cx, x, dim, i0), cx.b.reshape(l0, along)),
                         cx.b.mul(_index_select(cx, x, dim, i1), cx.b.reshape(l1, along)))  # fmt: skip
        return x

    return convert


converts(aten.upsample_linear1d.vec)(_upsample_linear(1))
converts(aten.upsample_bilinear2d.vec)(_upsample_linear(2))
converts(aten.upsample_trilinear3d.vec)(_upsample_linear(3))
for _nd in (1, 2, 3):
    converts(getattr(aten, f"max_pool{_nd}d_with_indices").default)(_max_pool(_nd))
    converts(getattr(aten, f"avg_pool{_nd}d").default)(_avg_pool(_nd))
    converts(getattr(aten, f"upsample_nearest{_nd}d").vec)(_upsample_nearest(_nd))
for _nd in (2, 3):
    converts(getattr(aten, f"_adaptive_avg_pool{_nd}d").default)(_adaptive_avg_pool(_nd))
converts(aten.adaptive_avg_pool1d.default)(_adaptive_avg_pool(1))


def _transposed_convolution(cx, x, w, bias, stride, padding, dilation, output_padding, groups):
    """A transposed convolution as a plain one (stride 1, the same dilation and groups): the
    input spread ``stride`` apart (a stepped ``nova.pad``: zeros between the elements), padded by
    ``dilation * (kernel - 1) - padding`` each side (sliced where that is negative) and by
    ``output_padding`` more on the right; the weight [C_in, C_out / g, k...] as [C_out, C_in / g,
    k...] per group, flipped along the kernel. It computes the products on the zeros too: correct,
    not a tuned kernel."""
    k = [int(n) for n in _shape(w)[2:]]
    nd, g = len(k), int(groups)
    stride, padding, dilation, extra = ([int(v) for v in t] for t in (stride, padding, dilation, output_padding))
    for d in range(nd):
        n = _shape(x)[2 + d]
        if stride[d] > 1 and n > 1:
            x = cx.b.one(nv.PadOp, [x], {"dim": 2 + d, "start": 0, "step": stride[d], "size": (n - 1) * stride[d] + 1})
        n = _shape(x)[2 + d]
        edge = dilation[d] * (k[d] - 1) - padding[d]
        lo, hi = edge, edge + extra[d]
        if lo < 0 or hi < 0:  # a negative padding crops
            start, end = max(0, -lo), n - max(0, -hi)
            if end <= start:
                raise Unsupported(f"transposed convolution with no output (input {_shape(x)[2:]}, kernel {k})")
            x = cx.b.one(nv.SliceOp, [x], {"dim": 2 + d, "start": start, "end": end, "step": 1})
            lo, hi = max(lo, 0), max(hi, 0)
        if lo or hi:
            x = cx.b.one(nv.PadOp, [x], {"dim": 2 + d, "start": lo, "step": 1, "size": _shape(x)[2 + d] + lo + hi})
    cin, cout_g = _shape(w)[:2]
    wt = cx.b.reshape(w, [g, cin // g, cout_g, *k])
    wt = cx.b.reshape(cx.b.transpose(wt, [0, 2, 1, *range(3, 3 + nd)]), [g * cout_g, cin // g, *k])
    wt = _flip(cx, wt, list(range(2, 2 + nd)))
    return _convolution(cx, x, wt, bias, [1] * nd, [0] * nd, dilation, False, [0] * nd, g)


@converts(aten.repeat.default)
def _repeat(cx, x, repeats):
    s = list(_shape(x))
    repeats = [int(r) for r in repeats]
    if len(repeats) < len(s):
        raise Unsupported("repeat with fewer repeats than dimensions")
    s = [1] * (len(repeats) - len(s)) + s
    inter = [v for n in s for v in (1, n)]
    wide = [v for r, n in zip(repeats, s) for v in (r, n)]
    y = cx.b.broadcast_to(cx.b.reshape(x, inter), wide)
    return cx.b.reshape(y, [r * n for r, n in zip(repeats, s)])


# --- indexing --------------------------------------------------------------------


def _i64(cx, value: int):
    return cx.b.full(float(value), (), i64)


def _in_range(cx, idx: SSAValue, n: int, wrap: bool) -> SSAValue:
    """``idx`` with negatives wrapped (advanced indexing) and anything still
    outside [0, n) sent to -1, which the embedding's range check rejects."""
    if elem_of(idx.type) != i64:
        if is_float(idx.type) or elem_of(idx.type) == i1:
            raise Unsupported(f"indexing with a {idx.type} index (boolean masks select a data-dependent number of elements)")
        idx = cx.b.cast(idx, i64)
    if wrap:
        idx = cx.b.where(cx.b.one(nv.LtOp, [idx, _i64(cx, 0)]), cx.b.add(idx, _i64(cx, n)), idx)
    ok = _and(cx, cx.b.one(nv.GeOp, [idx, _i64(cx, 0)]), cx.b.one(nv.LtOp, [idx, _i64(cx, n)]))
    return cx.b.where(ok, idx, _i64(cx, -1))


def _rows(cx, table: SSAValue, flat_idx: SSAValue) -> SSAValue:
    """table [R, C...] read at row indices of any shape -> [*idx, C...]."""
    s = _shape(table)
    rest = list(s[1:])
    two_d = cx.b.reshape(table, [s[0], numel(rest)])
    out = cx.b.one(nv.EmbeddingOp, [two_d, flat_idx], {"padding_idx": -1})
    return cx.b.reshape(out, [*_shape(flat_idx), *rest])


def _linear_index(cx, idxs: list[SSAValue], dims: list[int]) -> SSAValue:
    """sum_i idx_i * stride_i over a block of dims sizes ``dims`` (row-major)."""
    acc = None
    stride = 1
    for idx, n in reversed(list(zip(idxs, dims, strict=True))):
        term = idx if stride == 1 else cx.b.mul(idx, _i64(cx, stride))
        acc = term if acc is None else cx.b.add(acc, term)
        stride *= n
    return acc


@converts(aten.index.Tensor)
def _index(cx, x, indices):
    s = _shape(x)
    indices = list(indices)
    while indices and indices[-1] is None:
        indices.pop()
    used = [i for i, t in enumerate(indices) if t is not None]
    if not used:
        return x
    first, last = used[0], used[-1]
    if used != list(range(first, last + 1)):
        raise Unsupported("advanced indexing with index tensors on non-adjacent dimensions")
    if len(indices) > len(s):
        raise Unsupported(f"{len(indices)} indices for a tensor of rank {len(s)}")
    block = list(range(first, last + 1))
    idxs = [_in_range(cx, indices[d], s[d], wrap=True) for d in block]
    bshape = _broadcast_shape([_shape(i) for i in idxs])
    idxs = [cx.b.broadcast_to(i, bshape) if _shape(i) != bshape else i for i in idxs]
    flat = _linear_index(cx, idxs, [s[d] for d in block])
    for i in idxs:  # one invalid coordinate makes the whole position invalid
        flat = cx.b.where(cx.b.one(nv.LtOp, [i, _i64(cx, 0)]), _i64(cx, -1), flat)
    # move the indexed block to the front, read rows, move the kept leading dims back
    lead = list(range(first))
    perm = block + lead + list(range(last + 1, len(s)))
    front = cx.b.transpose(x, perm)
    fs = _shape(front)
    table = cx.b.reshape(front, [numel(fs[: len(block)]), *fs[len(block) :]])
    out = _rows(cx, table, flat)  # [*bshape, *lead dims, *rest]
    nb = len(bshape)
    if not lead:
        return out
    r = len(_shape(out))
    back = list(range(nb, nb + len(lead))) + list(range(nb)) + list(range(nb + len(lead), r))
    return cx.b.transpose(out, back)


def _broadcast_shape(shapes):
    from nova.ir.types import broadcast_shapes

    try:
        return list(broadcast_shapes(*shapes))
    except ValueError as e:
        raise Unsupported(f"index tensors of shapes {shapes} do not broadcast") from e


@converts(aten.index_select.default)
def _index_select(cx, x, dim, index):
    d = _dim(dim, len(_shape(x)))
    if len(_shape(index)) > 1:
        raise Unsupported("index_select with a multi-dimensional index")
    idx = _in_range(cx, cx.b.reshape(index, [numel(_shape(index))]), _shape(x)[d], wrap=False)
    return _index(cx, x, [None] * d + [idx])


@converts(aten.gather.default)
def _gather(cx, x, dim, index, sparse_grad=False):
    s, si = _shape(x), _shape(index)
    r = len(s)
    d = _dim(dim, r)
    if len(si) != r:
        raise Unsupported(f"gather with an index of rank {len(si)} for a tensor of rank {r}")
    if any(si[i] > s[i] for i in range(r) if i != d):
        raise Unsupported(f"gather with an index {si} larger than the input {s} outside dim {d}")
    idx = _in_range(cx, index, s[d], wrap=False)
    # out[i..] = x[i.., index[i..], ..]: every other dim is the output position itself
    coords = []
    for i in range(r):
        if i == d:
            coords.append(idx)
        else:
            shape = [1] * r
            shape[i] = si[i]
            ar = cx.b.one(nv.ArangeOp, [], {"start": 0, "step": 1}, tensor([si[i]], i64))
            coords.append(cx.b.broadcast_to(cx.b.reshape(ar, shape), list(si)))
    flat = _linear_index(cx, coords, list(s))
    # invalid positions must stay invalid after adding the other coordinates
    flat = cx.b.where(cx.b.one(nv.LtOp, [idx, _i64(cx, 0)]), _i64(cx, -1), flat)
    return cx.b.reshape(_rows(cx, cx.b.reshape(x, [numel(s), 1]), flat), list(si))



@converts(aten.flip.default)
def _flip(cx, x, dims):
    s = _shape(x)
    for d in sorted({_dim(d, len(s)) for d in dims}):
        n = s[d]
        if n > 1:
            rev = cx.b.one(nv.ArangeOp, [], {"start": n - 1, "step": -1}, tensor([n], i64))
            x = _index(cx, x, [None] * d + [rev])
    return x
