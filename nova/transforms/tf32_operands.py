"""The tf32_operands stage: matmul operands stored already rounded to tf32 by their producer.

Under the tf32 policy every f32 matmul rounds each operand to the nearest tf32 value
before its products, as cuBLAS does (``nova.codegen.triton.matmul``, precision
``tf32-rn``): in registers after each tile's load, or through a staging copy that
rounds while it makes the operand K-major. Rounding in the K loop costs instruction
issue beside the tensor cores. Measured on the H200 (``scripts/tf32_variants.py``,
``bench/results/runs/tf32_variants_d7039cd.json``, each launch of the step with its
own config): the matmuls of the 46M MLP LM's step at batch 8 take 6.34 ms as they
run, 5.85 ms with A already rounded, against cuBLAS's 5.02; GPT-2 124M's at batch
16, 49.7 / 44.7 / 41.9 ms.

Rounding is idempotent: a value rounded once gives the same bits to a matmul that
would round it again. So where every reader of a value is a tf32 matmul (through
layout views), the value may be stored rounded instead, and the matmuls take it as
it is. This stage, for the Triton target under the tf32 policy, puts a
``nova.round_tf32`` after the producer of each such value and has the readers read
its result. ``nova.round_tf32`` is an elementwise op: the fuse stage then places it
into its producer's kernel by category, as any elementwise epilogue (a LayerNorm's
output, a matmul's GELU epilogue, GELU's backward with its bias-gradient sum), so
no kernel and no pass over memory is added; the producer writes the rounded values
instead of the raw ones. The Triton backend passes the matmul ``prerounded`` for an
operand whose value comes from a ``nova.round_tf32`` (``nv.tf32_rounded``).

Rule: a result ``v`` (f32, not a view) of an op whose kernel takes an elementwise
epilogue on it: an elementwise op, a contraction with an epilogue (``EPILOGUE``), or
the first result of a row-wise reduction with an epilogue (a LayerNorm's output);
every use of ``v``, through chains of reshape, transpose, slice and broadcast_to, is
an operand of a ``nova.matmul`` whose operands are f32, or the h of the fused LM head
(``nova.linear_cross_entropy*``, f32 h and w: each chunk's logits h @ w^T and weight
gradient d^T @ h are tf32 matmuls, ``linear_ce.py``), but for column sums of ``v``
itself (``nv.column_sum``: the bias gradient beside GELU's backward, which the fuse
stage adds up in the same kernel from the raw values, so the rounded values are the
only ones stored; the sum's reader keeps ``v``). A value also read by
anything else (the residual gradient the next layer adds to, an attention output its
backward reads, a weight the optimizer updates, a returned value) keeps its raw
bits. Results: the same bits as without the stage on the Triton backend (the
matmuls saw rounded operands before); the reference executor computes
``nova.round_tf32`` as written, so its tf32 matmuls also see the rounded values.

In the step on the H200 (``scripts/tf32_stage_ab.py``,
``bench/results/runs/tf32_stage_ab_010c8a0.json``, the 46M step) the stage first made
it slower, 8.98 -> 9.41 ms of launches: the forward and epilogue matmuls gained
(0.071 -> 0.064 ms), the split-K weight gradients, whose A is dY^T (M-major, which
goes through registers anyway), lost (0.062 -> 0.107 ms) without their in-register
rounding. The matmul launcher now takes a prerounded operand as it is only where it
is K-contiguous (``matmul._run``): then 8.96 ms with the stage against 9.06 without
(``tf32_stage_ab_ba207a7.json``).

A weight keeps its raw bits (the optimizer reads it), but the matmuls that read it
K-major (the forward's x @ W^T: B with K contiguous, which the launcher would stage,
rounding a copy, at every launch) can read a rounded copy instead (``ROUND_ARGUMENTS``):
one ``nova.round_tf32`` of the step argument, read through copies of the views by
exactly those matmuls. Such groups read only step arguments and only contractions
read them, so the fuse stage batches those of one shape into one multi-tensor launch
before the first reader (as it does the bf16 casts): the 46M MLP's 12 forward staging
copies become 2 launches. The matmuls that read the weight N-major (the input
gradient's dY @ W) keep reading the raw argument: they stage a transposed copy anyway.

An attention backward's gradients dq, dk, dv (f32) are stored rounded by its own
kernels (the op's ``rounded``: ``tf32_rn`` on each tile as it is stored) where every
read of each of them, through views, is a tf32 matmul's, or a cat of only that op's
gradients every read of which is a tf32 matmul's (GPT-2's packed qkv projection: its
input gradient dqkv @ W and weight gradient dqkv^T @ x). Its bias gradient, the cat's
column sum, is no such read: the attention_sums stage, which runs before this one,
has made it the op's ``sums``, which its kernels add up from the raw tiles before
they are rounded; a column sum still there keeps the gradients raw. Without it the
input gradient's A (K-major, not rounded) goes through registers, rounded in every
K-step: 0.67x cuBLAS at 8192x768x2304 row/row against 0.82x for the same kernel with
A prerounded at 8192x768x3072 on an H100 (``bench/results/matmul_gpt2.md``, 4eb8856).
No store is added: the kernels write the rounded tiles instead of the raw ones.

A second store (``ROUND_SECOND_STORE``, off: no gain measured, below): a value whose kernel takes
an elementwise epilogue, which f32 matmuls read as a K-major A and other ops read raw
(the residual gradient: the next layer's adds and the weight gradient read it raw; the
input gradient dY @ W reads it as A), gets a ``nova.round_tf32`` read by exactly those
matmuls, through their own copies of the views. The fuse stage puts it into the
producer's kernel, which then stores both (12.6 MB more a layer for the 46M MLP at batch
8); the matmul reads A prerounded from shared memory instead of rounding it in registers
every K-step (the MLP's 8192x1536x384 row/row: 0.0564 ms, against 0.0429 for the same
shape with both operands prerounded, H100, c527b90), and GPT-2's fc input gradient loses
its staging copy of A. The peak is unchanged (the copy dies at its one reader).
"""

