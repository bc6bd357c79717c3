"""Vector-Jacobian products of the nova ops, one rule per op, side by side.

A rule receives the builder (anchored where the backward goes), the forward op
and one cotangent per result (None: zero, or not needed), and returns one
cotangent per operand (None: zero, or the operand is not differentiable). Each
returned cotangent has exactly its operand's type; rules of broadcasting ops
sum the broadcast dimensions away with ``b.sum_to``. Rules build IR only
through the builder, so every op they create is type-inferred like any other.

Ops without a gradient are registered as such (``nondifferentiable``) instead
of being left out: a missing entry always means "nobody wrote this rule yet",
and the pass turns it into an ``AutodiffError`` naming the op.
"""

from __future__ import annotations

from collections.abc import Callable

from xdsl.dialects.builtin import i64
from xdsl.ir import Operation, SSAValue

from nova.errors import AutodiffError
from nova.ir import dialect as nv
from nova.ir.builder import OpBuilder
from nova.ir.types import elem_of, is_float, shape_of, tensor

Cotangents = list[SSAValue | None]
Rule = Callable[[OpBuilder, Operation, Cotangents], Cotangents]

VJP_RULES: dict[type[nv.NovaOp], Rule] = {}
# ops registered as having no gradient (their rule returns only Nones, or raises)
NON_DIFFERENTIABLE: set[type[nv.NovaOp]] = set()


def defvjp(*op_classes: type[nv.NovaOp]):
    """Registers the decorated function as the VJP rule of ``op_classes``."""

    def register(fn: Rule) -> Rule:
        for c in op_classes:
            if c in VJP_RULES:
                raise ValueError(f"{c.name} already has a VJP rule")
            VJP_RULES[c] = fn
        return fn

    return register


def nondifferentiable(*op_classes: type[nv.NovaOp]) -> None:
    """Ops whose results carry no gradient to their operands (integer or
    boolean results, constants, random masks)."""

    def no_grad(b: OpBuilder, op: Operation, cts: Cotangents) -> Cotangents:
        return [None] * len(op.operands)

    defvjp(*op_classes)(no_grad)
    NON_DIFFERENTIABLE.update(op_classes)


def second_order(*op_classes: type[nv.NovaOp]) -> None:
    """The hand-written adjoints: differentiating them again is not supported."""

    def unsupported(b: OpBuilder, op: Operation, cts: Cotangents) -> Cotangents:
        raise AutodiffError(f"second-order differentiation of {op.name} is not supported")

    defvjp(*op_classes)(unsupported)
    NON_DIFFERENTIABLE.update(op_classes)


def _shape(v: SSAValue) -> tuple[int, ...]:
    return shape_of(v.type)


def _zero(b: OpBuilder, like: SSAValue) -> SSAValue:
    return b.scalar(0.0, like)


def _unbroadcast(b: OpBuilder, op: Operation, cts: list[SSAValue]) -> Cotangents:
    """Cotangents of the broadcast result, summed to each operand's shape."""
    return [b.sum_to(c, _shape(x)) for c, x in zip(cts, op.operands, strict=True)]


# ----------------------------------------------------------------------------
# binary elementwise (numpy broadcasting)


@defvjp(nv.AddOp)
def _add(b, op, cts):
    (g,) = cts
    return _unbroadcast(b, op, [g, g])


@defvjp(nv.SubOp)
def _sub(b, op, cts):
    (g,) = cts
    return _unbroadcast(b, op, [g, b.neg(g)])


@defvjp(nv.MulOp)
def _mul(b, op, cts):
    (g,) = cts
    x, y = op.operands
    if x is y:
        # x * x (torch's pow(x, 2) and square): one cotangent g * 2x, as torch's
        # pow backward computes it, not two halves that autodiff adds later
        # (summed with x's other uses in another order, they round differently)
        return [b.mul(g, b.scale(x, 2.0)), None]
    return _unbroadcast(b, op, [b.mul(g, y), b.mul(g, x)])


@defvjp(nv.DivOp)
def _div(b, op, cts):
    (g,) = cts
    x, y = op.operands
    gx = b.div(g, y)
    # d(x/y)/dy = -(x/y)/y
    gy = b.neg(b.div(b.mul(g, op.results[0]), y))
    return _unbroadcast(b, op, [gx, gy])


