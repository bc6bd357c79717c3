"""The cost model of a configured step, kernel by kernel: the bytes each kernel
moves, its FLOPs, its arithmetic intensity, its roofline bound and its predicted
time, from the same device numbers the Analytic Configurator decides with
(``DeviceSpec.mem_bandwidth``, ``DeviceSpec.flops(path)``, ``LAUNCH_SECONDS``).

A kernel is a step of the Triton backend's launch order (``plan_memory.launch_order``:
one per op, a ``nova.fused`` group, a matmul with its epilogue among them, is one
kernel; layout ops are views and launch nothing, a 0-d constant is computed once
when the step is bound). For each:

    memory_s  = bytes / BW                      (compulsory DRAM traffic)
    compute_s = flops / P(path)                 (the path's peak: bf16 / tf32 tensor
                                                 cores, fp32 / fp64 FMA)
    launch_s  = launches * LAUNCH_SECONDS       (kernels the lowering launches)
    predicted = max(memory_s, compute_s) + launch_s
    bound     = launch if launch_s >= max(memory_s, compute_s),
                else compute if compute_s >= memory_s, else memory

``bytes`` counts each operand read once and each result written once at its dtype;
an operand that is a view (a broadcast bias, a transposed weight, a slice) counts
the smaller of the view and the storage it views (a broadcast row is read once, from
cache, not once per row). Kernels whose lowering moves more than their operands and
results (split-K partials, tf32 staging copies, the fused LM head's logits chunks,
attention's backward statistics) add what they move; ``RULES`` holds one function
per op kind, beside each other, and a missing rule is an error naming the op.
``docs/configurator.md`` ("The cost model") states every formula.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from xdsl.ir import Operation, SSAValue

from nova.ir import dialect as nv
from nova.ir.types import elem_of, numel, shape_of, to_torch_dtype
from nova.schedule import configurator as cf
from nova.schedule.config import LoweringConfig
from nova.schedule.devices import DeviceSpec
from nova.transforms.plan_memory import VIEW_OPS, launch_order


class NoCostRule(NotImplementedError):
    """An op that becomes a kernel but has no cost rule (the message names it)."""


@dataclass(frozen=True)
class Cost:
    """What one kernel moves and computes, before any device is involved."""

    kind: str  # matmul | attention | lm_head | reduction | elementwise | fused | gather | check | copy
    bytes: int
    flops: int
    path: str  # the arithmetic path its FLOPs run on: bf16 | tf32 | fp32 | fp64
    launches: int = 1


@dataclass(frozen=True)
class KernelCost:
    """One kernel of the launch order with its roofline numbers on one device."""

    index: int  # position among the step's kernels, in launch order
    op: str  # nova.matmul, nova.fused, ...
    kind: str
    shape: str  # its first result's type, e.g. tensor<8x32xf32>
    loc: str | None  # the op's nova.loc
    config: str  # the lowering config, short (schedule_summary)
    bytes: int
    flops: int
    path: str
    launches: int
    memory_s: float
    compute_s: float
    launch_s: float
    ops: int = 1  # nova ops inside it (a fused group's body, a matmul's epilogue with it)

    @property
    def predicted_s(self) -> float:
        return max(self.memory_s, self.compute_s) + self.launch_s

    @property
    def intensity(self) -> float:
        """FLOP per byte moved."""
        return self.flops / self.bytes if self.bytes else 0.0

    @property
    def bound(self) -> str:
        if self.launch_s >= max(self.memory_s, self.compute_s):
            return "launch"
        return "compute" if self.compute_s >= self.memory_s else "memory"


# --------------------------------------------------------------------------- bytes


def _itemsize(v: SSAValue) -> int:
    return to_torch_dtype(elem_of(v.type)).itemsize


def _size(v: SSAValue) -> int:
    return numel(shape_of(v.type)) * _itemsize(v)


def read_bytes(v: SSAValue) -> int:
    """Bytes a kernel reads of operand ``v``: the smaller of the view and its storage."""
    return min(numel(shape_of(v.type)), numel(shape_of(nv.view_source(v).type))) * _itemsize(v)


def io_bytes(ins, outs) -> int:
    """Operands read once plus results written once."""
    return sum(read_bytes(v) for v in ins) + sum(_size(r) for r in outs)


def _float_path(values) -> str:
    """fp64 when any value is f64, else fp32: the CUDA cores' FMA rate (16-bit
    elementwise and reduction arithmetic runs in fp32 registers)."""
    return "fp64" if any(to_torch_dtype(elem_of(v.type)) == torch.float64 for v in values) else "fp32"


def _contraction_path(dtype: torch.dtype, precision: str) -> str:
    """The configure stage's rule: 16-bit operands on the 16-bit tensor cores, fp32
    ones by the step's policy (tf32 rounds to nearest), f64 on the fp64 FMA."""
    policy = "bf16" if dtype.itemsize == 2 else cf.STEP_MATMUL_PRECISION[precision]
    return cf.arithmetic_path(dtype, dtype, policy)


