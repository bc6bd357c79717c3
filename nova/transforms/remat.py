"""The remat stage: the backward recomputes cheap values instead of keeping them.

A training step keeps activations from the forward until the backward reads
them; remat frees such a value after its forward reads and recomputes it, from
values that exist then, just before its backward reads. The clones compute the
same ops on the same values, so every result is bit-identical.

Forward and backward, precisely: a value's *reads* are the launch steps (the
Triton backend's order, ``plan_memory.launch_order``) of the kernels that read
it or a strided view of it. Its definition and its reads, sorted by time, are
split at their largest gap: the reads before it keep the value, the reads after
it (the *late group*) read a recomputed copy made just before the first of
them. In a training step that gap is the distance from an activation's forward
use to its backward use; the stage never needs to know which op autodiff wrote.

A *recompute* of value ``v`` for its late group at time T clones ``v``'s
defining op and, recursively, the producers of its operands, stopping at
*leaves*: arguments (params, state, buffers: the caller's tensors; unless the
argument is updated in place before T), 0-d constants, and values *live at T
anyway* (their last read, kept by other readers, is at T or later). Layout ops
that are strided views cost nothing and are cloned along (the late readers'
views of ``v`` too). Only element-local ops are cloned: elementwise ones and
layer_norm (a row pass; only for its output, never for its statistics alone),
never a reduction, a contraction (matmul, attention, the fused LM head) or an
embedding. A leaf that is not live at T anyway is *extended*: it is kept until T.

  default   up to ``DEFAULT_OPS`` kernels, each elementwise (casts, add/mul with a
            bias or a scalar, gelu, neg, copies, ...) or a layer_norm, from leaves
            live at T anyway; or, *narrower source*, an elementwise-only chain
            whose extended leaves together are at most half the bytes of ``v``.
            On GPT-2 (bytes read + written per byte of ``v`` no longer kept):
            a weight's bf16 cast from the param (3); the bf16 GELU output from
            the pre-GELU value (7: gelu, cast); the bf16 LayerNorm outputs the
            backward matmuls read, from the input and params layer_norm_backward
            keeps (7: layer_norm, cast); the f32 pre-GELU bias add from the bf16
            matmul output, kept instead at half the bytes (3.5:
            cast, add); a residual from the previous one and the bf16 projection
            output (6.5). One pass over bytes per kernel, no FLOPs to speak of: at
            batch 32 x 1024 the recomputes move 45 GiB (about 10 ms at the H200's
            4.8 TB/s; 16 GiB before narrower sources and layer_norm) against about
            27 TFLOP of matmuls, attention and LM head (27 ms at 989 TFLOP/s). Each
            clone is its own launch today; fused into its reader (gelu_backward
            reading the bf16 matmul output) a narrower source moves fewer bytes
            than keeping ``v`` would.
  budget    with ``Compilation.memory_budget`` (bytes), also chains of up to
            ``BUDGET_OPS`` kernels, dropout masks (a counter-based RNG) and extended
            leaves of any size (e.g. each residual from the one two additions back
            and both bf16 projection outputs: 6 kernels, 13 bytes moved per byte).

Which choices: the plan's liveness (``plan_memory._Planner``: the same storage,
views and in-place rules as the final plan; before fusion, so every op is its
own launch here, a matmul's epilogue ops too) gives the bytes
live at every step and the step of the largest live set, t*. A choice helps
when it frees ``v`` across t* (more than any leaf it extends to T). Default:
every helping default choice (not touching another one applied in the same
round) is applied, liveness is recomputed, and rounds repeat while t* has a
helping choice; a round whose largest live set is larger than before is
undone and its choices tried one at a time, each kept only if the largest live
set does not grow. Choices from leaves live anyway go first, narrower sources
only in a round with none of those left (or none kept): once the GELU output
is recomputed from the pre-GELU value, that value's late reads include the
clone, and its narrower source (the bf16 matmul output) then serves both.
Budget: then, one choice at a time, the one that frees the most bytes at t*
per byte the recompute reads and writes (elementwise kernels are
bandwidth-bound), until the predicted peak (``plan_memory``'s full plan of the
IR as the next stages, norm_recompute and fuse, make it: ``peak_bytes``) fits;
if no choice is left, ``MemoryBudgetError`` names the budget and the smallest
peak reached.

Results: the list of ``Choice`` (``remat()`` returns it, the pipeline keeps it as
``Compilation.remat``) and ``report()`` for ``explain()``. Clones carry the
original's ``nova.loc`` and ``nova.remat = "<rule>"``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from xdsl.dialects.builtin import ModuleOp, StringAttr
from xdsl.ir import BlockArgument, Operation, SSAValue

from nova.errors import NovaError
from nova.ir import dialect as nv
from nova.ir.module import arg_slots, step_func
from nova.ir.types import shape_of
from nova.transforms import plan_memory as pm
from nova.transforms.simplify import dce

# kernels that compute each output element from the same-position (or broadcast)
# elements of their operands: a recompute costs one pass over the bytes
ELEMENTWISE = (
    nv.CastOp, nv.AddOp, nv.SubOp, nv.MulOp, nv.DivOp, nv.MaximumOp, nv.PowOp, nv.WhereOp,
    nv.NegOp, nv.ExpOp, nv.LogOp, nv.SqrtOp, nv.RsqrtOp, nv.TanhOp, nv.SigmoidOp, nv.ReluOp,
    nv.CosOp, nv.SinOp, nv.AbsOp, nv.Log1pOp, nv.Expm1Op, nv.GeluOp, nv.GeluBackwardOp, nv.RoundTf32Op, nv.CompareOp,
    nv.TransposeOp, nv.ReshapeOp, nv.BroadcastToOp, nv.SliceOp, nv.PadOp, nv.FullOp,
)  # fmt: skip
# one pass over a row: reads the row and writes it, like an elementwise kernel
# (its statistics are recomputed too and then unused)
ROW_LOCAL = (nv.LayerNormOp,)
# a counter-based RNG per element: only to fit a budget
BUDGET_ONLY = (nv.DropoutMaskOp,)
# a handful of element-local kernels: as cheap as the launches of the ops they serve
DEFAULT_OPS = 3
BUDGET_OPS = 8
MAX_ROUNDS = 200


class MemoryBudgetError(NovaError):
    """No rematerialization brings the step's predicted peak under the budget."""

    def __init__(self, budget: int, reachable: int, n_choices: int):
        self.budget, self.reachable = budget, reachable
        super().__init__(
            f"memory_budget {pm.gib(budget)} ({budget} bytes) cannot be met: the smallest predicted peak "
            f"rematerialization reaches is {pm.gib(reachable)} ({reachable} bytes, after {n_choices} recomputes); "
            "raise the budget or lower the batch size"
        )


