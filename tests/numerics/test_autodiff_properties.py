"""Property: on random programs, Nova's gradients equal torch.autograd's.

Two properties, both deterministic (``derandomize=True``: CI runs the same
examples every time; a failure is reported unshrunk, add ``Phase.shrink`` to
``DETERMINISTIC`` locally to minimize it):

1. Random torch programs through capture (the main one). Hypothesis draws a
   ``Recipe``: a few parameters of small random shapes and 4-10 torch
   operations over them, drawn from every differentiable op Nova captures:
   unary (neg, tanh, sigmoid, relu, exp, cos, sin, abs, gelu, a float32 cast
   round trip), sqrt / rsqrt / log / pow on a positive transform,
   broadcasting add / sub / mul / div / maximum / minimum / pow(tensor,
   tensor), scalar arithmetic, where (a comparison, a mask or ~mask),
   masked_fill, clamp (scalar and tensor bounds), matmul and linear,
   softmax, log_softmax, layer_norm, reshape, permute, expand, sum, mean,
   amax, slicing with steps, select, cumsum, cat, F.pad (negative pads crop),
   repeat, gather, advanced indexing (negative ids), index_select, embedding
   (padding_idx, repeated ids), cross_entropy (ignore_index, label_smoothing,
   reduction none / sum / mean) and scaled_dot_product_attention (is_causal,
   boolean or additive masks, a bias parameter, GQA, scale). The recipe
   becomes a ``torch.nn.Module`` that returns a loss; Nova captures it in
   float64 (torch.export, once per recipe: the capture is cached by the
   recipe's structure, the values change per example) and runs the pipeline
   after capture with ``optimizer=None`` (autodiff, precision, simplify);
   torch.autograd differentiates the same module run eagerly. Every
   parameter's gradient must match within 1e-9, relative to its largest
   element. Half the examples take parameters in multiples of 1/2, so ties
   are common: maximum and minimum of equal values (half each), amax with
   repeated maxima (split evenly), clamp at its bounds, relu and abs at 0.
   One more test checks, on a few programs, that the public path
   (``nova.compile`` with SGD, lr=1) moves every parameter by -grad.

2. Random hand-built IR (kept from before: it reaches IR shapes capture does
   not make, such as matmul batch broadcasting on either side and broadcast
   partners of every rank): DAGs of 3-8 ops over elementwise ops, matmul,
   softmax, log_softmax, layer_norm, gelu, reshape, transpose, reduce_sum and
   slice, differentiated by ``append_backward`` alone.

Does it find bugs? tests/numerics/test_autodiff_mutations.py injects
realistic gradient bugs into ``VJP_RULES`` one at a time and asserts that
property 1, with the budget and seed used here, catches every one of them.
Of the 21 bugs injected there, the hand-built-IR property alone (40
examples) catches 5 (before this test existed, 2 of 7 tried); property 1
catches 17 within its 200 examples (``python
tests/numerics/test_autodiff_mutations.py`` prints the table).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, assume, given, settings
from hypothesis import strategies as st
from xdsl.dialects.builtin import f64
from xdsl.ir import SSAValue

import nova
from nova import pipeline
from nova.autodiff import append_backward
from nova.backends.reference import run_function
from nova.capture.importer import Captured, capture
from nova.ir import dialect as nv
from nova.ir.builder import OpBuilder
from nova.ir.module import Slot, add_arg, arg_slots, new_step, returned, set_results, step_func
from nova.ir.types import numel, shape_of, tensor

# the same examples in every run, no example database, no shrinking (a shrink
# step of property 1 is a new torch.export, and a mutation test stops at the
# first failure anyway)
DETERMINISTIC = dict(
    derandomize=True,
    database=None,
    deadline=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
CAPTURED_EXAMPLES = 200  # property 1's budget in CI (~15 s); the mutation tests rely on it


# ============================================================================
# Part 1: hand-built IR

UNARY = [nv.NegOp, nv.TanhOp, nv.SigmoidOp, nv.ReluOp, nv.ExpOp]
BINARY = [nv.AddOp, nv.SubOp, nv.MulOp, nv.MaximumOp]
KINDS = ["unary", "gelu", "binary", "matmul", "softmax", "log_softmax", "layer_norm", "reshape", "transpose", "reduce_sum", "slice"]
dims = st.integers(1, 4)


class Program:
    """A step function under construction: fresh parameters are appended as arguments."""

    def __init__(self):
        self.module, self.fn = new_step([])
        self.b = OpBuilder(self.fn.body.block)
        self.args: list[Slot] = []

    def arg(self, role: str, shape) -> SSAValue:
        slot = Slot(role, f"{role}{len(self.args)}", tensor(shape, f64))
        self.args.append(slot)
        return add_arg(self.fn, slot)


def _shape(v: SSAValue) -> tuple[int, ...]:
    return shape_of(v.type)


def _broadcast_partner(draw, shape) -> tuple[int, ...]:
    """A shape that broadcasts with ``shape`` without changing the result's shape."""
    keep = draw(st.integers(0, len(shape)))  # drop leading dims
    return tuple(1 if draw(st.booleans()) else s for s in shape[len(shape) - keep :])


