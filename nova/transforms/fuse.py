"""The fuse stage: groups of elementwise ops become one ``nova.fused`` op each
(one generated kernel in the Triton backend, ``nova/codegen/triton/fused.py``),
a contraction with the elementwise ops that consume its result becomes one
``nova.fused "contraction"`` op (its epilogue: one matmul kernel,
``nova/codegen/triton/matmul.py``), and a reduction with the elementwise ops
that produce its input and consume its rows becomes one ``nova.fused
"reduction"`` op (its prologue and epilogue: one launch of its template,
``reduce.py`` / ``rowwise.py``).

Grouping reads only op categories (``NovaOp.CATEGORY``, and ``NovaOp.EPILOGUE``
for the contractions and row-wise reductions whose kernel takes an epilogue,
``NovaOp.PROLOGUE`` for the reductions whose kernel computes operands in a
prologue): an op added later with category elementwise fuses without new code
here, into loops, prologues and epilogues.

  vertical     an elementwise op joins the group of an elementwise producer of
               the same iteration shape (its result shape). Operands of another
               shape (broadcast biases, scalars) and layout views (transpose,
               broadcast_to, slice, reshape: strided views in the backend, even
               chains of them) stay outside: the kernel reads them through strides.
  horizontal   elementwise ops of one iteration shape that read the same
               non-scalar value join one group (a multi-output kernel reading it
               once), when they lie within ``HORIZONTAL_WINDOW`` ops of each other.
  scalars      a one-element elementwise op whose operands all have one element
               (the optimizer's bias corrections, lr * ..., the guard's ok flag)
               is not a kernel of its own: each consumer group recomputes it from
               its scalar leaves (a cone of at most ``SCALAR_CONE`` ops), unless
               something other than an elementwise op reads it (the return, a
               reduction): then it is computed where it is, and read. One-element
               results only the return reads (Adam's new step counters, the
               guard's flags) run last, ``TAIL_OUTPUTS`` to a group, after every
               group that recomputes from the old values they are written over.
  epilogue     (output fusion) an elementwise op reading the result of a
               contraction that takes an epilogue (a matmul), with the result's
               shape, joins the contraction's group, and the chain below it joins
               by the vertical rule: the bias add over rows, GELU, its backward
               (which reads the saved pre-activation: a second full tensor), a
               residual add, casts, a scale, a dropout mask. The kernel computes
               them on the fp32 accumulator tile before the store, reading the
               other operands at the tile's offsets. One reshape of the result
               that keeps its last dim ([B*T, N] read as [B, T, N], a relabelling
               of the tile's rows) may sit in between. What stays outside: an op
               of another shape (a broadcast to a larger result; a reduction, but
               for a column sum: below), a result read through any other view
               (transpose, slice, broadcast_to, or a reshape that changes the last
               dim: the tile's elements would land elsewhere), a second
               contraction (one kernel has one accumulator), the optimizer's
               update (an op reading its state or hyperparameters: in a weight
               gradient's epilogue Adam's new moments would be computed ahead of
               the guard's gate and kept for it, weight-sized temporaries). A horizontal partner
               of an epilogue op (a reader of one of the epilogue's operands, e.g.
               the remat stage's GELU recompute beside GELU's backward, both
               reading the saved pre-activation) joins it like any group, within
               the epilogue's budget (below). A value
               of the group read outside it (the pre-activation the backward
               keeps, the matmul result itself) is one more output, stored from
               the tile.
  column sum   (a bias gradient in the epilogue) a column sum (``nv.column_sum``:
               a reduction that adds up, ``NovaOp.SUMS``, a floating-point value
               over every dim but the last, without keepdim: [N] from [..., N]) of
               a value of a contraction group's epilogue of the iteration shape
               (GELU's backward: the c_fc bias gradient) joins that group, after
               the grouping, where every other reader of the value is in the group:
               the value is then no output (GPT-2 124M bf16 batch 32, measured on
               the H200 before this rule: the group 0.62 ms and the sum's kernel
               0.11 ms a layer, the 402 MB f32 value's write and read about 0.27 ms
               of that; the fused kernel is not measured on the device yet). The
               template adds up each output tile's rows in registers (masked rows
               0) into a partials buffer [P, N] in launch scratch (P: batch x
               cdiv(M, BLOCK_M) tiles' rows, or split-K's reduction tiles' rows,
               which run the epilogue there), fp32 (fp64 for an f64 value), and a
               second small kernel adds the partials up in a fixed order: no atomics,
               the same bits every run. Every path of the template takes it (the
               tile grid, the persistent kernel, split-K, batched, ragged edges, the
               column slices, the interpreter), so no combination is kept out. The
               numerics: the sum's order is not the standalone reduction's (its
               split of the rows), so the sum differs from the unfused one by fp32
               (fp64) rounding, not bit for bit (the other outputs stay exact); a
               bf16 value's sum is still fp32 rounded once. What stays out: a sum
               over other dims or with keepdim, a maximum, a sum of a value read
               outside the group too (written anyway: kept simple, the read it
               would save is not measured), of the matmul's operand or of any
               block argument, of the matmul's own result where the epilogue runs
               over its reshape, of integers; nothing in the group reads a column
               sum (finished only after every tile), and a widening cast only the
               sum reads stays the sum's prologue (the rule above). The sum counts
               in no budget: one add an element, against the f32 store it removes
               (its time in the epilogue is not measured yet).
  budget       an epilogue's elementwise ops cost at most ``EPILOGUE_MAX_FLOPS``
               an element together (the cost model's ``flops_per_element``: GELU
               8, its backward 12, arithmetic 1, casts 0); a merge that would pass
               it does not happen, and the op stays in a group of its own. The
               epilogue runs while the tile's tensor cores idle (the tile-grid
               kernel does not overlap it with the next tile's loads), on the
               values of a whole tile per program: measured on the H200 (GPT-2,
               batch 32, scripts/epilogue_variants.py, bench/results/runs/
               epilogue_variants_d5443cd.json) GELU's backward with the remat
               stage's GELU recompute and its bias add beside it (21) took 1.07 ms at 128x128x64,
               207 registers (scripts/epilogue_sm90_check.py: one block per SM
               where the schedule planned two), against 0.45 ms for GELU's
               backward alone (12; 104 registers) plus 0.16 ms for the recompute
               in its own elementwise kernel. The forward's bias + GELU (9) stays
               (with a residual add, 10). GELU's backward with its pre-activation's
               recompute (13) no longer does: in the epilogue (124 registers at
               128x128x64 w8, two blocks per SM) it cost the dh matmul 0.535 ms a
               layer against 0.233 ms bare plus 0.243 ms for GELU's backward in an
               elementwise kernel of its own (H200, batch 32, bench/results/runs/
               epilogue_variants_nobackward_00dabef.json); it goes to the bias
               gradient's sum instead ("stored prologue" below), or a kernel of its
               own. A widening cast of the matmul's result that only such ops read
               goes with them (the matmul writes the narrow value). The budget is a
               matmul epilogue's: a reduction's prologue and epilogue (below) run in
               memory-bound kernels and have none.
  prologue     (input fusion) elementwise ops whose only reader is a reduction
               that takes a prologue (``PROLOGUE``: reduce_sum / reduce_max's input,
               layer_norm's x, layer_norm_backward's grad and x), at such an operand,
               with that operand's shape, join the reduction's group: its kernel
               computes them where it would have loaded the operand (a bias
               gradient's sum reads the bf16 gradient and widens it in registers;
               a LayerNorm backward widens its bf16 incoming gradient). A reshape
               between them moves above the op (the view rule below). Until the
               reduction is reached, such an op only merges where the merged group
               could still be its prologue; a widening op (its result wider than
               the value it reads) reading a contraction's result or a row-wise
               reduction's first result waits for the prologue instead of joining
               that epilogue (the producer then writes the narrow value: half the
               bytes written and read), any other joins the epilogue.
  stored       a reduction whose kernel computes each prologue element once
  prologue     (``PROLOGUE_STORES``: reduce_sum / reduce_max) also stores prologue
               values for readers outside its group, and computes other elementwise
               ops of the prologue shape from them: an op past any epilogue's budget
               (GELU's backward, 12) that such a reduction reads (the c_fc bias
               gradient) is bound to its prologue though others read it too, and
               joins with its producers (the widened dh, the recomputed
               pre-activation) and its readers of that shape (its bf16 cast for the
               next matmuls, remat's GELU recompute of the same pre-activation,
               "shared recompute" below): one reduce kernel reading dh, the saved
               matmul result and the bias, writing the bias gradient, GELU's bf16
               backward and the bf16 GELU the weight gradient reads. A shared value
               merging into such a group is stored from it. Row-wise heads read a row
               twice or more (looping over column blocks): only layer_norm stores, below.
  row stores   a row-wise head that stores prologue values in its first pass over a
               row (``PROLOGUE_ROW_STORES``: layer_norm; ``ROW_PROLOGUE_STORES``
               switches the rule) takes an elementwise op of its prologue shape that it
               reads (directly or through its prologue) though others read it too (the
               first such head in block order, where several do; the others' prologues
               read the stored value), unless the op, or a producer of its shape only
               it reads, reads a contraction's result without widening it
               (``_keeps_epilogue``: an f32 matmul's bias and residual adds cost its
               epilogue no wider store, and a row kernel would read the f32 result
               back). GPT-2 in bf16: the residual stream's sum r + (cast(x @ w) + b)
               after each projection leaves the matmul's epilogue for the next
               LayerNorm's prologue, which stores it for the next residual add and the
               backward; the matmul writes its bf16 result (the backward's remat reads
               the attention projection's anyway) instead of reading the f32 residual
               and writing the f32 sum while its tensor cores idle (the attention
               projection with that epilogue 0.154 ms a layer against 0.065 bare at
               215611d; torch.compile computes these adds in its LayerNorm kernels too).
               Bytes at batch 32, each of a layer's two: the projection's epilogue 250
               (attention) or 200 (MLP) -> 50 MB, the LayerNorm 150 -> 300 MB. The first
               LayerNorm takes the embeddings' sum (one launch less, its read saved; in
               tf32 too). An epilogue op never reads a stored prologue value (the row
               kernel computes none). Not yet timed on the H200.
  row sides    such a head's group also takes side ops (``nv.row_sides``): elementwise
               ops of its prologue shape, not read by the head, reading no result of it,
               whose full-size operands are values of its prologue, other side ops, or
               row operands it loads as they are (the rest broadcasts: per-row
               statistics, per-column weights), recomputes of the remat stage (a side op
               its head cannot take would join no other group), bound to the first such
               head after them (``_side_head``); the kernel computes them with its
               prologue and stores them in its first pass over a row. The case:
               norm_recompute's LayerNorm
               output from the forward's statistics, ((x - mean) * rstd) * w + b in
               bf16 for the weight gradient, in the kernel of the LayerNorm backward
               that reads the same x (loaded, or recomputed in its prologue, which
               ``share_recomputes`` then does not clone for the side ops:
               ``_row_sides_read``): GPT-2's 24 LayerNorm recompute launches gone, each
               a read of x (100 MB at bf16 batch 32) saved. Not yet timed on the H200.
  reduction    (row epilogue) an elementwise op reading the first result of a
  epilogue     row-wise reduction that takes an epilogue (``EPILOGUE``: layer_norm
               and its backward), with that result's shape, joins its group, and
               the chain below it by the vertical rule: LayerNorm's output cast to
               bf16 (the f32 output is no longer written where nothing else reads
               it), the residual gradient's add after a LayerNorm backward and the
               casts of the sum. The kernel computes them on the row in registers;
               the reduction's other results (mean, rstd, the weight and bias
               gradients, finished only after every row) are never read inside.
               One reduction per group, but for column sums (``nv.column_sum``) of
               an epilogue value of a head that sums them (``EPILOGUE_SUMS``:
               LayerNorm's backward, the residual gradient its epilogue adds, the
               projections' bias gradients; or the head's first result where an
               epilogue reads it: the final LayerNorm's backward, whose input
               gradient the last projection's bias gradient sums), which join after
               the grouping though the value is read outside too (it is written
               anyway; the sum's read
               of it, 100 MB of f32 a launch at GPT-2 batch 32, is saved): the
               kernel adds it up over its rows into per-program partials beside
               its weight and bias gradients (the sum's order is not the reduce
               kernel's: within fp32 rounding of it, the same bits every run). Ops
               that recompute their flat index stay outside.
  shared       a recompute of the remat stage whose readers can each compute it
  recompute    (reductions reading it as prologue operands: the residual stream a
               LayerNorm recompute and the LayerNorm's backward both read;
               elementwise ops of its shape: the pre-activation cast(mm) + bias
               that GELU's recompute and GELU's backward, in the backward matmul's
               epilogue, both read) is cloned into each reader but the first where
               that moves fewer bytes (``share_recomputes``): a widening chain's
               f32 value is never written, each reader reads its bf16 input. Not
               where its readers can all be one kernel with it (elementwise of its
               shape, one past any epilogue's budget, and their other inputs made
               before the first: GELU's recompute and GELU's backward): computed once.
  views        a view (reshape, transpose, broadcast_to, slice) of a kernel's result
               moves up to just after that kernel (``hoist_views``), so that a group
               reading through it can be placed as early as its real inputs allow.
  no prologue  a cast feeding a matmul operand stays its own kernel (or joins its
               producer's group). In a training step such a cast's result (a
               LayerNorm output or a weight in bf16) is read by two matmuls, the
               forward one and the weight gradient's in the backward; reading the
               f32 source in both instead keeps the f32 value alive until the
               backward (twice the saved bytes: ~1.2 GiB more for GPT-2 at batch
               32) and doubles the operand's shared memory per pipeline stage.
               With TMA and wgmma the B operand is read from shared memory in its
               MMA dtype, so an f32 tile would be converted through registers and
               written back to shared memory (the slow register path the tf32
               staging in matmul.py exists to avoid). The cast's cheaper home is
               its producer: the f32 -> bf16 write in the LayerNorm's kernel. A
               weight has none inside the step: the optimizer's kernel writes the
               param at the end of step N, and a bf16 copy kept from there for step
               N+1 would go stale when the user writes the param through ``.data``
               between the steps (that bumps no version counter Nova could check:
               a silent wrong result), so weight casts stay in the step, batched
               (multi-tensor, below).
  multi-      update groups (writing the new value of a param or state) of one
  tensor       iteration shape (AdamW on a bias or a LayerNorm weight, on the weights
               of one shape) launch together in block order, up to ``SMALL_ARGS``
               pointers a kernel (``batch_small``), where one place lies after all
               their inputs and before all their readers: GPT-2's 74 [768] updates in
               6 kernels instead of 74 of 5 us each, its 48 weight updates of four
               shapes in 4 instead of 48 (the plan's peak unchanged: 8.654 GiB at bf16
               batch 32). The kernel runs each parameter's chain as its own part
               (``fused.segments_of``: one branch of the kernel a part, grid axis 1),
               so a program holds one parameter's values: as one straight-line kernel
               the 12 updates of a [3072, 768] shape took 244-255 registers and
               spilled (offline ptxas); as parts 56 and none. Groups that read only
               the step's arguments (a weight's bf16 cast for the forward's matmuls)
               batch the same way, one kernel a shape placed before the first reader:
               GPT-2 124M's 48 forward weight casts in 4 launches instead of 48 (the
               plan's peak unchanged, 8.654 GiB at bf16 batch 32: the copies are made
               at the step's start, where little else is live, and each dies at its
               layer's forward matmul). remat's recasts for the backward batch too,
               up to ``RECAST_BATCH`` of one shape a launch placed where the first of
               them was (after the peak, which lies before the backward's first
               recast on GPT-2: 47 launches become 8, the peak unchanged).
  not fused    ops reading their own flat index (arange, dropout_mask) are
               grouped like any op of their shape, never recomputed as scalars.
  singletons   a group of one op stays that op (no wrapper), unless it recomputes
               scalars (then its wrapper saves their kernels).

No cycles, no reordering surprises: every group is placed at the position of
one of its members, and a merge is taken only where that position lies after
every outside value the merged group reads and before every outside op that
reads its results (the ops outside groups keep their positions), so the block
in placement order is a valid order by construction; the ops are then sorted
into it. A group holding the new value of a param / state is never placed
before that op's own position: it stays after the reads of the old value, so
plan_memory can still write it in place; nor is a group holding a recompute of
the remat stage (``nova.remat``): it stays in the backward, where remat put it,
instead of joining the forward group of its producer (a batch of recasts: not
before the first of its recomputes). Inner ops keep their
attributes (``nova.loc``, ``nova.remat``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp, StringAttr
from xdsl.ir import Block, BlockArgument, Operation, Region, SSAValue
from xdsl.passes import ModulePass

from nova.ir import dialect as nv
from nova.ir.module import arg_slots, result_slots, return_op, step_func
from nova.ir.types import elem_of, numel, shape_of, tensor, to_torch_dtype
from nova.schedule.cost import flops_per_element
from nova.transforms.plan_memory import UPDATED_ROLES, VIEW_OPS
from nova.transforms.remat import is_recompute

# A recomputed scalar runs once per thread of every program of each consumer
# kernel (0-d values in Triton are not per element): 16 ops (a pow is some 40
# fp64 instructions) stay far below the ~3,000 fp64 FLOPs an H200 thread can
# issue in the time its 8 elements' ~200 bytes take to stream (67 TFLOP/s fp64
# against 4.8 TB/s), so the recompute is free where a kernel launch is not.
SCALAR_CONE = 16
# Horizontal partners this close in the step's order are computed together: the
# earlier one's inputs stay live for at most this many ops longer (or the later
# one's result is made that much earlier), which keeps the memory plan's live sets
# as they were, while reading the shared value once.
HORIZONTAL_WINDOW = 8
EPILOGUE_MAX_FLOPS = 11  # an epilogue's FLOPs per element (the module docstring, "budget")
# Outputs of one group of the scalars run last (a GPT-2 step has 148 step counters):
# with their inputs about 130 pointer arguments, about 1 KiB of the 4 KiB of kernel
# parameters CUDA before 12.1 allows
TAIL_OUTPUTS = 64
# Update groups of one iteration shape (more than one element) are launched together,
# SMALL_ARGS pointers to a kernel at most (the tail's bound): the AdamW update of a [768]
# LayerNorm weight or bias is one kernel of 5 us on the H200 (GPT-2 124M: 74 of them,
# 0.39 ms a step), nearly all of it launch and ramp; the 48 weight updates took 1.15 ms
# in 48 launches (bench/results/runs/kernel_profile_124m_b32_db6f021.json), where one
# launch for all 48 (scripts/multi_tensor_adamw.py's pointer table) took 0.70 ms against
# 1.34 one launch each (bench/results/runs/multi_tensor_adamw_49aaf89.json)
SMALL_ARGS = 128
# The forward's weight casts of one shape as one launch (``_prepares_operands``): GPT-2
# 124M bf16's casts took 0.38 ms of kernels in 95 launches (kernel_profile_124m_b32_
# 215611d.json: 2.3-5.2 us each for 3.5-14.2 MB read and written), half of them the
# forward's; those now take 4 launches for the same bytes. Not yet timed on the H200; a
# switch for that A/B (scripts/epilogue_variants.py "casts-unbatched", or
# scripts/step_launches.py --set transforms.fuse.BATCH_OPERAND_CASTS=False).
BATCH_OPERAND_CASTS = True
# remat's recasts of the weights for the backward's matmuls (``late``, each beside its
# reader): up to this many of one shape in one launch, placed where the first of them
# was, so a batch's later copies are made that many layers early. GPT-2 124M bf16: 47
# launches, 0.323 ms of kernels on the H200 at 92bcf2f, where the forward's 48 casts take
# 4 launches and 0.141 ms (and batching those took the step's graph from 66.01 to 65.65
# ms); batched, 8 launches, the plan's peak unchanged (8.654 GiB: the peak lies before
# the backward's first recast). A peak inside the backward can grow by a batch's copies;
# a memory budget sees it (remat's budget rounds predict the plan after this stage).
# 1: each its own launch (scripts/epilogue_variants.py "recasts:N").
RECAST_BATCH = 12
# The residual stream's sums computed in the next LayerNorm's prologue and stored from
# it (the module docstring, "row stores"), not in the projections' epilogues. Not yet
# timed on the H200; the switch is for that A/B (scripts/epilogue_variants.py
# "row-stores-off").
ROW_PROLOGUE_STORES = True


def fusible(op: Operation) -> bool:
    """An elementwise op (one result) that may be grouped."""
    return isinstance(op, nv.NovaOp) and op.CATEGORY == "elementwise" and len(op.results) == 1


def epilogue_head(op: Operation) -> bool:
    """A contraction whose kernel takes an epilogue (one result, nothing empty: an
    epilogue runs on the tiles of a real contraction)."""
    if not isinstance(op, nv.NovaOp) or op.CATEGORY != "contraction" or not op.EPILOGUE or len(op.results) != 1:
        return False
    return all(numel(shape_of(v.type)) > 0 for v in (*op.operands, *op.results))


def reduction_head(op: Operation) -> bool:
    """A reduction whose kernel takes a prologue (``NovaOp.PROLOGUE``) or an epilogue
    on its first result's rows (``NovaOp.EPILOGUE``), nothing empty."""
    if not isinstance(op, nv.NovaOp) or op.CATEGORY != "reduction" or not (op.PROLOGUE or op.EPILOGUE):
        return False
    return all(numel(shape_of(v.type)) > 0 for v in (*op.operands, *op.results))