@defvjp(nv.MaximumOp)
def _maximum(b, op, cts):
    # torch.maximum: where x == y each side gets half of the gradient
    (g,) = cts
    x, y = op.operands
    zero = _zero(b, g)
    tie = b.where(b.one(nv.EqOp, [x, y]), b.scale(g, 0.5), zero)
    gx = b.where(b.one(nv.GtOp, [x, y]), g, tie)
    gy = b.where(b.one(nv.LtOp, [x, y]), g, tie)
    return _unbroadcast(b, op, [gx, gy])


@defvjp(nv.PowOp)
def _pow(b, op, cts):
    # torch's conventions: no gradient to the base where the exponent is 0, and
    # none to the exponent where the base is 0 and the exponent >= 0 (0**y)
    (g,) = cts
    x, y = op.operands
    out = op.results[0]
    zero = _zero(b, g)
    dx = b.mul(g, b.mul(y, b.one(nv.PowOp, [x, b.sub(y, b.scalar(1.0, y))])))
    gx = b.where(b.one(nv.EqOp, [y, b.scalar(0.0, y)]), zero, dx)
    dy = b.mul(g, b.mul(out, b.one(nv.LogOp, [x])))
    y_nonneg = b.one(nv.GeOp, [y, b.scalar(0.0, y)])
    gy = b.where(b.one(nv.EqOp, [x, b.scalar(0.0, x)]), b.where(y_nonneg, zero, dy), dy)
    return _unbroadcast(b, op, [gx, gy])


@defvjp(nv.WhereOp)
def _where(b, op, cts):
    (g,) = cts
    cond, x, y = op.operands
    zero = _zero(b, g)
    gx = b.sum_to(b.where(cond, g, zero), _shape(x))
    gy = b.sum_to(b.where(cond, zero, g), _shape(y))
    return [None, gx, gy]


nondifferentiable(nv.EqOp, nv.NeOp, nv.LtOp, nv.LeOp, nv.GtOp, nv.GeOp)

# ----------------------------------------------------------------------------
# unary elementwise


@defvjp(nv.NegOp)
def _neg(b, op, cts):
    return [b.neg(cts[0])]


@defvjp(nv.ExpOp)
def _exp(b, op, cts):
    return [b.mul(cts[0], op.results[0])]


@defvjp(nv.LogOp)
def _log(b, op, cts):
    return [b.div(cts[0], op.operands[0])]


@defvjp(nv.SqrtOp)
def _sqrt(b, op, cts):
    return [b.div(cts[0], b.scale(op.results[0], 2.0))]


@defvjp(nv.RsqrtOp)
def _rsqrt(b, op, cts):
    # d(x^-1/2)/dx = -1/2 * (x^-1/2)^3
    y = op.results[0]
    return [b.mul(b.scale(cts[0], -0.5), b.mul(y, b.mul(y, y)))]


@defvjp(nv.TanhOp)
def _tanh(b, op, cts):
    y = op.results[0]
    return [b.mul(cts[0], b.sub(b.scalar(1.0, y), b.mul(y, y)))]


@defvjp(nv.SigmoidOp)
def _sigmoid(b, op, cts):
    y = op.results[0]
    return [b.mul(cts[0], b.mul(y, b.sub(b.scalar(1.0, y), y)))]


@defvjp(nv.ReluOp)
def _relu(b, op, cts):
    # as torch's threshold_backward: the gradient passes where the output is > 0
    y = op.results[0]
    positive = b.one(nv.GtOp, [y, b.scalar(0.0, y)])
    return [b.where(positive, cts[0], _zero(b, y))]


@defvjp(nv.CosOp)
def _cos(b, op, cts):
    return [b.neg(b.mul(cts[0], b.one(nv.SinOp, [op.operands[0]])))]


@defvjp(nv.SinOp)
def _sin(b, op, cts):
    return [b.mul(cts[0], b.one(nv.CosOp, [op.operands[0]]))]


@defvjp(nv.Log1pOp)
def _log1p(b, op, cts):
    # torch: grad / (x + 1)
    x = op.operands[0]
    return [b.div(cts[0], b.add(x, b.scalar(1.0, x)))]


@defvjp(nv.Expm1Op)
def _expm1(b, op, cts):
    # torch: grad * (result + 1)
    y = op.results[0]
    return [b.mul(cts[0], b.add(y, b.scalar(1.0, y)))]