from __future__ import annotations

from xdsl.dialects.builtin import ModuleOp, f32
from xdsl.ir import OpResult, SSAValue

from nova.ir import dialect as nv
from nova.ir.builder import OpBuilder
from nova.ir.module import step_func
from nova.ir.types import elem_of, numel, shape_of
from nova.transforms.remat import REMAT_ATTR, is_recompute


def _reads(v: SSAValue, chain: tuple = ()) -> list[tuple]:
    """Every (op, operand index, the views from ``v`` to that operand) reading ``v``,
    through view chains."""
    out = []
    for use in v.uses:
        if isinstance(use.operation, nv.VIEW_OPS):
            out += _reads(use.operation.results[0], chain + (use.operation,))
        else:
            out.append((use.operation, use.index, chain))
    return out


def _takes_epilogue(v: OpResult) -> bool:
    """Whether ``v``'s producer computes elementwise ops on ``v`` in its own kernel."""
    op = v.op
    if not isinstance(op, nv.NovaOp) or isinstance(op, nv.VIEW_OPS) or isinstance(op, nv.RoundTf32Op):
        return False
    if op.CATEGORY == "elementwise":
        return len(op.results) == 1
    if op.CATEGORY == "contraction":
        return op.EPILOGUE and len(op.results) == 1
    if op.CATEGORY == "reduction":
        return op.EPILOGUE and v.index == 0
    return False


# the fused LM head's ops: their h (the operand after the gradient, if any) is the logits'
# A and the weight gradient's B in every chunk, both tf32 matmuls of f32 operands
LM_HEADS = (nv.LinearCrossEntropyOp, nv.LinearCrossEntropyBackwardOp, nv.LinearCrossEntropyWithGradOp)


def _tf32_reader(op, index: int) -> bool:
    if isinstance(op, nv.MatmulOp):
        return True
    return isinstance(op, LM_HEADS) and index == (0 if isinstance(op, nv.LinearCrossEntropyOp) else 1)