def prologue_shape(head: Operation) -> tuple[int, ...] | None:
    """The shape of a reduction head's prologue operands (None: it takes none)."""
    return shape_of(head.operands[head.PROLOGUE[0]].type) if head.PROLOGUE else None


def stores_prologue(head: Operation) -> bool:
    """A reduction head whose kernel stores prologue values for readers outside its
    group (``PROLOGUE_STORES``; it takes no epilogue): its group may hold any
    elementwise op of the prologue shape, computed at each element and stored."""
    return bool(head.PROLOGUE) and head.PROLOGUE_STORES and epilogue_shape(head) is None


def stores_rows(head: Operation) -> bool:
    """A row-wise head whose kernel stores prologue values in its first pass over a
    row (``PROLOGUE_ROW_STORES``: layer_norm), where ``ROW_PROLOGUE_STORES`` is on."""
    return ROW_PROLOGUE_STORES and head.stores_prologue_rows()


def epilogue_shape(head: Operation) -> tuple[int, ...] | None:
    """The shape a reduction head's epilogue runs over: its first result's, the
    prologue's (a row-wise op); None where it takes no epilogue."""
    if not head.EPILOGUE:
        return None
    shape = shape_of(head.results[0].type)
    return shape if not head.PROLOGUE or shape == prologue_shape(head) else None