@dataclass(frozen=True)
class Choice:
    """One recompute: ``what`` (the cloned kernels, last = the freed value, and its
    type), where (``loc``), the bytes no longer kept across the gap and the bytes
    the recompute reads and writes."""

    what: str
    loc: str | None
    saved_bytes: int
    cost_bytes: int
    rule: str  # "default" | "budget"


# ----------------------------------------------------------------------------
# liveness of the current IR


class _Live:
    """One liveness analysis (plan_memory's planner without offsets)."""

    def __init__(self, fn):
        p = pm._Planner(fn)
        p.storage()
        p.liveness()
        inplace = p.results()
        self.p = p
        self.time: dict[Operation, int] = {}
        for t, st in enumerate(p.steps, 1):
            self.time[st.op] = t
        self.reads: dict[SSAValue, list[int]] = {}
        for t, st in enumerate(p.steps, 1):
            if isinstance(st.op, pm.VIEW_OPS) and self.kind(st.op.results[0]) == "view":
                continue  # a view launches nothing: its readers read the root
            for v in st.inputs:
                self.reads.setdefault(p.root(v), []).append(t)
        self.buffers = p.arena_buffers()
        self.live, self.peak_time = pm.live_profile(self.buffers, p.end_time)
        self.lower = self.live[self.peak_time]
        # an argument updated in place at step d holds the old value only until d
        by_slot = {(s.role, s.name): a for a, s in zip(p.block.args, arg_slots(fn), strict=True)}
        self.overwritten = {by_slot[(ip.role, ip.name)]: ip.written_at for ip in inplace if ip.how == "inplace"}

    def kind(self, v: SSAValue) -> str:
        q = self.p.place.get(v)
        return q.kind if q is not None else "fused"

    def available(self, u: SSAValue, t: int) -> bool:
        """``u`` can be read at step ``t`` without keeping any bytes longer."""
        r = self.p.root(u) if u in self.p.place else u
        k = self.kind(r)
        if k in ("const", "empty"):
            return True
        if k == "external":
            return self.overwritten.get(r, 1 << 60) >= t
        if k == "fused":
            return False
        return self.p.last[r] >= t

    def size(self, v: SSAValue) -> int:
        q = self.p.place.get(v)
        return q.size if q is not None and q.kind in ("arena", "input") else 0