def _broadcasts(a, b) -> bool:
    try:
        torch.broadcast_shapes(a, b)
    except RuntimeError:
        return False
    return True


def _step(draw, p: Program, pool: list[SSAValue]) -> SSAValue:
    b = p.b
    kind = draw(st.sampled_from(KINDS))
    ranked = [v for v in pool if _shape(v)]
    x = draw(st.sampled_from(ranked or pool))
    rank = len(_shape(x))
    if kind == "gelu":
        return b.one(nv.GeluOp, [x], {"approximate": draw(st.sampled_from(["none", "tanh"]))})
    if kind == "binary":
        op = draw(st.sampled_from(BINARY))
        partners = [v for v in pool if _broadcasts(_shape(v), _shape(x))]
        if partners and draw(st.booleans()):
            y = draw(st.sampled_from(partners))
        else:
            y = p.arg("param", _broadcast_partner(draw, _shape(x)))
        return b.one(op, [x, y] if draw(st.booleans()) else [y, x])
    if kind == "matmul":
        mats = [v for v in pool if len(_shape(v)) >= 2]
        if mats and draw(st.booleans()):  # pool value on the left, weight on the right
            a = draw(st.sampled_from(mats))
            batch = _broadcast_partner(draw, _shape(a)[:-2]) if draw(st.booleans()) else ()
            return b.matmul(a, p.arg("param", (*batch, _shape(a)[-1], draw(dims))))
        if mats:  # fresh matrix on the left, possibly with its own batch dim
            rhs = draw(st.sampled_from(mats))
            batch = (draw(dims),) if len(_shape(rhs)) == 2 and draw(st.booleans()) else ()
            return b.matmul(p.arg("param", (*batch, draw(dims), _shape(rhs)[-2])), rhs)
        return b.matmul(b.reshape(x, (1, numel(_shape(x)))), p.arg("param", (numel(_shape(x)), draw(dims))))
    if kind in ("softmax", "log_softmax") and rank:
        op = nv.SoftmaxOp if kind == "softmax" else nv.LogSoftmaxOp
        return b.one(op, [x], {"dim": draw(st.integers(-rank, rank - 1))})
    if kind == "layer_norm" and rank:
        n = _shape(x)[-1]
        op = b.create(nv.LayerNormOp, [x, p.arg("param", (n,)), p.arg("param", (n,))], {"eps": 1e-5})
        return op.results[0]
    if kind == "reshape":
        s = _shape(x)
        choices = [(numel(s),), (1, numel(s))]
        if rank >= 2:
            choices.append((s[0] * s[1], *s[2:]))
        if rank:
            choices.append((*s[:-1], 1, s[-1]))
        return b.one(nv.ReshapeOp, [x], None, tensor(draw(st.sampled_from(choices)), f64))
    if kind == "transpose" and rank >= 2:
        perm = draw(st.permutations(range(rank)))
        return b.one(nv.TransposeOp, [x], {"perm": tuple(perm)})
    if kind == "reduce_sum" and rank:
        ds = draw(st.lists(st.integers(0, rank - 1), min_size=1, max_size=rank, unique=True))
        return b.reduce_sum(x, sorted(ds), keepdim=draw(st.booleans()))
    if kind == "slice" and rank:
        d = draw(st.integers(0, rank - 1))
        size = _shape(x)[d]
        start = draw(st.integers(0, size - 1))
        end = draw(st.integers(start + 1, size))
        return b.one(nv.SliceOp, [x], {"dim": d, "start": start, "end": end, "step": draw(st.integers(1, 3))})
    return b.one(draw(st.sampled_from(UNARY)), [x])


@st.composite
def programs(draw):
    p = Program()
    pool = [p.arg("param", draw(st.lists(dims, min_size=1, max_size=3))) for _ in range(draw(st.integers(1, 2)))]
    for _ in range(draw(st.integers(3, 8))):
        pool.append(_step(draw, p, pool))
    # every unused value feeds the loss, so no drawn op is dead; one more value
    # that is also used elsewhere makes its cotangent a sum
    outs = [v for v in pool if not v.uses]
    extra = draw(st.sampled_from(pool))
    outs += [] if extra in outs else [extra]
    loss = None
    for v in outs:
        term = p.b.reduce_sum(p.b.mul(v, p.arg("batch", _shape(v))), range(len(_shape(v))))
        loss = term if loss is None else p.b.add(loss, term)
    set_results(p.fn, [("loss", "loss", loss)])
    return p, draw(st.integers(0, 2**31 - 1))