def relabels_rows(op: Operation) -> bool:
    """A reshape of a contraction result that keeps the last dim: the epilogue
    reads the tile's rows under the new leading dims (the row-major flat index of
    an element does not change)."""
    if not isinstance(op, nv.ReshapeOp) or not isinstance(op.operands[0].owner, Operation):
        return False
    src, out = shape_of(op.operands[0].type), shape_of(op.results[0].type)
    return epilogue_head(op.operands[0].owner) and bool(out) and out[-1] == src[-1]


def _scalar(v: SSAValue) -> bool:
    return numel(shape_of(v.type)) == 1


def _itemsize(v: SSAValue) -> int:
    return to_torch_dtype(elem_of(v.type)).itemsize


@dataclass(eq=False)
class Node:
    """A group under construction: ``members`` in block order, placed at ``pos``."""

    members: list[Operation]
    pos: int
    shape: tuple[int, ...] | None  # the iteration shape (None: not an elementwise node)
    fused: bool = True  # False for ops that are never grouped (opaque, layout, the return)
    kind: str = "elementwise"  # "contraction": one member is a contraction, the others its epilogue;
    # "reduction": one member is a reduction head, the others its prologue and epilogue
    reshape: Operation | None = None  # the contraction's result relabelled (``relabels_rows``)
    bound: Operation | None = None  # the reduction head whose prologue this node is kept for


@dataclass
class Group:
    """A finished group: its ops in block order and the scalar ops it recomputes."""

    members: list[Operation]
    cone: list[Operation] = field(default_factory=list)
    tail: bool = False  # placed last, just before the return
    kind: str = "elementwise"