# --------------------------------------------------------------------------- FLOPs per element
# Arithmetic per element, for the streaming kernels: a transcendental (exp, tanh,
# rsqrt) counts as one, as the SFU issues it in one instruction. These kernels sit
# at O(1) FLOP/byte, two orders of magnitude below every ridge point, so the count
# places them on the roofline; it never decides their time (bytes do).

# pure data movement or integer work: no floating-point arithmetic
_NO_FLOPS = (nv.CastOp, nv.FullOp, nv.ArangeOp, nv.DropoutMaskOp, nv.PadOp, nv.CatOp, nv.EmbeddingOp)
_ELEMENTWISE_FLOPS = {nv.GeluOp: 8, nv.GeluBackwardOp: 12, nv.SigmoidOp: 3, nv.WhereOp: 1}
# per input element of the row, by the configure stage's reduction kind
_ROW_FLOPS = {"sum": 1, "max": 1, "softmax": 5, "log_softmax": 5, "layernorm": 8, "cross_entropy": 5}
_ROW_BACKWARD_FLOPS = {"softmax": 4, "log_softmax": 4, "layernorm": 12, "cross_entropy": 5}


def flops_per_element(op: Operation) -> int:
    """FLOPs of one elementwise op per result element: 0 for data movement, else its
    ``_ELEMENTWISE_FLOPS`` entry (1 by default)."""
    if isinstance(op, _NO_FLOPS) or not op.results:
        return 0
    return _ELEMENTWISE_FLOPS.get(type(op), 1)


def elementwise_flops(op: Operation) -> int:
    """FLOPs of one elementwise op: ``flops_per_element`` x its result's elements."""
    return numel(shape_of(op.results[0].type)) * flops_per_element(op) if op.results else 0


# --------------------------------------------------------------------------- rules, one per op kind

Rule = Callable[[Operation, tuple, tuple, LoweringConfig | None, str], Cost]
RULES: dict[type, Rule] = {}


def rule(*op_classes):
    def register(fn: Rule) -> Rule:
        for c in op_classes:
            RULES[c] = fn
        return fn

    return register


def read_in_place(lhs, rhs) -> set[str]:
    """The operands ("a", "b") a staged tf32 config reads in place instead of copying:
    stored rounded by their producer (``nv.tf32_rounded``), K-major (A "row", B "col")
    and one matrix, as the launcher (``matmul._run``) decides."""
    from nova.transforms.configure import operand_layout  # the configure stage's layouts (imported late, as ROWWISE is)

    return {name for name, v, major in (("a", lhs, "row"), ("b", rhs, "col"))
            if nv.tf32_rounded(v) and numel(shape_of(v.type)[:-2]) == 1 and operand_layout(v) == major}


