"""The reference executor: runs nova IR op by op with torch operations.

It is the oracle every backend and every pass is tested against, so each op's
implementation here is the plainest correct one, on any torch device and dtype.
Statistics (softmax sums, attention scores, norms) of low-precision inputs are
computed in f32, as the dialect specifies.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from xdsl.dialects import func
from xdsl.ir import Operation, SSAValue

from nova import rng
from nova.ir import dialect as nv
from nova.ir.types import elem_of, shape_of, to_torch_dtype

Impl = Callable[[Operation, list[torch.Tensor]], Sequence[torch.Tensor]]
IMPLS: dict[type, Impl] = {}


def impl(*op_classes):
    def register(fn):
        for c in op_classes:
            IMPLS[c] = fn
        return fn

    return register


def _wide(x: torch.Tensor) -> torch.Tensor:
    """Low-precision floats are widened to f32 for statistics."""
    return x.float() if x.dtype in (torch.bfloat16, torch.float16) else x


def _result_dtype(op: Operation, i: int = 0) -> torch.dtype:
    return to_torch_dtype(elem_of(op.results[i].type))


_BINARY = {
    nv.AddOp: torch.add, nv.SubOp: torch.sub, nv.MulOp: torch.mul, nv.DivOp: torch.div,
    nv.MaximumOp: torch.maximum, nv.PowOp: torch.pow,
    nv.EqOp: torch.eq, nv.NeOp: torch.ne, nv.LtOp: torch.lt, nv.LeOp: torch.le,
    nv.GtOp: torch.gt, nv.GeOp: torch.ge,
}  # fmt: skip
_UNARY = {
    nv.NegOp: torch.neg, nv.ExpOp: torch.exp, nv.LogOp: torch.log, nv.SqrtOp: torch.sqrt,
    nv.RsqrtOp: torch.rsqrt, nv.TanhOp: torch.tanh, nv.SigmoidOp: torch.sigmoid, nv.ReluOp: torch.relu,
    nv.CosOp: torch.cos, nv.SinOp: torch.sin, nv.AbsOp: torch.abs,
    nv.Log1pOp: torch.log1p, nv.Expm1Op: torch.expm1,
}  # fmt: skip


@impl(*_BINARY)
def _binary(op, xs):
    return [_BINARY[type(op)](xs[0], xs[1])]


@impl(*_UNARY)
def _unary(op, xs):
    return [_UNARY[type(op)](xs[0])]


@impl(nv.WhereOp)
def _where(op, xs):
    return [torch.where(*xs)]


@impl(nv.StopGradientOp)
def _stop_gradient(op, xs):
    return [xs[0]]


@impl(nv.GeluOp)
def _gelu(op, xs):
    return [F.gelu(xs[0], approximate=op.props()["approximate"])]


@impl(nv.RoundTf32Op)
def _round_tf32(op, xs):
    # the matmul template's TF32_RN on the host (the op exists only in programs for the Triton target)
    from nova.codegen.triton.matmul import round_to_tf32

    return [round_to_tf32(xs[0])]


@impl(nv.GeluBackwardOp)
def _gelu_bwd(op, xs):
    return [torch.ops.aten.gelu_backward(xs[0], xs[1], approximate=op.props()["approximate"])]


@impl(nv.CastOp)
def _cast(op, xs):
    return [xs[0].to(_result_dtype(op))]


@impl(nv.FullOp)
def _full(op, xs, device=None):
    return [torch.full(shape_of(op.results[0].type), op.props()["value"], dtype=_result_dtype(op), device=device)]


@impl(nv.ArangeOp)
def _arange(op, xs, device=None):
    p, (n,) = op.props(), shape_of(op.results[0].type)
    r = torch.arange(n, dtype=torch.int64, device=device) * p["step"] + p["start"]
    return [r.to(_result_dtype(op))]


@impl(nv.DropoutMaskOp)
def _dropout_mask(op, xs):
    p = op.props()
    shape = shape_of(op.results[0].type)
    return [rng.dropout_scale(xs[0], p["salt"], shape, p["p"], _result_dtype(op), xs[0].device)]


@impl(nv.ReshapeOp)
def _reshape(op, xs):
    return [xs[0].reshape(shape_of(op.results[0].type))]


@impl(nv.TransposeOp)
def _transpose(op, xs):
    return [xs[0].permute(op.props()["perm"])]


@impl(nv.BroadcastToOp)
def _broadcast(op, xs):
    return [xs[0].expand(shape_of(op.results[0].type))]


@impl(nv.SliceOp)
def _slice(op, xs):
    p = op.props()
    idx = [slice(None)] * xs[0].dim()
    idx[p["dim"]] = slice(p["start"], p["end"], p["step"])
    return [xs[0][tuple(idx)]]


@impl(nv.PadOp)
def _pad(op, xs):
    p, x = op.props(), xs[0]
    out = x.new_zeros(shape_of(op.results[0].type))
    idx = [slice(None)] * x.dim()
    idx[p["dim"]] = slice(p["start"], p["start"] + x.shape[p["dim"]] * p["step"], p["step"])
    out[tuple(idx)] = x
    return [out]


@impl(nv.CatOp)
def _cat(op, xs):
    return [torch.cat(xs, dim=op.props()["dim"])]


@impl(nv.ReduceSumOp)
def _sum(op, xs):
    p = op.props()
    if not p["dims"]:
        return [xs[0]]
    return [torch.sum(xs[0], dim=p["dims"], keepdim=p["keepdim"])]


@impl(nv.ReduceMaxOp)
def _max(op, xs):
    p = op.props()
    if not p["dims"]:
        return [xs[0]]
    return [torch.amax(xs[0], dim=p["dims"], keepdim=p["keepdim"])]


@impl(nv.CumsumOp)
def _cumsum(op, xs):
    p, x = op.props(), xs[0]
    if x.dim() == 0:
        return [x]
    if p["reverse"]:
        return [x.flip(p["dim"]).cumsum(p["dim"]).flip(p["dim"])]
    return [x.cumsum(p["dim"])]


@impl(nv.MatmulOp)
def _matmul(op, xs):
    a, b = xs
    if _MATMUL_PRECISION.get() == "tf32" and a.is_cuda and a.dtype == b.dtype == torch.float32:
        # cuBLAS's tf32: operands rounded to nearest tf32, products and sums in f32;
        # the Triton backend's "tf32-rn" (configurator.STEP_MATMUL_PRECISION) does the same
        from nova.codegen.triton.matmul import round_to_tf32

        a, b = round_to_tf32(a), round_to_tf32(b)
    return [torch.matmul(a, b)]


@impl(nv.SoftmaxOp)
def _softmax(op, xs):
    return [torch.softmax(_wide(xs[0]), op.props()["dim"]).to(xs[0].dtype)]


@impl(nv.LogSoftmaxOp)
def _log_softmax(op, xs):
    return [torch.log_softmax(_wide(xs[0]), op.props()["dim"]).to(xs[0].dtype)]


# The backward kernels are torch's own (same formula, same summation order), so
# that a step matches eager autograd to the last bit in float32 too.
@impl(nv.SoftmaxBackwardOp)
def _softmax_bwd(op, xs):
    y, g = _wide(xs[0]), _wide(xs[1])
    d = op.props()["dim"]
    return [torch.ops.aten._softmax_backward_data(g, y, d, y.dtype).to(xs[0].dtype)]


@impl(nv.LogSoftmaxBackwardOp)
def _log_softmax_bwd(op, xs):
    y, g = _wide(xs[0]), _wide(xs[1])
    d = op.props()["dim"]
    return [torch.ops.aten._log_softmax_backward_data(g, y, d, y.dtype).to(xs[0].dtype)]


@impl(nv.LayerNormOp)
def _layer_norm(op, xs):
    x, w, b = xs
    xf = _wide(x)
    mean = xf.mean(-1)
    var = (xf - mean.unsqueeze(-1)).square().mean(-1)
    rstd = torch.rsqrt(var + op.props()["eps"])
    y = (xf - mean.unsqueeze(-1)) * rstd.unsqueeze(-1) * _wide(w) + _wide(b)
    return [y.to(x.dtype), mean.to(x.dtype), rstd.to(x.dtype)]


@impl(nv.LayerNormBackwardOp)
def _layer_norm_bwd(op, xs):
    g, x, w, mean, rstd = (_wide(t) for t in xs)
    xhat = (x - mean.unsqueeze(-1)) * rstd.unsqueeze(-1)
    lead = tuple(range(x.dim() - 1))
    gw = (g * xhat).sum(lead) if lead else g * xhat
    gb = g.sum(lead) if lead else g
    gxhat = g * w
    n = x.shape[-1]
    gx = rstd.unsqueeze(-1) / n * (
        n * gxhat - gxhat.sum(-1, keepdim=True) - xhat * (gxhat * xhat).sum(-1, keepdim=True)
    )
    dt = xs[1].dtype
    return [gx.to(dt), gw.to(dt), gb.to(dt)]


# Out-of-range ids and class targets are not errors of an op: like the Triton
# kernels, the ops here only never address outside their tables (a bad id reads a
# zero row, scatters nothing; a bad target's row loss is NaN), and the guard
# stage's nova.count_out_of_range reports them and keeps the step from writing.
def _in_range(ids: torch.Tensor, n: int) -> torch.Tensor:
    return (ids >= 0) & (ids < n)


@impl(nv.CountOutOfRangeOp)
def _count_out_of_range(op, xs):
    (ids,) = xs
    p = op.props()
    bad = (ids < p["low"]) | (ids >= p["high"])
    if p["ignore"] is not None:
        bad &= ids != p["ignore"]
    return [bad.sum(dtype=torch.int64)]


@impl(nv.CountNonfiniteOp)
def _count_nonfinite(op, xs):
    return [(~torch.isfinite(xs[0])).sum(dtype=torch.int64)]


@impl(nv.EmbeddingOp)
def _embedding(op, xs):
    w, ids = xs
    ok = _in_range(ids, w.shape[0])
    rows = F.embedding(torch.where(ok, ids, 0), w)
    return [torch.where(ok.unsqueeze(-1), rows, torch.zeros((), dtype=w.dtype, device=w.device))]


@impl(nv.EmbeddingBackwardOp)
def _embedding_bwd(op, xs):
    g, ids = xs
    p = op.props()
    out = torch.zeros(p["num_embeddings"], g.shape[-1], dtype=g.dtype, device=g.device)
    ids, g = ids.reshape(-1), g.reshape(-1, g.shape[-1])
    ok = _in_range(ids, p["num_embeddings"])
    out.index_add_(0, ids[ok], g[ok])
    if p["padding_idx"] >= 0:
        out[p["padding_idx"]] = 0
    return [out]


@impl(nv.CrossEntropyOp)
def _cross_entropy(op, xs):
    logits, target = xs
    p = op.props()
    bad = ~_in_range(target, logits.shape[1]) & (target != p["ignore_index"])
    # torch raises on a bad target: compute with an ignored id there, then make those rows NaN
    safe = torch.where(bad, p["ignore_index"], target)
    wide = _wide(logits)
    kw = {"ignore_index": p["ignore_index"], "label_smoothing": p["label_smoothing"]}
    if p["reduction"] == "none":
        loss = F.cross_entropy(wide, safe, reduction="none", **kw).masked_fill(bad, float("nan"))
    else:
        loss = F.cross_entropy(wide, safe, reduction=p["reduction"], **kw)
        loss = torch.where(bad.any(), torch.full((), float("nan"), dtype=loss.dtype, device=loss.device), loss)
    return [loss.to(logits.dtype)]


@impl(nv.CrossEntropyBackwardOp)
def _cross_entropy_bwd(op, xs):
    g, logits, target = xs
    p = op.props()
    ls = p["label_smoothing"]
    valid = target != p["ignore_index"]
    probs = torch.softmax(_wide(logits), dim=1)
    onehot = torch.zeros_like(probs)
    hit = valid & _in_range(target, logits.shape[1])  # a bad target's row has no one-hot entry
    onehot[hit, target[hit]] = 1.0
    d = (probs - (1.0 - ls) * onehot - ls / logits.shape[1]) * valid.unsqueeze(1)
    gw = _wide(g)
    if p["reduction"] == "mean":
        # torch's gradient of a mean over no rows is 0 (its loss is NaN)
        d = d / valid.sum().clamp(min=1)
    elif p["reduction"] == "none":
        gw = gw.unsqueeze(1)
    return [(d * gw).to(logits.dtype)]


def _scores(q, k, p, bias=None):
    s = torch.matmul(_wide(q), _wide(k).transpose(-1, -2)) * p["scale"]
    if bias is not None:
        s = s + _wide(bias)
    if p["causal"]:
        tq, tk = s.shape[-2], s.shape[-1]
        # top-left aligned, as torch.nn.functional.scaled_dot_product_attention(is_causal=True)
        mask = torch.ones(tq, tk, dtype=torch.bool, device=s.device).tril(0)
        s = s.masked_fill(~mask, float("-inf"))
    return s


def _probs(s, lse):
    """exp(s - lse), 0 on rows that mask every key (lse = -inf), as torch's SDPA."""
    dead = torch.isneginf(lse).unsqueeze(-1)
    return torch.where(dead, torch.zeros((), dtype=s.dtype, device=s.device), torch.exp(s - lse.unsqueeze(-1)))