class _Grouping:
    def __init__(self, block: Block, clones: set[Operation] = frozenset()):
        self.block = block
        self.clones = clones  # share_recomputes' copies: grouped with their readers only
        self.ops = list(block.ops)
        self.pos = {op: i for i, op in enumerate(self.ops)}
        self.virtual: set[Operation] = set()  # scalar ops recomputed by their consumers
        self.leaves: dict[SSAValue, tuple[SSAValue, ...]] = {}
        self._find_virtual()
        # the inputs of every op that stays an op (virtual scalars replaced by their leaves)
        self.inputs: dict[Operation, list[SSAValue]] = {}
        self.users: dict[SSAValue, list[Operation]] = {}
        for op in self.ops:
            if op in self.virtual:
                continue
            ins: list[SSAValue] = []
            for v in op.operands:
                for w in self._leaves_of(v) if self._is_virtual(v) else (v,):
                    if w not in ins:
                        ins.append(w)
            self.inputs[op] = ins
            for w in ins:
                self.users.setdefault(w, []).append(op)
        # ops writing the new value of an updated argument: never moved earlier, so that
        # they stay after the reads of the old value (which lets plan_memory write in place);
        # nor the remat stage's recomputes (``nova.remat``): moved up into their forward
        # producer's group, they would be computed early and kept, what remat undid
        self.late: set[Operation] = {op for op in self.ops if is_recompute(op)}
        # and share_recomputes' copies, placed just before their readers: moved up into
        # their producer's group, they would be computed there and written for the reader
        self.late |= set(clones)
        fn = block.parent_op()
        self.updates: set[Operation] = set()  # the ops writing the new value of a param or state
        for slot, v in zip(result_slots(fn), return_op(fn).operands, strict=True):
            if slot.role in UPDATED_ROLES and isinstance(v.owner, Operation):
                self.late.add(v.owner)
                self.updates.add(v.owner)
        # the optimizer's state and hyperparameters (Adam's moments, its betas, lr): what reads
        # them stays out of a contraction's epilogue (``_merge``)
        self.optimizer_args = {a for s, a in zip(arg_slots(fn), block.args, strict=True) if s.role in ("state", "hyper")}
        # scalars only the return reads (the new Adam step counters, the guard's flags): run
        # last, together, after every group that reads the old values they are written over
        ret = block.last_op
        self.tail = [op for op in self.ops if op not in self.virtual and fusible(op) and _scalar(op.results[0])
                     and all(u.operation is ret for u in op.results[0].uses)]  # fmt: skip
        self.node: dict[Operation, Node] = {}
        self.row_sums: set[Operation] = set()  # column sums joined to a row-wise head's group
        self.prologue_of: dict[Operation, Operation] = {}
        for op in reversed(self.ops):  # readers first
            head = self._prologue_reader(op) if op not in self.virtual and fusible(op) else None
            if head is not None:
                self.prologue_of[op] = head
        self.side_of: dict[Operation, Operation] = {}
        for op in self.ops:  # producers first
            head = self._side_head(op) if op not in self.virtual and fusible(op) else None
            if head is not None:
                self.side_of[op] = head
        for op in self.ops:
            if op in self.virtual:
                continue
            if epilogue_head(op):
                self.node[op] = Node([op], self.pos[op], shape_of(op.results[0].type), kind="contraction")
                continue
            if reduction_head(op):
                shape = prologue_shape(op) if stores_prologue(op) else epilogue_shape(op)
                self.node[op] = Node([op], self.pos[op], shape, kind="reduction")
                continue
            ok = fusible(op) and op not in self.tail
            self.node[op] = Node([op], self.pos[op], shape_of(op.results[0].type) if ok else None, ok)
            if ok:
                self.node[op].bound = self.prologue_of.get(op) or self.side_of.get(op)

    # --- a reduction's prologue ----------------------------------------------
    def _prologue_reader(self, op: Operation) -> Operation | None:
        """The reduction head whose prologue ``op`` can be, or None: every reader of
        its result is that head, at a ``PROLOGUE`` operand of ``op``'s shape, or an
        op that can be that head's prologue (``prologue_of``, readers first); or,
        for a head that stores its prologue's values (``stores_prologue``), ``op``
        costs more than any epilogue may (``EPILOGUE_MAX_FLOPS``: it is a kernel of
        its own or this prologue) and its other readers read the stored value; or
        else the first of those heads that stores prologue values in its first pass
        over a row (``stores_rows``), where no contraction's epilogue would compute
        ``op`` without a wider store (``_keeps_epilogue``): its other readers, other
        heads' prologues among them, read the stored value."""
        if op.FLAT_INDEX or not op.results[0].uses:
            return None
        heads, outside = set(), False
        for u in op.results[0].uses:
            r = u.operation
            if reduction_head(r) and u.index in r.PROLOGUE:
                heads.add(r)
            elif r in self.prologue_of:
                heads.add(self.prologue_of[r])
            else:
                outside = True
        row = min((h for h in heads if stores_rows(h)), key=self.pos.__getitem__, default=None)
        if len(heads) != 1 or outside and not (stores_prologue(next(iter(heads)))
                                               and flops_per_element(op) > EPILOGUE_MAX_FLOPS):  # fmt: skip
            if row is None or self._keeps_epilogue(op):
                return None
            heads = {row}
        (head,) = heads
        return head if shape_of(op.results[0].type) == prologue_shape(head) else None

    def _side_head(self, op: Operation) -> Operation | None:
        """The row-wise head that stores prologue values (``stores_rows``) whose side op
        ``op`` can be (the module docstring, "row sides"), or None: ``op`` is of that
        head's prologue shape, not read by the head, and every value of that size it
        reads is a value of the head's prologue or of its side ops, or a row operand
        the head loads as it is (the others are broadcasts: per-row statistics,
        per-column weights), so the kernel computes it from the row it holds. Only
        recomputes of the remat stage (``nova.remat``: norm_recompute's formula and its
        cast, placed before their backward with their readers after it): a side op
        bound to a head whose kernel cannot take it would join no other group."""
        if (op.FLAT_INDEX or op in self.prologue_of or op in self.tail or not op.results[0].uses
                or not is_recompute(op)):  # fmt: skip
            return None
        n, heads = numel(shape_of(op.results[0].type)), None
        for v in self.inputs[op]:
            if numel(shape_of(v.type)) < n:
                continue
            owner = v.owner
            found = {u.operation for u in v.uses if reduction_head(u.operation) and stores_rows(u.operation)
                     and u.index in u.operation.PROLOGUE}  # fmt: skip
            if isinstance(owner, Operation) and (owner in self.prologue_of or owner in self.side_of):
                found.add(self.prologue_of.get(owner) or self.side_of.get(owner))
            heads = found if heads is None else heads & found
        # the kernel that computes it comes after it (where its readers are): the first such head
        head = min((h for h in heads or () if self.pos[h] > self.pos[op]), key=self.pos.__getitem__, default=None)
        if head is None:
            return None
        if not stores_rows(head) or shape_of(op.results[0].type) != prologue_shape(head):
            return None
        return None if any(u.operation is head for u in op.results[0].uses) else head

    def _keeps_epilogue(self, op: Operation) -> bool:
        """Whether ``op``, or a producer of its shape that only it reads (and so on
        up), reads a contraction's result (or its relabelled rows) without widening
        it: in the contraction's epilogue such a chain costs no wider store (an f32
        matmul's bias and residual adds), so it stays there rather than in a row
        kernel's prologue, which would read the contraction's result back."""
        shape, stack, seen = shape_of(op.results[0].type), [op], set()
        while stack:
            o = stack.pop()
            if o in seen:
                continue
            seen.add(o)
            for v in o.operands:
                src = v.owner
                if not isinstance(src, Operation):
                    continue
                if epilogue_head(src) or relabels_rows(src):
                    if _itemsize(o.results[0]) <= _itemsize(v):
                        return True
                elif (fusible(src) and src not in self.virtual and shape_of(src.results[0].type) == shape
                      and all(u.operation is o for u in src.results[0].uses)):  # fmt: skip
                    stack.append(src)
        return False

    def absorbable(self, members: list[Operation], head: Operation, closed: bool = True) -> bool:
        """Whether ``members`` can be ``head``'s prologue: elementwise ops of its
        prologue shape whose values only the members and ``head`` (at ``PROLOGUE``
        operands) read, or (not ``closed``: a part of the prologue, still growing)
        other ops that can be its prologue; any reader, where the head stores its
        prologue's values (``stores_prologue``)."""
        inside = set(members)
        shape = prologue_shape(head)
        for m in members:
            if not fusible(m) or m.FLAT_INDEX or shape_of(m.results[0].type) != shape:
                return False
            if stores_prologue(head) or stores_rows(head) and (self.prologue_of.get(m) is head
                                                               or self.side_of.get(m) is head):
                continue  # its other readers read the stored value
            for u in m.results[0].uses:
                r = u.operation
                if r in inside or r is head and u.index in head.PROLOGUE:
                    continue
                if closed or self.prologue_of.get(r) is not head:
                    return False
        return True

    def _reduction_ok(self, members: list[Operation], column_sum: Operation | None = None) -> bool:
        """A would-be group holding a reduction head: what nova.fused "reduction"
        allows (the dialect's verifier says the same): the ops the head reads are an
        absorbable prologue, the rest an epilogue of the head's first result's shape
        that reads no other result of it, nothing recomputing its flat index (and
        ``column_sum``, joining now, a column sum of one of its values)."""
        members = [m for m in members if m is not column_sum and m not in self.row_sums]
        heads = [m for m in members if self.node[m].kind == "reduction" and reduction_head(m)]
        if len(heads) != 1:
            return False
        (head,) = heads
        inside = set(members)
        prologue = self._closure(head, members)
        if any(isinstance(v.owner, Operation) and v.owner in inside for j, v in enumerate(head.operands)
               if j not in head.PROLOGUE):  # fmt: skip
            return False
        if prologue and not self.absorbable(sorted(prologue, key=self.pos.__getitem__), head):
            return False
        if stores_rows(head):  # side ops: computed with the prologue, stored
            sides = nv.row_sides(head, [m for m in members if m is not head])
            if not self.absorbable(sorted(sides, key=self.pos.__getitem__), head):
                return False
            prologue = prologue | sides
        if not stores_prologue(head) and any(u.operation in inside and u.operation not in prologue
                                             and u.operation is not head for m in prologue for u in m.results[0].uses):
            return False  # an epilogue op reading a prologue value (a stored one): the row kernel computes none
        stores = stores_prologue(head)  # the other members: ops of the prologue computed and stored
        shape = prologue_shape(head) if stores else epilogue_shape(head)
        for m in members:
            if m is head or m in prologue:
                continue
            if shape is None or m.FLAT_INDEX or shape_of(m.results[0].type) != shape:
                return False
            if any(v in head.results[0 if stores else 1:] for v in (*m.operands, *self.inputs[m])):
                return False  # (``inputs``: the scalars it recomputes read too)
        return True

    def _optimizer_op(self, m: Operation) -> bool:
        """An op of the optimizer's update: one reading the optimizer's state or
        hyperparameters (``inputs``: through the scalar ops a kernel computes itself, 1 -
        beta2). (A param's new value computed from the step's values alone, p - x @ w, may
        still be a matmul's epilogue, written over p in place.)"""
        return any(v in self.optimizer_args for v in self.inputs.get(m, m.operands))

    def _widens_for_heavy_readers(self, op: Operation, w: SSAValue) -> bool:
        """A widening op (its result wider than ``w``) whose readers are all elementwise
        ops past any epilogue's budget (GELU's backward) or the optimizer's, which no
        epilogue takes: in the epilogue it would make the contraction write the wide
        value for them; outside, their kernel reads the narrow one."""
        if _itemsize(op.results[0]) <= _itemsize(w):
            return False
        readers = [u.operation for u in op.results[0].uses]
        return bool(readers) and all(
            fusible(r) and (flops_per_element(r) > EPILOGUE_MAX_FLOPS or self._optimizer_op(r)) for r in readers)

    # --- scalars recomputed where they are read ----------------------------
    def _is_virtual(self, v: SSAValue) -> bool:
        return isinstance(v.owner, Operation) and v.owner in self.virtual

    def _find_virtual(self) -> None:
        cone: dict[Operation, set[Operation]] = {}
        for op in self.ops:
            if not fusible(op) or op.FLAT_INDEX or not _scalar(op.results[0]):
                continue
            if not all(_scalar(v) for v in op.operands):
                continue
            if not all(fusible(u.operation) for u in op.results[0].uses):
                continue  # the return or a non-elementwise op reads it: computed where it is
            c = {op}
            for v in op.operands:
                if self._is_virtual(v):
                    c |= cone[v.owner]
            if len(c) > SCALAR_CONE:
                continue
            cone[op] = c
            self.virtual.add(op)

    def _leaves_of(self, v: SSAValue) -> tuple[SSAValue, ...]:
        """The values a virtual scalar is recomputed from (none for a constant)."""
        got = self.leaves.get(v)
        if got is None:
            out: list[SSAValue] = []
            for w in v.owner.operands:
                for x in self._leaves_of(w) if self._is_virtual(w) else (w,):
                    if x not in out:
                        out.append(x)
            got = self.leaves[v] = tuple(out)
        return got

    def cone_of(self, ops: list[Operation]) -> list[Operation]:
        """The virtual scalar ops these ops recompute, in block order."""
        seen: set[Operation] = set()
        stack = [v.owner for op in ops for v in op.operands if self._is_virtual(v)]
        while stack:
            o = stack.pop()
            if o in seen:
                continue
            seen.add(o)
            stack.extend(v.owner for v in o.operands if self._is_virtual(v))
        return sorted(seen, key=self.pos.__getitem__)

    # --- placement ---------------------------------------------------------
    def _def_pos(self, v: SSAValue) -> int:
        owner = v.owner
        return self.node[owner].pos if isinstance(owner, Operation) else -1

    def _window(self, members: list[Operation], merging: set[int]) -> tuple[int, int]:
        """(latest outside input, earliest outside reader) of a would-be group."""
        latest, earliest = -1, len(self.ops)
        for m in members:
            for w in self.inputs[m]:
                owner = w.owner
                if isinstance(owner, Operation) and id(self.node[owner]) in merging:
                    continue
                latest = max(latest, self._def_pos(w))
            for r in m.results:
                for u in self.users.get(r, ()):
                    n = self.node[u]
                    if id(n) not in merging:
                        earliest = min(earliest, n.pos)
        return latest, earliest

    def try_merge(self, nodes: list[Node], reshape: Operation | None = None,
                  column_sum: Operation | None = None, recomputes: bool = False) -> Node | None:
        """Merges ``nodes`` (of one iteration shape, the first's; at most one of
        them a contraction's, and ``reshape`` its result's relabelling when it joins
        now; ``column_sum`` a column sum joining a contraction's node, in a node of
        its own) into one placed at the latest member position that keeps every
        outside input before it and every outside reader after it; None (and
        nothing changes) where no member position does."""
        merging = {id(n) for n in nodes}
        if reshape is not None:
            merging.add(id(self.node[reshape]))
        extra = [reshape] if reshape is not None else []
        members = sorted([*(m for n in nodes for m in n.members), *extra], key=self.pos.__getitem__)
        heads = [n for n in nodes if n.kind != "elementwise" and column_sum not in n.members]
        if len(heads) > 1:
            return None  # one kernel, one head (one accumulator)
        sums = {m for m in members if m is column_sum or m in self.row_sums
                or nv.column_sum(m) and self.node[m].kind == "contraction"}  # fmt: skip
        if any(isinstance(v.owner, Operation) and v.owner in sums for m in members for v in m.operands):
            return None  # a column sum is finished after every tile: nothing in the kernel reads it
        bound = {n.bound for n in nodes if n.bound is not None}
        if len(bound) > 1 or bound and (heads or not self.absorbable(members, next(iter(bound)), closed=False)):
            return None  # a node kept for a reduction's prologue stays one it can take
        if heads and heads[0].kind == "reduction" and not self._reduction_ok(members, column_sum):
            return None
        latest, earliest = self._window(members, merging)
        late = [self.pos[m] - 1 for m in members if m in self.late]
        # a remat recompute stays in the backward: after its own position, or, in a batch
        # of ``recomputes`` (``RECAST_BATCH``), after the first of theirs
        latest = max([latest, *(late[:1] if recomputes else late)])
        inside = set(members)
        head = next((m for n in heads for m in n.members if epilogue_head(m)), None)
        if head is not None and any(v.owner in inside for v in head.operands):
            return None  # the contraction would read its own epilogue
        if heads and heads[0].kind == "contraction":
            if sum(flops_per_element(m) for m in members if fusible(m)) > EPILOGUE_MAX_FLOPS:
                return None  # past the epilogue's budget
            if any(map(self._optimizer_op, members)):
                # the optimizer's update stays in its multi-tensor groups: in a weight gradient's
                # epilogue (its layout is the parameter's with the transpose_matmul stage on) Adam's
                # new moments (or their terms) would be computed ahead of the guard's gate and kept
                # for it: weight-sized temporaries where the update writes in place
                return None
        for m in reversed(members):
            p = self.pos[m]
            if latest < p < earliest:
                merged = Node(members, p, nodes[0].shape, bound=next(iter(bound), None))
                if heads:
                    merged.kind = heads[0].kind
                    merged.reshape = reshape or heads[0].reshape
                for x in members:
                    self.node[x] = merged
                return merged
        return None

    def _producer(self, w: SSAValue, node: Node) -> tuple[Node, Operation | None] | None:
        """The node ``node`` may merge with vertically through its input ``w`` (and
        the reshape that joins with it), or None: an elementwise or contraction node
        of ``node``'s iteration shape, at most one contraction between them (see the
        module docstring for what stays outside an epilogue)."""
        owner = w.owner
        if not isinstance(owner, Operation):
            return None
        other, reshape = self.node[owner], None
        if not other.fused and relabels_rows(owner):
            head = self.node[owner.operands[0].owner]
            if head.kind != "contraction" or head.reshape is not None or len(head.members) > 1:
                return None  # its epilogue runs over the result's own shape already
            other, reshape = head, owner
            shape = shape_of(owner.results[0].type)
        else:
            shape = other.shape
        if other is node or not other.fused or shape != node.shape:
            return None
        if other.kind != "elementwise" and node.kind != "elementwise":
            return None  # one kernel, one head
        if other.kind == "reduction" and reduction_head(owner) and w is not owner.results[0]:
            return None  # only the first result is computed row by row (the rest: after every row)
        if other.kind == "contraction" and nv.column_sum(owner):
            return None  # a column sum is finished only after every tile
        return other, reshape

    def _join_row_sum(self, op: Operation, x: SSAValue, target: Node) -> None:
        """A column sum of an epilogue value of a row-wise head that sums them
        (``EPILOGUE_SUMS``: LayerNorm's backward, the residual gradient its epilogue
        adds), or of the head's first result where an epilogue reads it (the final
        LayerNorm's backward: its input gradient is the last projection's residual
        gradient), joins its group: the kernel adds the value up over its rows into
        per-program partials beside its own weight and bias gradients. The value may
        be read outside too (it is written anyway: the sum's read of it is saved)."""
        head = next((m for m in target.members if reduction_head(m)), None)
        if head is None or not head.EPILOGUE_SUMS or x.owner not in target.members:
            return
        if x.owner is head:  # its first result, as stored, where an epilogue reads it (the kernel's ``qin``)
            if not nv.first_result_in_epilogue(head, x, target.members):
                return
        elif shape_of(x.type) != epilogue_shape(head) or not fusible(x.owner):
            return
        prologue = prologue_shape(head)
        if prologue is not None and x.owner in self._closure(head, target.members):
            return  # a prologue value
        if self.try_merge([target, self.node[op]], column_sum=op) is not None:
            self.row_sums.add(op)

    def _closure(self, head: Operation, members: list[Operation]) -> set[Operation]:
        """The members ``head`` reads, directly or not (its prologue)."""
        return nv.producers(head.operands, set(members))

    def join_column_sums(self) -> None:
        """The column-sum rule (the module docstring, "column sum"): after the
        grouping, a column sum of a value of a contraction's epilogue joins that
        group where nothing outside it reads the value (which then is not
        written); one of an epilogue value of a row-wise head that sums them joins
        its group (``_join_row_sum``)."""
        for op in self.ops:
            node = self.node.get(op)
            if node is None or not nv.column_sum(op) or node.members != [op]:
                continue
            (x,) = op.operands
            owner = x.owner
            if not isinstance(owner, Operation) or owner not in self.node:
                continue  # a block argument
            target = self.node[owner]
            if target.kind == "reduction":
                self._join_row_sum(op, x, target)
                continue
            if target.kind != "contraction" or shape_of(x.type) != target.shape or len(target.members) < 2:
                continue  # no epilogue value (the matmul's operand), no epilogue, or not of the tile's shape
            if epilogue_head(owner) and target.reshape is not None:
                continue  # the matmul's own result where the epilogue runs over its relabelled rows
            inside = set(target.members)
            if any(u.operation is not op and u.operation not in inside for u in x.uses):
                continue  # written for another reader anyway
            self.try_merge([target, node], column_sum=op)

    # --- the rules ---------------------------------------------------------
    def group(self) -> None:
        for op in self.ops:
            node = self.node.get(op)
            if node is None or not node.fused or node.kind == "contraction" and epilogue_head(op):
                continue  # a contraction's operands are not its epilogue
            if node.kind == "reduction" and reduction_head(op):
                # input fusion: the nodes kept for its prologue, producers of producers too (every
                # one can join: their inputs lie before them, their only readers are in the prologue)
                kept: dict[int, Node] = {}
                stack = [*self.inputs[op], *(m.results[0] for m, h in self.side_of.items() if h is op)]
                while stack:
                    owner = stack.pop().owner
                    n = self.node.get(owner) if isinstance(owner, Operation) else None
                    if n is not None and n.bound is op and id(n) not in kept:
                        kept[id(n)] = n
                        stack.extend(w for m in n.members for w in self.inputs[m])
                if kept:
                    for n in kept.values():
                        n.bound = None
                    self.try_merge([node, *kept.values()])
                continue  # a reduction's operands are not its epilogue
            # vertical: producers of the same iteration shape (a contraction's result among them)
            for w in self.inputs[op]:
                found = self._producer(w, node)
                if found is not None:
                    other, reshape = found
                    if other.kind == "contraction" and self._widens_for_heavy_readers(op, w):
                        continue  # it joins its readers' kernel, which then reads the narrow value
                    kept_for = node.bound
                    if kept_for is not None and other.kind != "elementwise":
                        # a head's epilogue, or the prologue of the reduction reading it: the
                        # kernel that reads fewer bytes (a widening cast's narrow input)
                        if _itemsize(op.results[0]) > _itemsize(w):
                            continue
                        node.bound = None
                    merged = self.try_merge([node, other], reshape)
                    if merged is None:
                        node.bound = kept_for  # still the reduction's, should it get there
                    node = merged or node
            # horizontal: earlier readers of one of its non-scalar inputs, close by
            for w in self.inputs[op]:
                if _scalar(w):
                    continue
                for u in self.users.get(w, ()):
                    if u is op or self.pos[u] >= self.pos[op] or self.pos[op] - self.pos[u] > HORIZONTAL_WINDOW:
                        continue
                    other = self.node[u]
                    if other is node or not other.fused or other.shape != node.shape:
                        continue
                    if other.kind != "elementwise" and node.kind != "elementwise":
                        continue  # two heads
                    if epilogue_head(u) or reduction_head(u):
                        continue  # the head's operand, which is no tile of its epilogue
                    if op in self.clones or u in self.clones:
                        continue  # a clone is computed in its reader's kernel, not beside its original
                    node = self.try_merge([node, other]) or node

    def _args(self, node: Node) -> int:
        """Pointers a node's kernel takes: the values it reads from outside, its outputs."""
        inside = set(node.members)
        ins = {w for m in node.members for w in self.inputs[m]
               if not (isinstance(w.owner, Operation) and w.owner in inside)}  # fmt: skip
        outs = {r for m in node.members for r in m.results if any(u not in inside for u in self.users.get(r, ()))}
        return len(ins) + len(outs)

    def _prepares_operands(self, node: Node) -> bool:
        """``node`` reads only arguments of the step (params, buffers, state) and only
        contractions read its results (through views): a weight's cast for the matmuls.
        Batched, such a group is computed before its first reader; the rule keeps that
        to matmul operands (in a training step the forward reads them in layer order
        while its activations grow towards the peak), not any value computed early."""
        inside = set(node.members)
        if not all(isinstance(w, BlockArgument) for m in node.members for w in self.inputs[m]
                   if not (isinstance(w.owner, Operation) and w.owner in inside)):  # fmt: skip
            return False

        def contractions_only(v: SSAValue) -> bool:
            for u in v.uses:
                r = u.operation
                if r in inside:
                    continue
                if isinstance(r, VIEW_OPS):
                    if not contractions_only(r.results[0]):
                        return False
                elif not (isinstance(r, nv.NovaOp) and r.CATEGORY == "contraction"):
                    return False
            return True

        return all(contractions_only(r) for m in node.members for r in m.results)

    def batch_small(self) -> None:
        """Multi-tensor kernels: groups of one iteration shape of one of two kinds merge
        in block order into one kernel while it takes at most ``SMALL_ARGS`` pointers
        and ``try_merge`` finds a place for it (after every input, before every reader).
        Update groups (writing the new value of a param or state: the optimizer's; the
        updates of biases and LayerNorm weights, of the weights of one shape): a
        multi-tensor update. Groups that read only the step's arguments for the
        matmuls (``_prepares_operands``: the bf16 casts of the weights of one shape):
        one launch before the first of their readers. remat's recomputes of such casts
        (``late``: the weights' recasts for the backward) batch apart from them, up to
        ``RECAST_BATCH`` of one shape, each batch where the first of its recasts was."""
        current: dict[tuple[str, tuple[int, ...]], Node] = {}
        parts: dict[int, int] = {}  # a batch's groups
        for op in self.ops:
            n = self.node.get(op)
            if (n is None or not n.fused or n.kind != "elementwise" or n.shape is None or op is not n.members[-1]
                    or not 1 < numel(n.shape) or any(m.FLAT_INDEX for m in n.members)):  # fmt: skip
                continue
            if any(m in self.updates for m in n.members):
                key = ("update", n.shape)
            elif BATCH_OPERAND_CASTS and not any(m in self.late for m in n.members) and self._prepares_operands(n):
                key = ("arguments", n.shape)
            elif RECAST_BATCH > 1 and all(m in self.late for m in n.members) and self._prepares_operands(n):
                key = ("recasts", n.shape)
            else:
                continue
            cur = current.get(key)
            if (cur is not None and cur is not n and self._args(cur) + self._args(n) <= SMALL_ARGS
                    and (key[0] != "recasts" or parts[id(cur)] < RECAST_BATCH)):  # fmt: skip
                merged = self.try_merge([cur, n], recomputes=key[0] == "recasts")
                if merged is not None:
                    current[key] = merged
                    parts[id(merged)] = parts[id(cur)] + 1
                    continue
            current[key] = n
            parts[id(n)] = 1

    def groups(self) -> list[Group]:
        seen: set[int] = set()
        out: list[Group] = []
        for op in self.ops:
            n = self.node.get(op)
            if n is None or not n.fused or id(n) in seen:
                continue
            seen.add(id(n))
            cone = self.cone_of(n.members)
            if n.kind == "contraction":
                if len(n.members) > 1:  # a contraction without an epilogue stays itself
                    head = next(m for m in n.members if epilogue_head(m))
                    out.append(Group([head, *(m for m in n.members if m is not head)], cone, kind="contraction"))
                continue
            if n.kind == "reduction":
                if len(n.members) > 1:  # a reduction without a prologue or an epilogue stays itself
                    out.append(Group(n.members, cone, kind="reduction"))
                continue
            # a lone op reading only constants stays itself (0-d constants cost no kernel)
            if len(n.members) == 1 and all(not c.operands for c in cone):
                continue
            out.append(Group(n.members, cone))
        by_shape: dict[tuple[int, ...], list[Operation]] = {}  # () and [1] are two iteration shapes
        for op in self.tail:
            by_shape.setdefault(shape_of(op.results[0].type), []).append(op)
        for ops in by_shape.values():
            for k in range(0, len(ops), TAIL_OUTPUTS):
                members = ops[k:k + TAIL_OUTPUTS]
                cone = self.cone_of(members)
                if len(members) == 1 and all(not c.operands for c in cone):
                    continue
                out.append(Group(members, cone, tail=True))
        return out


