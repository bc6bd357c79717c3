"""The op-mapping table: ATen ops (as torch.export records them) -> nova IR.

Each converter receives the capture context and the node's arguments with
tensors already replaced by SSA values, and returns the SSA value(s) of the
node's result. A converter raises ``Unsupported`` for arguments Nova does not
handle (an attention mask, label smoothing, ...); capture collects those and
reports them all at once.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence

import torch
from xdsl.dialects.builtin import i1, i64
from xdsl.ir import SSAValue

from nova.ir import dialect as nv
from nova.ir.builder import OpBuilder
from nova.ir.types import elem_of, from_torch_dtype, is_float, numel, shape_of, tensor, to_torch_dtype

aten = torch.ops.aten


class Unsupported(Exception):
    """An op or argument Nova cannot compile (message says which)."""


class Ctx:
    """What converters need besides their arguments."""

    def __init__(self, b: OpBuilder, seed: Callable[[], SSAValue]):
        self.b = b
        self._seed = seed
        self.salt = 0

    def seed(self) -> SSAValue:
        return self._seed()


Converter = Callable[..., SSAValue | tuple[SSAValue, ...]]
CONVERTERS: dict[object, Converter] = {}
# ops that only assert metadata and produce nothing the step needs
IGNORED = {aten._assert_tensor_metadata.default, aten._assert_scalar.default}


def converts(*targets):
    def register(fn):
        for t in targets:
            CONVERTERS[t] = fn
        return fn

    return register


# --- helpers ---------------------------------------------------------------


def _shape(v: SSAValue) -> tuple[int, ...]:
    return shape_of(v.type)


def _dim(d: int, rank: int) -> int:
    return d % rank if rank else 0


# int32, int16, int8 and uint8 are captured as i64: the importer proves every value eager computes
# in one of them stays in its range (nova/capture/int_range.py), so the wider arithmetic is exact
WIDENED_INTS = {torch.int32: torch.int64, torch.int16: torch.int64, torch.int8: torch.int64, torch.uint8: torch.int64}


def int_span(dtype: torch.dtype) -> tuple[int, int]:
    """A widened integer dtype's range, where eager's arithmetic would wrap outside it."""
    info = torch.iinfo(dtype)
    return int(info.min), int(info.max)


def capture_elem(dtype: torch.dtype):
    """The nova element type of a torch dtype an op asks for (int32, int16, int8, uint8 as i64)."""
    return from_torch_dtype(WIDENED_INTS.get(dtype, dtype))


def default_float():
    """torch's default dtype as a nova element type (ints meeting a float scalar become it)."""
    return from_torch_dtype(torch.get_default_dtype())


def scalar_like(cx: Ctx, value, like: SSAValue) -> SSAValue:
    """A 0-d constant of ``like``'s element type holding the Python ``value``."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 2**53:
        raise Unsupported(f"integer constant {value} is not exactly representable (nova constants are f64)")
    return cx.b.full(float(value), (), elem_of(like.type))


def _promote(cx: Ctx, a, b) -> tuple[SSAValue, SSAValue]:
    """torch's type promotion for two operands, Python scalars included."""
    if not isinstance(a, SSAValue):
        a, b = b, a
        swapped = True
    else:
        swapped = False
    if not isinstance(b, SSAValue):
        # a Python scalar takes the tensor's type unless it is of a higher
        # category: a float meets an integral tensor (default float dtype), an
        # int meets a bool tensor (int64)
        elem = elem_of(a.type)
        if isinstance(b, float) and not is_float(a.type):
            elem = default_float()
        elif isinstance(b, int) and not isinstance(b, bool) and elem == i1:
            elem = i64
        a = cx.b.cast(a, elem)
        b = scalar_like(cx, b, a)
    else:
        ta, tb = to_torch_dtype(elem_of(a.type)), to_torch_dtype(elem_of(b.type))
        if ta != tb:
            # 0-d tensors do not promote dimensioned tensors of the same category
            if _shape(b) == () and _shape(a) != () and is_float(b.type) == is_float(a.type):
                target = ta
            elif _shape(a) == () and _shape(b) != () and is_float(b.type) == is_float(a.type):
                target = tb
            else:
                target = torch.promote_types(ta, tb)
            a, b = cx.b.cast(a, from_torch_dtype(target)), cx.b.cast(b, from_torch_dtype(target))
    return (b, a) if swapped else (a, b)


def _binary(op_cls, true_division: bool = False):
    def convert(cx: Ctx, a, b, alpha=1):
        if not isinstance(a, SSAValue) and not isinstance(b, SSAValue):
            raise Unsupported(f"{op_cls.name} of two Python scalars")
        a, b = _promote(cx, a, b)
        if not is_float(a.type):
            if true_division or op_cls is nv.PowOp:
                # torch: integer / integer is true division in the default float dtype
                a, b = cx.b.cast(a, default_float()), cx.b.cast(b, default_float())
            elif elem_of(a.type) == i1:
                raise Unsupported(f"{op_cls.name} of boolean tensors (use logical ops, or cast to an integer first)")
        if alpha != 1:
            b = cx.b.mul(b, scalar_like(cx, alpha, b))
        return cx.b.one(op_cls, [a, b])

    return convert


