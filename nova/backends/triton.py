"""The Triton backend: @train_step as a list of generated Triton kernels.

At compile time every op becomes one step of a launch plan:
  * layout ops (transpose, broadcast_to, slice, and reshape where the data
    allows) become zero-copy strided views: no kernel, no bytes moved;
  * a matmul becomes one template launch (``nova.codegen.triton.matmul``); a
    ``nova.fused "contraction"`` group (the fuse stage's output fusion: a matmul
    and its epilogue) one launch of the same template with the group's epilogue
    (``fused.epilogue_of``) applied to the accumulator;
  * every other op is lowered through the registry in
    ``nova.codegen.triton.lowering`` with the ``#nova.lowering_config`` the
    configure stage wrote on it.
At step time ``nova.runtime.executable.Executable`` binds these steps into the
memory plan's arena and launches them (or replays them as one CUDA graph).
``sources()`` returns every kernel's generated Triton source for dumping.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from xdsl.dialects import func
from xdsl.ir import Operation, SSAValue

from nova.codegen.triton import attention, checks, elementwise, embedding, fused, linear_ce, reduce, rowwise, scan  # noqa: F401  (register lowerings)
from nova.codegen.triton import lowering as lw
from nova.codegen.triton import matmul as mm
from nova.ir import dialect as nv
from nova.ir.types import elem_of, shape_of, to_torch_dtype
from nova.log import get_logger, once
from nova.schedule.config import LoweringConfig
from nova.schedule.configurator import STEP_MATMUL_PRECISION

_LOG = get_logger(__name__)

VIEW_OPS = nv.VIEW_OPS


_CONFIGS: dict = {}  # #nova.lowering_config attribute -> its LoweringConfig (frozen; many ops share one)


def config_of(op: Operation) -> LoweringConfig | None:
    attr = op.attributes.get("nova.lowering_config")
    if attr is None:
        return None
    cfg = _CONFIGS.get(attr)  # keyed by the attribute's value (xDSL attributes are immutable, compared by value)
    if cfg is None:
        if len(_CONFIGS) > 4096:
            _CONFIGS.clear()
        cfg = _CONFIGS[attr] = LoweringConfig.from_dict({k: nv.prop_value(v) for k, v in attr.config.data.items()})
    return cfg


@dataclass
class Step:
    op: Operation
    inputs: tuple[SSAValue, ...]
    outputs: tuple[SSAValue, ...]
    run: Callable[[list[torch.Tensor]], list[torch.Tensor]]
    kernel: lw.Kernel | None = None  # None for views and matmuls
    sources: dict[str, str] | None = None  # a matmul's: the kernels its launches used
    is_view: bool = False  # a layout op: a strided view (a copy where strides do not allow one)
    scratch: int = 0  # the most bytes its launch allocates besides its results (Kernel.scratch_bytes)


def _view(op: Operation, copy: Callable[[torch.Tensor], torch.Tensor]):
    p = op.props()
    out_shape = shape_of(op.results[0].type)
    if isinstance(op, nv.TransposeOp):
        return lambda xs: [xs[0].permute(p["perm"])]
    if isinstance(op, nv.BroadcastToOp):
        return lambda xs: [xs[0].expand(out_shape)]
    if isinstance(op, nv.SliceOp):

        def slice_(xs):
            idx = [slice(None)] * xs[0].dim()
            idx[p["dim"]] = slice(p["start"], p["end"], p["step"])
            return [xs[0][tuple(idx)]]

        return slice_

    def reshape(xs):
        try:
            return [xs[0].view(out_shape)]
        except RuntimeError:  # strides do not allow a view: materialize with a copy kernel
            return [copy(xs[0]).view(out_shape)]

    return reshape


def _matmul_run(op: Operation, precision: str, copy: Callable[[torch.Tensor], torch.Tensor], used: dict[str, str],
                group: nv.FusedOp | None = None):
    """The launch of ``op`` (a nova.matmul), or of ``group``'s epilogue around it
    (``op`` its contraction; the launch then takes the group's operands and
    writes its results)."""
    cfg = config_of(group if group is not None else op)
    out_shape = shape_of(op.results[0].type)
    out_dtype = to_torch_dtype(elem_of(op.results[0].type))
    batch = out_shape[:-2]
    # f32 operands follow the step's policy; 16-bit operands are used as they are
    prec = STEP_MATMUL_PRECISION[precision]
    # operands their producer stored rounded to tf32 (the tf32_operands stage): not rounded again
    outer = [group.operands[group.body.block.args.index(v)] for v in op.operands] if group is not None else op.operands
    pre = nv.prerounded_operands(*outer, prec)

    def flat3(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 2:
            return t  # the launcher broadcasts a 2-D operand over the batch
        t = t.expand(*batch, *t.shape[-2:])
        try:
            return t.view(-1, *t.shape[-2:])
        except RuntimeError:  # batch dims that strides cannot merge: one copy kernel
            once(_LOG, f"batch-copy:{tuple(t.shape)}:{tuple(t.stride())}",
                 "%s: batch dims of shape %s and strides %s do not merge into one: copied first",
                 op.name, tuple(t.shape), tuple(t.stride()))
            return copy(t).view(-1, *t.shape[-2:])

    if group is not None:
        from nova.codegen.triton.fused import epilogue_of

        ep, picked = epilogue_of(group)
        args = group.body.block.args
        ia, ib = (args.index(v) for v in op.operands)  # which group operands the matmul reads

        def run_group(xs: list[torch.Tensor], outs: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
            a, b = xs[ia], xs[ib]
            if batch:
                a, b = flat3(a), flat3(b)
            return mm.matmul_epilogue(a, b, ep, [xs[k] for k in picked], out_dtype, cfg=cfg, precision=prec,
                                      outs=outs, record=used, prerounded=pre)  # fmt: skip

        return run_group

    def run(xs: list[torch.Tensor], outs: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        a, b = xs[0], xs[1]
        if batch:
            a, b = flat3(a), flat3(b)
        out = None
        if outs is not None:
            out = outs[0].view(-1, *out_shape[-2:]) if batch else outs[0]
        y = mm.matmul(a, b, cfg=cfg, precision=prec, out_dtype=out_dtype, record=used, out=out, prerounded=pre)
        return [y.view(out_shape)] if outs is None else outs

    return run


def planned_scratch(fn: func.FuncOp) -> dict[Operation, int]:
    """The arena scratch of every launch that takes one (``lowering.ARENA_SCRATCH``)."""
    out = {}
    for op in fn.body.block.ops:
        rule = lw.ARENA_SCRATCH.get(type(op))
        if rule is not None:
            out[op] = rule(op)
    return out


def _matmul_scratch(op: Operation, precision: str, cfg_op: Operation | None = None) -> int:
    """What the launch of ``op`` (a matmul; ``cfg_op`` its group) allocates besides
    its results: ``mm.scratch_bytes``, with the partials of the group's column sums."""
    a, b = shape_of(op.operands[0].type), shape_of(op.operands[1].type)
    out = shape_of(op.results[0].type)
    batch = 1
    for d in out[:-2]:
        batch *= d
    dtype = to_torch_dtype(elem_of(op.operands[0].type))
    sums = ()
    if isinstance(cfg_op, nv.FusedOp):
        sums = tuple(mm.sum_accumulator(to_torch_dtype(elem_of(o.results[0].type)))
                     for o in cfg_op.inner_ops() if nv.column_sum(o))  # fmt: skip
    return mm.scratch_bytes(out[-2], out[-1], a[-1], batch, dtype, to_torch_dtype(elem_of(op.operands[1].type)),
                            to_torch_dtype(elem_of(op.results[0].type)), config_of(cfg_op or op),
                            precision=STEP_MATMUL_PRECISION[precision], column_sums=sums,
                            epilogue=isinstance(cfg_op, nv.FusedOp))  # fmt: skip