def _contracted(op) -> list[SSAValue]:
    """The operands ``op`` contracts: a matmul's two, the LM head's h and w."""
    if isinstance(op, nv.MatmulOp):
        return list(op.operands)
    g = 0 if isinstance(op, nv.LinearCrossEntropyOp) else 1
    return list(op.operands[g : g + 2])


def _f32_tf32_read(op, index: int) -> bool:
    """Operand ``index`` of ``op`` is contracted by a tf32 matmul of f32 operands."""
    return _tf32_reader(op, index) and all(elem_of(x.type) == f32 for x in _contracted(op))


def _only_matmuls(v: SSAValue) -> bool:
    """Every reader of ``v`` is an f32 matmul (or the fused LM head's h), or a column
    sum of ``v`` itself (a bias gradient: the fuse stage adds it up in ``v``'s
    producer's kernel, from the raw values, before the rounded ones are stored); at
    least one matmul."""
    readers = [(op, i) for op, i, _ in _reads(v)]
    matmuls = [op for op, i in readers if _f32_tf32_read(op, i)]
    sums = [op for op, _ in readers if nv.column_sum(op) and op.operands[0] is v]
    return bool(matmuls) and len(matmuls) + len(sums) == len(readers)


# a rounded copy of each step argument (a weight) for the matmuls that read it K-major
# (the forward's x @ W^T): one multi-tensor launch a shape before the first of them
# (the fuse stage's argument batches) instead of a staging copy a matmul
ROUND_ARGUMENTS = True


def _k_major_reads(w: SSAValue) -> list[tuple]:
    """The reads of ``_reads(w)`` that are an operand of an f32 matmul read K-major (A
    with K contiguous, B with K contiguous: what the launcher would otherwise stage,
    rounding a copy of it)."""
    from nova.transforms.configure import operand_layout  # the backend's strides of a view chain

    return [(op, i, chain) for op, i, chain in _reads(w)
            if isinstance(op, nv.MatmulOp) and all(elem_of(x.type) == f32 for x in op.operands)
            and operand_layout(chain[-1].results[0] if chain else w) == ("row" if i == 0 else "col")]  # fmt: skip


def _rounded_after(block, op, v: SSAValue) -> SSAValue:
    """A ``nova.round_tf32`` of ``v`` (a result of ``op``) just after ``op``, at its
    location; a recompute's rounding is part of the recompute."""
    b = OpBuilder(block, before=op.next_op)
    b.location = op.attributes["nova.loc"].data if "nova.loc" in op.attributes else None
    r = b.one(nv.RoundTf32Op, [v])
    if is_recompute(op):
        r.owner.attributes[REMAT_ATTR] = op.attributes[REMAT_ATTR]
    return r


def _read_through_copies(block, r: SSAValue, reads: list[tuple]) -> None:
    """Each (matmul, operand index, views) of ``reads`` reads ``r`` instead, through its
    own copies of the views, placed just before it."""
    for matmul, index, chain in reads:
        x = r
        for view in chain:
            copy = view.clone()
            copy.operands[0] = x
            block.insert_op_before(copy, matmul)
            x = copy.results[0]
        matmul.operands[index] = x


def _round_arguments(block) -> int:
    """A rounded copy of each f32 step argument that matmuls read K-major, read by those
    matmuls through their own copies of the views (``ROUND_ARGUMENTS``); returns how many."""
    ops = list(block.ops)
    done = 0
    for w in block.args:
        reads = _k_major_reads(w) if elem_of(w.type) == f32 and numel(shape_of(w.type)) > 1 else []
        if not reads:
            continue
        first = min((m for m, _, _ in reads), key=ops.index)
        b = OpBuilder(block, before=first)
        b.location = first.attributes["nova.loc"].data if "nova.loc" in first.attributes else None
        _read_through_copies(block, b.one(nv.RoundTf32Op, [w]), reads)
        done += 1
    return done