@settings(max_examples=40, **DETERMINISTIC)
@given(programs())
def test_random_programs_match_torch_autograd(program):
    p, seed = program
    gen = torch.Generator().manual_seed(seed)
    values = [torch.randn(shape_of(s.type), generator=gen, dtype=torch.float64) for s in p.args]

    forward = p.module.clone()
    xs = [v.clone().requires_grad_(s.role == "param") for v, s in zip(values, p.args)]
    loss = run_function(step_func(forward), xs)[0]
    assume(torch.isfinite(loss).item())  # exp of exp of ... may overflow
    params = [(s.name, x) for s, x in zip(p.args, xs) if s.role == "param"]
    expected = torch.autograd.grad(loss, [x for _, x in params], allow_unused=True)

    append_backward(p.module)
    p.module.verify()
    outs = run_function(p.fn, values)
    got = {name: t for (role, name, _), t in zip(returned(p.fn), outs) if role == "grad"}
    torch.testing.assert_close(outs[0], loss.detach(), rtol=1e-12, atol=1e-12)
    for (name, _), e in zip(params, expected):
        if e is None:
            assert name not in got, f"{name} does not reach the loss but got a gradient"
            continue
        assert name in got, f"no gradient for {name}"
        assume(torch.isfinite(e).all().item())
        torch.testing.assert_close(got[name], e, rtol=1e-9, atol=1e-9 * max(1.0, e.abs().max().item()))


# ============================================================================
# Part 2: random torch programs, through capture
#
# A recipe's steps are (name, *args); an argument is a literal or a Ref to an
# earlier value ("v"), a parameter ("p") or a batch input ("b"). run_recipe
# executes the steps with torch, as the forward of a RecipeModule (what Nova
# captures) and on leaf tensors (what torch.autograd differentiates).


class Ref(NamedTuple):
    space: str  # "v" an earlier step's value, "p" a parameter, "b" a batch input
    i: int


@dataclass(frozen=True)
class BatchSpec:
    kind: str  # float | mask | ids | target
    shape: tuple[int, ...]
    low: int = 0  # ids and targets lie in [low, high)
    high: int = 0
    ignore: int | None = None  # targets: the ignore_index about a quarter of them take


@dataclass(frozen=True)
class Recipe:
    params: tuple[tuple[int, ...], ...]
    batch: tuple[BatchSpec, ...]
    steps: tuple[tuple, ...]
    loss: tuple[tuple[int, int], ...]  # (value index, batch index of its weight)


def _resolve(a, env):
    if isinstance(a, Ref):
        return env[a.space][a.i]
    if isinstance(a, tuple):
        return tuple(_resolve(x, env) for x in a)
    return a


POSITIVE = {  # onto (0, inf), for sqrt, rsqrt, log, pow's base and denominators
    "square": lambda x: x * x + 0.5,
    "abs": lambda x: x.abs() + 0.5,
    "sigmoid": lambda x: torch.sigmoid(x) + 0.25,
    "exp": torch.exp,
}
UNARY_FNS = {
    "neg": torch.neg, "tanh": torch.tanh, "sigmoid": torch.sigmoid, "relu": torch.relu, "exp": torch.exp,
    "cos": torch.cos, "sin": torch.sin, "abs": torch.abs, "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "cast": lambda x: x.float().double(),
}  # fmt: skip
# (1.0 / x and c / x are aten.reciprocal, which Nova does not capture yet)
DOMAIN_FNS = {"sqrt": torch.sqrt, "rsqrt": torch.rsqrt, "log": torch.log}
BINARY_FNS = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": lambda x, y: x / y,
    "maximum": torch.maximum, "minimum": torch.minimum,
}  # fmt: skip
SCALAR_FNS = {
    "add": lambda x, c: x + c, "mul": lambda x, c: x * c, "rsub": lambda x, c: c - x,
    "div": lambda x, c: x / c,
}  # fmt: skip


def _index(mode, x, i0, i1=None):
    return {"0": lambda: x[i0], "1": lambda: x[:, i0], "01": lambda: x[i0, i1]}[mode]()


def _heads(x, h):
    """[..., D] as [1, h, T, D]: every head reads the same T x D values."""
    return x.reshape(1, 1, -1, x.shape[-1]).expand(1, h, -1, -1)


def _attention(hq, causal, scale, gqa, x, k, v, mask):
    return F.scaled_dot_product_attention(_heads(x, hq), k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa)


def _cross_entropy(red, smoothing, ignore, x, t):
    return F.cross_entropy(x.reshape(-1, x.shape[-1]), t, reduction=red, label_smoothing=smoothing, ignore_index=ignore)