# ----------------------------------------------------------------------------
# candidates


@dataclass
class _Candidate:
    value: SSAValue
    late: int  # T: the step of the first late read; the clones go before its op
    ops: list[Operation]  # to clone, in block order
    leaves: set[SSAValue]  # roots read by the clones
    extended: set[SSAValue]  # leaves whose lifetime grows to T
    net: int  # bytes freed at the largest live set
    cost: int
    rule: str
    kernels: list[str] = field(default_factory=list)  # the cloned ops that launch, by name

    def touched(self) -> set[SSAValue]:
        return {self.value, *self.leaves, *(r for op in self.ops for r in op.results)}


def _split(times: list[int]) -> tuple[int, int] | None:
    """(last early time, first late time) at the largest gap, or None."""
    if len(times) < 2:
        return None
    i = max(range(len(times) - 1), key=lambda i: (times[i + 1] - times[i], -i))
    return times[i], times[i + 1]


def _recompute(live: _Live, v: SSAValue, t: int, budget: bool):
    """The ops to clone, the leaves and the extended leaves (an op that is not
    recomputed, or not within the kernel limit, is kept until ``t``), or None
    when ``v`` cannot be recomputed at ``t``."""
    allowed = ELEMENTWISE + ROW_LOCAL + BUDGET_ONLY if budget else ELEMENTWISE + ROW_LOCAL
    limit = BUDGET_OPS if budget else DEFAULT_OPS
    ops: dict[Operation, None] = {}
    leaves: set[SSAValue] = set()
    extended: set[SSAValue] = set()
    kernels = 0

    def visit(u: SSAValue) -> bool:
        nonlocal kernels
        if u is not v and live.available(u, t):
            leaves.add(live.p.root(u) if u in live.p.place else u)
            return True
        op = u.owner
        if isinstance(u, BlockArgument) or not isinstance(op, Operation):
            return False  # an argument overwritten before t
        if op in ops:
            return True
        recomputable = isinstance(op, allowed) and kernels < limit
        if isinstance(op, ROW_LOCAL) and u is not op.results[0]:
            recomputable = False  # a row's statistics alone: 1/C of the bytes the pass moves
        if isinstance(op, nv.FullOp) and live.kind(u) == "const":
            recomputable = False
        if not recomputable:
            if u is v or live.kind(u) == "fused":
                return False
            r = live.p.root(u)
            leaves.add(r)
            extended.add(r)
            return True
        if live.kind(op.results[0]) != "view":
            kernels += 1
        if not all(visit(o) for o in op.operands):
            return False
        ops[op] = None
        return True

    if not visit(v):
        return None
    return list(ops), leaves, extended


def _grown_peak(live: _Live, size: int, early: int, late: int, extended: set[SSAValue]) -> int:
    """The largest live set while the extended leaves wait for step ``late`` (and
    the freed value, of ``size`` bytes, is gone between ``early`` and ``late``)."""
    grow = [0] * (late + 2)
    for r in extended:
        grow[live.p.last[r] + 1] += live.size(r)
        grow[late + 1] -= live.size(r)
    top, cur = 0, 0
    for t in range(min(live.p.last[r] for r in extended) + 1, late + 1):
        cur += grow[t]
        top = max(top, live.live[t] + cur - (size if early < t < late else 0))
    return top


def _default_kind(kernels: list[Operation], extended_bytes: int, size: int) -> bool:
    """The default rule: at most ``DEFAULT_OPS`` elementwise or row-local kernels
    whose leaves are live anyway, or an elementwise-only chain from narrower
    sources (the extended leaves at most half the bytes freed)."""
    if len(kernels) > DEFAULT_OPS or not all(isinstance(op, ELEMENTWISE + ROW_LOCAL) for op in kernels):
        return False
    if not extended_bytes:
        return True
    return all(isinstance(op, ELEMENTWISE) for op in kernels) and 2 * extended_bytes <= size