def _build(g: _Grouping, group: Group) -> nv.FusedOp:
    """The nova.fused op of ``group`` (not inserted yet); the outside readers of its
    results are redirected to it."""
    inside = set(group.members) | set(group.cone)
    ops = sorted(inside, key=g.pos.__getitem__)  # block order: a scalar may read a member
    if group.kind == "contraction":  # the contraction first (it reads outside values only)
        ops.remove(group.members[0])
        ops.insert(0, group.members[0])
    inputs: list[SSAValue] = []
    for op in ops:
        for v in op.operands:
            owner = v.owner
            if (not isinstance(owner, Operation) or owner not in inside) and v not in inputs:
                inputs.append(v)
    members = set(group.members)
    outputs = [r for m in group.members for r in m.results if any(u.operation not in members for u in r.uses)]
    block = Block(arg_types=[v.type for v in inputs])
    mapping: dict[SSAValue, SSAValue] = dict(zip(inputs, block.args, strict=True))
    for op in ops:
        new = op.clone(value_mapper=mapping)
        for old_r, new_r in zip(op.results, new.results, strict=True):
            mapping[old_r] = new_r
        block.add_op(new)
    block.add_op(nv.YieldOp.create(operands=[mapping[r] for r in outputs]))
    fused = nv.FusedOp.create(
        operands=inputs, result_types=[r.type for r in outputs],
        properties={"kind": StringAttr(group.kind)}, regions=[Region(block)],
    )  # fmt: skip
    for old, new in zip(outputs, fused.results, strict=True):
        for use in list(old.uses):
            if use.operation not in members:
                use.operation.operands[use.index] = new
    return fused


