"""The nova dialect: value-semantic tensor ops for a whole training step.

Every op declares its operands, results and properties, and infers its result
types from its operand types and properties (``infer``). The verifier checks
the declared result types against that inference, and the builder
(``nova.ir.builder``) uses the same inference to create ops, so the two can
never disagree.

Properties are builtin attributes: ``i64`` integers, ``f64`` floats,
``array<i64: ...>`` index lists, strings and ``i1`` booleans.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from xdsl.dialects.builtin import (
    I64,
    BoolAttr,
    DenseArrayBase,
    DictionaryAttr,
    Float64Type,
    FloatAttr,
    IntegerAttr,
    StringAttr,
    TensorType,
    f32,
    f64,
    i1,
    i64,
)
from xdsl.ir import Attribute, BlockArgument, Dialect, Operation, OpResult, SSAValue
from xdsl.irdl import (
    IRDLOperation,
    ParametrizedAttribute,
    irdl_attr_definition,
    irdl_op_definition,
    operand_def,
    opt_operand_def,
    opt_prop_def,
    opt_result_def,
    prop_def,
    region_def,
    result_def,
    traits_def,
    var_operand_def,
    var_result_def,
)
from xdsl.traits import HasParent, IsolatedFromAbove, IsTerminator, Pure
from xdsl.utils.exceptions import VerifyException

from nova.ir.types import broadcast_shapes, elem_of, is_float, is_int, numel, shape_of, tensor

# ----------------------------------------------------------------------------
# property helpers


def prop_value(attr: Attribute):
    """A property attribute as a plain Python value."""
    if isinstance(attr, IntegerAttr):
        v = attr.value.data
        return bool(v) if attr.type == i1 else int(v)
    if isinstance(attr, FloatAttr):
        return float(attr.value.data)
    if isinstance(attr, DenseArrayBase):
        return tuple(int(v) for v in attr.get_values())
    if isinstance(attr, StringAttr):
        return attr.data
    raise TypeError(f"unsupported nova property attribute {attr}")


def make_prop(value) -> Attribute:
    """A plain Python value as the property attribute that holds it."""
    if isinstance(value, bool):
        return IntegerAttr(int(value), i1)
    if isinstance(value, int):
        return IntegerAttr(value, i64)
    if isinstance(value, float):
        return FloatAttr(value, f64)
    if isinstance(value, str):
        return StringAttr(value)
    if isinstance(value, (tuple, list)):
        return DenseArrayBase.from_list(i64, [int(v) for v in value])
    raise TypeError(f"cannot store {value!r} as a nova property")


IntProp = IntegerAttr[I64]
FloatProp = FloatAttr[Float64Type]
BoolProp = BoolAttr


def _norm_dim(d: int, rank: int, what: str) -> int:
    if not -max(rank, 1) <= d < max(rank, 1):
        raise VerifyException(f"{what}: dim {d} out of range for rank {rank}")
    return d % max(rank, 1)


# ----------------------------------------------------------------------------
# base class


class NovaOp(IRDLOperation):
    """Base of every nova op: verification is type inference, compared."""

    # names of properties, in order, for ``props()``
    PROPS: ClassVar[tuple[str, ...]] = ()
    # ops whose result type is chosen by the creator (reshape, cast, full, ...)
    # receive it as ``hint`` in ``infer``
    FREE_RESULT: ClassVar[bool] = False
    # values of properties a creator may leave out (added later to an op that
    # existing IR and callers create without them)
    PROP_DEFAULTS: ClassVar[dict] = {}
    # leave a property of PROP_DEFAULTS out of the op where its value is falsy (the
    # default), instead of writing the default in: IR made before the property existed,
    # and ops that do not use it, keep their text and so their structural hash
    OMIT_DEFAULTS: ClassVar[bool] = False
    # what kind of computation the op is, for fusion (``nova.transforms.fuse``) and
    # scheduling; grouping reads this, never op names (CATEGORIES says what each means)
    CATEGORY: ClassVar[str] = "opaque"
    # an elementwise op whose value depends on its own flat index (arange, dropout_mask):
    # it is computed where its result lives, never recomputed inside another op's loop
    FLAT_INDEX: ClassVar[bool] = False
    # a contraction whose kernel takes an epilogue: elementwise ops applied to its
    # result tile before the store (the fuse stage's output fusion, nova.fused
    # kind "contraction"); the Triton lowering of such a group is its template's.
    # On a row-wise reduction (category reduction): elementwise ops applied to its
    # first result's row in registers before the store (nova.fused kind "reduction")
    EPILOGUE: ClassVar[bool] = False
    # a reduction whose kernel computes these operands' elements from an elementwise
    # prologue in registers instead of loading them (the fuse stage's input fusion,
    # nova.fused kind "reduction"); all of them have one shape, the prologue's
    PROLOGUE: ClassVar[tuple[int, ...]] = ()
    # a reduction with a prologue whose kernel computes every prologue element exactly
    # once (reduce.py: each element of the input is one lane of one tile): it can also
    # store prologue values for readers outside the group (a GELU backward's gradient,
    # summed into the bias gradient and written for the next matmuls), and compute
    # other elementwise ops of the prologue shape from them, stored too
    PROLOGUE_STORES: ClassVar[bool] = False
    # a row-wise reduction with a prologue and an epilogue whose kernel stores prologue
    # values (those its group yields) in its first pass over each row (layer_norm: the
    # residual stream's sum its prologue computes, written for the next residual add
    # and the backward); its prologue is still only what the head reads, and its group
    # may hold side ops computed with the prologue and stored (``row_sides``:
    # layer_norm_backward, the LayerNorm recompute norm_recompute puts beside it)
    PROLOGUE_ROW_STORES: ClassVar[bool] = False
    # a row-wise reduction with an epilogue whose kernel also sums epilogue values over
    # its rows (``column_sum``s of them in its group: a bias gradient of the residual
    # gradient a LayerNorm backward's epilogue adds), in per-program partials it adds up
    # with its own column sums
    EPILOGUE_SUMS: ClassVar[bool] = False
    # a reduction that adds up its operand's elements over its ``dims`` property (with
    # ``keepdim``): over every dim but the last, without keepdim, it is a column sum
    # (``column_sum``), which a contraction's epilogue computes tile by tile (the fuse
    # stage's column-sum rule, nova.fused kind "contraction")
    SUMS: ClassVar[bool] = False

    @classmethod
    def stores_prologue_rows(cls) -> bool:
        """A row-wise reduction that takes a prologue and stores its values in the
        first pass over a row (``PROLOGUE_ROW_STORES``)."""
        return bool(cls.PROLOGUE) and cls.PROLOGUE_ROW_STORES

    @classmethod
    def complete(cls, props: dict) -> dict:
        """``props`` with the defaults of the properties it leaves out (``OMIT_DEFAULTS``:
        without those of its defaulted properties that are falsy)."""
        if cls.OMIT_DEFAULTS:
            return {k: v for k, v in props.items() if k not in cls.PROP_DEFAULTS or v}
        return {**cls.PROP_DEFAULTS, **props} if cls.PROP_DEFAULTS else props

    def props(self) -> dict:
        return {k: prop_value(self.properties[k]) if k in self.properties else self.PROP_DEFAULTS[k] for k in self.PROPS}

    @classmethod
    def infer(cls, in_types: list[TensorType], props: dict, hint: TensorType | None) -> list[TensorType]:
        raise NotImplementedError(cls.name)

    def verify_(self) -> None:
        in_types = [o.type for o in self.operands]
        for t in in_types:
            if not isinstance(t, TensorType):
                raise VerifyException(f"{self.name}: operand type {t} is not a ranked tensor")
        hint = self.results[0].type if self.FREE_RESULT else None
        try:
            expected = self.infer(in_types, self.props(), hint)
        except ValueError as e:  # shape errors from helpers
            raise VerifyException(f"{self.name}: {e}") from e
        got = [r.type for r in self.results]
        if list(expected) != got:
            raise VerifyException(
                f"{self.name}: result types {[str(t) for t in got]} do not match inferred "
                f"{[str(t) for t in expected]}"
            )


def _require_float(name: str, *types: TensorType) -> None:
    for t in types:
        if not is_float(t):
            raise VerifyException(f"{name}: expected a floating-point tensor, got {t}")


def _same_elem(name: str, *types: TensorType) -> None:
    elems = {elem_of(t) for t in types}
    if len(elems) != 1:
        raise VerifyException(f"{name}: operands have different element types {[str(e) for e in elems]}")


# ----------------------------------------------------------------------------
# elementwise


class BinaryOp(NovaOp):
    CATEGORY: ClassVar = "elementwise"
    lhs = operand_def(TensorType)
    rhs = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    # add, sub, mul and maximum are also defined on i64 (position ids, index
    # arithmetic, counts); i1 takes part only through compares and where
    INTEGER_OK: ClassVar[bool] = False

    @classmethod
    def infer(cls, in_types, props, hint):
        a, b = in_types
        _same_elem(cls.name, a, b)
        if not (cls.INTEGER_OK and elem_of(a) == i64):
            _require_float(cls.name, a)
        return [tensor(broadcast_shapes(shape_of(a), shape_of(b)), elem_of(a))]


@irdl_op_definition
class AddOp(BinaryOp):
    name = "nova.add"
    INTEGER_OK: ClassVar = True


@irdl_op_definition
class SubOp(BinaryOp):
    name = "nova.sub"
    INTEGER_OK: ClassVar = True


@irdl_op_definition
class MulOp(BinaryOp):
    name = "nova.mul"
    INTEGER_OK: ClassVar = True


@irdl_op_definition
class DivOp(BinaryOp):
    name = "nova.div"


@irdl_op_definition
class MaximumOp(BinaryOp):
    name = "nova.maximum"
    INTEGER_OK: ClassVar = True


@irdl_op_definition
class PowOp(BinaryOp):
    name = "nova.pow"


class CompareOp(NovaOp):
    CATEGORY: ClassVar = "elementwise"
    lhs = operand_def(TensorType)
    rhs = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    @classmethod
    def infer(cls, in_types, props, hint):
        a, b = in_types
        _same_elem(cls.name, a, b)
        return [tensor(broadcast_shapes(shape_of(a), shape_of(b)), i1)]


@irdl_op_definition
class EqOp(CompareOp):
    name = "nova.eq"


@irdl_op_definition
class NeOp(CompareOp):
    name = "nova.ne"


@irdl_op_definition
class LtOp(CompareOp):
    name = "nova.lt"


@irdl_op_definition
class LeOp(CompareOp):
    name = "nova.le"


@irdl_op_definition
class GtOp(CompareOp):
    name = "nova.gt"


@irdl_op_definition
class GeOp(CompareOp):
    name = "nova.ge"


@irdl_op_definition
class WhereOp(NovaOp):
    """``cond ? a : b`` with broadcasting; ``cond`` is i1."""

    name = "nova.where"
    CATEGORY: ClassVar = "elementwise"
    cond = operand_def(TensorType)
    lhs = operand_def(TensorType)
    rhs = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    @classmethod
    def infer(cls, in_types, props, hint):
        c, a, b = in_types
        if elem_of(c) != i1:
            raise VerifyException(f"{cls.name}: condition must be i1, got {c}")
        _same_elem(cls.name, a, b)
        return [tensor(broadcast_shapes(shape_of(c), shape_of(a), shape_of(b)), elem_of(a))]


class UnaryOp(NovaOp):
    CATEGORY: ClassVar = "elementwise"
    input = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    @classmethod
    def infer(cls, in_types, props, hint):
        (x,) = in_types
        _require_float(cls.name, x)
        return [x]


@irdl_op_definition
class NegOp(UnaryOp):
    name = "nova.neg"


@irdl_op_definition
class ExpOp(UnaryOp):
    name = "nova.exp"


@irdl_op_definition
class LogOp(UnaryOp):
    name = "nova.log"


@irdl_op_definition
class SqrtOp(UnaryOp):
    name = "nova.sqrt"


@irdl_op_definition
class RsqrtOp(UnaryOp):
    name = "nova.rsqrt"


@irdl_op_definition
class TanhOp(UnaryOp):
    name = "nova.tanh"


@irdl_op_definition
class SigmoidOp(UnaryOp):
    name = "nova.sigmoid"


@irdl_op_definition
class ReluOp(UnaryOp):
    name = "nova.relu"


@irdl_op_definition
class StopGradientOp(NovaOp):
    """The value itself, through which no gradient flows (``Tensor.detach``).
    It matters only to autodiff; simplify removes it afterwards."""

    name = "nova.stop_gradient"
    input = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    @classmethod
    def infer(cls, in_types, props, hint):
        return [in_types[0]]


@irdl_op_definition
class CosOp(UnaryOp):
    name = "nova.cos"


@irdl_op_definition
class Log1pOp(UnaryOp):
    """log(1 + x), accurate where x is small (binary cross-entropy with logits, softplus)."""

    name = "nova.log1p"


@irdl_op_definition
class Expm1Op(UnaryOp):
    """exp(x) - 1, accurate where x is small (ELU)."""

    name = "nova.expm1"


@irdl_op_definition
class SinOp(UnaryOp):
    name = "nova.sin"


@irdl_op_definition
class AbsOp(UnaryOp):
    name = "nova.abs"


def _check_approximate(name: str, props: dict) -> None:
    if props["approximate"] not in ("none", "tanh"):
        raise VerifyException(f"{name}: approximate must be 'none' or 'tanh', got {props['approximate']!r}")


@irdl_op_definition
class GeluOp(UnaryOp):
    name = "nova.gelu"
    approximate = prop_def(StringAttr)
    PROPS: ClassVar = ("approximate",)

    @classmethod
    def infer(cls, in_types, props, hint):
        _check_approximate(cls.name, props)
        return UnaryOp.infer.__func__(cls, in_types, props, hint)


@irdl_op_definition
class RoundTf32Op(UnaryOp):
    """An f32 value rounded to the nearest tf32 value (10 mantissa bits, ties to even;
    inf and NaN stay): what a tf32 contraction does to each operand before its
    products. The ``tf32_operands`` stage puts it where a value's every reader is
    such a contraction, so the value's producer stores it rounded and the
    contractions take it as it is (rounding twice gives the same bits)."""

    name = "nova.round_tf32"

    @classmethod
    def infer(cls, in_types, props, hint):
        (x,) = in_types
        if elem_of(x) != f32:
            raise VerifyException(f"{cls.name}: rounds f32 values to tf32, got {elem_of(x)}")
        return [x]


@irdl_op_definition
class GeluBackwardOp(NovaOp):
    """d/dx gelu(x) * grad."""

    name = "nova.gelu_backward"
    CATEGORY: ClassVar = "elementwise"
    grad = operand_def(TensorType)
    input = operand_def(TensorType)
    result = result_def(TensorType)
    approximate = prop_def(StringAttr)
    traits = traits_def(Pure())
    PROPS: ClassVar = ("approximate",)

    @classmethod
    def infer(cls, in_types, props, hint):
        g, x = in_types
        _check_approximate(cls.name, props)
        _same_elem(cls.name, g, x)
        _require_float(cls.name, x)
        if shape_of(g) != shape_of(x):
            raise VerifyException(f"{cls.name}: grad shape {shape_of(g)} != input shape {shape_of(x)}")
        return [x]


@irdl_op_definition
class CastOp(NovaOp):
    """Element type conversion; the result type names the target."""

    name = "nova.cast"
    CATEGORY: ClassVar = "elementwise"
    input = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    FREE_RESULT: ClassVar = True

    @classmethod
    def infer(cls, in_types, props, hint):
        (x,) = in_types
        if hint is None or shape_of(hint) != shape_of(x):
            raise VerifyException(f"{cls.name}: result must have the input's shape {shape_of(x)}")
        return [hint]


@irdl_op_definition
class FullOp(NovaOp):
    """A tensor filled with one value (scalars are 0-d fulls)."""

    name = "nova.full"
    CATEGORY: ClassVar = "elementwise"
    value = prop_def(FloatProp)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    PROPS: ClassVar = ("value",)
    FREE_RESULT: ClassVar = True

    @classmethod
    def infer(cls, in_types, props, hint):
        if hint is None:
            raise VerifyException(f"{cls.name}: needs a result type")
        return [hint]


@irdl_op_definition
class ArangeOp(NovaOp):
    """``start + step * i`` for i in [0, n); n is the result's only dimension."""

    name = "nova.arange"
    CATEGORY: ClassVar = "elementwise"
    FLAT_INDEX: ClassVar = True
    start = prop_def(IntProp)
    step = prop_def(IntProp)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    PROPS: ClassVar = ("start", "step")
    FREE_RESULT: ClassVar = True

    @classmethod
    def infer(cls, in_types, props, hint):
        if hint is None or len(shape_of(hint)) != 1:
            raise VerifyException(f"{cls.name}: result must be 1-D")
        return [hint]