def candidates(live: _Live, budget: bool) -> list[_Candidate]:
    """The choices that free bytes at the current largest live set: with ``budget``
    every one (rule "budget"), else the default rule's."""
    tp = live.peak_time
    out = []
    for b in live.buffers:
        v = b.value
        if not b.start < tp < b.end or not isinstance(v.owner, Operation) or live.kind(v) != "arena":
            continue
        if live.p.last[v] >= live.p.end_time:
            continue  # returned
        times = sorted({b.start, *live.reads.get(v, [])})
        split = _split(times)
        if split is None or not split[0] < tp < split[1]:
            continue
        early, late = split
        found = _recompute(live, v, late, budget)
        if found is None:
            continue
        ops, leaves, extended = found
        added = sum(live.size(r) for r in extended if live.p.last[r] < tp)
        net = b.size - added
        if net <= 0:
            continue
        kernels = [op for op in ops if live.kind(op.results[0]) != "view"]
        grown = sum(live.size(r) for r in extended)
        if not budget and not _default_kind(kernels, grown, b.size):
            continue
        # no new largest live set elsewhere: the clones' intermediates at T (the clone
        # of v itself replaces v there) and each extended leaf over its new stretch
        transient = sum(live.size(r) for op in kernels for r in op.results if r is not v)
        if live.live[late] + transient + grown > live.lower:
            continue
        if extended and _grown_peak(live, b.size, early, late, extended) > live.lower:
            continue
        cost = sum(pm.nbytes(x) for op in kernels for x in (*op.operands, *op.results))
        rule = "budget" if budget else "default"
        names = [op.name.removeprefix("nova.") for op in kernels]
        out.append(_Candidate(v, late, ops, leaves, extended, net, cost, rule, names))
    return out


# ----------------------------------------------------------------------------
# applying a choice (and undoing it)


@dataclass
class _Applied:
    cand: _Candidate
    clones: list[Operation]
    rewired: list[tuple[Operation, int, SSAValue]]

    def undo(self) -> None:
        for op, i, old in reversed(self.rewired):
            op.operands[i] = old
        for op in reversed(self.clones):
            op.detach()
            op.erase()


REMAT_ATTR = "nova.remat"  # on every clone: the rule that made it (``Choice.rule``)


def is_recompute(op: Operation) -> bool:
    """Whether ``op`` is a recompute of this stage (or of a later stage's rewrite of one)."""
    return REMAT_ATTR in op.attributes


def _apply(live: _Live, c: _Candidate) -> _Applied:
    anchor = live.p.steps[c.late - 1].op
    block = anchor.parent_block()
    mapper: dict[SSAValue, SSAValue] = {}
    clones: list[Operation] = []
    rewired: list[tuple[Operation, int, SSAValue]] = []

    def clone(op: Operation) -> Operation:
        new = op.clone(value_mapper=mapper)
        new.attributes[REMAT_ATTR] = StringAttr(c.rule)
        for k in ("nova.storage", "nova.offset"):
            new.attributes.pop(k, None)
        block.insert_op_before(new, anchor)
        clones.append(new)
        return new

    for op in c.ops:
        clone(op)
    cloned = set(clones)

    def late_readers(x: SSAValue) -> bool:
        for u in x.uses:
            op = u.operation
            t = live.time.get(op, 0)
            if t >= c.late or (isinstance(op, pm.VIEW_OPS) and live.kind(op.results[0]) == "view"
                               and late_readers(op.results[0])):  # fmt: skip
                return True
        return False

    def rewire(orig: SSAValue, new: SSAValue) -> None:
        for u in list(orig.uses):
            op = u.operation
            if op in cloned:
                continue
            if live.time.get(op, 0) >= c.late:
                rewired.append((op, u.index, orig))
                op.operands[u.index] = new
            elif isinstance(op, pm.VIEW_OPS) and live.kind(op.results[0]) == "view" and late_readers(op.results[0]):
                view = clone(op)
                view.operands = [new]
                cloned.add(view)
                rewire(op.results[0], view.results[0])

    rewire(c.value, mapper[c.value])
    return _Applied(c, clones, rewired)


def _choice(c: _Candidate) -> Choice:
    op = c.value.owner
    loc = op.attributes.get("nova.loc")
    return Choice(
        what=f"{' -> '.join(c.kernels)} {c.value.type}",
        loc=loc.data if isinstance(loc, StringAttr) else None,
        saved_bytes=pm.nbytes(c.value),
        cost_bytes=c.cost,
        rule=c.rule,
    )


# ----------------------------------------------------------------------------
# the stage