class TritonProgram:
    def __init__(self, fn: func.FuncOp, precision: str):
        self.fn = fn
        self.precision = precision
        self.steps: list[Step] = []
        self._copy_kernels: dict[tuple, lw.Kernel] = {}
        for op in fn.body.block.ops:
            if isinstance(op, func.ReturnOp):
                continue
            if isinstance(op, VIEW_OPS):
                self.steps.append(Step(op, tuple(op.operands), tuple(op.results), _view(op, self.copy), is_view=True))
            elif isinstance(op, nv.COLLECTIVE_OPS):  # torch.distributed, wired below
                self.steps.append(Step(op, tuple(op.operands), tuple(op.results), None))
            elif isinstance(op, nv.MatmulOp):
                used: dict[str, str] = {}
                run = _matmul_run(op, precision, self.copy, used)
                self.steps.append(Step(op, tuple(op.operands), tuple(op.results), run, sources=used,
                                       scratch=_matmul_scratch(op, precision)))
            elif isinstance(op, nv.FusedOp) and op.contraction() is not None:
                head, used = op.contraction(), {}
                if not isinstance(head, nv.MatmulOp):
                    raise elementwise.UnsupportedError(f"{op.name}: no Triton epilogue for {head.name}")
                run = _matmul_run(head, precision, self.copy, used, group=op)
                self.steps.append(Step(op, tuple(op.operands), tuple(op.results), run, sources=used,
                                       scratch=_matmul_scratch(head, precision, op)))
            else:
                fn_lower = lw.lowering_for(op)
                takes_precision = (nv.AttentionOp, nv.AttentionBackwardOp, nv.LinearCrossEntropyOp, nv.LinearCrossEntropyBackwardOp,
                                   nv.LinearCrossEntropyWithGradOp)
                kwargs = {"precision": precision} if isinstance(op, takes_precision) else {}
                kernel = fn_lower(op, config_of(op), **kwargs)
                self.steps.append(Step(op, tuple(op.operands), tuple(op.results), self._launcher(kernel), kernel,
                                       scratch=kernel.scratch_bytes))

        if any(isinstance(st.op, nv.COLLECTIVE_OPS) for st in self.steps):
            from nova.runtime.distributed import wire

            wire(self.steps, fn)  # issued in place, finished before the first launch reading them

    def scratch(self, planned: dict) -> tuple[int, str]:
        """The largest scratch one launch allocates outside the arena (``planned``:
        the ops whose arena scratch the memory plan holds), and which op it is."""
        def outside(st: Step) -> int:
            taken = st.kernel.arena_scratch_bytes if st.kernel is not None and st.op in planned else 0
            return st.scratch - taken

        top = max(self.steps, key=outside, default=None)
        return (outside(top), top.op.name) if top is not None else (0, "")

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """A contiguous copy made by a generated kernel (for layouts a kernel cannot read)."""
        from nova.codegen.triton.elementwise import copy_kernel

        key = (tuple(t.shape), t.dtype)
        if key not in self._copy_kernels:
            self._copy_kernels[key] = copy_kernel(tuple(t.shape), t.dtype)
        return self._copy_kernels[key].launch([t])[0]

    def _launcher(self, kernel: lw.Kernel):
        need = set(kernel.needs_contiguous)

        def run(xs: list[torch.Tensor], outs: list[torch.Tensor] | None = None,
                scratch: torch.Tensor | None = None) -> list[torch.Tensor]:  # fmt: skip
            if need:
                for i in need:
                    if not xs[i].is_contiguous():
                        once(_LOG, f"contiguous:{kernel.name}:{i}",
                             "%s: operand %d is not contiguous (strides %s): copied first", kernel.name, i,
                             tuple(xs[i].stride()))
                xs = [self.copy(x) if i in need and not x.is_contiguous() else x for i, x in enumerate(xs)]
            if scratch is not None:
                return kernel.launch(xs, outs, scratch=scratch)
            return kernel.launch(xs) if outs is None else kernel.launch(xs, outs)

        return run

    def sources(self) -> dict[str, str]:
        """Every kernel's generated source, by name. A matmul's kernels are chosen at
        launch (TMA or pointer loads, staging, by the operands' strides), so they are
        listed once the step has run."""
        out = {}
        for st in self.steps:
            if st.kernel is not None:
                out[st.kernel.name] = st.kernel.source
            for key, text in (st.sources or {}).items():
                out["nova_matmul_" + Path(key).stem[:16]] = text
        return out