STEPS: dict[str, Callable] = {
    "param": lambda p: p,
    "unary": lambda f, x: UNARY_FNS[f](x),
    "domain": lambda f, pos, x: DOMAIN_FNS[f](POSITIVE[pos](x)),
    "pow_scalar": lambda pos, e, x: (POSITIVE[pos](x) if pos else x) ** e,
    "binary": lambda f, pos, x, y: BINARY_FNS[f](x, POSITIVE[pos](y) if pos else y),
    "pow_tensor": lambda pos, x, y: torch.pow(POSITIVE[pos](x), y),
    "scalar": lambda f, c, x: SCALAR_FNS[f](x, c),
    "where_cmp": lambda x, y, a, b: torch.where(x > y, a, b),
    "where_mask": lambda neg, m, a, b: torch.where(~m if neg else m, a, b),
    "masked_fill": lambda neg, m, value, x: x.masked_fill(~m if neg else m, value),
    "clamp": lambda lo, hi, x: torch.clamp(x, lo, hi),
    "matmul": lambda x, w: x @ w,
    "linear": lambda x, w, bias: F.linear(x, w, bias),
    "softmax": lambda dim, x: torch.softmax(x, dim),
    "log_softmax": lambda dim, x: torch.log_softmax(x, dim),
    "layer_norm": lambda k, x, w, bias: F.layer_norm(x, x.shape[x.dim() - k :], w, bias),
    "reshape": lambda shape, x: x.reshape(shape),
    "permute": lambda perm, x: x.permute(perm),
    "expand": lambda shape, x: x.expand(shape),
    "sum": lambda dims, keep, x: x.sum(dims, keepdim=keep),
    "mean": lambda dims, keep, x: x.mean(dims, keepdim=keep),
    "amax": lambda dims, keep, x: torch.amax(x, dims, keepdim=keep),
    "slice": lambda d, a, e, s, x: x[(slice(None),) * d + (slice(a, e, s),)],
    "select": lambda d, i, x: x.select(d, i),
    "cumsum": lambda d, x: torch.cumsum(x, d),
    "cat": lambda d, parts: torch.cat(parts, d),
    "pad": lambda pads, value, x: F.pad(x, pads, value=value),
    "repeat": lambda reps, x: x.repeat(*reps),
    "gather": lambda d, x, idx: torch.gather(x, d, idx),
    "index": _index,
    "index_select": lambda d, x, idx: x.index_select(d, idx),
    "embedding": lambda pad, table, ids: F.embedding(ids, table, padding_idx=pad),
    "cross_entropy": _cross_entropy,
    "self_kv": lambda h, x: _heads(x, h),
    "attention": _attention,
}


def run_recipe(r: Recipe, params: Sequence[torch.Tensor], batch: Sequence[torch.Tensor]) -> torch.Tensor:
    env = {"v": [], "p": list(params), "b": list(batch)}
    for name, *args in r.steps:
        env["v"].append(STEPS[name](*_resolve(tuple(args), env)))
    loss = None
    for vi, wi in r.loss:
        term = (env["v"][vi] * env["b"][wi]).sum()
        loss = term if loss is None else loss + term
    return loss


class RecipeModule(torch.nn.Module):
    """A recipe as a module: parameters p0, p1, ... and forward(*batch) -> loss."""

    def __init__(self, r: Recipe):
        super().__init__()
        self.recipe = r
        for i, s in enumerate(r.params):
            self.register_parameter(f"p{i}", torch.nn.Parameter(torch.zeros(s, dtype=torch.float64)))

    def forward(self, *batch):
        return run_recipe(self.recipe, [getattr(self, f"p{i}") for i in range(len(self.recipe.params))], batch)


def batch_value(spec: BatchSpec, gen: torch.Generator) -> torch.Tensor:
    if spec.kind == "float":
        return torch.randn(spec.shape, generator=gen, dtype=torch.float64)
    if spec.kind == "mask":  # small attention masks often mask a whole row (its output is 0)
        return torch.rand(spec.shape, generator=gen) < 0.6
    t = torch.randint(spec.low, spec.high, spec.shape, generator=gen)
    if spec.ignore is not None:
        t = torch.where(torch.rand(spec.shape, generator=gen) < 0.25, torch.full_like(t, spec.ignore), t)
    return t


def param_value(shape, gen: torch.Generator, quantized: bool) -> torch.Tensor:
    # multiples of 1/2 in [-1, 1] make ties and exact arithmetic
    if quantized:
        return torch.randint(-2, 3, shape, generator=gen).to(torch.float64) / 2
    return torch.randn(shape, generator=gen, dtype=torch.float64)


# --- drawing recipes -------------------------------------------------------------