# an attention backward's gradients stored rounded by its kernels where only tf32 matmuls read them
ROUND_ATTENTION_GRADIENTS = True


def _matmul_reads_only(v: SSAValue) -> bool:
    """Every read of ``v`` (through views) is an f32 tf32 matmul's (or the fused LM head's h); at least one."""
    reads = _reads(v)
    return bool(reads) and all(_f32_tf32_read(op, i) for op, i, _ in reads)


def _gradient_to_matmuls(att: nv.AttentionBackwardOp, i: int) -> bool:
    """Every read of ``att``'s gradient ``i`` (through views) is a tf32 matmul's, or a
    cat of only ``att``'s gradients that only tf32 matmuls read."""
    reads = _reads(att.results[i])
    for op, index, _ in reads:
        if isinstance(op, nv.CatOp):
            ours = all(isinstance(r := nv.view_source(x), OpResult) and r.op is att and r.index < 3 for x in op.operands)
            if not (ours and _matmul_reads_only(op.results[0])):
                return False
        elif not _f32_tf32_read(op, index):
            return False
    return bool(reads)


def _round_attention_gradients(block) -> int:
    """Sets ``rounded`` on each f32 attention backward whose dq, dk and dv only tf32
    matmuls read (``ROUND_ATTENTION_GRADIENTS``); returns how many."""
    done = 0
    for op in block.ops:
        if (isinstance(op, nv.AttentionBackwardOp) and not op.props()["rounded"]
                and elem_of(op.results[0].type) == f32 and all(_gradient_to_matmuls(op, i) for i in range(3))):
            op.properties["rounded"] = nv.make_prop(True)
            done += 1
    return done


# a second, rounded store of a value that other ops read raw, for the matmuls that read it
# as a K-major A (the residual gradient's input-gradient matmul). Measured on an H100, Nova
# alone, off against on: the 46M MLP tf32 b8 955,893 against 962,947 tok/s (83712ff), GPT-2
# 124M tf32 b16 191,323 against 191,727 (a555b0c; bench/results/runs/ab_rss_*): +0.7% and
# +0.2%, within the runs' spread (the MLP's off runs 954,702-955,893). Off: no gain shown
ROUND_SECOND_STORE = False


def _round_second_stores(block) -> int:
    """A ``nova.round_tf32`` beside each f32 value whose kernel takes an elementwise
    epilogue and that both f32 matmuls read as a K-major A and other ops read raw,
    read by exactly those matmuls through their own copies of the views
    (``ROUND_SECOND_STORE``); returns how many."""
    done = 0
    for op in list(block.ops):
        for v in op.results:
            if elem_of(v.type) != f32 or not _takes_epilogue(v) or _only_matmuls(v):
                continue
            reads = [(m, i, chain) for m, i, chain in _k_major_reads(v) if i == 0]
            if not reads:
                continue
            _read_through_copies(block, _rounded_after(block, op, v), reads)
            done += 1
    return done


def tf32_operands(module: ModuleOp, precision: str) -> int:
    """Rounds at the producer every value only tf32 matmuls read (the module
    docstring's rule), a rounded copy of each step argument for the matmuls that
    read it K-major, and an attention backward's gradients in its kernels, under
    ``precision == "tf32"``; returns how many."""
    if precision != "tf32":
        return 0
    block = step_func(module).body.block
    done = _round_arguments(block) if ROUND_ARGUMENTS else 0
    done += _round_attention_gradients(block) if ROUND_ATTENTION_GRADIENTS else 0
    done += _round_second_stores(block) if ROUND_SECOND_STORE else 0
    for op in list(block.ops):
        for v in op.results:
            if elem_of(v.type) != f32 or not _takes_epilogue(v) or not _only_matmuls(v):
                continue
            r = _rounded_after(block, op, v)
            # the matmuls (and their views) read the rounded value; a column sum keeps the raw one
            v.replace_uses_with_if(r, lambda use, r=r: use.operation is not r.owner and not nv.column_sum(use.operation))
            done += 1
    return done


__all__ = ["tf32_operands"]