# ----------------------------------------------------------------------------
# views between a producer and its consumers


def _sinkable(op: Operation) -> Operation | None:
    """The layout op to move ``op`` below: ``op`` is elementwise, its one use is a
    reshape or transpose whose readers are all elementwise and one of them has the
    view's shape (or read it as a reduction's prologue operand), and its operands
    have its shape (or are 0-d), each contiguous when the view is a reshape (so
    the new reshape is a view too)."""
    if not fusible(op) or op.FLAT_INDEX or not op.operands:
        return None
    uses = list(op.results[0].uses)
    if len(uses) != 1 or not isinstance(uses[0].operation, (nv.ReshapeOp, nv.TransposeOp)):
        return None
    view = uses[0].operation
    shape = shape_of(op.results[0].type)
    for v in op.operands:
        if shape_of(v.type) != shape:
            if shape_of(v.type) == ():
                continue  # broadcast to any shape: read as it is
            return None
        if isinstance(view, nv.ReshapeOp) and isinstance(v.owner, nv.NovaOp) and v.owner.CATEGORY == "layout":
            return None  # a reshape of a strided view may need a copy
    readers = [u.operation for u in view.results[0].uses]
    out = shape_of(view.results[0].type)
    # a reduction reading the view as a prologue operand computes f in its prologue
    prologue = [u.operation for u in view.results[0].uses if reduction_head(u.operation)
                and u.index in u.operation.PROLOGUE and prologue_shape(u.operation) == out]  # fmt: skip
    if not readers or not all(fusible(r) or r in prologue for r in readers):
        return None
    if not prologue and not any(shape_of(r.results[0].type) == out for r in readers):
        return None
    return view