@irdl_op_definition
class DropoutMaskOp(NovaOp):
    """The dropout multiplier (0 or 1/(1-p)) from Nova's counter-based RNG
    (``nova.rng``): a pure function of the 0-d i64 ``seed`` and the op's salt."""

    name = "nova.dropout_mask"
    CATEGORY: ClassVar = "elementwise"
    FLAT_INDEX: ClassVar = True
    seed = operand_def(TensorType)
    p = prop_def(FloatProp)
    salt = prop_def(IntProp)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    PROPS: ClassVar = ("p", "salt")
    FREE_RESULT: ClassVar = True

    @classmethod
    def infer(cls, in_types, props, hint):
        (s,) = in_types
        if shape_of(s) != () or elem_of(s) != i64:
            raise VerifyException(f"{cls.name}: seed must be a 0-d i64 tensor, got {s}")
        if not 0.0 <= props["p"] < 1.0:
            raise VerifyException(f"{cls.name}: p must be in [0, 1), got {props['p']}")
        if hint is None or not is_float(hint):
            raise VerifyException(f"{cls.name}: result must be a float tensor")
        return [hint]


# ----------------------------------------------------------------------------
# shapes


@irdl_op_definition
class ReshapeOp(NovaOp):
    name = "nova.reshape"
    CATEGORY: ClassVar = "layout"
    input = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    FREE_RESULT: ClassVar = True

    @classmethod
    def infer(cls, in_types, props, hint):
        (x,) = in_types
        if hint is None or numel(shape_of(hint)) != numel(shape_of(x)) or elem_of(hint) != elem_of(x):
            raise VerifyException(f"{cls.name}: cannot reshape {x} to {hint}")
        return [hint]


@irdl_op_definition
class TransposeOp(NovaOp):
    """General permutation: result dim i is input dim perm[i]."""

    name = "nova.transpose"
    CATEGORY: ClassVar = "layout"
    input = operand_def(TensorType)
    perm = prop_def(DenseArrayBase)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    PROPS: ClassVar = ("perm",)

    @classmethod
    def infer(cls, in_types, props, hint):
        (x,) = in_types
        perm, shape = props["perm"], shape_of(x)
        if sorted(perm) != list(range(len(shape))):
            raise VerifyException(f"{cls.name}: {perm} is not a permutation of rank {len(shape)}")
        return [tensor([shape[p] for p in perm], elem_of(x))]


@irdl_op_definition
class BroadcastToOp(NovaOp):
    name = "nova.broadcast_to"
    CATEGORY: ClassVar = "layout"
    input = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    FREE_RESULT: ClassVar = True

    @classmethod
    def infer(cls, in_types, props, hint):
        (x,) = in_types
        if hint is None or elem_of(hint) != elem_of(x):
            raise VerifyException(f"{cls.name}: needs a result of element type {elem_of(x)}")
        if broadcast_shapes(shape_of(x), shape_of(hint)) != shape_of(hint):
            raise VerifyException(f"{cls.name}: {shape_of(x)} does not broadcast to {shape_of(hint)}")
        return [hint]