@defvjp(nv.AbsOp)
def _abs(b, op, cts):
    # torch: g * sign(x), so no gradient at 0
    x, g = op.operands[0], cts[0]
    zero = _zero(b, g)
    pos = b.where(b.one(nv.GtOp, [x, _zero(b, x)]), g, zero)
    return [b.where(b.one(nv.LtOp, [x, _zero(b, x)]), b.neg(g), pos)]


@defvjp(nv.GeluOp)
def _gelu(b, op, cts):
    props = {"approximate": op.props()["approximate"]}
    return [b.one(nv.GeluBackwardOp, [cts[0], op.operands[0]], props)]


@defvjp(nv.CastOp)
def _cast(b, op, cts):
    x = op.operands[0]
    return [b.cast(cts[0], elem_of(x.type)) if is_float(x.type) else None]


nondifferentiable(nv.FullOp, nv.ArangeOp, nv.DropoutMaskOp, nv.StopGradientOp)
# the guard stage's counts: integer results, and they appear only after autodiff anyway
nondifferentiable(*nv.CHECK_OPS)

# ----------------------------------------------------------------------------
# shapes


@defvjp(nv.ReshapeOp)
def _reshape(b, op, cts):
    return [b.reshape(cts[0], _shape(op.operands[0]))]


@defvjp(nv.TransposeOp)
def _transpose(b, op, cts):
    perm = op.props()["perm"]
    inverse = [0] * len(perm)
    for i, p in enumerate(perm):
        inverse[p] = i
    return [b.transpose(cts[0], inverse)]


@defvjp(nv.BroadcastToOp)
def _broadcast_to(b, op, cts):
    return [b.sum_to(cts[0], _shape(op.operands[0]))]


@defvjp(nv.SliceOp)
def _slice(b, op, cts):
    p = op.props()
    size = _shape(op.operands[0])[p["dim"]]
    props = {"dim": p["dim"], "start": p["start"], "step": p["step"], "size": size}
    return [b.one(nv.PadOp, [cts[0]], props)]


@defvjp(nv.PadOp)
def _pad(b, op, cts):
    p = op.props()
    n = _shape(op.operands[0])[p["dim"]]
    start = min(p["start"], p["size"])
    end = start + (n - 1) * p["step"] + 1 if n else start
    props = {"dim": p["dim"], "start": start, "end": end, "step": p["step"]}
    return [b.one(nv.SliceOp, [cts[0]], props)]


@defvjp(nv.CatOp)
def _cat(b, op, cts):
    d = op.props()["dim"]
    out, start = [], 0
    for x in op.operands:
        n = _shape(x)[d]
        out.append(b.one(nv.SliceOp, [cts[0]], {"dim": d, "start": start, "end": start + n, "step": 1}))
        start += n
    return out


def _keepdim_shape(op: Operation) -> list[int]:
    dims = op.props()["dims"]
    return [1 if i in dims else s for i, s in enumerate(_shape(op.operands[0]))]


@defvjp(nv.ReduceSumOp)
def _reduce_sum(b, op, cts):
    x = op.operands[0]
    return [b.broadcast_to(b.reshape(cts[0], _keepdim_shape(op)), _shape(x))]


@defvjp(nv.ReduceMaxOp)
def _reduce_max(b, op, cts):
    # As torch.amax: the gradient goes to every position equal to the maximum,
    # divided evenly among ties (torch.max(dim) would pick one index instead).
    x = op.operands[0]
    keep = _keepdim_shape(op)
    g = b.reshape(cts[0], keep)
    is_max = b.one(nv.EqOp, [x, b.reshape(op.results[0], keep)])
    ones = b.where(is_max, b.scalar(1.0, x), _zero(b, x))
    count = b.reduce_sum(ones, op.props()["dims"], keepdim=True)
    return [b.where(is_max, b.div(g, count), _zero(b, x))]


@defvjp(nv.CumsumOp)
def _cumsum(b, op, cts):
    # each input element feeds every later prefix: the adjoint sums from the end
    p = op.props()
    return [b.one(nv.CumsumOp, [cts[0]], {"dim": p["dim"], "reverse": not p["reverse"]})]


# ----------------------------------------------------------------------------
# contraction