@rule(nv.MatmulOp)
def matmul_cost(op, ins, outs, cfg, precision, operands=None) -> Cost:
    """C[batch, M, N] = A @ B: FLOPs 2 M N K batch; bytes A, B (a 2-D operand
    broadcast over the batch read once) and C (an epilogue's operands and outputs
    instead of C: ``fused_cost``). Split-K writes and reads its f32 partials and
    launches the reduction; tf32 staging reads and writes the staged operand (f32)
    and launches its copy (the configurator's own terms), unless the operand is read
    in place (``read_in_place``; ``operands``: the values A and B are, a group's
    operands for its matmul)."""
    staged = cfg is not None and "+stage_" in cfg.instruction
    staged_free = read_in_place(*(operands or op.operands)) if staged else set()
    a, b = shape_of(op.operands[0].type), shape_of(op.operands[1].type)
    out = shape_of(op.results[0].type)
    M, K, N, batch = a[-2], a[-1], b[-1], numel(out[:-2])
    dtype = to_torch_dtype(elem_of(op.operands[0].type))
    flops = 2 * M * N * K * batch
    nbytes, launches = io_bytes(ins, outs), 1
    if cfg is not None and cfg.split_k > 1:
        nbytes += 2 * cfg.split_k * M * N * batch * 4
        launches += 1
    if cfg is not None and cfg.tail_at:  # rule 8f: the tail's launch, and its split's partials and reduction
        _, (tail, (r0, r1), (c0, c1)) = cf.tail_parts(cfg, M, N, K)
        launches += 1 + (tail.split_k > 1)
        nbytes += 2 * tail.split_k * (r1 - r0) * (c1 - c0) * 4 if tail.split_k > 1 else 0
    if cfg is not None and "+stage_a" in cfg.instruction and "a" not in staged_free:
        nbytes += 2 * M * K * batch * 4
        launches += 1
    if cfg is not None and "+stage_b" in cfg.instruction and "b" not in staged_free:
        nbytes += 2 * K * N * batch * 4
        launches += 1
    return Cost("matmul", nbytes, flops, _contraction_path(dtype, precision), launches)


def _attention_flops(q_shape, k_shape, causal: bool, matmuls: int) -> int:
    B, H, Tq, D = q_shape
    Tk = k_shape[2]
    pairs = Tq * Tk // 2 if causal else Tq * Tk  # causal: the key blocks above the diagonal are skipped
    return matmuls * 2 * B * H * pairs * D


@rule(nv.AttentionOp)
def attention_cost(op, ins, outs, cfg, precision) -> Cost:
    """FlashAttention forward: two matmuls per (query, key) pair, S = q k^T and
    O = P v, so 4 B H Tq Tk D FLOPs (halved when causal); bytes q, k, v (and the
    bias) read, O and the row log-sum-exp written, the score tile never leaving
    the SM."""
    q, k = shape_of(op.operands[0].type), shape_of(op.operands[1].type)
    dtype = to_torch_dtype(elem_of(op.operands[0].type))
    flops = _attention_flops(q, k, op.props()["causal"], 2)
    return Cost("attention", io_bytes(ins, outs), flops, _contraction_path(dtype, precision))