def _slice_len(size: int, start: int, end: int, step: int) -> int:
    return max(0, (min(end, size) - start + step - 1) // step)


@irdl_op_definition
class SliceOp(NovaOp):
    """Elements start, start+step, ... < end along dim (normalized, in range)."""

    name = "nova.slice"
    CATEGORY: ClassVar = "layout"
    input = operand_def(TensorType)
    dim = prop_def(IntProp)
    start = prop_def(IntProp)
    end = prop_def(IntProp)
    step = prop_def(IntProp)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    PROPS: ClassVar = ("dim", "start", "end", "step")

    @classmethod
    def infer(cls, in_types, props, hint):
        (x,) = in_types
        shape = list(shape_of(x))
        d = props["dim"]
        if not 0 <= d < len(shape):
            raise VerifyException(f"{cls.name}: dim {d} out of range")
        if props["step"] < 1 or not 0 <= props["start"] <= props["end"] <= shape[d]:
            raise VerifyException(f"{cls.name}: bad slice {props} of size {shape[d]}")
        shape[d] = _slice_len(shape[d], props["start"], props["end"], props["step"])
        return [tensor(shape, elem_of(x))]


@irdl_op_definition
class PadOp(NovaOp):
    """The adjoint of slice: places the input at start, start+step, ... along
    dim of a zero tensor whose dim has ``size`` elements."""

    name = "nova.pad"
    input = operand_def(TensorType)
    dim = prop_def(IntProp)
    start = prop_def(IntProp)
    step = prop_def(IntProp)
    size = prop_def(IntProp)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    PROPS: ClassVar = ("dim", "start", "step", "size")

    @classmethod
    def infer(cls, in_types, props, hint):
        (x,) = in_types
        shape = list(shape_of(x))
        d = props["dim"]
        if not 0 <= d < len(shape):
            raise VerifyException(f"{cls.name}: dim {d} out of range")
        n = shape[d]
        if props["step"] < 1 or props["start"] < 0 or (n and props["start"] + (n - 1) * props["step"] >= props["size"]):
            raise VerifyException(f"{cls.name}: {n} elements do not fit {props}")
        shape[d] = props["size"]
        return [tensor(shape, elem_of(x))]


@irdl_op_definition
class CatOp(NovaOp):
    """torch.cat: the inputs one after another along ``dim`` (normalized); every
    other dim equal. Each output element is one input element, unchanged (a zero
    keeps its sign, as eager's cat does; a sum of zero-pads would make -0.0 +0.0)."""

    name = "nova.cat"
    inputs = var_operand_def(TensorType)
    dim = prop_def(IntProp)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    PROPS: ClassVar = ("dim",)

    @classmethod
    def infer(cls, in_types, props, hint):
        if not in_types:
            raise VerifyException(f"{cls.name}: needs at least one input")
        _same_elem(cls.name, *in_types)
        first = list(shape_of(in_types[0]))
        d = props["dim"]
        if not 0 <= d < len(first):
            raise VerifyException(f"{cls.name}: dim {d} out of range for rank {len(first)}")
        total = 0
        for t in in_types:
            s = list(shape_of(t))
            if len(s) != len(first) or s[:d] + s[d + 1:] != first[:d] + first[d + 1:]:
                raise VerifyException(f"{cls.name}: {s} and {first} differ outside dim {d}")
            total += s[d]
        first[d] = total
        return [tensor(first, elem_of(in_types[0]))]


# ----------------------------------------------------------------------------
# reductions


class ReduceOp(NovaOp):
    CATEGORY: ClassVar = "reduction"
    PROLOGUE: ClassVar = (0,)
    PROLOGUE_STORES: ClassVar = True
    input = operand_def(TensorType)
    dims = prop_def(DenseArrayBase)
    keepdim = prop_def(BoolProp)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    PROPS: ClassVar = ("dims", "keepdim")

    @classmethod
    def infer(cls, in_types, props, hint):
        (x,) = in_types
        shape = shape_of(x)
        dims = props["dims"]
        if len(set(dims)) != len(dims) or any(not 0 <= d < len(shape) for d in dims):
            raise VerifyException(f"{cls.name}: bad dims {dims} for rank {len(shape)}")
        if props["keepdim"]:
            out = [1 if i in dims else s for i, s in enumerate(shape)]
        else:
            out = [s for i, s in enumerate(shape) if i not in dims]
        return [tensor(out, elem_of(x))]


@irdl_op_definition
class ReduceSumOp(ReduceOp):
    name = "nova.reduce_sum"
    SUMS: ClassVar = True


@irdl_op_definition
class ReduceMaxOp(ReduceOp):
    name = "nova.reduce_max"


@irdl_op_definition
class CumsumOp(NovaOp):
    """Inclusive prefix sum along ``dim`` (from the end when ``reverse``: the
    adjoint of the forward sum); f32/f64/bf16/f16 or i64."""

    name = "nova.cumsum"
    CATEGORY: ClassVar = "reduction"
    input = operand_def(TensorType)
    dim = prop_def(IntProp)
    reverse = prop_def(BoolProp)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    PROPS: ClassVar = ("dim", "reverse")

    @classmethod
    def infer(cls, in_types, props, hint):
        (x,) = in_types
        if not (is_float(x) or elem_of(x) == i64):
            raise VerifyException(f"{cls.name}: expects a float or i64 tensor, got {x}")
        if not 0 <= props["dim"] < max(len(shape_of(x)), 1):
            raise VerifyException(f"{cls.name}: dim {props['dim']} out of range for {x}")
        return [x]


# ----------------------------------------------------------------------------
# contraction


@irdl_op_definition
class MatmulOp(NovaOp):
    """``a[..., M, K] @ b[..., K, N]`` with broadcast batch dims. Operands of
    bf16 accumulate in f32; the result has the operands' element type."""

    name = "nova.matmul"
    CATEGORY: ClassVar = "contraction"
    EPILOGUE: ClassVar = True  # nova/codegen/triton/matmul.py applies it to the accumulator tile
    lhs = operand_def(TensorType)
    rhs = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    @classmethod
    def infer(cls, in_types, props, hint):
        a, b = in_types
        _same_elem(cls.name, a, b)
        _require_float(cls.name, a)
        sa, sb = shape_of(a), shape_of(b)
        if len(sa) < 2 or len(sb) < 2:
            raise VerifyException(f"{cls.name}: operands must be at least 2-D, got {sa} and {sb}")
        if sa[-1] != sb[-2]:
            raise VerifyException(f"{cls.name}: contraction sizes differ: {sa} @ {sb}")
        batch = broadcast_shapes(sa[:-2], sb[:-2])
        return [tensor([*batch, sa[-2], sb[-1]], elem_of(a))]


# ----------------------------------------------------------------------------
# neural-network ops with hand-written adjoints


class _DimOp(NovaOp):
    CATEGORY: ClassVar = "reduction"  # softmax, log_softmax and their backwards: row-wise
    dim = prop_def(IntProp)
    PROPS: ClassVar = ("dim",)


class _RowwiseOp(_DimOp):
    input = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    @classmethod
    def infer(cls, in_types, props, hint):
        (x,) = in_types
        _require_float(cls.name, x)
        _norm_dim(props["dim"], len(shape_of(x)), cls.name)
        return [x]


@irdl_op_definition
class SoftmaxOp(_RowwiseOp):
    name = "nova.softmax"


@irdl_op_definition
class LogSoftmaxOp(_RowwiseOp):
    name = "nova.log_softmax"


class _SoftmaxBackwardBase(_DimOp):
    output = operand_def(TensorType)
    grad = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    @classmethod
    def infer(cls, in_types, props, hint):
        y, g = in_types
        _same_elem(cls.name, y, g)
        if shape_of(y) != shape_of(g):
            raise VerifyException(f"{cls.name}: output and grad shapes differ")
        _norm_dim(props["dim"], len(shape_of(y)), cls.name)
        return [y]


@irdl_op_definition
class SoftmaxBackwardOp(_SoftmaxBackwardBase):
    """Given y = softmax(x) and dL/dy: dL/dx = y * (g - sum(g*y))."""

    name = "nova.softmax_backward"


@irdl_op_definition
class LogSoftmaxBackwardOp(_SoftmaxBackwardBase):
    """Given y = log_softmax(x) and dL/dy: dL/dx = g - exp(y) * sum(g)."""

    name = "nova.log_softmax_backward"


@irdl_op_definition
class LayerNormOp(NovaOp):
    """Normalizes over the last dimension; also returns the per-row mean and
    reciprocal standard deviation that layer_norm_backward consumes."""

    name = "nova.layer_norm"
    CATEGORY: ClassVar = "reduction"
    PROLOGUE: ClassVar = (0,)
    EPILOGUE: ClassVar = True
    PROLOGUE_ROW_STORES: ClassVar = True
    input = operand_def(TensorType)
    weight = operand_def(TensorType)
    bias = operand_def(TensorType)
    eps = prop_def(FloatProp)
    result = result_def(TensorType)
    mean = result_def(TensorType)
    rstd = result_def(TensorType)
    traits = traits_def(Pure())
    PROPS: ClassVar = ("eps",)

    @classmethod
    def infer(cls, in_types, props, hint):
        x, w, b = in_types
        _require_float(cls.name, x)
        _same_elem(cls.name, x, w, b)
        shape = shape_of(x)
        if not shape or shape_of(w) != shape[-1:] or shape_of(b) != shape[-1:]:
            raise VerifyException(f"{cls.name}: weight/bias must have shape {shape[-1:]}")
        stat = tensor(shape[:-1], elem_of(x))
        return [x, stat, stat]


@irdl_op_definition
class LayerNormBackwardOp(NovaOp):
    name = "nova.layer_norm_backward"
    CATEGORY: ClassVar = "reduction"
    PROLOGUE: ClassVar = (0, 1)
    EPILOGUE: ClassVar = True
    EPILOGUE_SUMS: ClassVar = True
    PROLOGUE_ROW_STORES: ClassVar = True
    grad = operand_def(TensorType)
    input = operand_def(TensorType)
    weight = operand_def(TensorType)
    mean = operand_def(TensorType)
    rstd = operand_def(TensorType)
    grad_input = result_def(TensorType)
    grad_weight = result_def(TensorType)
    grad_bias = result_def(TensorType)
    traits = traits_def(Pure())

    @classmethod
    def infer(cls, in_types, props, hint):
        g, x, w, m, r = in_types
        _same_elem(cls.name, g, x, w, m, r)
        shape = shape_of(x)
        if shape_of(g) != shape or shape_of(w) != shape[-1:] or shape_of(m) != shape[:-1] or shape_of(r) != shape[:-1]:
            raise VerifyException(f"{cls.name}: inconsistent shapes")
        return [x, w, w]


@irdl_op_definition
class EmbeddingOp(NovaOp):
    """``weight[ids]``: rows of a 2-D table (of any element type: gathers and
    advanced indexing of integer tensors lower to it too); ids are i64 of any
    shape. ``padding_idx`` (or -1) is the row that receives no gradient."""

    name = "nova.embedding"
    weight = operand_def(TensorType)
    ids = operand_def(TensorType)
    padding_idx = prop_def(IntProp)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    PROPS: ClassVar = ("padding_idx",)
    PROP_DEFAULTS: ClassVar = {"padding_idx": -1}

    @classmethod
    def infer(cls, in_types, props, hint):
        w, ids = in_types
        if len(shape_of(w)) != 2 or not is_int(ids) or elem_of(ids) == i1:
            raise VerifyException(f"{cls.name}: needs a 2-D weight and integer ids, got {w}, {ids}")
        if not -1 <= cls.complete(props)["padding_idx"] < shape_of(w)[0]:
            raise VerifyException(f"{cls.name}: padding_idx {props['padding_idx']} outside the table")
        return [tensor([*shape_of(ids), shape_of(w)[1]], elem_of(w))]


@irdl_op_definition
class EmbeddingBackwardOp(NovaOp):
    """Scatter-adds grad rows into a zero [num_embeddings, D] table; rows of
    ``padding_idx`` (if >= 0) get no gradient, as in torch."""

    name = "nova.embedding_backward"
    grad = operand_def(TensorType)
    ids = operand_def(TensorType)
    num_embeddings = prop_def(IntProp)
    padding_idx = prop_def(IntProp)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    PROPS: ClassVar = ("num_embeddings", "padding_idx")

    @classmethod
    def infer(cls, in_types, props, hint):
        g, ids = in_types
        if shape_of(g)[:-1] != shape_of(ids):
            raise VerifyException(f"{cls.name}: grad {shape_of(g)} does not match ids {shape_of(ids)}")
        return [tensor([props["num_embeddings"], shape_of(g)[-1]], elem_of(g))]


def _check_ce(name: str, logits: TensorType, target: TensorType, props: dict) -> None:
    if len(shape_of(logits)) != 2 or shape_of(target) != shape_of(logits)[:1]:
        raise VerifyException(f"{name}: expects logits [N, C] and target [N], got {logits}, {target}")
    if elem_of(target) != i64:
        raise VerifyException(f"{name}: target must be i64")
    if props["reduction"] not in ("mean", "sum", "none"):
        raise VerifyException(f"{name}: reduction must be 'mean', 'sum' or 'none'")
    if not 0.0 <= props["label_smoothing"] <= 1.0:
        raise VerifyException(f"{name}: label_smoothing must be in [0, 1], got {props['label_smoothing']}")


def _ce_shape(logits: TensorType, props: dict) -> list[int]:
    return list(shape_of(logits)[:1]) if props["reduction"] == "none" else []


@irdl_op_definition
class CrossEntropyOp(NovaOp):
    """Softmax cross-entropy of logits [N, C] against class ids [N], as
    ``torch.nn.functional.cross_entropy``: each row's loss is
    ``(1 - ls) * -log p[target] + ls * mean_c(-log p[c])`` (ls = label_smoothing);
    rows whose id equals ignore_index count neither in the sum nor in the mean's
    denominator (a mean over no rows is NaN, as in torch). ``reduction`` is
    "mean", "sum" (0-d results) or "none" (one loss per row, 0 where ignored)."""

    name = "nova.cross_entropy"
    CATEGORY: ClassVar = "reduction"
    logits = operand_def(TensorType)
    target = operand_def(TensorType)
    ignore_index = prop_def(IntProp)
    reduction = prop_def(StringAttr)
    label_smoothing = prop_def(FloatProp)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    PROPS: ClassVar = ("ignore_index", "reduction", "label_smoothing")
    PROP_DEFAULTS: ClassVar = {"label_smoothing": 0.0}

    @classmethod
    def infer(cls, in_types, props, hint):
        logits, target = in_types
        props = cls.complete(props)
        _require_float(cls.name, logits)
        _check_ce(cls.name, logits, target, props)
        return [tensor(_ce_shape(logits, props), elem_of(logits))]


@irdl_op_definition
class CrossEntropyBackwardOp(NovaOp):
    """dL/dlogits = grad * (softmax(logits) - (1 - ls) onehot(target) - ls / C)
    / count for valid rows, 0 for ignored ones; torch's gradient of a mean over
    no rows is 0 (not NaN), so the count is at least 1 here."""

    name = "nova.cross_entropy_backward"
    CATEGORY: ClassVar = "reduction"
    grad = operand_def(TensorType)
    logits = operand_def(TensorType)
    target = operand_def(TensorType)
    ignore_index = prop_def(IntProp)
    reduction = prop_def(StringAttr)
    label_smoothing = prop_def(FloatProp)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    PROPS: ClassVar = ("ignore_index", "reduction", "label_smoothing")
    PROP_DEFAULTS: ClassVar = {"label_smoothing": 0.0}

    @classmethod
    def infer(cls, in_types, props, hint):
        g, logits, target = in_types
        props = cls.complete(props)
        _check_ce(cls.name, logits, target, props)
        if list(shape_of(g)) != _ce_shape(logits, props):
            raise VerifyException(f"{cls.name}: grad must have the loss's shape {_ce_shape(logits, props)}")
        return [logits]


def attention_tail(values: Sequence, props: dict) -> tuple[list, list]:
    """An attention op's operands after its fixed ones (q, k, v; the backward's
    grad, q, k, v, output, lse), split into ([bias] or [], [seed] or []): the
    optional additive score bias, then the dropout seed, which is there exactly
    when the op's ``dropout`` is not 0. Values, types or runtime tensors alike."""
    values = list(values)
    seeds = 1 if props.get("dropout") else 0
    if not seeds <= len(values) <= seeds + 1:
        raise VerifyException(f"attention: {len(values)} operands after the fixed ones, expected "
                              f"{'a seed' if seeds else 'none'} after an optional bias")
    return values[: len(values) - seeds], values[len(values) - seeds:]


def _check_attention(name: str, q: TensorType, k: TensorType, v: TensorType, tail: list[TensorType],
                     props: dict) -> None:
    bias, seed = attention_tail(tail, props)
    if not 0.0 <= props.get("dropout", 0.0) < 1.0:
        raise VerifyException(f"{name}: dropout must be in [0, 1), got {props['dropout']}")
    for s in seed:
        if shape_of(s) != () or elem_of(s) != i64:
            raise VerifyException(f"{name}: the dropout seed must be a 0-d i64 tensor, got {s}")
    sq, sk, sv = shape_of(q), shape_of(k), shape_of(v)
    _same_elem(name, q, k, v)
    if len(sq) != 4 or sk != sv or sq[:2] != sk[:2] or sq[3] != sk[3]:
        raise VerifyException(f"{name}: expects q [B,H,Tq,D], k and v [B,H,Tk,D]; got {sq}, {sk}, {sv}")
    for m in bias:
        scores = (*sq[:3], sk[2])
        if len(shape_of(m)) != 4 or broadcast_shapes(shape_of(m), scores) != scores:
            raise VerifyException(f"{name}: bias {shape_of(m)} does not broadcast to the scores {scores}")
        if not is_float(m):
            raise VerifyException(f"{name}: bias must be a float tensor (-inf where masked), got {m}")


@irdl_op_definition
class AttentionOp(NovaOp):
    """softmax(q k^T * scale (+ bias) (+ causal mask)) v; also returns the
    per-row log-sum-exp [B, H, Tq] (f32 or wider) that attention_backward uses.
    ``extras`` are an optional ``bias``, an additive mask of rank 4 that
    broadcasts to the scores [B, H, Tq, Tk] (boolean masks arrive as 0 / -inf),
    then, with ``dropout`` p > 0, the step's 0-d i64 seed (``attention_tail``).
    A row that masks every key gives 0, as torch's SDPA does (its lse is -inf).

    With ``dropout`` (SDPA's dropout_p) the probabilities are multiplied by
    ``nova.dropout_mask``'s multiplier of the scores' shape [B, H, Tq, Tk]
    (the element at flat index ((b H + h) Tq + i) Tk + j, with the op's ``salt``:
    ``nova.rng``) before the product with v, as torch's SDPA drops them (with
    Nova's random bits, not torch's); lse is of the scores, dropout aside."""

    name = "nova.attention"
    CATEGORY: ClassVar = "contraction"
    q = operand_def(TensorType)
    k = operand_def(TensorType)
    v = operand_def(TensorType)
    extras = var_operand_def(TensorType)
    causal = prop_def(BoolProp)
    scale = prop_def(FloatProp)
    dropout = opt_prop_def(FloatProp)
    salt = opt_prop_def(IntProp)
    result = result_def(TensorType)
    lse = result_def(TensorType)
    traits = traits_def(Pure())
    PROPS: ClassVar = ("causal", "scale", "dropout", "salt")
    # absent: no dropout (capture creates the op without them then)
    PROP_DEFAULTS: ClassVar = {"dropout": 0.0, "salt": 0}
    OMIT_DEFAULTS: ClassVar = True

    @classmethod
    def infer(cls, in_types, props, hint):
        q, k, v, *tail = in_types
        _require_float(cls.name, q)
        _check_attention(cls.name, q, k, v, tail, props)
        return [q, tensor(shape_of(q)[:3], stat_elem(q))]


def stat_elem(t: TensorType) -> Attribute:
    # statistics of low-precision tensors are kept in f32
    return elem_of(t) if elem_of(t) == f64 else f32


@irdl_op_definition
class AttentionBackwardOp(NovaOp):
    """The gradients dq, dk, dv of nova.attention from its output's gradient
    ``grad`` and its forward's operands, output and lse. With ``sums`` (the
    attention_sums stage sets it) a fourth result ``grad_sums`` [3, H, D] holds
    each gradient's sum over the batch and the sequence, of its elements as
    returned (rounded to the gradients' type), added up in the statistics type
    (f32; f64 for f64): the bias gradient of a packed qkv projection, which
    the kernels add up from their tiles instead of reading the gradients back.
    With ``rounded`` (the tf32_operands stage sets it where only tf32 matmuls read
    the gradients) dq, dk and dv are returned rounded to the nearest tf32 value
    (``nova.round_tf32``'s rounding, f32 only); the column sums are of the values
    before that rounding. ``extras``, ``dropout`` and ``salt`` are the forward's
    (the same multiplier on P in dV = (P Z)^T dO and on dP = dO v^T)."""

    name = "nova.attention_backward"
    CATEGORY: ClassVar = "contraction"
    grad = operand_def(TensorType)
    q = operand_def(TensorType)
    k = operand_def(TensorType)
    v = operand_def(TensorType)
    output = operand_def(TensorType)
    lse = operand_def(TensorType)
    extras = var_operand_def(TensorType)
    causal = prop_def(BoolProp)
    scale = prop_def(FloatProp)
    dropout = opt_prop_def(FloatProp)
    salt = opt_prop_def(IntProp)
    sums = opt_prop_def(BoolProp)
    rounded = opt_prop_def(BoolProp)
    grad_q = result_def(TensorType)
    grad_k = result_def(TensorType)
    grad_v = result_def(TensorType)
    grad_sums = opt_result_def(TensorType)
    traits = traits_def(Pure())
    PROPS: ClassVar = ("causal", "scale", "dropout", "salt", "sums", "rounded")
    # absent: no dropout, no column sums, gradients not rounded (autodiff creates the op without the last two)
    PROP_DEFAULTS: ClassVar = {"dropout": 0.0, "salt": 0, "sums": False, "rounded": False}
    OMIT_DEFAULTS: ClassVar = True

    @classmethod
    def infer(cls, in_types, props, hint):
        g, q, k, v, o, lse, *tail = in_types
        _check_attention(cls.name, q, k, v, tail, props)
        if props.get("rounded") and elem_of(q) != f32:
            raise VerifyException(f"{cls.name}: rounded (to tf32) needs f32 gradients, got {elem_of(q)}")
        if shape_of(g) != shape_of(q) or shape_of(o) != shape_of(q) or shape_of(lse) != shape_of(q)[:3]:
            raise VerifyException(f"{cls.name}: inconsistent shapes")
        if not props.get("sums"):
            return [q, k, v]
        if shape_of(k) != shape_of(q):
            raise VerifyException(f"{cls.name}: column sums need q, k and v of one shape, got {shape_of(q)}, {shape_of(k)}")
        _require_float(cls.name, q)
        b, h, t, d = shape_of(q)
        return [q, k, v, tensor([3, h, d], stat_elem(q))]


# ----------------------------------------------------------------------------
# the LM head with the loss


def _check_linear_ce(name: str, h: TensorType, w: TensorType, target: TensorType, bias: list[TensorType],
                     props: dict) -> Attribute:
    """Checks the operands of linear_cross_entropy(_backward, _with_grad); returns the logits' element type."""
    sh, sw = shape_of(h), shape_of(w)
    if len(sh) != 2 or len(sw) != 2 or sh[1] != sw[1]:
        raise VerifyException(f"{name}: expects h [N, D] and w [V, D], got {h}, {w}")
    _require_float(name, h)
    _same_elem(name, h, w)
    if shape_of(target) != sh[:1] or elem_of(target) != i64:
        raise VerifyException(f"{name}: target must be i64 [N] = [{sh[0]}], got {target}")
    if props["reduction"] not in ("mean", "sum"):
        raise VerifyException(f"{name}: reduction must be 'mean' or 'sum' ('none' stays unfused)")
    if not 0.0 <= props["label_smoothing"] <= 1.0:
        raise VerifyException(f"{name}: label_smoothing must be in [0, 1], got {props['label_smoothing']}")
    if props["chunk"] < 1:
        raise VerifyException(f"{name}: chunk must be positive, got {props['chunk']}")
    if not bias:
        return elem_of(h)
    (b,) = bias
    if shape_of(b) != (sw[0],):
        raise VerifyException(f"{name}: bias must be [V] = [{sw[0]}], got {b}")
    # the bias has the matmul's type, or f32 when a bf16 / f16 matmul's result was widened before the add
    if elem_of(b) != elem_of(h) and not (elem_of(h) != f64 and elem_of(h) != f32 and elem_of(b) == f32):
        raise VerifyException(f"{name}: bias must be {elem_of(h)} (or f32 for a 16-bit head), got {b}")
    return elem_of(b)


def _linear_ce_loss(name: str, logits: Attribute, hint: TensorType | None) -> TensorType:
    """The loss's type: the logits' or, for 16-bit logits widened before the loss, f32."""
    out = logits if hint is None else elem_of(hint)
    if out != logits and not (out == f32 and logits not in (f32, f64)):
        raise VerifyException(f"{name}: the loss must be {logits} (or f32 for 16-bit logits), got {out}")
    return tensor([], out)


def _check_loss_grad(name: str, g: TensorType) -> None:
    if shape_of(g) != () or not is_float(g):
        raise VerifyException(f"{name}: grad must be a 0-d float (the loss's cotangent), got {g}")


_LINEAR_CE_DEFAULTS: dict = {"label_smoothing": 0.0, "chunk": 4096}


@irdl_op_definition
class LinearCrossEntropyOp(NovaOp):
    """``cross_entropy(h @ w^T (+ bias), target)`` without the [N, V] logits: the
    LM head (``w`` [V, D] as nn.Linear or a tied embedding stores it) fused with
    the loss, computed ``chunk`` rows at a time. Numerics are the unfused ops':
    z = h @ w^T rounded to h's type; with a bias, logits = z + bias in the bias's
    type (f32 when a 16-bit matmul's result was widened first); softmax
    statistics in f32 (f64 for f64); the properties as nova.cross_entropy's
    (reduction "mean" or "sum" only; a mean over no rows is NaN). The loss's
    type is the logits' or, for 16-bit logits widened before the loss, f32 (the
    result type is given by the creator)."""

    name = "nova.linear_cross_entropy"
    CATEGORY: ClassVar = "contraction"
    h = operand_def(TensorType)
    w = operand_def(TensorType)
    target = operand_def(TensorType)
    bias = opt_operand_def(TensorType)
    ignore_index = prop_def(IntProp)
    reduction = prop_def(StringAttr)
    label_smoothing = prop_def(FloatProp)
    chunk = prop_def(IntProp)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    PROPS: ClassVar = ("ignore_index", "reduction", "label_smoothing", "chunk")
    PROP_DEFAULTS: ClassVar = _LINEAR_CE_DEFAULTS
    FREE_RESULT: ClassVar = True

    @classmethod
    def infer(cls, in_types, props, hint):
        h, w, target, *bias = in_types
        logits = _check_linear_ce(cls.name, h, w, target, bias, cls.complete(props))
        return [_linear_ce_loss(cls.name, logits, hint)]


@irdl_op_definition
class LinearCrossEntropyBackwardOp(NovaOp):
    """The gradients of linear_cross_entropy: with d = grad * (softmax(logits) -
    (1 - ls) onehot(target) - ls / V) * valid / max(count, 1) (mean; sum: no
    division) rounded to the logits' type, dh = d @ w and dw = d^T @ h (in h's
    type, d cast to it first, f32 accumulation), dbias = sum over rows of d;
    computed ``chunk`` rows at a time, dw and dbias accumulated across chunks."""

    name = "nova.linear_cross_entropy_backward"
    CATEGORY: ClassVar = "contraction"
    grad = operand_def(TensorType)
    h = operand_def(TensorType)
    w = operand_def(TensorType)
    target = operand_def(TensorType)
    bias = opt_operand_def(TensorType)
    ignore_index = prop_def(IntProp)
    reduction = prop_def(StringAttr)
    label_smoothing = prop_def(FloatProp)
    chunk = prop_def(IntProp)
    grad_h = result_def(TensorType)
    grad_w = result_def(TensorType)
    grad_bias = opt_result_def(TensorType)
    traits = traits_def(Pure())
    PROPS: ClassVar = ("ignore_index", "reduction", "label_smoothing", "chunk")
    PROP_DEFAULTS: ClassVar = _LINEAR_CE_DEFAULTS

    @classmethod
    def infer(cls, in_types, props, hint):
        g, h, w, target, *bias = in_types
        _check_linear_ce(cls.name, h, w, target, bias, cls.complete(props))
        _check_loss_grad(cls.name, g)
        return [h, w, *bias]


@irdl_op_definition
class LinearCrossEntropyWithGradOp(NovaOp):
    """linear_cross_entropy and its backward in one pass, for a step whose loss's
    cotangent ``grad`` is known before the loss is computed (the autodiff seed;
    the loss_grad stage merges the pair): results ``loss`` as
    nova.linear_cross_entropy's and ``grad_h``, ``grad_w`` (, ``grad_bias``) as
    nova.linear_cross_entropy_backward's, bit for bit; each chunk's logits are
    computed once, and their gradient written over them. The loss's type is given
    by the creator, as the forward op's."""

    name = "nova.linear_cross_entropy_with_grad"
    CATEGORY: ClassVar = "contraction"
    grad = operand_def(TensorType)
    h = operand_def(TensorType)
    w = operand_def(TensorType)
    target = operand_def(TensorType)
    bias = opt_operand_def(TensorType)
    ignore_index = prop_def(IntProp)
    reduction = prop_def(StringAttr)
    label_smoothing = prop_def(FloatProp)
    chunk = prop_def(IntProp)
    loss = result_def(TensorType)
    grad_h = result_def(TensorType)
    grad_w = result_def(TensorType)
    grad_bias = opt_result_def(TensorType)
    traits = traits_def(Pure())
    PROPS: ClassVar = ("ignore_index", "reduction", "label_smoothing", "chunk")
    PROP_DEFAULTS: ClassVar = _LINEAR_CE_DEFAULTS
    FREE_RESULT: ClassVar = True  # the loss's type, as the forward op's

    @classmethod
    def infer(cls, in_types, props, hint):
        g, h, w, target, *bias = in_types
        logits = _check_linear_ce(cls.name, h, w, target, bias, cls.complete(props))
        _check_loss_grad(cls.name, g)
        return [_linear_ce_loss(cls.name, logits, hint), h, w, *bias]


# ----------------------------------------------------------------------------
# checks: the guard stage's device-side counts (nova.transforms.guard), so that a
# bad step is detected without a host read and gates the update


@irdl_op_definition
class CountOutOfRangeOp(NovaOp):
    """How many ``ids`` lie outside ``[low, high)``, not counting ids equal to
    ``ignore`` (when given): a 0-d i64. Checks embedding ids (high = rows; a
    padding_idx row is in range) and class targets (ignore = ignore_index)."""

    name = "nova.count_out_of_range"
    CATEGORY: ClassVar = "reduction"
    ids = operand_def(TensorType)
    low = prop_def(IntProp)
    high = prop_def(IntProp)
    ignore = opt_prop_def(IntProp)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    PROPS: ClassVar = ("low", "high", "ignore")

    def props(self) -> dict:
        # ``ignore`` is optional: absent means every id is checked
        p = {k: prop_value(self.properties[k]) for k in ("low", "high")}
        p["ignore"] = prop_value(self.properties["ignore"]) if "ignore" in self.properties else None
        return p

    @classmethod
    def infer(cls, in_types, props, hint):
        (ids,) = in_types
        if not is_int(ids) or elem_of(ids) == i1:
            raise VerifyException(f"{cls.name}: ids must be an integer tensor, got {ids}")
        if props["low"] > props["high"]:
            raise VerifyException(f"{cls.name}: empty range [{props['low']}, {props['high']})")
        return [tensor([], i64)]


@irdl_op_definition
class CountNonfiniteOp(NovaOp):
    """How many elements of a float tensor are NaN or +-inf: a 0-d i64."""

    name = "nova.count_nonfinite"
    CATEGORY: ClassVar = "reduction"
    input = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    @classmethod
    def infer(cls, in_types, props, hint):
        (x,) = in_types
        _require_float(cls.name, x)
        return [tensor([], i64)]


CHECK_OPS: tuple[type[NovaOp], ...] = (CountOutOfRangeOp, CountNonfiniteOp)


# ----------------------------------------------------------------------------
# fusion: a group of ops that becomes one kernel (nova.transforms.fuse)

CATEGORIES: dict[str, str] = {
    "elementwise": "result element i reads element i of each operand, broadcast (right-aligned) to the result's "
                   "shape; generators (full, arange, dropout_mask) read their own flat index",
    "layout": "a view of its operand (reshape, transpose, broadcast_to, slice): the Triton backend makes a "
              "strided view, no kernel",
    "reduction": "reduces (or scans) along dims: sums, maxima, row-wise softmax / layer_norm / cross-entropy, counts",
    "contraction": "matmul, attention and the fused LM head",
    "opaque": "anything else (gathers, scatters, pad): never fused",
    "fused": "a nova.fused group",
    "collective": "communication across the ranks of the default process group (all-reduce, reduce-scatter, "
                  "all-gather) and the rank's own shard of a value: never fused (the ops: below)",
}  # fmt: skip
FUSED_KINDS = ("elementwise", "contraction", "reduction")


def column_sum(op: Operation) -> bool:
    """A column sum: a reduction that adds up (``NovaOp.SUMS``) a floating-point
    operand of rank >= 2 over every dim but the last, without keepdim (result
    [N], N the operand's last dim): what a contraction's epilogue can compute from
    its tiles (the sums of each tile's rows, then of those partials)."""
    if not isinstance(op, NovaOp) or op.CATEGORY != "reduction" or not op.SUMS or len(op.operands) != 1:
        return False
    x = op.operands[0].type
    if not isinstance(x, TensorType) or not is_float(x) or len(shape_of(x)) < 2:
        return False
    p = op.props()
    return tuple(p["dims"]) == tuple(range(len(shape_of(x)) - 1)) and not p["keepdim"]


def first_result_in_epilogue(head: Operation, x: SSAValue, ops) -> bool:
    """``x`` is row-wise ``head``'s first result and an op of ``ops`` other than ``head``
    reads it: a row epilogue's input as stored (the kernel's ``qin``), which a column
    sum of the group may add up."""
    return x is head.results[0] and any(x in o.operands for o in ops if o is not head)


def prerounded_operands(lhs: SSAValue, rhs: SSAValue, precision: str) -> tuple[str, ...]:
    """The operands ("a" for ``lhs``, "b" for ``rhs``) of a matmul on the ``precision``
    path ("tf32-rn", ...) that their producers stored rounded to tf32 (``tf32_rounded``):
    what the Triton backend launches as ``prerounded`` and the configure stage configures
    so. None off the rounded tf32 path."""
    if precision != "tf32-rn":
        return ()
    return tuple(x for x, v in zip("ab", (lhs, rhs)) if tf32_rounded(v))


def view_source(value: SSAValue) -> SSAValue:
    """The value whose storage ``value`` reads through a chain of layout views (itself if none)."""
    while isinstance(value, OpResult) and isinstance(value.op, VIEW_OPS):
        value = value.op.operands[0]
    return value


def tf32_rounded(value: SSAValue) -> bool:
    """Whether ``value`` (through layout views) is a ``nova.round_tf32`` result, or a
    group's result that one computes, or a gradient of a ``rounded`` attention
    backward, or a cat of such values: its bits are tf32 values already (the
    tf32_operands stage), so a tf32 matmul need not round it."""
    value = view_source(value)
    if not isinstance(value, OpResult):
        return False
    op = value.op
    if isinstance(op, FusedOp):
        inner = op.body.block.last_op.operands[value.index]  # the yield's value
        return isinstance(inner, OpResult) and isinstance(inner.op, RoundTf32Op)
    if isinstance(op, AttentionBackwardOp):
        return value.index < 3 and op.props()["rounded"]
    if isinstance(op, CatOp):
        return all(tf32_rounded(x) for x in op.operands)
    return isinstance(op, RoundTf32Op)


def producers(values, inside) -> set[Operation]:
    """The ops of ``inside`` (a set) that compute ``values``, directly or not (of a
    group's head: its prologue)."""
    seen: set[Operation] = set()
    stack = [v.owner for v in values if v.owner in inside]
    while stack:
        o = stack.pop()
        if o not in seen:
            seen.add(o)
            stack.extend(v.owner for v in o.operands if v.owner in inside)
    return seen


def row_sides(head: Operation, ops: list[Operation]) -> set[Operation]:
    """Of ``ops`` (a would-be or built "reduction" group's ops but its head and column
    sums, in block order), the side ops of a row-wise ``head`` that stores prologue
    values in its first pass over a row (``PROLOGUE_ROW_STORES``): those outside the
    prologue (what the head reads, directly or not) and outside the epilogue (what
    reads the head's first result, directly or not, and what those read besides the
    prologue), e.g. a LayerNorm recompute from the forward's statistics beside the
    backward that reads the same row; the kernel computes them with the prologue, in
    every pass, and stores them in the first."""
    inner = set(ops)
    prologue = producers(head.operands, inner)
    epilogue: set[Operation] = set()
    for o in ops:  # block order: what reads the head's first result, directly or not
        if any(v is head.results[0] or v.owner in epilogue for v in o.operands):
            epilogue.add(o)
    stack = list(epilogue)
    while stack:  # and what those read besides the prologue (one-element values, casts of arguments)
        o = stack.pop()
        for v in o.operands:
            if v.owner in inner and v.owner not in prologue and v.owner not in epilogue:
                epilogue.add(v.owner)
                stack.append(v.owner)
    return inner - prologue - epilogue


@irdl_op_definition
class FusedOp(NovaOp):
    """A group of ops that runs as one kernel. Operands: the group's inputs from
    outside; results: the group's values used outside. The one block's arguments
    are the operands, 1:1 (same types), its ops the original nova ops (with their
    ``nova.loc``), and it ends in ``nova.yield`` of the results. The region is
    isolated: inner ops read only block arguments and inner values.

    ``kind`` "elementwise": every inner op is of category elementwise, and every
    inner result either has the iteration shape (the first result's shape) or has
    one element (a scalar the group recomputes from scalar inputs).

    ``kind`` "contraction" (output fusion: the contraction's epilogue): the first
    inner op is a contraction whose kernel takes an epilogue (``EPILOGUE``), reading
    block arguments only; then at most one reshape of its result that keeps the
    last dim (the tile's rows relabelled: [B*T, N] as [B, T, N]); then elementwise
    ops, each result of the iteration shape (the reshape's, else the
    contraction's) or of one element; and column sums (``column_sum``) of inner
    values of the iteration shape, whose [N] results nothing inside reads (they
    are finished only after every tile). Results have the iteration shape, are the
    contraction's result (stored as it is), or are column sums.

    ``kind`` "reduction" (input fusion: a reduction with its prologue, and its
    epilogue): one op of category reduction (the head) whose ``PROLOGUE`` operands
    may be computed inside, by elementwise ops of the prologue shape (those
    operands' shape) or of one element, never yielded, each of more than one
    element read only inside the prologue or by the head at a ``PROLOGUE``
    operand; the head's other operands
    are block arguments; every other op is its epilogue (the head must take one,
    ``EPILOGUE``): elementwise ops of the shape of the head's first result, which
    is the prologue shape (a row-wise op), or of one element, reading no other
    result of the head. Results: the head's results and epilogue values. The
    iteration shape is the prologue shape. A head that computes each prologue
    element once (``PROLOGUE_STORES``) also stores prologue values: they may be
    yielded and read by any inner op, and every other op of the group is a
    prologue op too (of the prologue shape, or of one element; it may read
    nothing of the head), computed at each element and stored where yielded:
    results are then the head's and prologue values. A row-wise head that stores
    prologue values in its first pass over a row (``PROLOGUE_ROW_STORES``) keeps
    its prologue and epilogue as above, but prologue values of the prologue shape
    may be yielded (read outside the group, stored), though still by no epilogue
    op, and the group may hold side ops (``prologue_sides``: neither read by the
    head nor reading its first result), of the prologue shape, computed with the
    prologue from its values and stored where yielded. A row-wise head that sums its
    epilogue's values (``EPILOGUE_SUMS``) may be followed by column sums
    (``column_sum``) of epilogue values of its row shape (or of its first result,
    where an epilogue reads it), which nothing inside reads: results are then also
    those sums."""

    name = "nova.fused"
    CATEGORY: ClassVar = "fused"
    inputs = var_operand_def(TensorType)
    kind = prop_def(StringAttr)
    outputs = var_result_def(TensorType)
    body = region_def("single_block")
    traits = traits_def(Pure(), IsolatedFromAbove())
    PROPS: ClassVar = ("kind",)

    def inner_ops(self) -> list[Operation]:
        """The group's ops in order, without the yield."""
        return [o for o in self.body.block.ops if not isinstance(o, YieldOp)]

    def contraction(self) -> Operation | None:
        """The contraction of a "contraction" group (its first op), else None."""
        return self.body.block.first_op if self.props()["kind"] == "contraction" else None

    def reduction(self) -> Operation | None:
        """The head of a "reduction" group (its first op of category reduction; any
        later one is a column sum of its epilogue's values), else None."""
        if self.props()["kind"] != "reduction":
            return None
        return next((o for o in self.body.block.ops if isinstance(o, NovaOp) and o.CATEGORY == "reduction"), None)

    def epilogue_sums(self) -> list[Operation]:
        """A "reduction" group's column sums of its epilogue's values (every op of
        category reduction but the head)."""
        head = self.reduction()
        return [o for o in self.inner_ops() if o is not head and isinstance(o, NovaOp) and o.CATEGORY == "reduction"]

    def prologue_sides(self) -> set[Operation]:
        """A "reduction" group's side ops (``row_sides``); empty but under a head that
        stores prologue values in its first pass over a row."""
        head = self.reduction()
        if head is None or not head.stores_prologue_rows():
            return set()
        return row_sides(head, [o for o in self.inner_ops() if o is not head and o not in self.epilogue_sums()])

    def iteration_shape(self) -> tuple[int, ...]:
        """The shape the group's elementwise ops run over (a contraction group's
        epilogue: its reshape's shape, else the contraction's result shape; a
        reduction group's: its head's prologue shape)."""
        head = self.reduction()
        if head is not None:
            return shape_of(head.operands[head.PROLOGUE[0]].type) if head.PROLOGUE else shape_of(head.results[0].type)
        c = self.contraction()
        if c is None:
            return shape_of(self.results[0].type)
        shape = shape_of(c.results[0].type)
        for use in c.results[0].uses:
            if isinstance(use.operation, ReshapeOp):
                return shape_of(use.operation.results[0].type)
        return shape

    def verify_(self) -> None:
        kind = self.props()["kind"]
        if kind not in FUSED_KINDS:
            raise VerifyException(f"{self.name}: kind must be one of {FUSED_KINDS}, got {kind!r}")
        block = self.body.block
        if [a.type for a in block.args] != [o.type for o in self.operands]:
            raise VerifyException(f"{self.name}: block arguments {[str(a.type) for a in block.args]} do not match "
                                  f"the operands {[str(o.type) for o in self.operands]}")
        last = block.last_op
        if not isinstance(last, YieldOp):
            raise VerifyException(f"{self.name}: the body must end in nova.yield")
        if [v.type for v in last.operands] != [r.type for r in self.results]:
            raise VerifyException(f"{self.name}: yielded types {[str(v.type) for v in last.operands]} do not match "
                                  f"the results {[str(r.type) for r in self.results]}")
        if not self.results:
            raise VerifyException(f"{self.name}: a group without results")
        ops = self.inner_ops()
        if kind == "reduction":
            self._verify_reduction(ops)
            return
        contraction = self._verify_contraction(ops) if kind == "contraction" else None
        shape = self.iteration_shape()
        sums = set()
        for op in ops:
            if op is contraction or (contraction is not None and isinstance(op, ReshapeOp)):
                continue
            if contraction is not None and column_sum(op):
                self._verify_column_sum(op, shape)
                sums.add(op.results[0])
                continue
            if not isinstance(op, NovaOp) or op.CATEGORY != "elementwise":
                raise VerifyException(f"{self.name} ({kind}): holds {op.name}, which is not of category elementwise")
            for r in op.results:
                if shape_of(r.type) != shape and numel(shape_of(r.type)) != 1:
                    raise VerifyException(f"{self.name}: {op.name} gives {shape_of(r.type)}, neither the iteration "
                                          f"shape {shape} nor one element")
        for v, r in zip(last.operands, self.results, strict=True):
            if shape_of(r.type) != shape and (contraction is None or v is not contraction.results[0]) and v not in sums:
                raise VerifyException(f"{self.name}: result {r.type} does not have the iteration shape {shape}")

    def _verify_column_sum(self, op: Operation, shape: tuple[int, ...]) -> None:
        """A column sum in a "contraction" group: of an inner value of the
        iteration shape, its result read by nothing inside."""
        (x,) = op.operands
        if isinstance(x, BlockArgument) or shape_of(x.type) != shape:
            raise VerifyException(f"{self.name} (contraction): {op.name} must sum an inner value of the iteration "
                                  f"shape {shape}, got {'a block argument' if isinstance(x, BlockArgument) else x.type}")
        if any(not isinstance(u.operation, YieldOp) for u in op.results[0].uses):
            raise VerifyException(f"{self.name} (contraction): the column sum {op.name} is read inside the group "
                                  "(it is finished only after every tile)")

    def _verify_contraction(self, ops: list[Operation]) -> Operation:
        """The checks of a "contraction" group's head (see the class docstring)."""
        head = ops[0] if ops else None
        if not isinstance(head, NovaOp) or head.CATEGORY != "contraction" or not head.EPILOGUE:
            raise VerifyException(f"{self.name} (contraction): the first op must be a contraction that takes an "
                                  f"epilogue, got {head.name if head is not None else 'nothing'}")
        if len(head.results) != 1 or any(not isinstance(v, BlockArgument) for v in head.operands):
            raise VerifyException(f"{self.name} (contraction): {head.name} must read block arguments only and give "
                                  "one result")
        result = head.results[0]
        reshapes = [op for op in ops[1:] if isinstance(op, ReshapeOp)]
        if len(reshapes) > 1:
            raise VerifyException(f"{self.name} (contraction): at most one reshape, got {len(reshapes)}")
        for op in reshapes:
            out, src = shape_of(op.results[0].type), shape_of(result.type)
            if op.operands[0] is not result or not out or out[-1] != src[-1]:
                raise VerifyException(f"{self.name} (contraction): a reshape must read {head.name}'s result and keep "
                                      f"its last dim, got {src} -> {out}")
        for op in ops[1:]:
            if op not in reshapes and reshapes and result in op.operands:
                raise VerifyException(f"{self.name} (contraction): {op.name} reads {head.name}'s result besides its "
                                      "reshape")
        return head

    def _verify_reduction(self, ops: list[Operation]) -> None:
        """The checks of a "reduction" group (see the class docstring)."""
        heads = [op for op in ops if isinstance(op, NovaOp) and op.CATEGORY == "reduction"]
        if not heads or not (heads[0].PROLOGUE or heads[0].EPILOGUE):
            raise VerifyException(f"{self.name} (reduction): needs exactly one reduction that takes a prologue or an "
                                  f"epilogue, got {[op.name for op in heads]}")
        head, sums = heads[0], heads[1:]
        if sums and not head.EPILOGUE_SUMS:
            raise VerifyException(f"{self.name} (reduction): needs exactly one reduction that takes a prologue or an "
                                  f"epilogue, got {[op.name for op in heads]} ({head.name} sums no epilogue value)")
        ops = [op for op in ops if op not in sums]
        pro_shape = shape_of(head.operands[head.PROLOGUE[0]].type) if head.PROLOGUE else None
        epi_shape = shape_of(head.results[0].type)
        for j, v in enumerate(head.operands):
            if j in head.PROLOGUE:
                if shape_of(v.type) != pro_shape:
                    raise VerifyException(f"{self.name} (reduction): {head.name}'s prologue operands differ in shape")
            elif not isinstance(v, BlockArgument):
                raise VerifyException(f"{self.name} (reduction): {head.name}'s operand {j} is no prologue operand "
                                      "and must be a block argument")
        # the prologue: every op the head reads, directly or through other inner ops
        prologue = producers(head.operands, set(ops))
        yielded = set(self.body.block.last_op.operands)
        stores = bool(head.PROLOGUE and head.PROLOGUE_STORES)
        row_stores = head.stores_prologue_rows()
        sides = self.prologue_sides()  # computed with the prologue, so of its shape
        prologue |= sides
        for op in ops:
            if op is head:
                continue
            if not isinstance(op, NovaOp) or op.CATEGORY != "elementwise":
                raise VerifyException(f"{self.name} (reduction): holds {op.name}, which is neither its head nor of "
                                      "category elementwise")
            if stores:  # every inner op is a prologue op, its values stored where yielded
                if any(v in head.results for v in op.operands):
                    raise VerifyException(f"{self.name} (reduction): {op.name} reads {head.name}'s result, which "
                                          "its prologue cannot")
                for r in op.results:
                    if shape_of(r.type) != pro_shape and numel(shape_of(r.type)) != 1:
                        raise VerifyException(f"{self.name} (reduction): {op.name} gives {shape_of(r.type)}, neither "
                                              f"the prologue shape {pro_shape} nor one element")
                    if r in yielded and shape_of(r.type) != pro_shape:
                        raise VerifyException(f"{self.name} (reduction): yields {op.name}'s one-element value (a "
                                              f"prologue stores values of its shape {pro_shape} only)")
                continue
            part, shape = ("prologue", pro_shape) if op in prologue else ("epilogue", epi_shape)
            if part == "epilogue" and (not head.EPILOGUE or epi_shape != pro_shape and head.PROLOGUE):
                raise VerifyException(f"{self.name} (reduction): {op.name} is an epilogue, which {head.name} does not "
                                      "take here")
            for r in op.results:
                if shape_of(r.type) != shape and numel(shape_of(r.type)) != 1:
                    raise VerifyException(f"{self.name} (reduction): {op.name} gives {shape_of(r.type)}, neither the "
                                          f"{part} shape {shape} nor one element")
                stored = row_stores and shape_of(r.type) == pro_shape  # yielded: written in the first pass
                if part == "prologue" and (r in yielded and not stored or numel(shape_of(r.type)) != 1 and any(
                        u.operation is head and u.index not in head.PROLOGUE
                        or u.operation is not head and u.operation not in prologue
                        and not (stored and isinstance(u.operation, YieldOp)) for u in r.uses)):
                    raise VerifyException(f"{self.name} (reduction): the prologue value of {op.name} is read "
                                          f"outside the prologue")  # fmt: skip
            if any(v in head.results[1:] for v in op.operands):
                raise VerifyException(f"{self.name} (reduction): {op.name} reads a result of {head.name} other than "
                                      "its first")
        for op in sums:  # column sums of epilogue values, finished after every row
            x = op.operands[0] if len(op.operands) == 1 else None
            inner = x is not None and not isinstance(x, BlockArgument) and x.owner in ops
            # an epilogue value, or the head's first result as the epilogue reads it
            first = inner and first_result_in_epilogue(head, x, ops)
            if (not column_sum(op) or not inner or x.owner is head and not first or x.owner in prologue
                    or shape_of(x.type) != epi_shape):  # fmt: skip
                raise VerifyException(f"{self.name} (reduction): {op.name} must be a column sum of an epilogue value of "
                                      f"{head.name}'s row shape {epi_shape}")
            if any(not isinstance(u.operation, YieldOp) for u in op.results[0].uses):
                raise VerifyException(f"{self.name} (reduction): the column sum {op.name} is read inside the group "
                                      "(it is finished only after every row)")


@irdl_op_definition
class YieldOp(IRDLOperation):
    """The values a nova.fused group gives to the outside, in result order."""

    name = "nova.yield"
    values = var_operand_def(TensorType)
    traits = traits_def(IsTerminator(), HasParent(FusedOp), Pure())


NOVA_OPS: list[type[NovaOp]] = [
    AddOp, SubOp, MulOp, DivOp, MaximumOp, PowOp,
    EqOp, NeOp, LtOp, LeOp, GtOp, GeOp, WhereOp,
    NegOp, ExpOp, LogOp, SqrtOp, RsqrtOp, TanhOp, SigmoidOp, ReluOp, CosOp, SinOp, AbsOp, Log1pOp, Expm1Op,
    GeluOp, GeluBackwardOp, RoundTf32Op, CastOp, FullOp, ArangeOp, DropoutMaskOp, StopGradientOp,
    ReshapeOp, TransposeOp, BroadcastToOp, SliceOp, PadOp, CatOp,
    ReduceSumOp, ReduceMaxOp, CumsumOp, MatmulOp,
    SoftmaxOp, LogSoftmaxOp, SoftmaxBackwardOp, LogSoftmaxBackwardOp,
    LayerNormOp, LayerNormBackwardOp, EmbeddingOp, EmbeddingBackwardOp,
    CrossEntropyOp, CrossEntropyBackwardOp, AttentionOp, AttentionBackwardOp,
    LinearCrossEntropyOp, LinearCrossEntropyBackwardOp, LinearCrossEntropyWithGradOp,
    CountOutOfRangeOp, CountNonfiniteOp,
]  # fmt: skip

# the layout views: strided views of their operand in the Triton backend, no kernel
VIEW_OPS: tuple[type[NovaOp], ...] = (TransposeOp, BroadcastToOp, SliceOp, ReshapeOp)

# ops that steer autodiff only and are gone before configure (simplify removes them)
AUTODIFF_ONLY: tuple[type[NovaOp], ...] = (StopGradientOp,)


@irdl_attr_definition
class LoweringConfigAttr(ParametrizedAttribute):
    """``#nova.lowering_config<{...}>``: the schedule the Analytic Configurator
    chose for an op (the fields of ``nova.schedule.config.LoweringConfig``),
    attached to the op as its ``nova.lowering_config`` attribute."""

    name = "nova.lowering_config"
    config: DictionaryAttr


# ----------------------------------------------------------------------------
# collectives: data parallelism across the ranks of torch.distributed's default
# process group (the distribute stage, nova.transforms.distribute). Not pure: every
# rank must issue the same collectives in the same order, so no pass may drop,
# merge or reorder one; fusion leaves category "collective" alone (it groups only
# elementwise ops). The executors run them through torch.distributed
# (nova.runtime.distributed): gloo on CPUs, NCCL on GPUs.


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class _CollectiveOp(NovaOp):
    """Operands of one element type, treated as one flat bucket in operand order."""

    CATEGORY: ClassVar = "collective"
    inputs = var_operand_def(TensorType)
    outputs = var_result_def(TensorType)
    world_size = prop_def(IntProp)
    bucket = prop_def(IntProp)  # the bucket's index in issue order (explain, the runtime's names)
    PROPS: ClassVar = ("world_size", "bucket")

    @classmethod
    def _check(cls, in_types, props) -> None:
        if not in_types:
            raise VerifyException(f"{cls.name}: needs at least one operand")
        _same_elem(cls.name, *in_types)
        if props["world_size"] < 1:
            raise VerifyException(f"{cls.name}: world_size must be >= 1, got {props['world_size']}")
        if props.get("average") and not is_float(in_types[0]):
            raise VerifyException(f"{cls.name}: average needs floating-point operands, got {in_types[0]}")


@irdl_op_definition
class AllReduceOp(_CollectiveOp):
    """The sum over ranks of each operand (same types out). ``average``: each
    operand is multiplied by 1/world_size (in its own type) before the sum, as
    DistributedDataParallel's reducer does by default (``mul_out(bucket_view,
    grad, 1/div_factor)`` while copying into the bucket), so the result is the
    rank-mean with DDP's rounding."""

    name = "nova.all_reduce"
    average = prop_def(BoolProp)
    PROPS: ClassVar = ("world_size", "bucket", "average")

    @classmethod
    def infer(cls, in_types, props, hint):
        cls._check(in_types, props)
        return list(in_types)


@irdl_op_definition
class ReduceScatterOp(_CollectiveOp):
    """The rank's shard of the sum over ranks (``average`` as all_reduce's). Each
    operand of n elements is flattened, zero-padded to world_size * ceil(n /
    world_size) and split into world_size equal shards; result i is this rank's
    shard of operand i, 1-D of ceil(n / world_size) elements."""

    name = "nova.reduce_scatter"
    average = prop_def(BoolProp)
    PROPS: ClassVar = ("world_size", "bucket", "average")

    @classmethod
    def infer(cls, in_types, props, hint):
        cls._check(in_types, props)
        w = props["world_size"]
        return [tensor([_ceil_div(numel(shape_of(t)), w)], elem_of(t)) for t in in_types]


@irdl_op_definition
class AllGatherOp(_CollectiveOp):
    """The inverse of the sharding: operand i is this rank's 1-D shard of a value of
    ``numels[i]`` elements (ceil(numels[i] / world_size) of them); result i is the
    whole value, 1-D, every rank's shard in rank order, the padding dropped."""

    name = "nova.all_gather"
    numels = prop_def(DenseArrayBase)
    PROPS: ClassVar = ("world_size", "bucket", "numels")

    @classmethod
    def infer(cls, in_types, props, hint):
        cls._check(in_types, props)
        w, numels = props["world_size"], props["numels"]
        if len(numels) != len(in_types):
            raise VerifyException(f"{cls.name}: {len(numels)} numels for {len(in_types)} operands")
        out = []
        for t, n in zip(in_types, numels, strict=True):
            if shape_of(t) != (_ceil_div(n, w),):
                raise VerifyException(f"{cls.name}: a shard of {n} elements over {w} ranks is "
                                      f"[{_ceil_div(n, w)}], got {shape_of(t)}")  # fmt: skip
            out.append(tensor([n], elem_of(t)))
        return out


@irdl_op_definition
class LocalShardOp(NovaOp):
    """This rank's shard of ``input`` (flattened, zero-padded, split as
    reduce_scatter splits it): 1-D of ceil(n / world_size) elements. No
    communication, but its value depends on the rank, known only at run time."""

    name = "nova.local_shard"
    CATEGORY: ClassVar = "collective"
    input = operand_def(TensorType)
    world_size = prop_def(IntProp)
    result = result_def(TensorType)
    PROPS: ClassVar = ("world_size",)

    @classmethod
    def infer(cls, in_types, props, hint):
        (x,) = in_types
        if props["world_size"] < 1:
            raise VerifyException(f"{cls.name}: world_size must be >= 1, got {props['world_size']}")
        return [tensor([_ceil_div(numel(shape_of(x)), props["world_size"])], elem_of(x))]


COLLECTIVE_OPS: tuple[type[NovaOp], ...] = (AllReduceOp, ReduceScatterOp, AllGatherOp, LocalShardOp)


# the fuse stage's structure: not ops of a step before fusion (no VJP rule, no lowering of their own kind)
STRUCTURAL_OPS: tuple[type[IRDLOperation], ...] = (FusedOp, YieldOp)

Nova = Dialect("nova", [*NOVA_OPS, *STRUCTURAL_OPS, *COLLECTIVE_OPS], [LoweringConfigAttr])

OP_BY_NAME: dict[str, type[NovaOp]] = {op.name: op for op in NOVA_OPS}

__all__ = [op.__name__ for op in (*NOVA_OPS, *STRUCTURAL_OPS, *COLLECTIVE_OPS)] + ["column_sum", "CHECK_OPS", "COLLECTIVE_OPS", "CATEGORIES", "STRUCTURAL_OPS", "Nova", "NovaOp", "OP_BY_NAME", "prop_value", "make_prop"]