def _dropped(P, p, seed):
    """The dropout multiplier of the attention probabilities P [B, H, Tq, Tk] (the
    op's ``dropout`` and ``salt``, ``nova.rng``'s bits at P's flat indices), or None
    without dropout."""
    if not p["dropout"]:
        return None
    return rng.dropout_scale(seed[0], p["salt"], P.shape, p["dropout"], P.dtype, P.device)


@impl(nv.AttentionOp)
def _attention(op, xs):
    q, k, v, *tail = xs
    p = op.props()
    bias, seed = nv.attention_tail(tail, p)
    s = _scores(q, k, p, *bias)
    lse = torch.logsumexp(s, dim=-1)
    P = _probs(s, lse)
    z = _dropped(P, p, seed)
    out = torch.matmul(P if z is None else P * z, _wide(v))
    return [out.to(q.dtype), lse.to(_result_dtype(op, 1))]


@impl(nv.AttentionBackwardOp)
def _attention_bwd(op, xs):
    g, q, k, v, o, lse, *tail = xs
    p = op.props()
    bias, seed = nv.attention_tail(tail, p)
    P = _probs(_scores(q, k, p, *bias), _wide(lse))
    z = _dropped(P, p, seed)
    gf, vf = _wide(g), _wide(v)
    dv = torch.matmul((P if z is None else P * z).transpose(-1, -2), gf)
    dp = torch.matmul(gf, vf.transpose(-1, -2))
    if z is not None:
        dp = dp * z
    delta = (gf * _wide(o)).sum(-1, keepdim=True)
    ds = P * (dp - delta) * p["scale"]
    dq = torch.matmul(ds, _wide(k))
    dk = torch.matmul(ds.transpose(-1, -2), _wide(q))
    grads = [dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)]
    out = grads
    if p["rounded"]:  # stored rounded to tf32 (the tf32_operands stage); the sums below are of the raw values
        from nova.codegen.triton.matmul import round_to_tf32

        out = [round_to_tf32(x) for x in grads]
    if not p["sums"]:
        return out
    # each gradient in its type, summed over batch and sequence in the statistics type
    stat = _result_dtype(op, 3)
    return [*out, torch.stack([x.to(stat).sum(dim=(0, 2)) for x in grads])]


