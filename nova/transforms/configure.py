"""The configure stage: the Analytic Configurator writes ``#nova.lowering_config``
on every op that becomes a kernel.

The schedule is a pure function of the op's shapes, dtypes and layouts and of
the target's device description (``nova.schedule.devices``); nothing is timed
or searched (``docs/configurator.md`` gives the model). Layout ops (transpose,
broadcast, slice, reshape) become strided views in the Triton backend and get
no config.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from xdsl.context import Context
from xdsl.dialects.builtin import DictionaryAttr, ModuleOp
from xdsl.passes import ModulePass

from nova.ir import dialect as nv
from nova.ir.module import step_func
from nova.ir.types import elem_of, numel, shape_of, to_torch_dtype
from nova.schedule import configurator as cf
from nova.schedule.config import LoweringConfig
from nova.schedule.devices import DeviceSpec

LAYOUT_OPS = (nv.TransposeOp, nv.BroadcastToOp, nv.SliceOp, nv.ReshapeOp)
# the configurator's reduction kind for each row-wise op (backward passes read
# and reduce the same rows as their forward)
ROWWISE = {
    nv.SoftmaxOp: "softmax", nv.LogSoftmaxOp: "log_softmax", nv.SoftmaxBackwardOp: "softmax",
    nv.LogSoftmaxBackwardOp: "log_softmax", nv.LayerNormOp: "layernorm",
    nv.LayerNormBackwardOp: "layernorm", nv.CrossEntropyOp: "cross_entropy",
    nv.CrossEntropyBackwardOp: "cross_entropy", nv.ReduceSumOp: "sum", nv.ReduceMaxOp: "max",
    # a scan reads each row once and writes it once, like a sum (it is never split:
    # the lowering ignores split_k)
    nv.CumsumOp: "sum",
}  # fmt: skip
# ops scheduled by the elementwise model (one stream in, one out per element):
# arithmetic, compares, activations, casts, generators, pad, cat (an input per
# piece, each element read from one of them), and the embedding
# gather / scatter (``block`` is their row-segment width), and the guard's counts
# (one stream in, one number out: ``block`` is elements per program; scheduled by
# their input's dtype, since their one i64 result is no stream)
ELEMENTWISE = (
    nv.AddOp, nv.SubOp, nv.MulOp, nv.DivOp, nv.MaximumOp, nv.PowOp,
    nv.EqOp, nv.NeOp, nv.LtOp, nv.LeOp, nv.GtOp, nv.GeOp, nv.WhereOp,
    nv.NegOp, nv.ExpOp, nv.LogOp, nv.SqrtOp, nv.RsqrtOp, nv.TanhOp, nv.SigmoidOp, nv.ReluOp,
    nv.CosOp, nv.SinOp, nv.AbsOp, nv.Log1pOp, nv.Expm1Op, nv.GeluOp, nv.GeluBackwardOp, nv.RoundTf32Op,
    nv.CastOp, nv.FullOp, nv.ArangeOp, nv.DropoutMaskOp, nv.PadOp, nv.CatOp, nv.EmbeddingOp, nv.EmbeddingBackwardOp,
    *nv.CHECK_OPS,
)  # fmt: skip
# the integer and mask dtypes, for models that need only the element size: the
# float of the same (or the nearest supported) width
_SIZE_ALIKE = {torch.int64: torch.float64, torch.bool: torch.float16}


class NoScheduleError(NotImplementedError):
    """An op the configure stage has no schedule rule for (the message names it)."""


def operand_layout(v) -> str:
    """How the kernel will read ``v``: "row" (last dim contiguous), "col" (the
    second-to-last is) or "strided", as ``nova.codegen.triton.matmul.layout`` says of
    the tensor the backend hands it. The backend binds every op result and step
    argument as a contiguous arena view and turns each layout op into the strided
    view ``nova.backends.triton._view`` makes (a reshape the strides cannot view is
    copied, i.e. contiguous again); so the chain of layout ops above ``v`` is replayed
    here on a contiguous meta tensor of its source's shape. A transpose of a transpose
    of the last two dims is therefore "row" (the input gradient's ``W``), not "col"."""
    chain = []
    while isinstance(v.owner, LAYOUT_OPS):
        chain.append(v.owner)
        v = v.owner.operands[0]
    t = torch.empty(shape_of(v.type), device="meta")
    for op in reversed(chain):
        p, out = op.props(), shape_of(op.results[0].type)
        if isinstance(op, nv.TransposeOp):
            t = t.permute(p["perm"])
        elif isinstance(op, nv.BroadcastToOp):
            t = t.expand(out)
        elif isinstance(op, nv.SliceOp):
            idx = [slice(None)] * t.dim()
            idx[p["dim"]] = slice(p["start"], p["end"], p["step"])
            t = t[tuple(idx)]
        else:
            try:
                t = t.view(out)
            except RuntimeError:  # the backend copies it first
                t = t.contiguous().view(out)
    if t.dim() < 2 or t.stride(-1) == 1:
        return "row"
    return "col" if t.stride(-2) == 1 else "strided"


def configure_fused(op: nv.FusedOp, device: DeviceSpec) -> LoweringConfig:
    """A fused elementwise group: the elementwise model over its iteration shape,
    its streams every input of more than one element and every output (0-d inputs
    are one load per thread, no stream), sized by the widest of them (the registers
    a loaded value takes). A multi-tensor kernel (the fuse stage's ``batch_small``:
    parts, ``fused.segments_of``) is counted by its largest part's streams: each of
    its programs loads one part's values (the model's register budget is a thread's)."""
    from nova.codegen.triton.fused import segments_of  # the parts the kernel branches on

    if op.props()["kind"] != "elementwise":
        raise NoScheduleError(f"the configure stage has no schedule rule for {op.name} of kind {op.props()['kind']!r}")
    streamed = [numel(shape_of(v.type)) > 1 for v in op.operands]
    streams = [v for v, s in zip(op.operands, streamed) if s] + list(op.results)
    dts = [_SIZE_ALIKE.get(d, d) for d in (to_torch_dtype(elem_of(v.type)) for v in streams)]
    dt = max(dts, key=lambda d: d.itemsize)
    parts = segments_of(op)
    count = max(sum(streamed[j] for j in ins) + len(outs) for ins, _, outs in parts) if parts else len(streams)
    # configure_elementwise counts the inputs besides its one output
    return cf.configure_elementwise(numel(op.iteration_shape()), dt, max(1, count - 1), device)


def matmul_arguments(op: nv.MatmulOp, lhs, rhs, precision: str, epilogue: bool = False,
                     epilogue_sums: bool = False) -> dict:
    """``configure_matmul``'s keyword arguments for a matmul, the device aside (also what
    ``bench/step_matmuls.py`` records); ``lhs`` / ``rhs`` are the values it reads (in a group:
    the group's operands, whose producers say the layout). A matmul with an
    epilogue (``epilogue``) gets the schedule it has without one but for the grid:
    BLOCK_K and the split are what fix its summation order (each output element is
    the same wgmma K-steps in the same order whatever the tile's M and N, measured
    bit-identical: bench/results/runs/epilogue_variants_d5443cd.json), so the fused
    kernel adds the same products in the same order as the unfused one; it keeps the
    one-program-per-tile grid (``PERSISTENT_EPILOGUES``), and its operand tiles are
    read once per output tile, as the separate kernel read them. ``epilogue_sums``: the
    epilogue adds up column sums (not on the warp-specialized kernel, rule 8b). An
    operand its producer stores rounded to tf32 (the tf32_operands stage) is passed as
    ``prerounded``, as the Triton backend launches it: K-major, it is read in place,
    which the configurator counts as staged (rule 8d's persistent loop, the staged
    ladder), so the schedule describes the kernel that runs."""
    a, b = shape_of(op.operands[0].type), shape_of(op.operands[1].type)
    out = shape_of(op.results[0].type)
    in_dt = to_torch_dtype(elem_of(op.operands[0].type))
    dt = to_torch_dtype(elem_of(op.results[0].type))
    path = "bf16" if in_dt.itemsize == 2 else cf.STEP_MATMUL_PRECISION[precision]
    return dict(M=a[-2], N=b[-1], K=a[-1], batch=numel(out[:-2]), dtype_a=in_dt, dtype_b=in_dt, out_dtype=dt,
                precision=path, a_layout=operand_layout(lhs), b_layout=operand_layout(rhs), has_bias=False,
                epilogue=epilogue, epilogue_sums=epilogue_sums, prerounded=nv.prerounded_operands(lhs, rhs, path))


def group_matmul_arguments(op: nv.FusedOp, precision: str) -> dict | None:
    """``matmul_arguments`` of a fused group's matmul with its epilogue (``epilogue_sums``:
    the epilogue sums columns, which keeps it off the warp-specialized kernel, rule 8b);
    None for a group without one."""
    head = op.contraction()
    if not isinstance(head, nv.MatmulOp):
        return None
    args = list(op.body.block.args)
    lhs, rhs = (op.operands[args.index(v)] for v in head.operands)
    sums = any(nv.column_sum(o) for o in op.inner_ops())
    return matmul_arguments(head, lhs, rhs, precision, epilogue=True, epilogue_sums=sums)


def configure_op(op: nv.NovaOp, device: DeviceSpec, precision: str) -> LoweringConfig | None:
    if isinstance(op, LAYOUT_OPS) or op.CATEGORY == "collective":  # no kernel: torch.distributed runs it
        return None
    group = group_matmul_arguments(op, precision) if isinstance(op, nv.FusedOp) else None
    if group is not None:  # a matmul with its epilogue: the matmul's schedule
        return cf.configure_matmul(**group, device=device)
    reduction = op.reduction() if isinstance(op, nv.FusedOp) else None
    if reduction is not None:
        # a reduction with its prologue / epilogue: the reduction's own schedule, which fixes
        # its summation order (the fused kernel sums the same values in the same order as
        # the unfused one: bit-identical results)
        return configure_op(reduction, device, precision)
    if isinstance(op, nv.FusedOp):
        return configure_fused(op, device)
    dt = to_torch_dtype(elem_of(op.results[0].type)) if op.results else None
    if isinstance(op, nv.MatmulOp):
        return cf.configure_matmul(**matmul_arguments(op, op.operands[0], op.operands[1], precision), device=device)
    if isinstance(op, (nv.LinearCrossEntropyOp, nv.LinearCrossEntropyBackwardOp, nv.LinearCrossEntropyWithGradOp)):
        # the fused LM head's dominant kernel: one chunk's logits h[chunk] @ w^T (w [V, D] read transposed);
        # the lowering's row kernels and its two gradient matmuls are sized at launch
        g_in = 0 if isinstance(op, nv.LinearCrossEntropyOp) else 1
        (n, d), (v, _) = shape_of(op.operands[g_in].type), shape_of(op.operands[g_in + 1].type)
        in_dt = to_torch_dtype(elem_of(op.operands[g_in].type))
        path = "bf16" if in_dt.itemsize == 2 else cf.STEP_MATMUL_PRECISION[precision]
        rows = min(op.props()["chunk"], max(n, 1))
        # (tail=False: the lowering launches its chunks with prologues and epilogues, one launch each)
        return cf.configure_matmul(rows, v, d, 1, in_dt, in_dt, in_dt, path, "row", "col", False, device, tail=False)
    if isinstance(op, (nv.AttentionOp, nv.AttentionBackwardOp)):
        q = shape_of(op.operands[0 if isinstance(op, nv.AttentionOp) else 1].type)
        in_dt = to_torch_dtype(elem_of(op.operands[0].type))
        # f32 under the tf32 policy: the kernels' dots run on tf32 tensor cores (attention.py)
        path = cf.STEP_MATMUL_PRECISION[precision] if in_dt == torch.float32 else None
        return cf.configure_attention(q[0], q[1], q[2], q[3], op.props()["causal"], in_dt, device, path)
    if type(op) in ROWWISE:
        x = shape_of(op.operands[1 if isinstance(op, (nv.LayerNormBackwardOp, nv.CrossEntropyBackwardOp)) else 0].type)
        if isinstance(op, (nv.ReduceSumOp, nv.ReduceMaxOp)):
            dims = op.props()["dims"]
            cols = numel([x[d] for d in dims])
            moving = [d for d in range(len(x)) if x[d] > 1]
            if moving and moving[-1] not in dims and cols > 1:
                # the kept axis is the contiguous one (a bias gradient summed over tokens)
                in_dt = to_torch_dtype(elem_of(op.operands[0].type))
                kept = numel(x) // cols
                return cf.configure_column_reduction(kept, cols, _SIZE_ALIKE.get(in_dt, in_dt), device, ROWWISE[type(op)])
        elif "dim" in op.PROPS:
            cols = x[op.props()["dim"]] if x else 1  # a 0-d cumsum: one element
        else:
            cols = x[-1]
        rows = max(1, numel(x) // max(cols, 1))
        in_dt = to_torch_dtype(elem_of(op.operands[0].type))
        return cf.configure_reduction(rows, max(cols, 1), _SIZE_ALIKE.get(in_dt, in_dt), device, ROWWISE[type(op)])
    if not isinstance(op, ELEMENTWISE):
        raise NoScheduleError(f"the configure stage has no schedule rule for {op.name}")
    shape = shape_of(op.results[0].type)
    if isinstance(op, nv.CHECK_OPS):  # the stream is the checked input
        dt = to_torch_dtype(elem_of(op.operands[0].type))
        shape = shape_of(op.operands[0].type)
    # the elementwise model needs only the element size: integers and masks are
    # scheduled as the float of the same (or the nearest supported) width
    dt = _SIZE_ALIKE.get(dt, dt)
    # generators (full, arange) read no tensor but still write one: count the output as the stream
    return cf.configure_elementwise(numel(shape), dt, max(1, len(op.operands)), device)


def config_attr(cfg: LoweringConfig) -> nv.LoweringConfigAttr:
    return nv.LoweringConfigAttr(DictionaryAttr({k: nv.make_prop(v) for k, v in cfg.to_dict().items()}))


@dataclass(frozen=True)
class Configure(ModulePass):
    name = "nova-configure"
    device: DeviceSpec | None = None
    precision: str = "fp32"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        if self.device is None:
            return  # the reference executor needs no schedules
        for o in step_func(op).body.block.ops:
            if isinstance(o, nv.NovaOp):
                cfg = configure_op(o, self.device, self.precision)
                if cfg is not None:
                    o.attributes["nova.lowering_config"] = config_attr(cfg)
