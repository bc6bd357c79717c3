"""The plan_memory stage: liveness over the whole step, one static arena, in-place updates.

The step is one straight-line block, run in the Triton backend's launch order
(``nova.backends.triton``): one launch per op, layout ops are strided views and
launch nothing, a ``nova.fused`` group (a matmul with its epilogue among them)
is one kernel. The plan gives every value a storage (``docs/memory.md`` is the
long version):

  arena     an intermediate: (offset, size) in one device arena, sizes rounded
            up to ``ALIGNMENT``; a buffer is reused once its value is dead
  input     a batch / hyper / seed argument: an arena slot the step call fills
            before the first launch, reused after its last read like any other
  view      transpose, broadcast_to, slice and a reshape the strides allow:
            the source's storage (its lifetime grows to cover the view's reads)
  external  a param / state / buffer argument: the caller's tensor, bound as it is
  inplace   the new value of a param / state: written into the argument of the
            same name (legal only when nothing reads the old value afterwards)
  output    a returned loss / grad: its own allocation outside the arena (the
            caller keeps it after the arena is reused)
  const     a 0-d ``nova.full``: a compile-time constant pool, no arena bytes
  window    an op's result written straight into its window of a ``nova.cat``'s
            buffer (the cat is then *assembled*: it launches nothing)
  empty     a tensor of zero elements

Layouts (``plan_layouts``): an arena value is dense in its buffer, except

  permuted  the result of a kernel that stores it through any strides (attention's
            o), read by kernels that read any strides and through a transpose
            whose reshape the dense layout makes a copy: its buffer holds
            ``value.permute(perm)`` densely (o [B, H, T, D] as [B, T, H, D]), so
            the transpose is dense and its [B, T, C] reshape a view
  window    every piece of a ``nova.cat`` a kernel result (attention's dq, dk, dv)
            that only the cat reads, through transposes at most: each is placed
            at its window of the cat's buffer (the window holds
            ``value.permute(perm)``), the cat's buffer is live from the first
            window's write, and the cat launches nothing (the same bytes)

Times: 0 is the step's entry (the inputs are copied in), step ``i`` of the
launch order runs at time ``i + 1``, the return is at ``len(steps) + 1``. A
value is live on the closed interval [def, last read]; an op reads its operands
while it writes its results, so they never share bytes.

Offsets: buffers in decreasing size, each into the best-fitting gap (the
smallest that holds it, the lowest on a tie) left by the already placed buffers
it is live together with, or on top of them (XLA's GlobalDecreasingSizeBestFit
heap). Interference queries go through a segment tree over time plus a sorted
list of starts: O(n log n) plus the number of interfering pairs it must look at.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import torch
from xdsl.context import Context
from xdsl.dialects.builtin import ArrayAttr, DenseArrayBase, DictionaryAttr, IntegerAttr, ModuleOp, StringAttr, i64
from xdsl.ir import Operation, SSAValue
from xdsl.passes import ModulePass

from nova.ir import dialect as nv
from nova.ir.module import arg_slots, result_slots, return_op, step_func
from nova.ir.types import elem_of, numel, shape_of, to_torch_dtype

# cudaMalloc returns 256-byte aligned pointers; TMA descriptors need 16 B, vector loads 16 B
ALIGNMENT = 256
# torch's CUDA caching allocator rounds every allocation up to a multiple of 512 B
# (kMinBlockSize), and max_memory_allocated counts the rounded sizes
TORCH_BLOCK = 512

# the layout ops the Triton backend turns into strided views (the dialect's list)
VIEW_OPS = nv.VIEW_OPS
# kernels that read element i of every same-shape operand before writing element i
# of their one result: the only ops that may write over an operand they read
SAME_INDEX = (
    nv.AddOp, nv.SubOp, nv.MulOp, nv.DivOp, nv.MaximumOp, nv.PowOp, nv.WhereOp,
    nv.NegOp, nv.ExpOp, nv.LogOp, nv.SqrtOp, nv.RsqrtOp, nv.TanhOp, nv.SigmoidOp, nv.ReluOp,
    nv.CosOp, nv.SinOp, nv.AbsOp, nv.Log1pOp, nv.Expm1Op, nv.GeluOp, nv.GeluBackwardOp, nv.RoundTf32Op,
)  # fmt: skip
EXTERNAL_ROLES = ("param", "state", "buffer", "guard")
# arguments whose result of the same name is their new value (written in place where it can be;
# a buffer has one only where the forward writes it: batch norm's running statistics)
UPDATED_ROLES = ("param", "state", "buffer", "guard")
INPUT_ROLES = ("batch", "hyper", "seed")


def _align(n: int, to: int = ALIGNMENT) -> int:
    return -(-n // to) * to


def nbytes(v: SSAValue) -> int:
    return numel(shape_of(v.type)) * to_torch_dtype(elem_of(v.type)).itemsize


@dataclass
class Placement:
    """Where one value lives. ``offset``/``size`` for arena and input values;
    ``root`` the storage-owning value of a view; ``arg`` the argument an inplace
    value is written into."""

    kind: str
    offset: int = -1
    size: int = 0
    root: SSAValue | None = None
    arg: str | None = None
    # the order of the value's dims in its bytes: its buffer (arena) or its window of
    # the root's (window) holds value.permute(perm) densely; None: the value's own order
    perm: tuple[int, ...] | None = None
    window: tuple[int, int, int] | None = None  # a window: (dim, start, end) of the root (a nova.cat result)
    assembled: bool = False  # a cat whose pieces are windows its producers wrote: its op launches nothing


@dataclass(frozen=True)
class Buffer:
    """One arena allocation: ``value`` defined at time ``start``, last read at ``end``."""

    value: SSAValue
    offset: int
    size: int  # aligned bytes
    start: int
    end: int
    what: str  # "nova.matmul #0", "batch x", ...
    loc: str | None

    def overlaps_in_time(self, other: "Buffer") -> bool:
        return self.start <= other.end and other.start <= self.end


@dataclass(frozen=True)
class InPlace:
    """A param / state result and how it reaches its argument: ``inplace`` (its
    value is computed into the argument), ``copy`` (copied in after the step,
    ``reason`` says why) or ``unchanged`` (the result is the argument itself)."""

    role: str
    name: str
    how: str
    written_at: int  # the time the new value is written (-1: unchanged)
    reason: str | None = None


@dataclass
class MemoryPlan:
    alignment: int
    arena_bytes: int  # the arena's size: the top of the highest buffer
    sum_bytes: int  # every arena buffer's aligned size added up (no reuse)
    lower_bound_bytes: int  # the largest live set: no assignment of these intervals needs less
    peak_time: int  # when the largest live set occurs
    peak_what: str  # the op running then ("entry" at time 0)
    peak_loc: str | None
    external: dict[str, int]  # what lives outside the arena, by kind, rounded as torch allocates
    buffers: list[Buffer]
    inplace: list[InPlace]
    live_bytes: list[int]  # arena bytes live at each time
    steps: list[str]  # the op name of each step, in launch order
    placements: dict[SSAValue, Placement] = field(repr=False, default_factory=dict)
    scratch_at: dict[Operation, tuple[int, int]] = field(repr=False, default_factory=dict)  # op -> planned scratch
    scratch_bytes: int = 0  # the most one launch allocates outside the arena (set by the backend's kernels)
    scratch_what: str = ""  # the op whose launch that is

    @property
    def peak_bytes(self) -> int:
        """The predicted ``torch.cuda.max_memory_allocated()`` of one steady-state step:
        the arena (one allocation) plus everything outside it that is allocated while
        the step runs: params, optimizer state, model buffers, the caller's batch and
        scalar inputs, the returned outputs and the constant pool (each rounded up to
        512 B as torch's caching allocator does), and the largest scratch of one
        launch (known once the backend has lowered the kernels: ``scratch_bytes``)."""
        return (_align(self.arena_bytes, TORCH_BLOCK) + sum(self.external.values())
                + _align(self.scratch_bytes, TORCH_BLOCK))  # fmt: skip


# ----------------------------------------------------------------------------
# the launch order


@dataclass(frozen=True)
class Step:
    op: Operation
    inputs: tuple[SSAValue, ...]
    outputs: tuple[SSAValue, ...]


def launch_order(fn) -> list[Step]:
    """The steps in the order the backend launches them: one per op (what runs in
    one kernel is one op by now: the fuse stage's groups, a matmul's epilogue
    among them)."""
    ret = return_op(fn)
    return [Step(op, tuple(op.operands), tuple(op.results)) for op in fn.body.block.ops if op is not ret]


# ----------------------------------------------------------------------------
# storage of each value


def _meta(v: SSAValue, layouts: dict) -> torch.Tensor:
    t = layouts.get(v)
    if t is None:  # a kernel's result or an argument: contiguous
        t = torch.empty(shape_of(v.type), device="meta")
    return t


def _view_layout(op: Operation, src: torch.Tensor) -> torch.Tensor | None:
    """The strided view the backend makes of ``src`` (a meta tensor), or None
    when a reshape's strides allow no view (the backend copies then)."""
    out_shape = shape_of(op.results[0].type)
    if isinstance(op, nv.TransposeOp):
        return src.permute(op.props()["perm"])
    if isinstance(op, nv.BroadcastToOp):
        return src.expand(out_shape)
    if isinstance(op, nv.SliceOp):
        p = op.props()
        idx = [slice(None)] * src.dim()
        idx[p["dim"]] = slice(p["start"], p["end"], p["step"])
        return src[tuple(idx)]
    try:
        return src.view(out_shape)
    except RuntimeError:
        return None


def _what(op: Operation, i: int) -> str:
    return f"{op.name} #{i}" if len(op.results) > 1 else op.name


def _loc(op: Operation | None) -> str | None:
    a = op.attributes.get("nova.loc") if op is not None else None
    return a.data if a is not None else None


# ----------------------------------------------------------------------------
# layouts: permuted placements and cat windows

# kernels that store these results through any non-overlapping strides
# (nova.codegen.triton.attention: o; dq, dk, dv; tests/kernels/test_attention.py)
STRIDED_OUTPUTS: dict[type, tuple[int, ...]] = {nv.AttentionOp: (0,), nv.AttentionBackwardOp: (0, 1, 2)}
# kernels that read every operand through its own strides (never a dense copy first)
STRIDED_READERS = (nv.AttentionOp, nv.AttentionBackwardOp)


def inverse(perm: tuple[int, ...]) -> tuple[int, ...]:
    out = [0] * len(perm)
    for i, d in enumerate(perm):
        out[d] = i
    return tuple(out)


def window_view(root: torch.Tensor, window: tuple[int, int, int], perm: tuple[int, ...] | None,
                shape) -> torch.Tensor:
    """The value of ``shape`` placed in ``window`` (dim, start, end) of its cat's buffer
    ``root``: the window holds ``value.permute(perm)``, or (perm None) the value
    flattened, densely."""
    dim, s, e = window
    held = root.narrow(dim, s, e - s)
    return held.view(tuple(shape)) if perm is None else placed_view(held, perm)


def placed_view(held: torch.Tensor, perm: tuple[int, ...] | None) -> torch.Tensor:
    """The value whose dims ``held`` holds in the order ``perm`` (``held`` is
    ``value.permute(perm)``: a permuted buffer, or a window of a cat's buffer)."""
    return held if perm is None else held.permute(inverse(perm))


def _dense_meta(shape, perm: tuple[int, ...]) -> torch.Tensor:
    """The layout of a value of ``shape`` whose buffer holds ``value.permute(perm)`` densely."""
    return placed_view(torch.empty([shape[d] for d in perm], device="meta"), perm)


@dataclass
class Layouts:
    """What ``plan_layouts`` found: the permuted placements (value -> perm) and the
    cat windows (value -> (cat result, dim, start, end, perm)) with their cats."""

    permuted: dict[SSAValue, tuple[int, ...]] = field(default_factory=dict)
    windows: dict[SSAValue, tuple[SSAValue, int, int, int, tuple[int, ...]]] = field(default_factory=dict)
    assembled: dict[SSAValue, list[SSAValue]] = field(default_factory=dict)  # cat result -> its windows


def _stored_strided(v: SSAValue) -> bool:
    op = v.owner
    return isinstance(op, Operation) and v.index in STRIDED_OUTPUTS.get(type(op), ()) and nbytes(v) > 0


def _reaches_return(v: SSAValue, returned: set) -> bool:
    """Whether ``v`` or a layout view of it (of a view of it, ...) is returned."""
    stack = [v]
    while stack:
        u = stack.pop()
        if u in returned:
            return True
        stack.extend(use.operation.results[0] for use in u.uses if isinstance(use.operation, VIEW_OPS))
    return False


def _window_source(x: SSAValue) -> tuple[SSAValue, tuple[int, ...]] | None:
    """``(r, perm)`` when the cat piece ``x`` is ``r.permute(perm)`` through transposes
    only, each value on the way (``r`` too) read by the next alone, ``r`` a kernel
    result stored through any strides; else None."""
    perm = tuple(range(len(shape_of(x.type))))
    u = x
    while True:
        if not u.has_one_use():
            return None
        if not isinstance(u.owner, nv.TransposeOp):
            break
        p = u.owner.props()["perm"]
        perm = tuple(p[d] for d in perm)
        u = u.owner.operands[0]
    return (u, perm) if _stored_strided(u) else None


# a dense window's start in bytes: a multiple of this (TMA descriptors and Triton's
# pointer specialization ask 16; the arena's own buffers are ALIGNMENT-aligned)
DENSE_WINDOW_ALIGN = 16


def _dense_window_source(x: SSAValue, dim: int, start: int) -> SSAValue | None:
    """``r`` when the piece ``x`` of a cat along ``dim`` 0 is ``r`` flattened (``r`` itself
    when 1-D), ``r`` a launch's dense result that only this flattening reads, and the
    window starts at a multiple of ``DENSE_WINDOW_ALIGN`` bytes: ``r`` is then stored
    densely in its window, whatever kernel writes it (ddp's gradient buckets); else None."""
    if dim != 0 or len(shape_of(x.type)) != 1 or not x.has_one_use():
        return None
    r = x
    if isinstance(x.owner, nv.ReshapeOp):
        r = x.owner.operands[0]
        if not r.has_one_use():
            return None
    op = r.owner
    if not isinstance(op, Operation) or isinstance(op, (*VIEW_OPS, nv.CatOp, nv.FullOp)) or nbytes(r) == 0:
        return None
    if _stored_strided(r):
        return None  # stored through strides the permuted rule may choose: not here
    if start * to_torch_dtype(elem_of(x.type)).itemsize % DENSE_WINDOW_ALIGN:
        return None
    return r


def _cat_windows(block, returned: set, out: Layouts) -> None:
    for op in block.ops:
        if not isinstance(op, nv.CatOp):
            continue
        c = op.results[0]
        if nbytes(c) == 0 or _reaches_return(c, returned):
            continue
        dim, start, found = op.props()["dim"], 0, {}
        for x in op.operands:
            n = shape_of(x.type)[dim]
            src = _window_source(x)
            if src is not None:
                found[src[0]] = (c, dim, start, start + n, src[1])
            elif (r := _dense_window_source(x, dim, start)) is not None:
                found[r] = (c, dim, start, start + n, None)  # perm None: dense, the window viewed as r's shape
            else:
                break
            start += n
        else:
            out.windows.update(found)
            out.assembled[c] = list(found)


def _copies_saved(v: SSAValue, perm: tuple[int, ...]) -> int | None:
    """How many reshape copies among the layout views of ``v`` (views of views, ...)
    a buffer holding ``v.permute(perm)`` makes views; None when it makes a view a
    copy, or hands a kernel that reads only dense operands a strided one where the
    dense layout gave it a dense one."""
    shape = shape_of(v.type)
    saved, stack = 0, [(v, torch.empty(shape, device="meta"), _dense_meta(shape, perm))]
    while stack:
        u, a, b = stack.pop()
        for use in u.uses:
            o = use.operation
            if isinstance(o, VIEW_OPS):
                va, vb = _view_layout(o, a), _view_layout(o, b)
                if va is not None and vb is None:
                    return None
                saved += va is None and vb is not None
                dense = torch.empty(shape_of(o.results[0].type), device="meta")  # a copy's buffer
                stack.append((o.results[0], dense if va is None else va, dense if vb is None else vb))
            elif a.is_contiguous() and not b.is_contiguous() and not isinstance(o, STRIDED_READERS):
                return None
    return saved


def _permuted(block, returned: set, out: Layouts) -> None:
    for op in block.ops:
        for i in STRIDED_OUTPUTS.get(type(op), ()):
            v = op.results[i]
            if v in out.windows or nbytes(v) == 0 or _reaches_return(v, returned):
                continue
            best = (0, None)
            perms = dict.fromkeys(u.operation.props()["perm"] for u in v.uses if isinstance(u.operation, nv.TransposeOp))
            for perm in perms:
                saved = _copies_saved(v, perm)
                if saved is not None and saved > best[0]:
                    best = (saved, perm)
            if best[1] is not None:
                out.permuted[v] = best[1]


def plan_layouts(fn) -> Layouts:
    """The values of @train_step placed other than densely in a buffer of their own
    (see the module's docstring): cat windows first, then permuted placements. No
    rule matches a value that is returned (or a view of it is), a piece read by
    anything but its cat, a piece through a reshape, slice or broadcast, a cat with
    a piece no kernel of ``STRIDED_OUTPUTS`` writes, or a permutation that makes a
    view a copy or gives a dense-only kernel a strided operand."""
    returned = set(return_op(fn).operands)
    out = Layouts()
    _cat_windows(fn.body.block, returned, out)
    _permuted(fn.body.block, returned, out)
    return out


def layout_text(p: Placement) -> str:
    """A placement's layout as ``nova.layout`` and ``explain()`` show it ("" when dense)."""
    if p.kind == "window":
        dim, s, e = p.window
        return f"window dim {dim} [{s}:{e}] " + ("dense" if p.perm is None else f"perm {','.join(map(str, p.perm))}")
    if p.assembled:
        return "assembled from windows"
    if p.perm is not None:
        return f"perm {','.join(map(str, p.perm))}"
    return ""


class _Planner:
    def __init__(self, fn):
        self.fn = fn
        self.block = fn.body.block
        self.steps = launch_order(fn)
        self.end_time = len(self.steps) + 1
        self.place: dict[SSAValue, Placement] = {}
        self.start: dict[SSAValue, int] = {}
        self.last: dict[SSAValue, int] = {}
        self.step_of: dict[SSAValue, int] = {}  # value -> time of the step defining it

    def storage(self) -> None:
        self.layouts = plan_layouts(self.fn)
        for a, s in zip(self.block.args, arg_slots(self.fn), strict=True):
            kind = "external" if s.role in EXTERNAL_ROLES else "input"
            self.place[a] = Placement(kind, size=_align(nbytes(a)) if kind == "input" else 0)
            self.start[a] = 0
        layouts: dict[SSAValue, torch.Tensor] = {}
        for t, st in enumerate(self.steps, 1):
            op = st.op
            for r in op.results:
                self.step_of[r] = t
            for r in st.outputs:
                self.step_of[r] = t
                self.start[r] = t
            if isinstance(op, VIEW_OPS):
                src = op.operands[0]
                view = _view_layout(op, _meta(src, layouts))
                if view is not None:
                    layouts[op.results[0]] = view
                    root = self.root(src)
                    self.place[op.results[0]] = Placement("view", root=root)
                    continue
            for r in st.outputs:
                if nbytes(r) == 0:
                    self.place[r] = Placement("empty")
                elif isinstance(op, nv.FullOp) and shape_of(r.type) == ():
                    self.place[r] = Placement("const")
                else:
                    self.place[r] = Placement("arena", size=_align(nbytes(r)))
            self._lay_out(st.outputs, layouts)

    def _lay_out(self, outputs, layouts: dict) -> None:
        """A step's results placed as ``plan_layouts`` found: a permuted buffer, a
        window of a cat's buffer (the cat's root; no buffer of its own), or an
        assembled cat (live from its first window's write)."""
        lay = self.layouts
        for r in outputs:
            if r in lay.windows:
                c, dim, s, e, perm = lay.windows[r]
                self.place[r] = Placement("window", root=c, perm=perm, window=(dim, s, e))
                layouts[r] = window_view(torch.empty(shape_of(c.type), device="meta"), (dim, s, e), perm, shape_of(r.type))
            elif r in lay.permuted and self.place[r].kind == "arena":
                self.place[r].perm = lay.permuted[r]
                layouts[r] = _dense_meta(shape_of(r.type), lay.permuted[r])
            elif r in lay.assembled and self.place[r].kind == "arena":
                self.place[r].assembled = True
                self.start[r] = min(self.start[w] for w in lay.assembled[r])

    def root(self, v: SSAValue) -> SSAValue:
        p = self.place[v]
        return p.root if p.kind in ("view", "window") else v

    def liveness(self) -> None:
        for v, t in self.start.items():
            self.last[v] = t
        for t, st in enumerate(self.steps, 1):
            for v in st.inputs:
                self.last[v] = max(self.last[v], t)
        for v in return_op(self.fn).operands:
            self.last[v] = self.end_time
        # a view reads its root's bytes: the root lives as long as its last view is read
        for v, p in self.place.items():
            if p.kind in ("view", "window"):  # a window: its bytes are in its cat's buffer
                self.last[p.root] = max(self.last[p.root], self.last[v])

    def _step_reads_only_same_index(self, t: int, arg: SSAValue, new: SSAValue) -> bool:
        """Whether step ``t`` may write ``new`` over ``arg`` while reading it: a
        same-index op, or a fused kernel (every lane loads all its input elements
        before it stores; ``new`` has the iteration shape, so an ``arg`` of its type
        is read at the flat index; in a matmul's epilogue, at the tile's elements,
        which only that tile writes; never an operand of the matmul itself, which
        every tile of a row or column reads, nor a column sum of the epilogue, which
        every tile adds to), reading ``arg`` itself only, never
        through a view (a broadcast or transpose reads other lanes' elements)."""
        st = self.steps[t - 1]
        if isinstance(st.op, nv.FusedOp):
            head = st.op.contraction()
            reads = head is not None and any(st.op.operands[st.op.body.block.args.index(v)] is arg
                                             for v in head.operands)  # fmt: skip
            # a reduction group's kernel reads whole rows (or columns) before it writes: never in place;
            # nor a column sum of a matmul's epilogue (an [N] sum of every tile's rows)
            sums = {r for r, y in zip(st.op.results, st.op.body.block.last_op.operands, strict=True)
                    if nv.column_sum(y.owner)}  # fmt: skip
            same_index = new in st.outputs and new not in sums and not reads and st.op.reduction() is None
        else:
            same_index = isinstance(st.op, SAME_INDEX) and len(st.outputs) == 1
        if not same_index or new.type != arg.type:
            return False
        return all(v is arg for v in st.inputs if self.root(v) is arg)

    def _describe(self, t: int) -> str:
        if t >= self.end_time:
            return "it is returned"
        op = self.steps[t - 1].op
        loc = _loc(op)
        return f"{op.name} (step {t}{', ' + loc if loc else ''}) reads it"

    def results(self) -> list[InPlace]:
        args = {(s.role, s.name): a for a, s in zip(self.block.args, arg_slots(self.fn), strict=True)}
        out: list[InPlace] = []
        claimed: set[SSAValue] = set()
        rets = list(zip(result_slots(self.fn), return_op(self.fn).operands, strict=True))
        self.result_storage: list[str] = []
        for s, v in rets:
            if s.role not in UPDATED_ROLES:
                self.result_storage.append("")
                continue
            arg = args[(s.role, s.name)]
            # the bytes of v are the root's when only reshape views lie between them
            root = v
            while self.place[root].kind == "view" and isinstance(root.owner, nv.ReshapeOp):
                root = root.owner.operands[0]
            how, reason, t = "copy", None, self.start.get(root, -1)
            if root is arg:
                how = "unchanged"
            elif self.place[root].kind != "arena":
                reason = f"the new value is a {self.place[root].kind} value, not a buffer of its own"
            elif root in claimed:
                reason = "its value is also the new value of another argument"
            elif nbytes(root) != nbytes(arg):
                reason = "its value has another size than the argument"
            elif self.last[arg] > t or (self.last[arg] == t and not self._step_reads_only_same_index(t, arg, root)):
                reason = (f"the old value is still read after the new one is written at step {t}: "
                          f"{self._describe(self.last[arg])}")
            else:
                how = "inplace"
            if how == "inplace":
                claimed.add(root)
                self.place[root] = Placement("inplace", arg=s.name)
            out.append(InPlace(s.role, s.name, how, t if how != "unchanged" else -1, reason))
            self.result_storage.append(how)
        # the loss and the gradients leave the step: their own allocations
        for k, (s, v) in enumerate(rets):
            if s.role in UPDATED_ROLES:
                continue
            if self.place[v].kind == "arena" and v not in claimed:
                claimed.add(v)
                self.place[v] = Placement("output")
                self.result_storage[k] = "output"
            else:
                self.result_storage[k] = "copy"  # a view, an argument, a constant or a shared value
        return out

    def arena_buffers(self) -> list[Buffer]:
        bufs = []
        for v, p in self.place.items():
            if p.kind not in ("arena", "input"):
                continue
            if isinstance(v.owner, Operation):
                op = v.owner
                what, loc = _what(op, v.index), _loc(op)
            else:
                s = arg_slots(self.fn)[v.index]
                what, loc = f"{s.role} {s.name}", None
            bufs.append(Buffer(v, -1, p.size, self.start[v], self.last[v], what, loc))
        return bufs


def assign_offsets(sizes: list[int], starts: list[int], ends: list[int]) -> list[int]:
    """Offsets for closed time intervals so that no two intervals live at the same
    time overlap in bytes: decreasing size, best-fit gap (see the module's docstring)."""
    n = len(sizes)
    horizon = max(ends, default=0) + 1
    width = 1
    while width < horizon:
        width *= 2
    tree: list[list[int]] = [[] for _ in range(2 * width)]  # node -> placed intervals covering it
    placed_starts: list[int] = []
    placed_ids: list[int] = []
    offsets = [-1] * n
    for i in sorted(range(n), key=lambda i: (-sizes[i], starts[i], i)):
        s, e, size = starts[i], ends[i], sizes[i]
        hits: list[int] = []
        node = s + width
        while node >= 1:  # placed intervals containing s
            hits.extend(tree[node])
            node >>= 1
        lo, hi = bisect.bisect_right(placed_starts, s), bisect.bisect_right(placed_starts, e)
        hits.extend(placed_ids[lo:hi])  # placed intervals starting in (s, e]
        best_gap, best_off, top = None, None, 0
        for a, b in sorted((offsets[j], offsets[j] + sizes[j]) for j in hits):
            gap = a - top
            if gap >= size and (best_gap is None or gap < best_gap):
                best_gap, best_off = gap, top
            top = max(top, b)
        offsets[i] = best_off if best_off is not None else top
        lo_n, hi_n = s + width, e + width + 1
        while lo_n < hi_n:
            if lo_n & 1:
                tree[lo_n].append(i)
                lo_n += 1
            if hi_n & 1:
                hi_n -= 1
                tree[hi_n].append(i)
            lo_n >>= 1
            hi_n >>= 1
        k = bisect.bisect_right(placed_starts, s)
        placed_starts.insert(k, s)
        placed_ids.insert(k, i)
    return offsets


def live_profile(bufs: list[Buffer], end_time: int) -> tuple[list[int], int]:
    """The bytes live at each time 0..end_time, and the (first) time of the most."""
    delta = [0] * (end_time + 2)
    for b in bufs:
        delta[b.start] += b.size
        delta[b.end + 1] -= b.size
    live, cur = [], 0
    for t in range(end_time + 1):
        cur += delta[t]
        live.append(cur)
    return live, max(range(len(live)), key=lambda t: (live[t], -t))


def _torch_bytes(n: int) -> int:
    return _align(n, TORCH_BLOCK) if n else 0


def plan_memory(module: ModuleOp, scratch: dict[Operation, int] | None = None) -> MemoryPlan:
    """Plans @train_step's memory and records it in the IR (see ``annotate``).
    ``scratch``: bytes of arena scratch a launch takes (the backend's ``arena_scratch``
    rules), planned as a buffer live only during that launch (``MemoryPlan.scratch_at``)."""
    fn = step_func(module)
    p, inplace, bufs, scratch_steps = planned_buffers(fn, scratch)
    offsets = assign_offsets([b.size for b in bufs], [b.start for b in bufs], [b.end for b in bufs])
    bufs = [Buffer(b.value, o, b.size, b.start, b.end, b.what, b.loc) for b, o in zip(bufs, offsets, strict=True)]
    plan = assemble(fn, p, inplace, bufs, scratch_steps)
    annotate(module, p, plan)
    return plan


def planned_buffers(fn, scratch: dict[Operation, int] | None):
    """The planner run up to placement: ``(planner, in-place results, buffers without
    offsets, [(op, buffer index)] of the launch scratch buffers)``."""
    p = _Planner(fn)
    p.storage()
    p.liveness()
    inplace = p.results()
    bufs = p.arena_buffers()
    scratch_steps = []
    for t, st in enumerate(p.steps, 1):
        n = (scratch or {}).get(st.op, 0)
        if n:
            scratch_steps.append((st.op, len(bufs)))
            bufs.append(Buffer(st.op.results[0], -1, _align(n), t, t, f"{st.op.name} scratch", _loc(st.op)))
    return p, inplace, bufs, scratch_steps


def assemble(fn, p: "_Planner", inplace: list, bufs: list[Buffer], scratch_steps: list) -> MemoryPlan:
    """The ``MemoryPlan`` of placed ``bufs`` (their offsets set): the values' offsets
    recorded in the planner, the live profile, the external bytes."""
    scratch_at = {op: (bufs[i].offset, bufs[i].size) for op, i in scratch_steps}
    scratch_bufs = {i for _, i in scratch_steps}
    for i, b in enumerate(bufs):
        if i not in scratch_bufs:
            p.place[b.value].offset = b.offset
    live, peak_time = live_profile(bufs, p.end_time)
    peak_op = p.steps[peak_time - 1].op if 1 <= peak_time <= len(p.steps) else None
    external = {"params": 0, "state": 0, "buffers": 0, "inputs": 0, "outputs": 0, "constants": 0}
    for a, s in zip(p.block.args, arg_slots(fn), strict=True):
        key = {"param": "params", "state": "state", "buffer": "buffers"}.get(s.role, "inputs")
        external[key] += _torch_bytes(nbytes(a))  # inputs: the caller's own batch tensors and scalars
    for s, v in zip(result_slots(fn), return_op(fn).operands, strict=True):
        if s.role not in UPDATED_ROLES:
            external["outputs"] += _torch_bytes(nbytes(v))
    n_const = sum(1 for q in p.place.values() if q.kind == "const")
    external["constants"] = _torch_bytes(n_const * ALIGNMENT)
    return MemoryPlan(
        alignment=ALIGNMENT,
        arena_bytes=max((b.offset + b.size for b in bufs), default=0),
        sum_bytes=sum(b.size for b in bufs),
        lower_bound_bytes=live[peak_time] if live else 0,
        peak_time=peak_time,
        peak_what=peak_op.name if peak_op is not None else ("entry" if peak_time == 0 else "return"),
        peak_loc=_loc(peak_op),
        external=external,
        buffers=bufs,
        inplace=inplace,
        live_bytes=live,
        steps=[st.op.name for st in p.steps],
        placements=p.place,
        scratch_at=scratch_at,
    )


def _i64s(values) -> DenseArrayBase:
    return DenseArrayBase.from_list(i64, [int(v) for v in values])


def layout_attr(p: "_Planner", op: Operation) -> ArrayAttr | None:
    """``nova.layout`` of ``op``: one ``layout_text`` per result, or None (no
    attribute) when every result is dense in its own storage."""
    texts = [layout_text(p.place[r]) if r in p.place else "" for r in op.results]
    return ArrayAttr([StringAttr(t) for t in texts]) if any(texts) else None


def annotate(module: ModuleOp, p: _Planner, plan: MemoryPlan) -> None:
    """Writes the plan into the IR:
    - every op: ``nova.storage`` (one kind per result) and ``nova.offset`` (the
      arena offset per result, -1 where the result has no arena buffer); where a
      result is permuted, a window or an assembled cat, ``nova.layout`` (one
      ``layout_text`` per result);
    - every argument: ``nova.storage`` and, for input slots, ``nova.offset``;
    - every result: ``nova.storage`` = inplace / copy / unchanged / output;
    - the module: ``nova.memory_plan`` with the arena size, the sum of sizes, the
      live-set lower bound and the predicted peak in bytes, and the alignment."""
    fn = p.fn
    for op in p.block.ops:
        if not isinstance(op, nv.NovaOp):
            continue
        kinds = [p.place[r].kind if r in p.place else "fused" for r in op.results]
        op.attributes["nova.storage"] = ArrayAttr([StringAttr(k) for k in kinds])
        op.attributes["nova.offset"] = _i64s(p.place[r].offset if r in p.place else -1 for r in op.results)
        layouts = layout_attr(p, op)
        if layouts is not None:
            op.attributes["nova.layout"] = layouts
        else:
            op.attributes.pop("nova.layout", None)
    attrs = []
    for a, d in zip(p.block.args, fn.arg_attrs.data, strict=True):
        q = p.place[a]
        extra = {"nova.storage": StringAttr(q.kind)}
        if q.kind == "input":
            extra["nova.offset"] = IntegerAttr(q.offset, i64)
        attrs.append(DictionaryAttr({**d.data, **extra}))
    fn.arg_attrs = ArrayAttr(attrs)
    if fn.res_attrs is not None:
        fn.res_attrs = ArrayAttr([DictionaryAttr({**d.data, "nova.storage": StringAttr(how)})
                                  for d, how in zip(fn.res_attrs.data, p.result_storage, strict=True)])  # fmt: skip
    module.attributes["nova.memory_plan"] = DictionaryAttr({
        "arena_bytes": IntegerAttr(plan.arena_bytes, i64),
        "sum_bytes": IntegerAttr(plan.sum_bytes, i64),
        "lower_bound_bytes": IntegerAttr(plan.lower_bound_bytes, i64),
        "peak_bytes": IntegerAttr(plan.peak_bytes, i64),
        "alignment": IntegerAttr(plan.alignment, i64),
    })  # fmt: skip


@dataclass(frozen=True)
class PlanMemory(ModulePass):
    name = "nova-plan-memory"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        plan_memory(op)


# ----------------------------------------------------------------------------
# reporting


def gib(n: int) -> str:
    return f"{n / 2**30:.3f} GiB" if n >= 2**28 else f"{n / 2**20:.2f} MiB"


def report(plan: MemoryPlan, top: int = 10) -> list[str]:
    """The plan in a few lines, for ``explain()``."""
    ext = ", ".join(f"{k} {gib(v)}" for k, v in plan.external.items() if v)
    scratch = f" + the largest launch scratch {gib(plan.scratch_bytes)} ({plan.scratch_what})" if plan.scratch_bytes else ""
    lines = [
        f"predicted peak {gib(plan.peak_bytes)} = arena {gib(plan.arena_bytes)} + outside it: {ext}{scratch}",
        f"arena {gib(plan.arena_bytes)}: {len(plan.buffers)} buffers summing to {gib(plan.sum_bytes)} without reuse; "
        f"the largest live set is {gib(plan.lower_bound_bytes)} (a lower bound), "
        f"{plan.arena_bytes / max(plan.lower_bound_bytes, 1):.3f}x of it",
        f"largest live set at step {plan.peak_time} of {len(plan.steps)}: {plan.peak_what} "
        + (f"({plan.peak_loc})" if plan.peak_loc else "(no nova.loc: an op the compiler added)"),
    ]
    copies = [ip for ip in plan.inplace if ip.how == "copy"]
    n_in = sum(1 for ip in plan.inplace if ip.how == "inplace")
    lines.append(f"parameters and state: {n_in} updated in place, {len(copies)} copied back after the step")
    for ip in copies[:top]:
        lines.append(f"  copy {ip.role} {ip.name}: {ip.reason}")
    lines.extend(layout_report(plan, top))
    lines.append(f"the {min(top, len(plan.buffers))} largest buffers:")
    for b in sorted(plan.buffers, key=lambda b: (-b.size, b.start))[:top]:
        lines.append(f"  {gib(b.size):>12}  offset {b.offset:>12}  steps {b.start}-{b.end}  "
                     f"{b.what} {b.value.type}" + (f"  ({b.loc})" if b.loc else ""))  # fmt: skip
    return lines


def layout_report(plan: MemoryPlan, top: int = 10) -> list[str]:
    """The permuted placements and the assembled cats, for ``report``."""
    permuted = [(v, q) for v, q in plan.placements.items() if q.kind == "arena" and q.perm is not None]
    cats = [(v, q) for v, q in plan.placements.items() if q.assembled]
    if not permuted and not cats:
        return []
    n_win = sum(1 for q in plan.placements.values() if q.kind == "window")
    lines = [f"layouts: {len(permuted)} buffers permuted (their transposes dense, those reshapes views), "
             f"{len(cats)} cats assembled from {n_win} windows their producers write (the cats launch nothing)"]
    for v, q in (permuted + cats)[:top]:
        lines.append(f"  {layout_text(q)}: {_what(v.owner, v.index)} {v.type} at arena byte {q.offset}"
                     + (f"  ({_loc(v.owner)})" if _loc(v.owner) else ""))
    return lines


def plot_timeline(plan: MemoryPlan, path) -> None:
    """A PNG of the arena's live bytes over the steps, with the arena's size and
    the predicted peak (matplotlib's Agg canvas: no global backend is touched)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    outside = plan.peak_bytes - _align(plan.arena_bytes, TORCH_BLOCK)
    unit, g = ("GiB", 2**30) if plan.peak_bytes >= 2**28 else ("MiB", 2**20)
    fig = Figure(figsize=(10, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    xs = list(range(len(plan.live_bytes)))
    live = [b / g for b in plan.live_bytes]
    ax.fill_between(xs, live, step="post", alpha=0.3, color="C0", lw=0)
    ax.step(xs, live, where="post", lw=0.8, color="C0", label="arena bytes live")
    ax.step(xs, [v + outside / g for v in live], where="post", lw=0.8, color="C1",
            label="+ outside the arena (params, state, inputs, outputs)")
    ax.axhline(plan.arena_bytes / g, color="C3", ls="--", lw=1, label=f"arena {gib(plan.arena_bytes)}")
    ax.axhline(plan.peak_bytes / g, color="k", ls=":", lw=1, label=f"predicted peak {gib(plan.peak_bytes)}")
    ax.axvline(plan.peak_time, color="C2", lw=0.8, label=f"largest live set: step {plan.peak_time} {plan.peak_what}")
    ax.set_xlabel("step of the launch order (0 = entry)")
    ax.set_ylabel(unit)
    ax.set_ylim(0, plan.peak_bytes / g * 1.35)
    ax.set_title(f"Nova memory plan: {len(plan.buffers)} arena buffers, {len(plan.steps)} steps")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(str(path))