_NEEDS_DEVICE = (nv.FullOp, nv.ArangeOp)


@impl(nv.FusedOp)
def _fused(op, xs, device=None):
    """A group runs its ops one by one, with the same implementations as unfused."""
    block = op.body.block
    env: dict[SSAValue, torch.Tensor] = dict(zip(block.args, xs, strict=True))
    run_ops(op.inner_ops(), env, device if device is not None else (xs[0].device if xs else torch.device("cpu")))
    return [env[v] for v in block.last_op.operands]


_NEEDS_DEVICE = (*_NEEDS_DEVICE, nv.FusedOp)


def run_ops(ops, env: dict[SSAValue, torch.Tensor], device: torch.device) -> None:
    """Executes ``ops`` in order, reading and extending ``env``."""
    for op in ops:
        if isinstance(op, func.ReturnOp):
            continue
        fn = IMPLS.get(type(op))
        if fn is None:
            raise NotImplementedError(f"reference executor has no implementation of {op.name}")
        xs = [env[v] for v in op.operands]
        outs = fn(op, xs, device) if isinstance(op, _NEEDS_DEVICE) else fn(op, xs)
        for r, t in zip(op.results, outs, strict=True):
            env[r] = t


import contextvars  # noqa: E402  (beside its one use)

# The matmul precision of the step this thread is running (run_function sets it).
# torch's allow_tf32 flags are process-wide: a step that flipped them would run
# another thread's fp32 step in tf32, so the executor never reads or sets them.
_MATMUL_PRECISION: contextvars.ContextVar[str] = contextvars.ContextVar("nova_reference_precision", default="fp32")