@defvjp(nv.MatmulOp)
def _matmul(b, op, cts):
    # batch dims broadcast like elementwise ops: sum them back to each operand
    (g,) = cts
    x, y = op.operands
    gx = b.matmul(g, b.swap_last(y))
    gy = b.matmul(b.swap_last(x), g)
    return [b.sum_to(gx, _shape(x)), b.sum_to(gy, _shape(y))]


# ----------------------------------------------------------------------------
# neural-network ops: their adjoints are dedicated ops


@defvjp(nv.SoftmaxOp)
def _softmax(b, op, cts):
    return [b.one(nv.SoftmaxBackwardOp, [op.results[0], cts[0]], {"dim": op.props()["dim"]})]


@defvjp(nv.LogSoftmaxOp)
def _log_softmax(b, op, cts):
    return [b.one(nv.LogSoftmaxBackwardOp, [op.results[0], cts[0]], {"dim": op.props()["dim"]})]


def _add_opt(b: OpBuilder, acc: SSAValue | None, c: SSAValue) -> SSAValue:
    return c if acc is None else b.add(acc, c)


@defvjp(nv.LayerNormOp)
def _layer_norm(b, op, cts):
    g, g_mean, g_rstd = cts
    x, w, _ = op.operands
    _, mean, rstd = op.results
    gx = gw = gb = None
    if g is not None:
        bwd = b.create(nv.LayerNormBackwardOp, [g, x, w, mean, rstd])
        gx, gw, gb = bwd.results
    # The statistics are rarely used, but are results like any other:
    # d mean/dx = 1/n and d rstd/dx = -rstd^3 (x - mean) / n.
    shape = _shape(x)
    n = shape[-1]
    col = [*shape[:-1], 1]
    if g_mean is not None:
        gx = _add_opt(b, gx, b.broadcast_to(b.reshape(b.scale(g_mean, 1.0 / n), col), shape))
    if g_rstd is not None:
        r3 = b.mul(rstd, b.mul(rstd, rstd))
        coef = b.reshape(b.scale(b.mul(g_rstd, r3), -1.0 / n), col)
        gx = _add_opt(b, gx, b.mul(coef, b.sub(x, b.reshape(mean, col))))
    return [gx, gw, gb]


@defvjp(nv.EmbeddingOp)
def _embedding(b, op, cts):
    # embedding_backward scatter-adds, so repeated ids accumulate; the
    # padding_idx row (if any) gets none, as in torch
    w, ids = op.operands
    props = {"num_embeddings": _shape(w)[0], "padding_idx": op.props()["padding_idx"]}
    return [b.one(nv.EmbeddingBackwardOp, [cts[0], ids], props), None]


@defvjp(nv.CrossEntropyOp)
def _cross_entropy(b, op, cts):
    logits, target = op.operands
    return [b.one(nv.CrossEntropyBackwardOp, [cts[0], logits, target], op.props()), None]


@defvjp(nv.AttentionOp)
def _attention(b, op, cts):
    g, g_lse = cts
    q, k, v, *tail = op.operands
    bias, seed = nv.attention_tail(tail, op.props())
    out, lse = op.results
    gq = gk = gv = gbias = None
    if g is not None:
        bwd = b.create(nv.AttentionBackwardOp, [g, q, k, v, out, lse, *tail], op.props())
        gq, gk, gv = bwd.results
        if bias:
            # d scores / d bias = 1: the bias gets the unscaled dS. Built from
            # plain ops (the fused backward does not return it); autodiff erases
            # them again unless the bias depends on a parameter.
            gbias = _attention_dbias(b, op, g)
    if g_lse is not None:
        dq, dk, ds = _lse_vjp(b, op, g_lse)
        gq, gk = _add_opt(b, gq, dq), _add_opt(b, gk, dk)
        if bias:
            gbias = _add_opt(b, gbias, b.sum_to(b.cast(ds, elem_of(bias[0].type)), _shape(bias[0])))
    return [gq, gk, gv, *([gbias] if bias else []), *([None] if seed else [])]  # the seed has no cotangent