@rule(nv.AttentionBackwardOp)
def attention_backward_cost(op, ins, outs, cfg, precision) -> Cost:
    """FlashAttention-2 backward: delta = rowsum(dO O) (one launch), a dK/dV kernel
    (recomputes S and P, then dV += P^T dO, dP = dO v^T, dK += dS^T q: 4 matmuls)
    and a dQ kernel (S, dP, dQ += dS k: 3 matmuls): 14 B H Tq Tk D FLOPs (halved
    when causal), 3 launches; bytes every operand and result once plus delta
    (f32 [B, H, Tq]) written once and read by both walks. With ``sums`` (the
    gradients' column sums) a fourth launch, and the partials (a row of H D per
    program and gradient, in the statistics type) written and read once."""
    q, k = shape_of(op.operands[1].type), shape_of(op.operands[2].type)
    dtype = to_torch_dtype(elem_of(op.operands[1].type))
    flops = _attention_flops(q, k, op.props()["causal"], 7)
    delta = 3 * q[0] * q[1] * q[2] * 4
    if not op.props()["sums"]:
        return Cost("attention", io_bytes(ins, outs) + delta, flops, _contraction_path(dtype, precision), 3)
    stat = 8 if dtype == torch.float64 else 4
    bm = cfg.block_m if cfg is not None and cfg.block_m else 64
    partials = 2 * 3 * q[0] * math.ceil(q[2] / bm) * q[1] * q[3] * stat
    return Cost("attention", io_bytes(ins, outs) + delta + partials, flops, _contraction_path(dtype, precision), 4)


def _lm_head_shapes(op, backward: bool):
    g = 1 if backward else 0
    (N, D), (V, _) = shape_of(op.operands[g].type), shape_of(op.operands[g + 1].type)
    e = _itemsize(op.operands[g])
    bias = op.operands[g + 3] if len(op.operands) == g + 4 else None
    chunk = min(op.props()["chunk"], max(N, 1))
    return N, D, V, e, bias, chunk, math.ceil(N / chunk)


def _weight_rounding(V: int, D: int, e: int, precision: str, copies: int) -> tuple[int, int]:
    """(bytes, launches) of an f32 head's weight rounded to tf32 under the tf32 policy,
    once a launch (``linear_ce.HOIST_WEIGHT_TF32``): w read and a rounded copy written,
    ``copies`` times (w for the logits; with the gradients also a dense w^T for dh)."""
    if e != 4 or precision != "tf32":
        return 0, 0
    return copies * 2 * V * D * 4, copies


@rule(nv.LinearCrossEntropyOp)
def lm_head_cost(op, ins, outs, cfg, precision) -> Cost:
    """The fused LM head's forward, chunk by chunk: the logits matmul h[chunk] @ w^T
    (2 N V D FLOPs in all; w read once per chunk, each chunk's logits written once
    to the [chunk, V] buffer and read once by the row kernel), the row kernel's
    online log-sum-exp (5 FLOPs a logit, the row loss written in f32) and the final
    in-order sum: 2 launches per chunk + 1 (+ the weight's rounding under tf32,
    ``_weight_rounding``)."""
    N, D, V, e, bias, chunk, n_c = _lm_head_shapes(op, False)
    rounding, copies = _weight_rounding(V, D, e, precision, 1)
    nbytes = (N * D * e + n_c * V * D * e  # h once, w once per chunk
              + 2 * N * V * e  # the logits: written by the matmul, read by the row kernel
              + (n_c * V * _itemsize(bias) if bias is not None else 0)
              + 2 * N * 8 + 2 * N * 4 + sum(_size(r) for r in outs)  # targets and row losses, twice each
              + rounding)
    flops = 2 * N * V * D + _ROW_FLOPS["cross_entropy"] * N * V
    dtype = to_torch_dtype(elem_of(op.operands[0].type))
    return Cost("lm_head", nbytes, flops, _contraction_path(dtype, precision), 2 * n_c + 1 + copies)