@contextlib.contextmanager
def precision_mode(precision: str):
    """Eager PyTorch's tf32 setting for ``precision`` (tf32: the process-wide
    ``allow_tf32`` flags on; GPU only, the CPU has no tf32), restored on exit. For
    running *eager* code to compare against; Nova's executors take the precision as
    an argument and never touch these flags (they would leak into other threads)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = precision == "tf32"
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def run_function(fn: func.FuncOp, args: Sequence[torch.Tensor], precision: str = "fp32") -> list[torch.Tensor]:
    """Runs ``@train_step`` on positional arguments; returns its results.
    ``precision``: the step's policy; "tf32" rounds f32 matmul operands to
    nearest tf32 on CUDA (on the CPU tf32 is fp32), nothing global changes."""
    block = fn.body.block
    if len(args) != len(block.args):
        raise ValueError(f"@{fn.sym_name.data} takes {len(block.args)} arguments, got {len(args)}")
    device = args[0].device if args else torch.device("cpu")
    env: dict[SSAValue, torch.Tensor] = dict(zip(block.args, args))
    token = _MATMUL_PRECISION.set(precision)
    try:
        run_ops(block.ops, env, device)
    finally:
        _MATMUL_PRECISION.reset(token)
    ret = block.last_op
    return [env[v] for v in ret.operands]



# ----------------------------------------------------------------------------
# the LM head with the loss, chunked over tokens: at most ``chunk`` rows of the
# [N, V] logits exist at a time, with the numerics of the unfused
# matmul (+ add) + cross_entropy (+ their backwards)


def _head_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _matmul(None, [a, b])[0]  # the step's matmul precision, as nova.matmul


def _chunk_logits(h, w, bias, r0, r1):
    """Rows r0:r1 of the logits: h @ w^T in h's type, + bias in the bias's type."""
    z = _head_matmul(h[r0:r1], w.t())
    if bias is not None:
        z = z.to(bias.dtype) + bias
    return z


def _ce_rows(op, xs):
    h, w, target, *bias = xs
    p = op.props()
    valid = target != p["ignore_index"]
    return h, w, target, (bias[0] if bias else None), p, valid


def _stat_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


class _LinearCE:
    """The fused LM head's numerics, chunk by chunk, shared by its three ops (so the
    merged nova.linear_cross_entropy_with_grad is the other two bit for bit): a
    chunk's logits (``logits``), its loss rows summed into ``total`` (``add_loss``)
    and its gradients (``add_grads``), each from the same logits."""

    def __init__(self, op, xs, g=None):
        h, w, target, bias, p, valid = _ce_rows(op, xs)
        self.h, self.w, self.target, self.bias, self.p, self.valid = h, w, target, bias, p, valid
        self.ls, self.n, self.V = p["label_smoothing"], h.shape[0], w.shape[0]
        self.acc = acc = _stat_dtype(h)
        self.total = torch.zeros((), dtype=acc, device=h.device)
        if g is None:
            return
        self.scale = g.to(acc) / valid.sum().clamp(min=1) if p["reduction"] == "mean" else g.to(acc)
        self.dh = torch.empty_like(h)
        self.dw = torch.zeros(w.shape, dtype=acc, device=w.device)
        self.dbias = None if bias is None else torch.zeros(self.V, dtype=_stat_dtype(bias), device=bias.device)

    def chunks(self):
        for r0 in range(0, self.n, self.p["chunk"]):
            yield r0, min(self.n, r0 + self.p["chunk"])

    def logits(self, r0, r1) -> torch.Tensor:
        return _chunk_logits(self.h, self.w, self.bias, r0, r1)

    def add_loss(self, z, r0, r1) -> None:
        x, ls, acc = _wide(z).to(self.acc), self.ls, self.acc
        t, ok = self.target[r0:r1], self.valid[r0:r1]
        hit = ok & _in_range(t, self.V)
        lse = torch.logsumexp(x, dim=1)
        xt = x.gather(1, torch.where(hit, t, 0).unsqueeze(1)).squeeze(1)
        row = lse - xt if not ls else (1.0 - ls) * (lse - xt) + ls * (lse - x.mean(1))
        row = torch.where(hit | ~ok, row, float("nan"))  # a bad target's row loss is NaN
        self.total = self.total + torch.where(ok, row, torch.zeros((), dtype=acc, device=x.device)).sum()

    def loss(self, dtype) -> torch.Tensor:
        total = self.total
        if self.p["reduction"] == "mean":
            total = total / self.valid.sum()  # a mean over no rows is 0 / 0 = NaN, as in torch
        return total.to(dtype)

    def add_grads(self, z, r0, r1) -> None:
        x, ls, acc = _wide(z).to(self.acc), self.ls, self.acc
        t, ok = self.target[r0:r1], self.valid[r0:r1]
        hit = ok & _in_range(t, self.V)
        d = torch.softmax(x, dim=1)
        d[hit, t[hit]] -= 1.0 - ls
        if ls:
            d -= ls / self.V
        d = (d * (ok.to(acc) * self.scale).unsqueeze(1)).to(z.dtype)  # the logits' gradient, in their type
        if self.dbias is not None:
            self.dbias += d.to(self.dbias.dtype).sum(0)
        dz = d.to(self.h.dtype)  # the cast back to the matmul's type (a no-op without a widening)
        self.dh[r0:r1] = _head_matmul(dz, self.w)
        self.dw += _head_matmul(dz.t().to(acc), self.h[r0:r1].to(acc))  # accumulated in f32 (f64), rounded once

    def grads(self) -> list[torch.Tensor]:
        outs = [self.dh, self.dw.to(self.w.dtype)]
        if self.dbias is not None:
            outs.append(self.dbias.to(self.bias.dtype))
        return outs


@impl(nv.LinearCrossEntropyOp)
def _linear_cross_entropy(op, xs):
    ce = _LinearCE(op, xs)
    for r0, r1 in ce.chunks():
        ce.add_loss(ce.logits(r0, r1), r0, r1)
    return [ce.loss(_result_dtype(op))]


@impl(nv.LinearCrossEntropyBackwardOp)
def _linear_cross_entropy_bwd(op, xs):
    g, *rest = xs
    ce = _LinearCE(op, rest, g)
    for r0, r1 in ce.chunks():
        ce.add_grads(ce.logits(r0, r1), r0, r1)
    return ce.grads()


@impl(nv.LinearCrossEntropyWithGradOp)
def _linear_cross_entropy_with_grad(op, xs):
    g, *rest = xs
    ce = _LinearCE(op, rest, g)
    for r0, r1 in ce.chunks():
        z = ce.logits(r0, r1)  # once per chunk: the forward's and the backward's logits are the same values
        ce.add_loss(z, r0, r1)
        ce.add_grads(z, r0, r1)
    return [ce.loss(_result_dtype(op)), *ce.grads()]


# ----------------------------------------------------------------------------
# collectives (the distribute stage): through torch.distributed's default process
# group, gloo on the CPU (nova.runtime.distributed holds the bucket layouts)


@impl(nv.AllReduceOp, nv.ReduceScatterOp, nv.AllGatherOp, nv.LocalShardOp)
def _collective(op, xs):
    from nova.runtime import distributed

    return distributed.run(op, xs)