MAX_NUMEL = 64  # of any value: keeps the reference executor and torch.export fast
FAMILIES = {"unary": UNARY_FNS, "domain": DOMAIN_FNS, "binary": BINARY_FNS, "scalar": SCALAR_FNS}
STEP_KINDS = [  # "binary:sub": a family's kind with its function
    *(f"{k}:{f}" for k, fns in FAMILIES.items() for f in fns), "pow_scalar", "pow_tensor", "where_cmp", "where_mask", "masked_fill",
    "clamp", "matmul", "linear", "softmax", "log_softmax", "layer_norm", "reshape", "permute", "expand", "sum",
    "mean", "amax", "slice", "select", "cumsum", "cat", "pad", "repeat", "gather", "index", "index_select",
    "embedding", "cross_entropy", "attention",
]  # fmt: skip
small = st.integers(1, 3)
sizes = st.integers(1, 4)


class _Drawer:
    """Builds a recipe step by step, running each step on example values to
    learn its result's shape."""

    def __init__(self, draw):
        self.draw = draw
        self.params: list[tuple[int, ...]] = []
        self.batch: list[BatchSpec] = []
        self.steps: list[tuple] = []
        self.env: dict[str, list[torch.Tensor]] = {"v": [], "p": [], "b": []}

    def param(self, shape) -> Ref:
        self.params.append(tuple(shape))
        self.env["p"].append(torch.ones(shape, dtype=torch.float64))
        return Ref("p", len(self.params) - 1)

    def input(self, spec: BatchSpec) -> Ref:
        self.batch.append(spec)
        self.env["b"].append(batch_value(spec, torch.Generator().manual_seed(0)))
        return Ref("b", len(self.batch) - 1)

    def shape(self, ref: Ref) -> tuple[int, ...]:
        return tuple(self.env[ref.space][ref.i].shape)

    def add(self, name, *args) -> Ref | None:
        """Appends the step if torch accepts its shapes and its result is small."""
        try:
            out = STEPS[name](*_resolve(args, self.env))
        except (RuntimeError, IndexError, ValueError):  # a loosely drawn shape that does not fit
            return None
        if out.numel() > MAX_NUMEL or out.numel() == 0:
            return None
        self.steps.append((name, *args))
        self.env["v"].append(out)
        return Ref("v", len(self.steps) - 1)

    def value(self) -> Ref:
        ranked = [i for i, v in enumerate(self.env["v"]) if v.dim()] or range(len(self.steps))
        return Ref("v", self.draw(st.sampled_from(ranked)))

    def partner(self, shape, grow: bool = True) -> Ref:
        """An earlier value that broadcasts with ``shape`` (``grow``: the
        result may be larger), or a fresh parameter that does without
        changing the result's shape, often of the same rank with some dims 1."""
        shape = tuple(shape)
        ok = _broadcasts if grow else lambda a, b: _broadcasts(a, b) and torch.broadcast_shapes(a, b) == b
        fits = [Ref("v", i) for i, v in enumerate(self.env["v"]) if ok(tuple(v.shape), shape)]
        if fits and self.draw(st.booleans()):
            return self.draw(st.sampled_from(fits))
        if self.draw(st.booleans()):
            return self.param(tuple(1 if self.draw(st.booleans()) else n for n in shape))
        return self.param(_broadcast_partner(self.draw, shape))