def _relayout(view: Operation, v: SSAValue) -> Operation:
    """``view``'s layout op applied to ``v`` instead (its attributes, e.g. nova.loc, kept)."""
    if isinstance(view, nv.TransposeOp):
        perm = view.props()["perm"]
        result = tensor([shape_of(v.type)[p] for p in perm], elem_of(v.type))
    else:
        result = tensor(shape_of(view.results[0].type), elem_of(v.type))
    return type(view).create(operands=[v], result_types=[result], properties=dict(view.properties),
                             attributes=dict(view.attributes))  # fmt: skip


def sink_views(block: Block) -> int:
    """``layout(f(a, b))`` becomes ``f(layout(a), layout(b))`` where the layout op's
    readers are elementwise (see ``_sinkable``): ``f`` then has its readers'
    iteration shape and joins their group, reading ``a`` and ``b`` through the view
    instead of a kernel writing ``f``'s result first. Exact: the same ops on the
    same elements. Returns how many ops moved."""
    moved = 0
    changed = True
    while changed:
        changed = False
        for op in list(block.ops):
            view = _sinkable(op)
            if view is None:
                continue
            operands = []
            shape = shape_of(op.results[0].type)
            for v in op.operands:
                if shape_of(v.type) != shape:  # a 0-d operand (_sinkable)
                    operands.append(v)
                    continue
                lay = _relayout(view, v)
                block.insert_op_before(lay, view)
                operands.append(lay.results[0])
            new = type(op).create(operands=operands, result_types=[view.results[0].type.__class__(
                elem_of(op.results[0].type), view.results[0].type.get_shape())],
                properties=dict(op.properties), attributes=dict(op.attributes))  # fmt: skip
            block.insert_op_before(new, view)
            view.results[0].replace_all_uses_with(new.results[0])
            block.erase_op(view)
            block.erase_op(op)
            moved += 1
            changed = True
    return moved


def hoist_views(block: Block) -> int:
    """Each view (``VIEW_OPS``: a strided view in the backend, no kernel) of a kernel's
    result moves up to just after that kernel, in block order: a group reading through
    it may then be placed as early as its real inputs allow (GELU's backward, which
    reads the input-gradient matmul's result through a reshape, with remat's GELU
    recompute, which the weight gradient reads before that reshape was placed). Exact,
    and the memory plan's live ranges stay as they were (a view's bytes are its
    root's, live until the view's last reader). A view of a block argument or of
    another view stays where it is (that one could be a copy). Returns how many moved."""
    ops = list(block.ops)
    after: dict[Operation, list[Operation]] = {}
    for op in ops:
        if isinstance(op, VIEW_OPS) and isinstance(op.operands[0].owner, Operation) \
                and not isinstance(op.operands[0].owner, VIEW_OPS):  # fmt: skip
            after.setdefault(op.operands[0].owner, []).append(op)
    hoisted = {v for vs in after.values() for v in vs}
    order: list[Operation] = []
    for op in ops:
        if op not in hoisted:
            order.append(op)
            order += after.get(op, [])
    moved = sum(1 for i, op in enumerate(order) if op in hoisted and ops[i] is not op)
    if moved:
        for op in ops:
            block.detach_op(op)
        for op in order:
            block.add_op(op)
    return moved


def _shared_reader(u) -> str | None:
    """How a reader of a remat recompute ``v`` can compute ``v`` itself: "prologue" (a
    reduction reading it as a prologue operand of its shape), "elementwise" (an
    elementwise op of its shape: the recompute joins its group, vertically, or its
    epilogue when it sits in a contraction's), or None."""
    r, shape = u.operation, shape_of(u.operation.operands[u.index].type)
    if reduction_head(r) and u.index in r.PROLOGUE and prologue_shape(r) == shape:
        return "prologue"
    if fusible(r) and not r.FLAT_INDEX and shape_of(r.results[0].type) == shape:
        return "elementwise"
    return None


def _chain_of(op: Operation, order: dict[Operation, float]) -> list[Operation]:
    """``op`` and the elementwise ops of its shape only the chain reads, in block order
    (``order``: the block's ops' positions)."""
    shape = shape_of(op.results[0].type)
    members = {op}
    changed = True
    while changed:
        changed = False
        for m in list(members):
            for v in m.operands:
                p = v.owner
                if (isinstance(p, Operation) and p not in members and fusible(p) and not p.FLAT_INDEX
                        and shape_of(p.results[0].type) == shape
                        and all(u.operation in members for u in p.results[0].uses)):  # fmt: skip
                    members.add(p)
                    changed = True
    return sorted(members, key=order.__getitem__)