@rule(nv.LinearCrossEntropyBackwardOp)
def lm_head_backward_cost(op, ins, outs, cfg, precision) -> Cost:
    """The fused LM head's backward, chunk by chunk: the logits again (h[chunk] @
    w^T), the row kernel writing the logits' gradient d over them in place, dh =
    d @ w and dw += d^T h[chunk] (f32; after the first chunk the old value read and
    written again by the matmul's epilogue), the bias gradient's column sum when
    there is a bias: 6 N V D FLOPs; d is written and read five times (matmul out,
    row kernel in/out, both gradient matmuls in), w twice per chunk, h twice;
    launches: the scale, 4 per chunk (5 with a bias), the rounding copy of a 16-bit dw
    (and the weight's two tf32 roundings under tf32, ``_weight_rounding``)."""
    N, D, V, e, bias, chunk, n_c = _lm_head_shapes(op, True)
    has_bias = bias is not None
    rounding, copies = _weight_rounding(V, D, e, precision, 2)
    z_passes = 5 + (1 if has_bias else 0)
    nbytes = (2 * N * D * e + 2 * n_c * V * D * e  # h and w: logits and gradient matmuls
              + z_passes * N * V * e  # the logits chunk buffer
              + N * D * e  # dh
              + V * D * 4 + max(0, n_c - 1) * 2 * V * D * 4  # dw: written, then read and written per chunk
              + (V * D * (4 + e) if e != 4 else 0)  # the rounding copy of a 16-bit dw
              + (2 * n_c * V * 4 if has_bias else 0)  # the bias gradient's f32 accumulator
              + 2 * N * 8 + 16  # targets (scale kernel and row kernel), the scale
              + rounding)
    flops = 6 * N * V * D + _ROW_BACKWARD_FLOPS["cross_entropy"] * N * V
    launches = 1 + n_c * (4 + has_bias) + (e != 4) + (has_bias and e != 4) + copies
    dtype = to_torch_dtype(elem_of(op.operands[1].type))
    return Cost("lm_head", nbytes, flops, _contraction_path(dtype, precision), int(launches))


@rule(nv.LinearCrossEntropyWithGradOp)
def lm_head_with_grad_cost(op, ins, outs, cfg, precision) -> Cost:
    """The fused LM head's loss and gradients in one pass (the loss_grad stage's
    merge): the backward's launches with the forward's row losses written by the
    same row kernel (one log-sum-exp pass over the logits, not two) and its final
    sum; no second logits matmul: 6 N V D FLOPs, the logits chunk buffer written
    and read five times (six with a bias), w read twice per chunk."""
    N, D, V, e, bias, chunk, n_c = _lm_head_shapes(op, True)
    backward = lm_head_backward_cost(op, ins, outs[1:], cfg, precision)
    nbytes = backward.bytes + 2 * N * 4 + N * 8 + _size(outs[0])  # row losses (written, summed), the count's targets, the loss
    flops = backward.flops + 2 * N  # the loss's two extra terms per row
    return Cost("lm_head", nbytes, flops, backward.path, backward.launches + 1)


def _row_kind(op) -> str:
    from nova.transforms.configure import ROWWISE  # the configure stage's own table of row kinds

    return ROWWISE[type(op)]


_BACKWARDS = (nv.SoftmaxBackwardOp, nv.LogSoftmaxBackwardOp, nv.LayerNormBackwardOp, nv.CrossEntropyBackwardOp)


@rule(nv.ReduceSumOp, nv.ReduceMaxOp, nv.CumsumOp, nv.SoftmaxOp, nv.LogSoftmaxOp, nv.SoftmaxBackwardOp,
      nv.LogSoftmaxBackwardOp, nv.LayerNormOp, nv.LayerNormBackwardOp, nv.CrossEntropyOp, nv.CrossEntropyBackwardOp)