def _draw_step(d: _Drawer, kinds: list[str]) -> None:  # noqa: C901 - one branch per kind of step
    draw = d.draw
    kind, _, fn = draw(st.sampled_from(kinds)).partition(":")
    x = d.value()
    s = d.shape(x)
    r = len(s)
    pick = lambda xs: draw(st.sampled_from(sorted(xs)))  # noqa: E731
    if kind == "unary":
        d.add("unary", fn, x)
    elif kind == "domain":
        d.add("domain", fn, pick(POSITIVE), x)
    elif kind == "pow_scalar":
        e = draw(st.sampled_from([2, 3, 4, 0.5, -0.5, -1, -2, 1.5, -1.5]))
        pos = None if e in (2, 3, 4) and draw(st.booleans()) else pick(POSITIVE)
        d.add("pow_scalar", pos, e, x)
    elif kind == "binary":
        f, y = fn, d.partner(s)
        pos = pick(POSITIVE) if f == "div" else None
        d.add("binary", f, pos, *((x, y) if pos or draw(st.booleans()) else (y, x)))
    elif kind == "pow_tensor":
        y = d.partner(s)
        d.add("pow_tensor", pick(POSITIVE), *((x, y) if draw(st.booleans()) else (y, x)))
    elif kind == "scalar":
        d.add("scalar", fn, draw(st.sampled_from([0.5, -2.0, 3.0])), x)
    elif kind == "where_cmp":
        y = d.partner(s)
        a, b = draw(st.sampled_from([(x, y), (y, x), (x, 0.5)]))
        d.add("where_cmp", x, d.partner(s), a, b)
    elif kind == "where_mask":
        m, y = d.input(BatchSpec("mask", _broadcast_partner(draw, s))), d.partner(s)
        d.add("where_mask", draw(st.booleans()), m, *((x, y) if draw(st.booleans()) else (y, x)))
    elif kind == "masked_fill":
        m = d.input(BatchSpec("mask", _broadcast_partner(draw, s)))
        d.add("masked_fill", draw(st.booleans()), m, draw(st.sampled_from([0.0, -1.5])), x)
    elif kind == "clamp":
        lo, hi = draw(st.sampled_from([(-0.5, 0.5), (0.0, None), (None, 0.5), (-1.0, 0.0)]))
        if draw(st.booleans()):  # a tensor bound, which gets a gradient of its own
            # One, not two: where min == max, torch's clamp backward gives the
            # gradient to neither bound (min's needs min < max, max's x > max),
            # Nova's to min. Bounds that broadcast x to a larger shape break
            # torch's own clamp backward.
            lo, hi = (d.partner(s, grow=False), None) if draw(st.booleans()) else (None, d.partner(s, grow=False))
        d.add("clamp", lo, hi, x)
    elif kind == "matmul" and r:
        if r >= 2 and draw(st.booleans()):
            batch = tuple(1 if draw(st.booleans()) else n for n in s[:-2]) if draw(st.booleans()) else ()
            d.add("matmul", x, d.param((*batch, s[-1], draw(small))))
        elif r >= 2:
            d.add("matmul", d.param((draw(small), s[-2])), x)
        else:
            d.add("matmul", x, d.param((s[-1], draw(small))) if draw(st.booleans()) else d.param((s[-1],)))
    elif kind == "linear" and r:
        n = draw(small)
        d.add("linear", x, d.param((n, s[-1])), d.param((n,)) if draw(st.booleans()) else None)
    elif kind in ("softmax", "log_softmax", "cumsum") and r:
        d.add(kind, draw(st.integers(-r, r - 1)), x)
    elif kind == "layer_norm" and r:
        k = draw(st.integers(1, min(r, 2)))
        w, b = (d.param(s[r - k :]) if draw(st.booleans()) else None for _ in range(2))
        d.add("layer_norm", k, x, w, b)
    elif kind == "reshape":
        n = numel(s)
        choices = [(n,), (1, n), (n, 1), *((a, n // a) for a in (2, 3) if n % a == 0 and n > a)]
        d.add("reshape", draw(st.sampled_from(choices + ([(s[0] * s[1], *s[2:])] if r >= 2 else []))), x)
    elif kind == "permute" and r >= 2:
        d.add("permute", tuple(draw(st.permutations(range(r)))), x)
    elif kind == "expand":
        if 1 in s and draw(st.booleans()):
            d.add("expand", tuple(draw(st.integers(2, 3)) if n == 1 else n for n in s), x)
        else:
            d.add("expand", (draw(st.integers(2, 3)), *s), x)
    elif kind in ("sum", "mean", "amax") and r:
        ds = draw(st.lists(st.integers(0, r - 1), min_size=1, max_size=r, unique=True))
        d.add(kind, tuple(sorted(ds)), draw(st.booleans()), x)
    elif kind == "slice" and r:
        dim = draw(st.integers(0, r - 1))
        start = draw(st.integers(0, s[dim] - 1))
        d.add("slice", dim, start, draw(st.integers(start + 1, s[dim])), draw(st.integers(1, 3)), x)
    elif kind == "select" and r:
        dim = draw(st.integers(0, r - 1))
        d.add("select", dim, draw(st.integers(-s[dim], s[dim] - 1)), x)
    elif kind == "cat" and r:
        dim = draw(st.integers(0, r - 1))
        same = [Ref("v", i) for i, v in enumerate(d.env["v"]) if tuple(v.shape) == s]
        other = draw(st.sampled_from(same)) if draw(st.booleans()) else d.param((*s[:dim], draw(small), *s[dim + 1 :]))
        parts = (x, other) if draw(st.booleans()) else (other, x)
        d.add("cat", dim, parts + ((x,) if draw(st.booleans()) else ()))  # x twice: its cotangent is a sum
    elif kind == "pad" and r:
        pads: list[int] = []
        for dim in range(r - 1, r - 1 - draw(st.integers(1, min(r, 2))), -1):
            lo, hi = draw(st.integers(-1, 2)), draw(st.integers(-1, 2))
            pads += [lo, hi] if s[dim] + lo + hi >= 1 else [max(lo, 0), max(hi, 0)]
        d.add("pad", tuple(pads), draw(st.sampled_from([0.0, 0.5])), x)
    elif kind == "repeat":
        d.add("repeat", tuple(draw(st.integers(1, 2)) for _ in range(r + draw(st.integers(0, 1)))), x)
    elif kind == "gather" and r:
        dim = draw(st.integers(0, r - 1))
        shape = tuple(draw(small) if i == dim else draw(st.integers(1, n)) for i, n in enumerate(s))
        d.add("gather", dim, x, d.input(BatchSpec("ids", shape, 0, s[dim])))
    elif kind == "index" and r:
        mode = draw(st.sampled_from(["0", "1", "01"] if r >= 2 else ["0"]))
        shape = tuple(draw(st.lists(small, min_size=1, max_size=2)))
        ids = [d.input(BatchSpec("ids", shape, -s[0], s[0]))] if mode != "1" else []  # negative ids wrap
        if mode != "0":
            shape1 = (_broadcast_partner(draw, shape) or (1,)) if mode == "01" else shape  # a 0-d id would be .item()
            ids.append(d.input(BatchSpec("ids", shape1, -s[1], s[1])))
        d.add("index", mode, x, *ids)
    elif kind == "index_select" and r:
        dim = draw(st.integers(0, r - 1))
        d.add("index_select", dim, x, d.input(BatchSpec("ids", (draw(st.integers(1, 4)),), 0, s[dim])))
    elif kind == "embedding":
        if r == 2 and draw(st.booleans()):
            table, n = x, s[0]  # an earlier value as the table: its gradient flows on
        else:
            n = draw(st.integers(2, 5))
            table = d.param((n, draw(small)))
        ids = d.input(BatchSpec("ids", tuple(draw(st.lists(small, min_size=1, max_size=2))), 0, n))
        d.add("embedding", draw(st.sampled_from([None, 0, n - 1, -1])), table, ids)
    elif kind == "cross_entropy" and r:
        c = s[-1]
        ignore = draw(st.sampled_from([-100, 0, c - 1]))
        t = d.input(BatchSpec("target", (numel(s) // c,), 0, c, ignore if draw(st.booleans()) else None))
        red = draw(st.sampled_from(["none", "sum", "mean"]))
        d.add("cross_entropy", red, draw(st.sampled_from([0.0, 0.1, 0.3])), ignore, x, t)
    elif kind == "attention" and r:
        tq, dh = numel(s) // s[-1], s[-1]
        hq = draw(st.integers(1, 2))
        hk = draw(st.sampled_from(sorted({1, hq})))
        if draw(st.booleans()):  # self-attention: k = v = the value q is made of
            k = v = d.add("self_kv", hk, x)
            tk = tq
        else:
            tk = draw(st.integers(1, 4))
            # v's head dim is q's: nova.attention does not take another (SDPA does)
            k, v = d.param((1, hk, tk, dh)), d.param((1, hk, tk, dh))
        mode = draw(st.sampled_from(["none", "causal", "bool", "float", "bias"]))
        mask = {
            "bool": lambda: d.input(BatchSpec("mask", (tq, tk))),
            "float": lambda: d.input(BatchSpec("float", (tq, tk))),
            "bias": lambda: d.param((draw(st.sampled_from([1, hq])), tq, tk)),  # its gradient is attention's dS
        }.get(mode, lambda: None)()
        if k is not None:
            d.add("attention", hq, mode == "causal", draw(st.sampled_from([None, 0.7])), hk != hq, x, k, v, mask)
    else:  # a kind that needs a rank x does not have
        d.add("unary", pick(["tanh", "sin", "neg"]), x)


@st.composite
def recipes(draw) -> Recipe:
    d = _Drawer(draw)
    # each recipe combines a few kinds of step, so that every kind is drawn
    # several times in the recipes that have it (a bug in a rule often shows
    # only in one case of its op: ties, a step > 1, a padding row that an id
    # hits), picked evenly (hypothesis draws early elements
    # of a list more often than late ones, and permutations close to the
    # identity: a seeded random.Random picks evenly)
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    kinds = rng.sample(STEP_KINDS, rng.randint(4, 12))
    for _ in range(draw(st.integers(1, 2))):
        d.add("param", d.param(tuple(draw(st.lists(sizes, min_size=1, max_size=3)))))
    for _ in range(draw(st.integers(4, 10))):
        _draw_step(d, kinds)
    # every value no later step uses feeds the loss, so no step is dead; one
    # more that is also used elsewhere makes its cotangent a sum
    used = {a.i for _, *args in d.steps for a in _refs(args) if a.space == "v"}
    outs = [i for i in range(len(d.steps)) if i not in used]
    extra = draw(st.integers(0, len(d.steps) - 1))
    outs += [] if extra in outs else [extra]
    loss = tuple((i, d.input(BatchSpec("float", tuple(d.env["v"][i].shape))).i) for i in outs)
    return Recipe(tuple(d.params), tuple(d.batch), tuple(d.steps), loss)


def _refs(args):
    for a in args:
        if isinstance(a, Ref):
            yield a
        elif isinstance(a, tuple):
            yield from _refs(a)


# --- the checker -------------------------------------------------------------------


class GradientMismatch(AssertionError):
    """Nova's gradient of a parameter differs from torch.autograd's."""


_CAPTURED: dict[Recipe, Captured] = {}  # torch.export is the slow part: once per recipe
EXAMPLES_RUN = [0]  # checker calls, for the mutation tests' report


def captured(r: Recipe) -> Captured:
    if r not in _CAPTURED:
        gen = torch.Generator().manual_seed(0)
        _CAPTURED[r] = capture(RecipeModule(r), tuple(batch_value(b, gen) for b in r.batch))
    return _CAPTURED[r]


def nova_gradients(r: Recipe, params, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Nova's loss and gradients: the cached capture, then the pipeline's
    other stages with no optimizer (autodiff, precision, simplify)."""
    cap = captured(r)
    module = cap.module.clone()
    c = pipeline.Compilation(RecipeModule(r), tuple(batch), None, "fp32", torch.float64)
    c.captured = Captured(module, step_func(module), cap.params, cap.buffers, cap.batch_names)
    for name, stage in pipeline.STAGES:
        if name != "capture":
            stage(c)
            c.module.verify()
    fn = c.captured.fn
    by_name = {f"p{i}": p for i, p in enumerate(params)} | {n: b for n, b in zip(cap.batch_names, batch)}
    by_name |= {n: t for n, t in cap.buffers.items()}
    by_name |= {s.name: torch.tensor(0) for s in arg_slots(fn) if s.role == "guard"}  # nothing failed before
    outs = run_function(fn, [by_name[s.name] for s in arg_slots(fn)])
    grads = {name: t for (role, name, _), t in zip(returned(fn), outs) if role == "grad"}
    return outs[0], grads


def check_recipe(r: Recipe, seed: int, quantized: bool) -> None:
    EXAMPLES_RUN[0] += 1
    gen = torch.Generator().manual_seed(seed)
    params = [param_value(s, gen, quantized).requires_grad_() for s in r.params]
    batch = [batch_value(b, gen) for b in r.batch]
    loss = run_recipe(r, params, batch)
    assume(torch.isfinite(loss).item())  # exp of exp of ... may overflow
    expected = torch.autograd.grad(loss, params, allow_unused=True)
    got_loss, got = nova_gradients(r, [p.detach() for p in params], batch)
    torch.testing.assert_close(got_loss, loss.detach(), rtol=1e-10, atol=1e-10)
    for i, e in enumerate(expected):
        name = f"p{i}"
        if e is None:
            if name in got:
                raise GradientMismatch(f"{name} does not reach the loss, but Nova gives it a gradient")
            continue
        if name not in got:
            raise GradientMismatch(f"Nova gives {name} no gradient")
        assume(torch.isfinite(e).all().item())
        err = (got[name] - e).abs().max().item()
        if not err <= 1e-9 * max(1.0, e.abs().max().item()):
            raise GradientMismatch(f"gradient of {name} {tuple(e.shape)}: max |nova - torch| = {err:.3g}\n"
                                   f"torch: {e}\nnova:  {got[name]}")  # fmt: skip


@settings(max_examples=CAPTURED_EXAMPLES, **DETERMINISTIC)
@given(recipes(), st.integers(0, 2**31 - 1), st.booleans())
def test_captured_programs_match_torch_autograd(recipe, seed, quantized):
    check_recipe(recipe, seed, quantized)


@settings(max_examples=4, **DETERMINISTIC)
@given(recipes(), st.integers(0, 2**31 - 1))
def test_sgd_step_through_compile_moves_parameters_by_minus_grad(recipe, seed):
    # the public path: nova.compile with SGD(lr=1), one step, against the same checker's gradients
    gen = torch.Generator().manual_seed(seed)
    model = RecipeModule(recipe)
    with torch.no_grad():
        for p, s in zip(model.parameters(), recipe.params):
            p.copy_(param_value(s, gen, False))
    batch = [batch_value(b, gen) for b in recipe.batch]
    before = [p.detach().clone() for p in model.parameters()]
    loss = run_recipe(recipe, list(model.parameters()), batch)
    assume(torch.isfinite(loss).item())
    expected = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    assume(all(e is None or torch.isfinite(e).all().item() for e in expected))
    step = nova.compile(model, torch.optim.SGD(model.parameters(), lr=1.0), backend="reference")
    torch.testing.assert_close(step(*batch), loss.detach(), rtol=1e-10, atol=1e-10)
    for p, p0, e in zip(model.parameters(), before, expected):
        moved = p.detach() - p0
        want = torch.zeros_like(p0) if e is None else -e
        scale = max(1.0, p0.abs().max().item(), want.abs().max().item())
        torch.testing.assert_close(moved, want, rtol=1e-9, atol=1e-9 * scale)