def _one_kernel_for_readers(op: Operation, uses: list, kinds: list, order: dict[Operation, float]) -> bool:
    """Whether the readers of ``op``'s value can all be one kernel with it, so that it
    is neither written nor cloned: every reader elementwise of its shape, one of them
    past any epilogue's budget (GELU's backward: its kernel, an elementwise one or a
    reduction's prologue, has no budget the others could pass), and everything the
    later readers read besides (through elementwise producers of the shape, which join
    them) made before the first reader, where the kernel can then be placed (remat's
    GELU recompute, before the weight gradient that reads it, and GELU's backward of
    the input gradient computed before it)."""
    if set(kinds) != {"elementwise"} or not any(flops_per_element(u.operation) > EPILOGUE_MAX_FLOPS for u in uses):
        return False
    first = min(order[u.operation] for u in uses)
    shape = shape_of(op.results[0].type)
    seen: set[Operation] = {op}
    stack = [u.operation for u in uses]
    while stack:
        r = stack.pop()
        if r in seen:
            continue
        seen.add(r)
        for v in r.operands:
            p = v.owner
            if not isinstance(p, Operation) or p in seen:
                continue
            if fusible(p) and not p.FLAT_INDEX and shape_of(p.results[0].type) == shape:
                stack.append(p)
            elif order[p] >= first:
                return False
    return True


def _row_sides_read(op: Operation, uses: list, kinds: list) -> bool:
    """Whether ``op``'s value is read by one row-wise head that stores prologue
    values (``stores_rows``), as a prologue operand, and otherwise only by elementwise
    ops of its shape that read nothing else of its size (the head's side ops to be:
    a LayerNorm recompute from the forward's statistics beside its backward): one
    kernel computes it for all of them, in the head's prologue."""
    if kinds.count("prologue") != 1 or set(kinds) - {"prologue", "elementwise"}:
        return False
    n = numel(shape_of(op.results[0].type))
    for u, kind in zip(uses, kinds, strict=True):
        r = u.operation
        if kind == "prologue" and not stores_rows(r):
            return False
        if kind == "elementwise" and (not is_recompute(r) or any(
                v is not op.results[0] and numel(shape_of(v.type)) >= n for v in r.operands)):
            return False  # (a recompute's: norm_recompute's formula, placed so its kernel can be the head's)
    return True


def share_recomputes(block: Block) -> set[Operation]:
    """A recompute of the remat stage (every op ``nova.remat``) whose readers can each
    compute it (``_shared_reader``: reductions reading it as prologue operands, the
    residual stream a LayerNorm recompute and its backward both read; elementwise
    ops of its shape, the pre-activation ``cast(mm) + bias`` that GELU's recompute
    and GELU's backward in the backward matmul's epilogue both read) is cloned into
    each reader but the first, one copy per use, where that moves fewer bytes than
    one kernel writing the value for all. A chain reading ``ins`` bytes an element
    and giving ``out``, with k readers: written once, it costs ``ins + out + k out``
    where every reader is a reduction (the chain is a kernel of its own) and
    ``ins + out + (k - 1) out`` where one is elementwise (the chain joins that
    reader's group and is written for the others); cloned, ``k ins``. So cloning
    needs ``(k - 1) ins <= (k + 1) out``, or ``<= k out``. A widening chain (bf16
    in, f32 out) always passes: the f32 value is never written. Only within an
    epilogue's FLOPs (``EPILOGUE_MAX_FLOPS``: each reader computes it again), and
    only remat's recomputes or widening chains. Remat chose its recomputes from
    values live anyway at that point of the backward, and their readers are the
    backward's ops beside them, so the memory plan's live sets stay as they were;
    elsewhere a chain's inputs live until its last reader instead of its value,
    which only a widening chain (fewer bytes in than out an element) makes smaller:
    the pre-activation ``cast(mm) + bias`` of the last layer's MLP, which remat
    leaves to be saved (its backward comes next), then keeps its bf16 matmul
    result alive through the loss instead of the f32 sum. Exact: the same ops on
    the same values. Returns the clones: each is computed where its reader is, so it never
    joins another group horizontally (beside the chain it copies it would be that
    chain's kernel again)."""
    clones: set[Operation] = set()
    ops = list(block.ops)
    # positions, computed once: a clone is placed just before its reader (below), and the
    # chains found later (earlier in the block) never reach a clone
    order: dict[Operation, float] = {o: i for i, o in enumerate(ops)}
    for op in reversed(ops):
        if not fusible(op) or op.FLAT_INDEX:
            continue
        uses = list(op.results[0].uses)
        if len(uses) < 2:
            continue
        kinds = [_shared_reader(u) for u in uses]
        if None in kinds:
            continue
        chain = _chain_of(op, order)
        n = numel(shape_of(op.results[0].type))
        inside = set(chain)
        ins = {v for m in chain for v in m.operands if not (isinstance(v.owner, Operation) and v.owner in inside)}
        in_bytes = sum(_itemsize(v) for v in ins if numel(shape_of(v.type)) == n)  # broadcasts: read from cache
        k, out = len(uses), _itemsize(op.results[0])
        if in_bytes >= out and not all(is_recompute(m) for m in chain):
            continue  # neither remat's recompute nor widening
        if _one_kernel_for_readers(op, uses, kinds, order) or _row_sides_read(op, uses, kinds):
            continue  # one kernel computes it for every reader: nothing written, nothing computed twice
        written = (k + 1 if "elementwise" not in kinds else k) * out
        if (k - 1) * in_bytes > written or sum(flops_per_element(m) for m in chain) > EPILOGUE_MAX_FLOPS:
            continue
        for use in sorted(uses, key=lambda u: order[u.operation])[1:]:  # the first reader keeps the chain
            mapping: dict[SSAValue, SSAValue] = {}
            at = order[use.operation]
            for j, m in enumerate(chain):
                new = m.clone(value_mapper=mapping)
                for a, b in zip(m.results, new.results, strict=True):
                    mapping[a] = b
                block.insert_op_before(new, use.operation)
                order[new] = at - 0.5 + j / (2 * len(chain))  # before its reader, in the chain's order
                clones.add(new)
            use.operation.operands[use.index] = mapping[op.results[0]]
    return clones


def fuse(module: ModuleOp) -> list[nv.FusedOp]:
    """Groups @train_step's elementwise ops (see the module docstring); returns the
    nova.fused ops made, in block order."""
    fn = step_func(module)
    block = fn.body.block
    sink_views(block)
    hoist_views(block)
    clones = share_recomputes(block)
    g = _Grouping(block, clones)
    g.group()
    g.join_column_sums()
    g.batch_small()
    groups = g.groups()
    placed: dict[int, Operation] = {}  # position -> the op that goes there
    last: list[Operation] = []  # the tail groups, before the return
    replaced: set[Operation] = set()
    made = []
    for group in groups:
        fused = _build(g, group)
        if group.tail:
            last.append(fused)
        else:
            placed[g.node[group.members[0]].pos] = fused
        replaced.update(group.members)
        made.append(fused)
    order: list[Operation] = []
    for i, op in enumerate(g.ops):
        if i in placed:
            order.append(placed[i])
        elif op is block.last_op:
            order += [*last, op]
        elif op not in replaced:
            order.append(op)
    # ops outside groups keep their position; a group goes where it was placed
    for op in list(block.ops):
        block.detach_op(op)
    for op in replaced:
        op.erase(safe_erase=False)
    for op in order:
        block.add_op(op)
    # virtual scalars every reader now recomputes are dead
    for op in reversed(order):
        if op in g.virtual and all(not r.uses for r in op.results):
            block.erase_op(op)
    assert isinstance(block.last_op, func.ReturnOp)
    return made


def report(module: ModuleOp, top: int = 10) -> list[str]:
    """The groups in a few lines, for ``explain()``: how many, how many ops they
    hold, and the ``top`` largest (their ops, inputs and outputs)."""
    groups = [op for op in step_func(module).body.block.ops if isinstance(op, nv.FusedOp)]
    if not groups:
        return ["fuse: no groups"]
    inner = sum(len(g.inner_ops()) for g in groups)
    epilogues = sum(1 for g in groups if g.contraction() is not None)
    reductions = sum(1 for g in groups if g.reduction() is not None)
    lines = [f"fuse: {len(groups)} groups (one kernel each; {epilogues} of them a contraction with its epilogue, "
             f"{reductions} a reduction with its prologue and epilogue) "
             f"holding {inner} ops (scalars recomputed in each group count in each)"]
    for g in sorted(groups, key=lambda g: -len(g.inner_ops()))[:top]:
        names = [o.name.removeprefix("nova.") for o in g.inner_ops()]
        shape = "x".join(map(str, g.iteration_shape())) or "scalar"
        lines.append(f"  [{shape}] {len(names)} ops, {len(g.operands)} inputs, {len(g.results)} outputs: "
                     + " ".join(names))
    return lines


@dataclass(frozen=True)
class Fuse(ModulePass):
    name = "nova-fuse"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        fuse(op)