def reduction_cost(op, ins, outs, cfg, precision) -> Cost:
    """Reductions, scans and the row-wise ops: bytes, operands read once and results
    written once (a looped row read again stays in L2 for the row lengths of a
    step); FLOPs per input element by the row kind (``_ROW_FLOPS``); a split
    reduction writes and reads its f32 partials and launches its second pass; layer
    norm's backward launches its column sums, cross-entropy (mean / sum) its scale
    or final sum."""
    kind = _row_kind(op)
    table = _ROW_BACKWARD_FLOPS if isinstance(op, _BACKWARDS) else _ROW_FLOPS
    x = op.operands[1] if isinstance(op, (nv.LayerNormBackwardOp, nv.CrossEntropyBackwardOp)) else op.operands[0]
    flops = numel(shape_of(x.type)) * table.get(kind, 1)
    nbytes, launches = io_bytes(ins, outs), 1
    if cfg is not None and cfg.split_k > 1 and isinstance(op, (nv.ReduceSumOp, nv.ReduceMaxOp)):
        nbytes += 2 * cfg.split_k * sum(numel(shape_of(r.type)) for r in outs) * 4
        launches += 1
    if isinstance(op, nv.LayerNormBackwardOp):
        launches += 1
    if isinstance(op, (nv.CrossEntropyOp, nv.CrossEntropyBackwardOp)) and op.props().get("reduction") != "none":
        launches += 1
    return Cost("reduction", nbytes, flops, _float_path(ins), launches)


@rule(*[c for c in nv.NOVA_OPS if c.CATEGORY == "elementwise"])
def elementwise_cost(op, ins, outs, cfg, precision) -> Cost:
    """One pointwise kernel: operands read once, its result written once; FLOPs
    ``elementwise_flops``."""
    return Cost("elementwise", io_bytes(ins, outs), elementwise_flops(op), _float_path([*ins, *outs]))


@rule(nv.FusedOp)
def fused_cost(op, ins, outs, cfg, precision) -> Cost:
    """A nova.fused group is one kernel: its operands read once and its results
    written once (the intermediates stay in registers), FLOPs the sum of its body's
    ops (scalars it recomputes count once per program, i.e. not at all here). A
    contraction group is its matmul (``matmul_cost``: FLOPs, path, split-K partials
    and staging) with the group's operands and results for bytes and its epilogue's
    FLOPs added: kind "matmul"; a column sum in its epilogue (``nv.column_sum``) adds
    one FLOP per element summed, its partials [P, N] written and read once (the
    value it sums is no result, so it counts no bytes) and its final pass's launch
    (``column_sum_cost``). A reduction group likewise is its reduction
    (``reduction_cost``: FLOPs, split partials, launches) with the group's operands
    and results for bytes (the prologue's values and the epilogue's input stay in
    registers) and its prologue's and epilogue's FLOPs added, and for each column
    sum of an epilogue value (``FusedOp.epilogue_sums``) one FLOP per element summed
    (its partial rows stay in the kernel's final pass, like the head's own):
    kind "reduction"."""
    head = op.contraction()
    reduction = op.reduction()
    body = [o for o in op.inner_ops() if o is not head and o.CATEGORY == "elementwise"]
    flops = sum(elementwise_flops(o) for o in body if numel(shape_of(o.results[0].type)) > 1)
    if reduction is not None:
        alone = RULES[type(reduction)](reduction, tuple(reduction.operands), tuple(reduction.results), cfg, precision)
        extra = alone.bytes - io_bytes(reduction.operands, reduction.results)  # a split's partials
        flops += sum(numel(shape_of(o.operands[0].type)) for o in op.epilogue_sums())
        return Cost("reduction", io_bytes(ins, outs) + extra, alone.flops + flops, alone.path, alone.launches)
    if head is None:
        return Cost("fused", io_bytes(ins, outs), flops, _float_path([*ins, *outs]))
    args = list(op.body.block.args)
    outer = [op.operands[args.index(v)] for v in head.operands]
    alone = matmul_cost(head, tuple(head.operands), tuple(head.results), cfg, precision, operands=outer)
    extra = alone.bytes - io_bytes(head.operands, head.results)  # the partials and the staged copies
    sums = [column_sum_cost(head, o, cfg) for o in op.inner_ops() if nv.column_sum(o)]
    return Cost("matmul", io_bytes(ins, outs) + extra + sum(b for b, _ in sums), alone.flops + flops
                + sum(f for _, f in sums), alone.path, alone.launches + len(sums))  # fmt: skip