converts(aten.add.Tensor, aten.add.Scalar)(_binary(nv.AddOp))
converts(aten.sub.Tensor, aten.sub.Scalar)(_binary(nv.SubOp))
converts(aten.mul.Tensor, aten.mul.Scalar)(_binary(nv.MulOp))
converts(aten.div.Tensor, aten.div.Scalar)(_binary(nv.DivOp, true_division=True))
converts(aten.maximum.default)(_binary(nv.MaximumOp))
converts(aten.pow.Tensor_Tensor, aten.pow.Scalar)(_binary(nv.PowOp))  # pow.Scalar: a Python base, a tensor exponent


@converts(aten.reciprocal.default)
def _reciprocal(cx, x):
    return _binary(nv.DivOp, true_division=True)(cx, 1.0, x)  # 1 / x, as torch's kernel divides


@converts(aten.pow.Tensor_Scalar)
def _pow_scalar(cx, x, exponent):
    # torch computes these exponents with plain multiplications and roots (its
    # pow kernel's fast paths), which round differently from exp/log pow
    if is_float(x.type) and not isinstance(exponent, bool) and exponent in (2, 3, 0.5, -0.5, -1, -2):
        e = float(exponent)
        if e == 2:
            return cx.b.mul(x, x)
        if e == 3:
            return cx.b.mul(cx.b.mul(x, x), x)
        if e == 0.5:
            return cx.b.one(nv.SqrtOp, [x])
        if e == -0.5:
            return cx.b.one(nv.RsqrtOp, [x])
        one = cx.b.scalar(1.0, x)
        return cx.b.div(one, x if e == -1 else cx.b.mul(x, x))
    return _binary(nv.PowOp)(cx, x, exponent)
converts(operator.add)(_binary(nv.AddOp))
converts(operator.mul)(_binary(nv.MulOp))


@converts(aten.rsub.Scalar, aten.rsub.Tensor)
def _rsub(cx, a, b, alpha=1):
    return _binary(nv.SubOp)(cx, b, cx.b.mul(a, scalar_like(cx, alpha, a)) if alpha != 1 else a)


def _compare(op_cls):
    def convert(cx: Ctx, a, b):
        a, b = _promote(cx, a, b)
        return cx.b.one(op_cls, [a, b])

    return convert


converts(aten.eq.Scalar, aten.eq.Tensor)(_compare(nv.EqOp))
converts(aten.ne.Scalar, aten.ne.Tensor)(_compare(nv.NeOp))
converts(aten.lt.Scalar, aten.lt.Tensor)(_compare(nv.LtOp))
converts(aten.le.Scalar, aten.le.Tensor)(_compare(nv.LeOp))
converts(aten.gt.Scalar, aten.gt.Tensor)(_compare(nv.GtOp))
converts(aten.ge.Scalar, aten.ge.Tensor)(_compare(nv.GeOp))


def _unary(op_cls):
    def convert(cx: Ctx, x):
        if not is_float(x.type):
            if op_cls is nv.NegOp and elem_of(x.type) == i64:
                return cx.b.sub(cx.b.scalar(0.0, x), x)
            if op_cls is nv.ReluOp and elem_of(x.type) == i64:
                return cx.b.one(nv.MaximumOp, [x, cx.b.scalar(0.0, x)])
            x = cx.b.cast(x, default_float())  # torch: exp, log, sin, ... of integers are floats
        return cx.b.one(op_cls, [x])

    return convert


for _t, _c in [
    (aten.neg.default, nv.NegOp), (aten.exp.default, nv.ExpOp), (aten.log.default, nv.LogOp),
    (aten.sqrt.default, nv.SqrtOp), (aten.rsqrt.default, nv.RsqrtOp), (aten.tanh.default, nv.TanhOp),
    (aten.sigmoid.default, nv.SigmoidOp), (aten.relu.default, nv.ReluOp), (aten.cos.default, nv.CosOp),
    (aten.sin.default, nv.SinOp), (aten.log1p.default, nv.Log1pOp), (aten.expm1.default, nv.Expm1Op),
]:  # fmt: skip
    converts(_t)(_unary(_c))


@converts(aten.square.default)
def _square(cx, x):
    return cx.b.mul(x, x)


@converts(aten.gelu.default)
def _gelu(cx, x, approximate="none"):
    return cx.b.one(nv.GeluOp, [x], {"approximate": approximate})


@converts(aten.silu.default)
def _silu(cx, x):
    return cx.b.mul(x, cx.b.one(nv.SigmoidOp, [x]))


@converts(aten.where.self)
def _where(cx, cond, a, b):
    a, b = _promote(cx, a, b)
    return cx.b.where(as_bool(cx, cond), a, b)