def _try_round(fn, live: _Live, cands: list[_Candidate], chosen: list[Choice]) -> tuple[_Live, bool]:
    """Applies every candidate not touching another one applied before it; keeps
    them if the largest live set does not grow, else tries them one at a time.
    Returns the new liveness and whether anything was kept."""
    touched: set[SSAValue] = set()
    applied: list[_Applied] = []
    for c in cands:
        if c.touched() & touched:
            continue
        touched |= c.touched()
        applied.append(_apply(live, c))
    after = _Live(fn)
    if after.lower <= live.lower:
        chosen.extend(_choice(a.cand) for a in applied)
        return (_Live(fn) if dce(fn.body.block) else after), True
    for a in reversed(applied):  # the round made a larger live set: one choice at a time
        a.undo()
    kept = 0
    for c in [a.cand for a in applied]:
        a = _apply(live, c)
        nxt = _Live(fn)
        if nxt.lower <= live.lower:
            chosen.append(_choice(c))
            kept += 1
        else:
            a.undo()
    dce(fn.body.block)
    return _Live(fn), kept > 0


def _default_rounds(fn, live: _Live, chosen: list[Choice]) -> _Live:
    for _ in range(MAX_ROUNDS):
        cands = sorted(candidates(live, budget=False), key=lambda c: -c.net)
        # from values live anyway first, narrower sources after (module docstring)
        groups = [[c for c in cands if not c.extended], [c for c in cands if c.extended]]
        for group in groups:
            if group:
                live, kept = _try_round(fn, live, group, chosen)
                if kept:
                    break
        else:
            return live
    return live


def _peak(module: ModuleOp) -> int:
    """The predicted peak of the step the later stages make of this IR: norm_recompute's
    moves (a weight gradient after the LayerNorm backward) and the fuse stage's groups
    (fewer intermediates, a few moved) planned, as the final plan is."""
    from nova.transforms.fuse import fuse
    from nova.transforms.norm_recompute import norm_recompute

    fused = module.clone()
    norm_recompute(fused)
    fuse(fused)
    return pm.plan_memory(fused).peak_bytes


def remat(module: ModuleOp, budget: int | None = None) -> list[Choice]:
    """Rematerializes @train_step in place (see the module docstring); returns the choices."""
    fn = step_func(module)
    chosen: list[Choice] = []
    live = _default_rounds(fn, _Live(fn), chosen)
    if budget is None:
        return chosen
    peak = _peak(module)
    best = peak
    outside = peak - pm._align(live.lower, pm.TORCH_BLOCK)  # params, state, inputs, outputs, constants
    for _ in range(MAX_ROUNDS):
        if peak <= budget:
            return chosen
        estimate = pm._align(live.lower, pm.TORCH_BLOCK) + outside
        need = estimate - budget if estimate > budget else peak - budget
        # best bytes per recompute cost first; as many (not touching each other) as the
        # largest live set needs to shrink by
        cands = sorted(candidates(live, budget=True), key=lambda c: (-c.net / max(c.cost, 1), -c.net))
        batch, touched, freed = [], set(), 0
        for c in cands:
            if not c.touched() & touched:
                batch.append(c)
                touched |= c.touched()
                freed += c.net
                if freed >= need:
                    break
        applied = [_apply(live, c) for c in batch]
        nxt = _Live(fn)
        if nxt.lower > live.lower:  # together they made a larger live set elsewhere: the best alone
            for a in reversed(applied):
                a.undo()
            applied = []
            for c in batch:
                a = _apply(live, c)
                nxt = _Live(fn)
                if nxt.lower <= live.lower:
                    applied = [a]
                    break
                a.undo()
        if not applied:
            raise MemoryBudgetError(budget, min(best, _peak(module)), len(chosen))
        chosen.extend(_choice(a.cand) for a in applied)
        live = _Live(fn) if dce(fn.body.block) else nxt
        if pm._align(live.lower, pm.TORCH_BLOCK) + outside <= budget:
            peak = _peak(module)  # the estimate fits: what does the full plan say
            best = min(best, peak)
    raise MemoryBudgetError(budget, min(best, _peak(module)), len(chosen))


def report(choices: list[Choice], top: int = 10) -> list[str]:
    """The choices in a few lines, for ``explain()``."""
    if not choices:
        return ["remat: nothing recomputed"]
    saved = sum(c.saved_bytes for c in choices)
    cost = sum(c.cost_bytes for c in choices)
    by_rule = {r: sum(1 for c in choices if c.rule == r) for r in ("default", "budget")}
    lines = [
        f"remat: {len(choices)} values recomputed ({by_rule['default']} default, {by_rule['budget']} for the budget), "
        f"{pm.gib(saved)} no longer kept from their early to their late reads, "
        f"the recomputes read and write {pm.gib(cost)}"
    ]
    for c in sorted(choices, key=lambda c: -c.saved_bytes)[:top]:
        lines.append(f"  {pm.gib(c.saved_bytes):>12}  [{c.rule}] {c.what}" + (f"  ({c.loc})" if c.loc else ""))
    return lines