def column_sum_cost(head: Operation, op: Operation, cfg: LoweringConfig | None) -> tuple[int, int]:
    """(bytes, FLOPs) of a column sum in ``head``'s epilogue: its partials [P, N]
    (``matmul.column_sum_rows``: one row per output tile, or per split-K reduction
    tile; without a config the most of both) in fp32 / fp64, written by the tiles
    and read by the final pass; one add per element summed."""
    from nova.codegen.triton.matmul import column_sum_rows, split_k_plan, sum_accumulator

    out = shape_of(head.results[0].type)
    M, N, K, batch = out[-2], out[-1], shape_of(head.operands[0].type)[-1], numel(out[:-2])
    splits = split_k_plan(K, cfg)[1] if cfg is not None else None
    acc = sum_accumulator(to_torch_dtype(elem_of(op.results[0].type))).itemsize
    return 2 * column_sum_rows(M, batch, cfg, splits) * N * acc, numel(shape_of(op.operands[0].type))


@rule(nv.EmbeddingOp)
def embedding_cost(op, ins, outs, cfg, precision) -> Cost:
    """A gather: the ids, the rows they hit (n rows of D, not the whole table) and
    the result."""
    rows = _size(op.results[0])
    return Cost("gather", read_bytes(op.operands[1]) + 2 * rows, 0, "fp32")


@rule(nv.EmbeddingBackwardOp)
def embedding_backward_cost(op, ins, outs, cfg, precision) -> Cost:
    """The deterministic scatter-add: zero the [V, D] gradient, sort the ids (torch's
    stable sort: counted as one read and write of ids and permutation), sum each
    row's grads in token order: grad read once, the rows written once; 3 launches
    (memset, sort, segment sum; the sort may launch more)."""
    g, ids = op.operands[0], op.operands[1]
    n = numel(shape_of(ids.type))
    nbytes = _size(op.results[0]) + read_bytes(g) + read_bytes(ids) + 4 * n * 8 + _size(g)
    return Cost("gather", nbytes, numel(shape_of(g.type)), _float_path([g]), 3)


@rule(*nv.CHECK_OPS)
def check_cost(op, ins, outs, cfg, precision) -> Cost:
    """The guard's counts: the checked tensor read once, one count written; a second
    launch sums the per-program counts when there is more than one program."""
    n = numel(shape_of(op.operands[0].type))
    launches = 2 if cfg is not None and cfg.block and math.ceil(n / cfg.block) > 1 else 1
    return Cost("check", io_bytes(ins, outs), n, _float_path(ins), launches)


@rule(*VIEW_OPS, nv.PadOp, nv.CatOp)
def copy_cost(op, ins, outs, cfg, precision) -> Cost:
    """A pad, a cat, or a layout op whose strides allow no view: one copy kernel
    (each operand read once, the result written once)."""
    return Cost("copy", io_bytes(ins, outs), 0, "fp32")


# --------------------------------------------------------------------------- the step's kernels


def config_of(op: Operation) -> LoweringConfig | None:
    attr = op.attributes.get("nova.lowering_config")
    if attr is None:
        return None
    return LoweringConfig.from_dict({k: nv.prop_value(v) for k, v in attr.config.data.items()})


def schedule_summary(cfg: LoweringConfig | None) -> str:
    """A lowering config in one short phrase: the fields that apply to its kind."""
    if cfg is None:
        return "-"
    if cfg.kind in ("matmul", "attention"):
        s = f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k}"
        if cfg.kind == "matmul":
            s += f" g{cfg.group_m}" + (f" split{cfg.split_k}" if cfg.split_k > 1 else "")
        s += f" w{cfg.num_warps} s{cfg.num_stages} {cfg.instruction}"
        if cfg.tail_at:  # rule 8f: the tail's launch after C's first tail_at rows (columns)
            bm, bn, _, _ = cf.TAIL_TILE
            s += (f" | tail {'rows' if cfg.tail_axis == 'm' else 'cols'} {cfg.tail_at}+ {bm}x{bn}"
                  + (f" split{cfg.tail_split}" if cfg.tail_split > 1 else ""))
        return s
    s = f"block {cfg.block}" + (f"x{cfg.block_m}" if cfg.block_m > 1 else "")
    s += f" split{cfg.split_k}" if cfg.split_k > 1 else ""
    return s + f" w{cfg.num_warps}"