@converts(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
def _masked_fill(cx, x, mask, value):
    if isinstance(value, SSAValue):
        value = cx.b.cast(value, elem_of(x.type))
    else:
        value = scalar_like(cx, value, x)
    return cx.b.where(as_bool(cx, mask), value, x)


def as_bool(cx: Ctx, x: SSAValue) -> SSAValue:
    """x != 0 as i1 (torch's truth value of a number), x itself if it is i1."""
    if elem_of(x.type) == i1:
        return x
    return cx.b.one(nv.NeOp, [x, cx.b.scalar(0.0, x)])


# --- dtype and constants ---------------------------------------------------


@converts(aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout)
def _to(cx, x, dtype=None, **kw):
    # device arguments are dropped: the whole step runs on the parameters' device
    if dtype is None:
        return x
    return cast_to(cx, x, dtype)


@converts(aten.to.device)
def _to_device(cx, x, device=None, dtype=None, non_blocking=False, copy=False, **kw):
    return _to(cx, x, dtype)


def cast_to(cx: Ctx, x: SSAValue, dtype: torch.dtype) -> SSAValue:
    """A cast with torch's semantics: to bool is ``x != 0``, not a truncation."""
    elem = capture_elem(dtype)
    if elem == i1:
        return as_bool(cx, x)
    return cx.b.cast(x, elem)


@converts(aten.type_as.default)
def _type_as(cx, x, other):
    return cast_to(cx, x, to_torch_dtype(elem_of(other.type)))


def _fill(cx, shape, value, dtype):
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 2**53:
        raise Unsupported(f"integer fill value {value} is not exactly representable (nova constants are f64)")
    dtype = dtype or torch.get_default_dtype()
    return cx.b.full(float(value), [int(s) for s in shape], capture_elem(dtype))


@converts(aten.full.default)
def _full(cx, size, value, dtype=None, **kw):
    if dtype is None:
        dtype = torch.bool if isinstance(value, bool) else torch.int64 if isinstance(value, int) else None
    return _fill(cx, size, value, dtype)


@converts(aten.empty.memory_format)
def _empty(cx, size, dtype=None, **kw):
    # value semantics: an empty tensor's contents are never read before the
    # (functionalized) writes that replace it, so zeros are as good as any
    return _fill(cx, size, 0, dtype)


@converts(aten.empty_permuted.default)
def _empty_permuted(cx, size, physical_layout, dtype=None, **kw):
    return _fill(cx, size, 0, dtype)  # a layout is no value: as empty


@converts(aten.bernoulli.p)
def _bernoulli(cx, x, p=0.5, generator=None):
    """A tensor of x's shape and dtype, 1 with probability p, else 0, from Nova's RNG (the
    dropout mask's draw: torch's distribution, not its bit stream). PyTorch draws in-place
    dropout (``nn.Dropout(inplace=True)``) on the CPU this way, then scales and multiplies."""
    if generator is not None:
        raise Unsupported("bernoulli with a torch.Generator (Nova draws from its own counter-based RNG)")
    if not is_float(x.type):
        raise Unsupported(f"bernoulli into {x.type}")
    if p >= 1.0 or p <= 0.0:
        return cx.b.full(1.0 if p >= 1.0 else 0.0, _shape(x), elem_of(x.type))
    cx.salt += 1
    keep = cx.b.one(nv.DropoutMaskOp, [cx.seed()], {"p": 1.0 - float(p), "salt": cx.salt}, x.type)
    zero = cx.b.scalar(0.0, x)
    return cx.b.where(cx.b.one(nv.GtOp, [keep, zero]), cx.b.scalar(1.0, x), zero)


@converts(aten.zeros.default)
def _zeros(cx, size, dtype=None, **kw):
    return _fill(cx, size, 0.0, dtype)


@converts(aten.ones.default)
def _ones(cx, size, dtype=None, **kw):
    return _fill(cx, size, 1.0, dtype)


@converts(aten.zeros_like.default)
def _zeros_like(cx, x, dtype=None, **kw):
    return _fill(cx, _shape(x), 0.0, dtype or to_torch_dtype(elem_of(x.type)))


@converts(aten.ones_like.default)
def _ones_like(cx, x, dtype=None, **kw):
    return _fill(cx, _shape(x), 1.0, dtype or to_torch_dtype(elem_of(x.type)))


@converts(aten.full_like.default)
def _full_like(cx, x, value, dtype=None, **kw):
    return _fill(cx, _shape(x), value, dtype or to_torch_dtype(elem_of(x.type)))


@converts(aten.scalar_tensor.default)
def _scalar_tensor(cx, value, dtype=None, **kw):
    return _fill(cx, (), value, dtype)


def _new_fill(value):
    def convert(cx, x, size, dtype=None, **kw):
        return _fill(cx, size, value, dtype or to_torch_dtype(elem_of(x.type)))

    return convert


converts(aten.new_ones.default)(_new_fill(1))
converts(aten.new_zeros.default, aten.new_empty.default)(_new_fill(0))


@converts(aten.new_full.default)
def _new_full(cx, x, size, fill_value, dtype=None, **kw):
    return _fill(cx, size, fill_value, dtype or to_torch_dtype(elem_of(x.type)))


@converts(aten.arange.default, aten.arange.start, aten.arange.start_step)
def _arange(cx, *args, dtype=None, **kw):
    start, end, step = (0, args[0], 1) if len(args) == 1 else (*args, 1)[:3]
    if step == 0:
        raise Unsupported("arange with step 0")
    if any(isinstance(v, float) for v in (start, end, step)):
        # torch: float bounds give the default float dtype; integral values are exact as ints
        if not all(float(v).is_integer() for v in (start, step)):
            raise Unsupported(f"arange({start}, {end}, {step}) with non-integral start or step")
        n = max(0, math.ceil((end - start) / step))
        start, step = int(start), int(step)
        dtype = dtype or torch.get_default_dtype()
    elif not all(isinstance(v, int) for v in (start, end, step)):
        raise Unsupported("arange with non-numeric bounds")
    else:
        n = max(0, -(-(end - start) // step))
    out = cx.b.one(nv.ArangeOp, [], {"start": start, "step": step}, tensor([n], i64))
    return cast_to(cx, out, dtype) if dtype is not None else out


@converts(aten.native_dropout.default)
def _native_dropout(cx, x, p, train=True):
    # (output, keep mask): the mask says where the multiplier is not 0
    scale = _dropout_scale(cx, x, p, train)
    if scale is None:
        return x, cx.b.full(1.0, _shape(x), i1)
    return cx.b.mul(x, scale), cx.b.one(nv.NeOp, [scale, cx.b.scalar(0.0, scale)])


@converts(aten.dropout.default)
def _dropout(cx, x, p, train=True):
    scale = _dropout_scale(cx, x, p, train)
    return x if scale is None else cx.b.mul(x, scale)


def _dropout_scale(cx, x, p, train):
    """The dropout multiplier (0 or 1/(1-p)) for x, or None when dropout is off."""
    if not train or p == 0.0:
        return None
    if p >= 1.0:
        return cx.b.full(0.0, _shape(x), elem_of(x.type))
    cx.salt += 1
    return cx.b.one(nv.DropoutMaskOp, [cx.seed()], {"p": float(p), "salt": cx.salt}, x.type)


# --- shapes ----------------------------------------------------------------


def _infer_shape(shape: Sequence[int], total: int) -> list[int]:
    shape = [int(s) for s in shape]
    if -1 in shape:
        known = numel([s for s in shape if s != -1])
        shape[shape.index(-1)] = total // known if known else 0
    return shape


@converts(aten.view.default, aten.reshape.default, aten._unsafe_view.default)
def _view(cx, x, shape):
    return cx.b.reshape(x, _infer_shape(shape, numel(_shape(x))))


@converts(aten.flatten.using_ints)
def _flatten(cx, x, start_dim=0, end_dim=-1):
    s = _shape(x)
    if not s:
        return cx.b.reshape(x, [1])
    a, e = _dim(start_dim, len(s)), _dim(end_dim, len(s))
    return cx.b.reshape(x, [*s[:a], numel(s[a : e + 1]), *s[e + 1 :]])


@converts(aten.unsqueeze.default)
def _unsqueeze(cx, x, dim):
    s = list(_shape(x))
    s.insert(dim % (len(s) + 1), 1)
    return cx.b.reshape(x, s)


@converts(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
def _squeeze(cx, x, dim=None):
    s = _shape(x)
    dims = range(len(s)) if dim is None else [dim] if isinstance(dim, int) else dim
    drop = {_dim(d, len(s)) for d in dims if s[_dim(d, len(s))] == 1}
    return cx.b.reshape(x, [n for i, n in enumerate(s) if i not in drop])


@converts(aten.transpose.int)
def _transpose(cx, x, d0, d1):
    r = len(_shape(x))
    perm = list(range(r))
    a, b = _dim(d0, r), _dim(d1, r)
    perm[a], perm[b] = perm[b], perm[a]
    return cx.b.transpose(x, perm)


@converts(aten.t.default, aten.numpy_T.default)
def _t(cx, x):
    r = len(_shape(x))
    return cx.b.transpose(x, list(reversed(range(r))))


@converts(aten.permute.default)
def _permute(cx, x, perm):
    r = len(_shape(x))
    return cx.b.transpose(x, [_dim(p, r) for p in perm])


@converts(aten.expand.default)
def _expand(cx, x, size, implicit=False):
    s = _shape(x)
    lead = len(size) - len(s)
    target = [s[i - lead] if n == -1 else n for i, n in enumerate(size)]
    return cx.b.broadcast_to(x, target)


@converts(aten.contiguous.default, aten.clone.default, aten.alias.default, aten.lift_fresh_copy.default,
          aten.lift_fresh.default)  # fmt: skip
def _identity(cx, x, **kw):
    # value semantics: layout-only ops are no-ops
    return x


@converts(aten.detach.default, aten.detach_.default)
def _detach(cx, x):
    return cx.b.one(nv.StopGradientOp, [x])


def _slice_value(cx, x, dim, start, end, step=1):
    s = _shape(x)
    d = _dim(dim, len(s))
    start, end, _ = slice(start, end, step).indices(s[d])
    if start == 0 and end >= s[d] and step == 1:
        return x
    end = max(end, start)
    return cx.b.one(nv.SliceOp, [x], {"dim": d, "start": start, "end": end, "step": step})


@converts(aten.slice.Tensor)
def _slice(cx, x, dim=0, start=None, end=None, step=1):
    return _slice_value(cx, x, dim, start, end, step)


@converts(aten.select.int)
def _select(cx, x, dim, index):
    s = _shape(x)
    d = _dim(dim, len(s))
    i = index % s[d]
    y = _slice_value(cx, x, d, i, i + 1)
    return cx.b.reshape(y, [n for j, n in enumerate(s) if j != d])


@converts(aten.split.Tensor, aten.split_with_sizes.default)
def _split(cx, x, sizes, dim=0):
    s = _shape(x)
    d = _dim(dim, len(s))
    if isinstance(sizes, int):
        sizes = [min(sizes, s[d] - i) for i in range(0, s[d], sizes)]
    outs, start = [], 0
    for n in sizes:
        outs.append(_slice_value(cx, x, d, start, start + n))
        start += n
    return tuple(outs)


@converts(aten.chunk.default)
def _chunk(cx, x, chunks, dim=0):
    n = _shape(x)[_dim(dim, len(_shape(x)))]
    return _split(cx, x, -(-n // chunks), dim)


@converts(aten.unbind.int)
def _unbind(cx, x, dim=0):
    s = _shape(x)
    return tuple(_select(cx, x, dim, i) for i in range(s[_dim(dim, len(s))]))


# --- reductions ------------------------------------------------------------


def _dims(x, dim) -> list[int]:
    r = len(_shape(x))
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return list(range(r))
    dims = [dim] if isinstance(dim, int) else list(dim)
    return sorted({_dim(d, r) for d in dims})


@converts(aten.sum.dim_IntList, aten.sum.default)
def _sum(cx, x, dim=None, keepdim=False, dtype=None):
    if dtype is not None:
        x = cx.b.cast(x, capture_elem(dtype))
    elif elem_of(x.type) == i1:
        x = cx.b.cast(x, i64)  # torch sums booleans as int64
    return cx.b.reduce_sum(x, _dims(x, dim), keepdim)


@converts(aten.mean.dim, aten.mean.default)
def _mean(cx, x, dim=None, keepdim=False, dtype=None):
    if dtype is not None:
        x = cx.b.cast(x, capture_elem(dtype))
    dims = _dims(x, dim)
    n = numel([_shape(x)[d] for d in dims])
    # sum / n as torch does (not sum * (1/n), which rounds differently)
    return cx.b.div(cx.b.reduce_sum(x, dims, keepdim), cx.b.scalar(float(n), x))


@converts(aten.var.correction, aten.var.dim)
def _var(cx, x, dim=None, unbiased=None, keepdim=False, correction=None):
    dims = _dims(x, dim)
    n = numel([_shape(x)[d] for d in dims])
    corr = correction if correction is not None else (1 if unbiased in (None, True) else 0)
    mean = cx.b.scale(cx.b.reduce_sum(x, dims, True), 1.0 / n)
    dev = cx.b.sub(x, mean)
    return cx.b.scale(cx.b.reduce_sum(cx.b.mul(dev, dev), dims, keepdim), 1.0 / max(n - corr, 0) if n > corr else math.inf)


@converts(aten.amax.default)
def _amax(cx, x, dim=(), keepdim=False):
    return cx.b.one(nv.ReduceMaxOp, [x], {"dims": tuple(_dims(x, dim)), "keepdim": keepdim})


@converts(aten.amin.default)
def _amin(cx, x, dim=(), keepdim=False):
    if elem_of(x.type) != i64 and not is_float(x.type):
        raise Unsupported(f"amin of {x.type}")
    neg = cx.b.neg(x) if is_float(x.type) else cx.b.sub(cx.b.scalar(0.0, x), x)
    m = _amax(cx, neg, dim, keepdim)
    return cx.b.neg(m) if is_float(x.type) else cx.b.sub(cx.b.scalar(0.0, m), m)


# --- contractions ----------------------------------------------------------


def _matmul(cx, a, b):
    sa, sb = _shape(a), _shape(b)
    if len(sa) == 1 and len(sb) == 1:
        return cx.b.reshape(cx.b.matmul(cx.b.reshape(a, [1, sa[0]]), cx.b.reshape(b, [sb[0], 1])), [])
    if len(sa) == 1:
        out = cx.b.matmul(cx.b.reshape(a, [1, sa[0]]), b)
        return cx.b.reshape(out, [*_shape(out)[:-2], _shape(out)[-1]])
    if len(sb) == 1:
        out = cx.b.matmul(a, cx.b.reshape(b, [sb[0], 1]))
        return cx.b.reshape(out, _shape(out)[:-1])
    if len(sb) == 2 and len(sa) > 2:
        # fold the batch into rows: one 2-D matmul, and the weight gradient needs no batch sum
        flat = cx.b.reshape(a, [numel(sa[:-1]), sa[-1]])
        return cx.b.reshape(cx.b.matmul(flat, b), [*sa[:-1], sb[-1]])
    return cx.b.matmul(a, b)


converts(aten.matmul.default, aten.mm.default, aten.bmm.default)(_matmul)


@converts(aten.linear.default)
def _linear(cx, x, w, bias=None):
    y = _matmul(cx, x, cx.b.transpose(w, [1, 0]))
    return cx.b.add(y, bias) if bias is not None else y


@converts(aten.addmm.default)
def _addmm(cx, bias, a, b, beta=1, alpha=1):
    y = _matmul(cx, a, b)
    if alpha != 1:
        y = cx.b.scale(y, float(alpha))
    return cx.b.add(y, cx.b.scale(bias, float(beta)) if beta != 1 else bias)


# --- neural-network ops ----------------------------------------------------


def _softmax_like(op_cls):
    # softmax.int(x, dim, dtype=None) takes a dtype third;
    # _softmax(x, dim, half_to_float) a flag (f16 in, f32 out)
    def convert(cx, x, dim, dtype=None):
        if dtype is not None:
            x = cx.b.cast(x, capture_elem(dtype))
        return cx.b.one(op_cls, [x], {"dim": _dim(dim, len(_shape(x)))})

    def convert_internal(cx, x, dim, half_to_float=False):
        return convert(cx, x, dim, torch.float32 if half_to_float else None)

    return convert, convert_internal


for _public, _internal, _cls in [(aten.softmax.int, aten._softmax.default, nv.SoftmaxOp),
                                 (aten.log_softmax.int, aten._log_softmax.default, nv.LogSoftmaxOp)]:  # fmt: skip
    _by_dtype, _by_flag = _softmax_like(_cls)
    converts(_public)(_by_dtype)
    converts(_internal)(_by_flag)


@converts(aten.layer_norm.default)
def _layer_norm(cx, x, normalized_shape, weight=None, bias=None, eps=1e-5, cudnn_enable=True):
    s = _shape(x)
    k = len(normalized_shape)
    d = numel(s[len(s) - k :])
    flat = cx.b.reshape(x, [*s[: len(s) - k], d]) if k != 1 else x
    elem = elem_of(x.type)
    w = cx.b.reshape(weight, [d]) if weight is not None else cx.b.full(1.0, [d], elem)
    b = cx.b.reshape(bias, [d]) if bias is not None else cx.b.full(0.0, [d], elem)
    y = cx.b.create(nv.LayerNormOp, [flat, w, b], {"eps": float(eps)}).results[0]
    return cx.b.reshape(y, s)


def _batch_norm(cx, x, weight, bias, stats, momentum: float, eps: float, running=None):
    """Batch norm from plain ops, as PyTorch's own decomposition (``torch._decomp``'s
    ``native_batch_norm_helper``, what Inductor compiles) computes it: per channel (dim 1), in
    f32 for a 16-bit input, ``(x - mean) * rsqrt(var + eps) * weight + bias``, the mean and the
    biased variance over every other dim. ``stats``: the batch's own (training), else
    ``running`` = (mean, var) are used as they are (eval). In training with ``running``, also
    the new running statistics ``momentum * batch + (1 - momentum) * running``, the variance
    unbiased (n / (n - 1)); they are step results the step writes into the buffers.
    Returns (out, mean, rstd, new running mean, new running var)."""
    s = _shape(x)
    if len(s) < 2:
        raise Unsupported(f"batch_norm of a rank-{len(s)} input (it needs [N, C, ...])")
    c = s[1]
    keep = [1, c] + [1] * (len(s) - 2)
    dims = [0, *range(2, len(s))]
    elem = elem_of(x.type)
    wide = to_torch_dtype(elem) in (torch.float32, torch.float64)
    acc = x if wide else cx.b.cast(x, from_torch_dtype(torch.float32))
    n = numel([s[d] for d in dims])
    new_mean = new_var = None
    if stats:
        mean = cx.b.div(cx.b.reduce_sum(acc, dims, True), cx.b.scalar(float(n), acc))
        dev = cx.b.sub(acc, mean)
        var = cx.b.div(cx.b.reduce_sum(cx.b.mul(dev, dev), dims, True), cx.b.scalar(float(n), acc))
        rstd = cx.b.one(nv.RsqrtOp, [cx.b.add(var, cx.b.scalar(float(eps), var))])
        out = cx.b.mul(dev, rstd)
        if running is not None:
            rm, rv = running
            flat_mean, flat_var = cx.b.reshape(mean, [c]), cx.b.reshape(var, [c])
            unbiased = cx.b.mul(flat_var, cx.b.scalar(n / (n - 1) if n > 1 else math.inf, flat_var))
            new_mean = _running_update(cx, rm, flat_mean, momentum)
            new_var = _running_update(cx, rv, unbiased, momentum)
    else:
        if running is None:
            raise Unsupported("batch_norm in eval mode without running statistics")
        rm, rv = running
        mean = cx.b.reshape(cx.b.cast(rm, elem_of(acc.type)), keep)
        rstd = cx.b.one(nv.RsqrtOp, [cx.b.add(cx.b.reshape(cx.b.cast(rv, elem_of(acc.type)), keep),
                                              cx.b.scalar(float(eps), acc))])  # fmt: skip
        out = cx.b.mul(cx.b.sub(acc, mean), rstd)
    if weight is not None:
        out = cx.b.mul(out, cx.b.reshape(weight, keep))
    if bias is not None:
        out = cx.b.add(out, cx.b.reshape(bias, keep))
    out = cx.b.cast(out, elem)
    return out, cx.b.reshape(mean, [c]), cx.b.reshape(rstd, [c]), new_mean, new_var


def _running_update(cx, old, batch, momentum: float) -> SSAValue:
    """``momentum * batch + (1 - momentum) * old`` in the running statistic's dtype (the
    decomposition's order); no gradient flows into it (eager updates it under no_grad)."""
    batch = cx.b.one(nv.StopGradientOp, [cx.b.cast(batch, elem_of(old.type))])
    return cx.b.add(cx.b.scale(batch, float(momentum)), cx.b.scale(old, 1.0 - float(momentum)))


@converts(aten._native_batch_norm_legit_functional.default)
def _batch_norm_functional(cx, x, weight, bias, running_mean, running_var, training, momentum, eps):
    out, mean, rstd, new_mean, new_var = _batch_norm(cx, x, weight, bias, bool(training), momentum, eps,
                                                      (running_mean, running_var))  # fmt: skip
    if not training:  # eval through the functional form: the buffers come back unchanged
        new_mean, new_var = running_mean, running_var
    return out, mean, rstd, new_mean, new_var


@converts(aten._native_batch_norm_legit_no_training.default)
def _batch_norm_eval(cx, x, weight, bias, running_mean, running_var, momentum, eps):
    return _batch_norm(cx, x, weight, bias, False, momentum, eps, (running_mean, running_var))[:3]


@converts(aten._native_batch_norm_legit.no_stats)
def _batch_norm_no_stats(cx, x, weight, bias, training, momentum, eps):
    if not training:
        raise Unsupported("batch_norm in eval mode without running statistics")
    return _batch_norm(cx, x, weight, bias, True, momentum, eps)[:3]


@converts(aten.native_group_norm.default)
def _group_norm(cx, x, weight, bias, n, c, hw, group, eps):
    """Group norm from plain ops, as PyTorch's decomposition computes it: [N, C, *] seen as
    [N, G, C/G * HxW], each row normalized by its mean and biased variance (in f32 for a
    16-bit input), then the per-channel affine. Returns (out, mean [N, G], rstd [N, G])."""
    s = _shape(x)
    g = int(group)
    elem = elem_of(x.type)
    wide = to_torch_dtype(elem) in (torch.float32, torch.float64)
    acc = x if wide else cx.b.cast(x, from_torch_dtype(torch.float32))
    rows = cx.b.reshape(acc, [s[0], g, numel(s) // (s[0] * g)])
    m = _shape(rows)[2]
    mean = cx.b.div(cx.b.reduce_sum(rows, [2], True), cx.b.scalar(float(m), rows))
    dev = cx.b.sub(rows, mean)
    var = cx.b.div(cx.b.reduce_sum(cx.b.mul(dev, dev), [2], True), cx.b.scalar(float(m), rows))
    rstd = cx.b.one(nv.RsqrtOp, [cx.b.add(var, cx.b.scalar(float(eps), var))])
    out = cx.b.reshape(cx.b.mul(dev, rstd), s)
    keep = [1, s[1]] + [1] * (len(s) - 2)
    if weight is not None:
        out = cx.b.mul(out, cx.b.reshape(weight, keep))
    if bias is not None:
        out = cx.b.add(out, cx.b.reshape(bias, keep))
    return cx.b.cast(out, elem), cx.b.reshape(mean, [s[0], g]), cx.b.reshape(rstd, [s[0], g])


@converts(aten.embedding.default)
def _embedding(cx, weight, ids, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    if scale_grad_by_freq or sparse:
        # sparse gradients: some torch optimizers (Adam, AdamW) reject them, so eager would fail
        raise Unsupported("embedding with scale_grad_by_freq or sparse gradients")
    n = _shape(weight)[0]
    pad = -1 if padding_idx is None or padding_idx == -1 else padding_idx % n
    return cx.b.one(nv.EmbeddingOp, [weight, ids], {"padding_idx": pad})


@converts(aten.cross_entropy_loss.default)
def _cross_entropy(cx, logits, target, weight=None, reduction=1, ignore_index=-100, label_smoothing=0.0):
    red = {0: "none", 1: "mean", 2: "sum"}[int(reduction)]
    if is_float(target.type):
        return _probability_cross_entropy(cx, logits, target, weight, red, int(ignore_index), float(label_smoothing))
    if len(_shape(logits)) != 2 or elem_of(target.type) != i64:
        raise Unsupported("cross_entropy needs logits [N, C] and int64 class targets [N] (or class probabilities "
                          "[N, C])")
    if weight is not None:
        return _weighted_cross_entropy(cx, logits, target, weight, red, int(ignore_index), float(label_smoothing))
    props = {"ignore_index": int(ignore_index), "reduction": red, "label_smoothing": float(label_smoothing)}
    return cx.b.one(nv.CrossEntropyOp, [logits, target], props)


def _check_class_weights(weight, logits) -> None:
    """cross_entropy's ``weight``: a [C] vector of the logits' dtype, as eager takes it."""
    if list(_shape(weight)) != [_shape(logits)[1]] or elem_of(weight.type) != elem_of(logits.type):
        raise Unsupported(f"cross_entropy with class weights {weight.type} for logits {logits.type} (eager takes a "
                          f"[C] weight of the logits' dtype)")


def _weighted_cross_entropy(cx, logits, target, weight, red: str, ignore_index: int, eps: float) -> SSAValue:
    """cross_entropy with class weights w [C], from plain ops, as ATen computes it
    (``cross_entropy_loss_label_smoothing`` over ``nll_loss_nd``, and torch's decomposition of
    ``nll_loss_forward``): logp = log_softmax(logits); a row's loss -(logp w)[t] where its target t
    is not ignore_index, else 0; "mean" divides the sum by the targets' weights (0 / 0: NaN for
    a batch of padding, as eager). With label smoothing eps: (1 - eps) of that plus eps / C of the
    row's -sum(logp w) (0 where ignored), its "mean" divided by the same total weight. Not the
    fused nova.cross_entropy (nor the LM head's fusion, which needs it): every op here has its own
    VJP. An out-of-range target is caught on the device as a gather's index is."""
    from nova.capture.aten_data import _gather, _index_select

    n, c = _shape(logits)
    elem = elem_of(logits.type)
    _check_class_weights(weight, logits)
    logp = cx.b.one(nv.LogSoftmaxOp, [logits], {"dim": 1})
    keep = cx.b.one(nv.NeOp, [target, cx.b.full(float(ignore_index), [], i64)])
    safe = cx.b.where(keep, target, cx.b.full(0.0, [], i64))
    zero = cx.b.full(0.0, [], elem)
    # w[t] a row, not the [N, C] broadcast ATen gathers it from: the same value, and (logp w)[t]
    # is logp[t] w[t], one rounding either way
    wt = _index_select(cx, weight, 0, safe)
    picked = cx.b.reshape(_gather(cx, logp, 1, cx.b.reshape(safe, [n, 1])), [n])
    loss = cx.b.where(keep, cx.b.neg(cx.b.mul(picked, wt)), zero)
    total = cx.b.reduce_sum(cx.b.where(keep, wt, zero), [0])

    def reduce(x: SSAValue) -> SSAValue:
        if red == "none":
            return x
        s = cx.b.reduce_sum(x, [0])
        return s if red == "sum" else cx.b.div(s, total)

    nll = reduce(loss)
    if not eps:
        return nll
    wl = cx.b.mul(logp, cx.b.broadcast_to(cx.b.reshape(weight, [1, c]), [n, c]))
    smooth = reduce(cx.b.where(keep, cx.b.neg(cx.b.reduce_sum(wl, [1])), zero))
    return cx.b.add(cx.b.scale(nll, 1.0 - eps), cx.b.scale(smooth, eps / c))


def _probability_cross_entropy(cx, logits, target, weight, red: str, ignore_index: int, eps: float) -> SSAValue:
    """cross_entropy with class-probability targets p [N, C] (distillation, mixup), from plain
    ops as ATen's ``cross_entropy_loss_prob_target`` computes it: logp = log_softmax(logits);
    with label smoothing p (1 - eps) + eps / C; the product logp p (times w [C] with class
    weights); "none" each row's negated sum, "sum" the negated sum of all, "mean" that divided by
    N (not by the weights, unlike class-id targets). The targets may carry gradients (a
    teacher's probabilities not detached): every op has its own VJP."""
    n, c = _shape(logits) if len(_shape(logits)) == 2 else (None, None)
    elem = elem_of(logits.type)
    if n is None or list(_shape(target)) != [n, c] or elem_of(target.type) != elem:
        raise Unsupported(f"cross_entropy with class-probability targets {target.type} for logits {logits.type} "
                          f"(Nova takes logits [N, C] and targets of the same shape and dtype)")
    if ignore_index >= 0:  # eager: "ignore_index is not supported for floating point target"
        raise Unsupported(f"cross_entropy with class-probability targets and ignore_index {ignore_index}")
    if weight is not None:
        _check_class_weights(weight, logits)
    logp = cx.b.one(nv.LogSoftmaxOp, [logits], {"dim": 1})
    if eps:
        target = cx.b.add(cx.b.scale(target, 1.0 - eps), cx.b.full(eps / c, [], elem))
    prod = cx.b.mul(logp, target)
    if weight is not None:
        prod = cx.b.mul(prod, cx.b.broadcast_to(cx.b.reshape(weight, [1, c]), [n, c]))
    if red == "none":
        return cx.b.neg(cx.b.reduce_sum(prod, [1]))
    total = cx.b.neg(cx.b.reduce_sum(prod, [0, 1]))
    return total if red == "sum" else cx.b.div(total, cx.b.full(float(n), [], elem))


@converts(aten.scaled_dot_product_attention.default)
def _sdpa(cx, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if not 0.0 <= dropout_p < 1.0:
        raise Unsupported(f"scaled_dot_product_attention with dropout_p {dropout_p} (Nova takes 0 <= dropout_p < 1)")
    if len(_shape(q)) != 4 or len(_shape(k)) != 4:
        raise Unsupported("scaled_dot_product_attention needs [B, H, T, D] inputs")
    if attn_mask is not None and is_causal:
        raise Unsupported("scaled_dot_product_attention with both attn_mask and is_causal (torch rejects it too)")
    hq, hk = _shape(q)[1], _shape(k)[1]
    if hq != hk:
        if not enable_gqa or hq % hk:
            raise Unsupported(f"scaled_dot_product_attention with {hq} query heads and {hk} key heads"
                              + ("" if enable_gqa else " without enable_gqa"))  # fmt: skip
        k, v = _repeat_heads(cx, k, hq // hk), _repeat_heads(cx, v, hq // hk)
    scale = 1.0 / math.sqrt(_shape(q)[-1]) if scale is None else float(scale)
    operands = [q, k, v]
    props = {"causal": bool(is_causal), "scale": scale}
    if attn_mask is not None:
        operands.append(_attention_bias(cx, attn_mask, q))
    if dropout_p:  # the probabilities dropped inside the kernels, with Nova's bits (nova.rng), as nova.dropout_mask
        cx.salt += 1
        operands.append(cx.seed())
        props |= {"dropout": float(dropout_p), "salt": cx.salt}
    op = cx.b.create(nv.AttentionOp, operands, props)
    return op.results[0]


def _repeat_heads(cx, x, groups: int) -> SSAValue:
    """[B, Hkv, T, D] -> [B, Hkv * groups, T, D], head h reading kv head h // groups
    (SDPA's enable_gqa, and what transformers' repeat_kv does)."""
    b, h, t, d = _shape(x)
    wide = cx.b.broadcast_to(cx.b.reshape(x, [b, h, 1, t, d]), [b, h, groups, t, d])
    return cx.b.reshape(wide, [b, h * groups, t, d])


def _attention_bias(cx, mask, q) -> SSAValue:
    """SDPA's attn_mask as an additive rank-4 bias in q's element type: a
    boolean mask (True = attend) becomes 0 / -inf."""
    if elem_of(mask.type) == i1:
        zero = cx.b.full(0.0, (), elem_of(q.type))
        mask = cx.b.where(mask, zero, cx.b.full(float("-inf"), (), elem_of(q.type)))
    elif not is_float(mask.type):
        raise Unsupported(f"scaled_dot_product_attention with an attn_mask of {mask.type} (use bool or float)")
    else:
        mask = cx.b.cast(mask, elem_of(q.type))
    s = _shape(mask)
    if len(s) > 4:
        raise Unsupported(f"scaled_dot_product_attention with an attn_mask of rank {len(s)}")
    return cx.b.reshape(mask, [1] * (4 - len(s)) + list(s))


from nova.capture import aten_data  # noqa: E402,F401  (registers the integer, boolean and indexing ops)