def _attention_probs(b: OpBuilder, op: Operation) -> tuple[SSAValue, SSAValue, SSAValue]:
    """The attention probabilities P [B, H, Tq, Tk] rebuilt from q, k, the bias
    and lse, in lse's (statistics) element type, with q and k cast to it; 0 on
    rows that mask every key."""
    q, k, _, *tail = op.operands
    lse = op.results[1]
    p = op.props()
    bias, _ = nv.attention_tail(tail, p)
    elem = elem_of(lse.type)
    bsz, heads, tq, _ = _shape(q)
    tk = _shape(k)[2]
    qs, ks = b.cast(q, elem), b.cast(k, elem)
    scores = b.scale(b.matmul(qs, b.swap_last(ks)), p["scale"])
    if bias:
        scores = b.add(scores, b.cast(bias[0], elem))
    lse4 = b.reshape(lse, [bsz, heads, tq, 1])
    probs = b.one(nv.ExpOp, [b.sub(scores, lse4)])
    zero = _zero(b, probs)
    if p["causal"]:  # top-left aligned: query i sees keys j <= i
        rows = b.reshape(_arange(b, tq), [tq, 1])
        cols = b.reshape(_arange(b, tk), [1, tk])
        probs = b.where(b.one(nv.GeOp, [rows, cols]), probs, zero)
    if bias:  # a row with lse = -inf masks every key: P is 0 there, not NaN
        dead = b.one(nv.EqOp, [lse4, b.scalar(float("-inf"), lse4)])
        probs = b.where(dead, zero, probs)
    return probs, qs, ks


def _attention_dbias(b: OpBuilder, op: Operation, g: SSAValue) -> SSAValue:
    """dS = P * (dP - rowsum(dO * O)) with dP = dO V^T (times the dropout
    multiplier Z with dropout: dP = (dO V^T) Z), summed to the bias's shape."""
    _, _, v, *tail = op.operands
    p = op.props()
    (bias,), seed = nv.attention_tail(tail, p)
    out = op.results[0]
    probs, _, _ = _attention_probs(b, op)
    elem = elem_of(probs.type)
    gs, vs, os = b.cast(g, elem), b.cast(v, elem), b.cast(out, elem)
    dp = b.matmul(gs, b.swap_last(vs))
    if seed:  # the forward's multiplier: the same bits at the same flat indices of [B, H, Tq, Tk]
        z = b.one(nv.DropoutMaskOp, seed, {"p": p["dropout"], "salt": p["salt"]}, probs.type)
        dp = b.mul(dp, z)
    delta = b.reduce_sum(b.mul(gs, os), [3], keepdim=True)
    ds = b.mul(probs, b.sub(dp, delta))
    return b.sum_to(b.cast(ds, elem_of(bias.type)), _shape(bias))


def _lse_vjp(b: OpBuilder, op: Operation, g_lse: SSAValue) -> tuple[SSAValue, SSAValue, SSAValue]:
    """Cotangents of q and k from lse's: d lse/d scores = the attention
    probabilities P, so dS = P * g_lse and dq = scale dS k, dk = scale dS^T q
    (dS itself is the bias's). Computed in lse's (statistics) element type."""
    q, k = op.operands[0], op.operands[1]
    p = op.props()
    bsz, heads, tq, _ = _shape(q)
    probs, qs, ks = _attention_probs(b, op)
    ds = b.mul(probs, b.reshape(g_lse, [bsz, heads, tq, 1]))
    dss = b.scale(ds, p["scale"])
    dq = b.matmul(dss, ks)
    dk = b.matmul(b.swap_last(dss), qs)
    return b.cast(dq, elem_of(q.type)), b.cast(dk, elem_of(k.type)), ds


def _arange(b: OpBuilder, n: int) -> SSAValue:
    return b.one(nv.ArangeOp, [], {"start": 0, "step": 1}, tensor([n], i64))

second_order(
    nv.GeluBackwardOp,
    nv.SoftmaxBackwardOp,
    nv.LogSoftmaxBackwardOp,
    nv.LayerNormBackwardOp,
    nv.EmbeddingBackwardOp,
    nv.CrossEntropyBackwardOp,
    nv.AttentionBackwardOp,
)


@defvjp(nv.LinearCrossEntropyOp)
def _linear_cross_entropy(b, op, cts):
    h, w, target, *bias = op.operands
    bwd = b.create(nv.LinearCrossEntropyBackwardOp, [cts[0], h, w, target, *bias], op.props())
    grads = list(bwd.results)
    return [grads[0], grads[1], None, *grads[2:]]


second_order(nv.LinearCrossEntropyBackwardOp, nv.LinearCrossEntropyWithGradOp)  # the latter: loss_grad, after autodiff
second_order(nv.RoundTf32Op)  # made by the tf32_operands stage, after autodiff: never differentiated