def _launch_summary(op: Operation, device: DeviceSpec) -> str:
    """``schedule_summary`` of the op's config, with "stream-K" where the launcher runs its
    split as stream-K on ``device`` (a plain matmul: ``matmul.runs_stream_k``)."""
    cfg = config_of(op)
    s = schedule_summary(cfg)
    if cfg is not None and cfg.kind == "matmul" and cfg.split_k > 1 and isinstance(op, nv.MatmulOp):
        from nova.codegen.triton.matmul import runs_stream_k

        a, b = shape_of(op.operands[0].type), shape_of(op.operands[1].type)
        f32 = to_torch_dtype(elem_of(op.operands[0].type)) == torch.float32
        if runs_stream_k(a[-2], b[-1], a[-1], numel(shape_of(op.results[0].type)[:-2]), cfg, device.sm_count, f32):
            s = s.replace(f" split{cfg.split_k}", f" split{cfg.split_k} stream-K", 1)
    return s


def cost_of(op: Operation, ins, outs, precision: str) -> Cost:
    r = RULES.get(type(op))
    if r is None:
        raise NoCostRule(f"the cost model has no rule for {op.name} (nova.schedule.cost.RULES)")
    return r(op, tuple(ins), tuple(outs), config_of(op), precision)


def kernel_steps(fn, placements: dict | None = None) -> list:
    """The steps of the launch order that launch kernels: not views (``placements``,
    the memory plan's, says which layout ops the strides allow as views: without
    it every layout op is taken for one), not the 0-d constants computed when
    the step is bound, and not a cat the plan assembled from windows."""
    steps = launch_order(fn)
    out = []
    for st in steps:
        kinds = [placements[r].kind for r in st.outputs if r in placements] if placements else []
        if isinstance(st.op, VIEW_OPS) and (not placements or kinds == ["view"]):
            continue
        if kinds and all(k == "const" for k in kinds):
            continue
        if placements and any(placements[r].assembled for r in st.outputs if r in placements):
            continue  # a cat of the windows its pieces' kernels wrote: launches nothing
        out.append(st)
    return out


def kernel_costs(fn, device: DeviceSpec, precision: str, placements: dict | None = None) -> list[KernelCost]:
    """Every kernel of ``fn`` (a configured ``@train_step``) with its roofline numbers
    on ``device``, in launch order."""
    out = []
    for i, st in enumerate(kernel_steps(fn, placements)):
        c = cost_of(st.op, st.inputs, st.outputs, precision)
        loc = st.op.attributes.get("nova.loc")
        n_ops = len(st.op.inner_ops()) if isinstance(st.op, nv.FusedOp) else 1
        out.append(KernelCost(
            index=i, op=st.op.name, kind=c.kind, shape=str(st.outputs[0].type) if st.outputs else "", ops=n_ops,
            loc=loc.data if loc is not None else None, config=_launch_summary(st.op, device),
            bytes=c.bytes, flops=c.flops, path=c.path, launches=c.launches,
            memory_s=c.bytes / device.mem_bandwidth, compute_s=c.flops / device.flops(c.path),
            launch_s=c.launches * cf.LAUNCH_SECONDS,
        ))  # fmt: skip
    return out


__all__ = ["Cost", "KernelCost", "NoCostRule", "RULES", "column_sum_cost", "cost_of", "kernel_costs", "kernel_steps", "read_bytes",
           "io_bytes", "elementwise_flops", "schedule_summary", "config_of"]  # fmt: skip
