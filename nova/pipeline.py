"""The ordered list of stages: the one place where the pipeline's order lives.

Each stage takes valid IR and leaves valid IR (the verifier runs after every
stage), and the IR after each stage is kept as text for ``explain()``.

  capture     torch.export the forward + loss (PyTorch's decompositions for ops
              without a conversion), import into @train_step
  fold        values that depend only on static shapes (position ids, causal
              masks) computed once, passed as buffers
  fuse_loss   cross_entropy(lm_head(x)) as one nova.linear_cross_entropy op
              (chunked over tokens: the [tokens, vocab] logits never exist)
  autodiff    append the backward (Nova's own VJP rules)
  optimizer   append the parameter and state update (Adam, AdamW, SGD)
  guard       device-side checks (ids in range; with skip_nonfinite a finite loss
              and gradients) gate every param/state update; "status" results
  distribute  data_parallel only: gradient buckets all-reduced (ddp) or reduce-
              scattered with the update on shards and the params all-gathered
              (zero1), each right after its last gradient; the guard's counts
              summed over the ranks
  precision   the bf16 / tf32 policy
  concat      sums of zero-pads (split's backward) as nova.cat; a cat of widened
              casts or of reshapes becomes a cast or reshape of a cat (fewer bytes)
  simplify    cast canonicalization (casts above layout ops, exact round trips
              dropped), CSE and DCE
  transpose_matmul  transpose(a @ b) as b^T @ a^T (a weight gradient in its parameter's
              layout): every match with its switch on; under tf32 the f32 ones whose
              B (the operand a tf32 kernel copies unless K-major) gets smaller
  loss_grad   the fused LM head's forward and backward as one op computing the loss
              and its gradients chunk by chunk (the loss's cotangent, the seed, is
              known before the loss): one logits matmul per chunk instead of two
  remat       recompute cheap elementwise values in the backward instead of keeping
              them from the forward; with memory_budget, more until the plan fits;
              nothing with nova.compile(remat=False)
  norm_recompute  a LayerNorm output remat recomputes for a weight gradient is computed
              from the forward's statistics beside the LayerNorm backward reading the
              same row (the weight gradient moves after it), so fuse puts it in that
              backward's kernel
  attention_sums  a packed qkv projection's bias gradient (the column sum of the cat
              of an attention backward's gradients) added up by that op's kernels
  tf32_operands  (GPU targets, tf32) a value only tf32 matmuls read is stored rounded
              by its producer's kernel (an attention backward's gradients by its
              own, hence after attention_sums), and the matmuls take it as prerounded
  fuse        elementwise ops grouped into nova.fused ops (one kernel each):
              vertical chains, horizontal neighbours, scalars recomputed inside,
              a matmul with the elementwise ops on its result (its epilogue), a
              reduction with its prologue and epilogue, and the updates (and the
              forward's weight casts) of one shape as multi-tensor launches
  configure   the Analytic Configurator's #nova.lowering_config on every kernel
              (only for a GPU target; the reference executor needs none)
  plan_memory liveness over the whole step, one static arena with an offset per
              buffer, in-place param/state updates, the predicted peak (MemoryPlan)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from xdsl.dialects.builtin import ModuleOp

from nova.autodiff import append_backward
from nova.capture.importer import Captured, capture
from nova.config import SETTINGS
from nova.ir.module import context, print_module, returned, step_func
from nova.transforms.fold import fold_static
from nova.transforms.optimizer import OptimizerSpec, append_optimizer
from nova.transforms.precision import PrecisionPass
from nova.transforms.simplify import Simplify


@dataclass
class Compilation:
    """Everything the stages read and write for one program."""

    model: torch.nn.Module
    batch: tuple
    optimizer: torch.optim.Optimizer | None  # None: forward + grads only
    precision: str
    step_dtype: torch.dtype
    captured: Captured | None = None
    spec: OptimizerSpec | None = None  # the optimizer's structure, named as in the IR
    device: object | None = None  # nova.schedule.devices.DeviceSpec of a GPU target, else None
    stages: dict[str, str] = field(default_factory=dict)  # stage name -> IR text after it
    memory: object | None = None  # nova.transforms.plan_memory.MemoryPlan, after plan_memory
    cache: str = "off"  # the step cache: "hit" | "miss" | "off" | "rebuilt: <reason>" (nova.runtime.cache)
    times: dict[str, float] = field(default_factory=dict)  # stage (and "cache.*") -> seconds
    skip_nonfinite: bool = False  # guard: a non-finite loss or gradient makes the step write nothing
    grads: dict | None = None  # parameter name -> gradient value, as the optimizer stage found them
    memory_budget: int | None = None  # bytes: remat recomputes until the predicted peak fits (None: cheap ones only)
    remat: list = field(default_factory=list)  # nova.transforms.remat.Choice per recomputed value, after remat
    recompute: bool = True  # False (nova.compile(remat=False)): the remat stage recomputes nothing

    @property
    def module(self) -> ModuleOp:
        assert self.captured is not None
        return self.captured.module


def _capture(c: Compilation) -> None:
    c.captured = capture(c.model, c.batch)


def _fold(c: Compilation) -> None:
    device = next(iter(c.captured.params.values()), None)
    fold_static(c.module, c.captured.buffers, device.device if device is not None else torch.device("cpu"))


def _fuse_loss(c: Compilation) -> None:
    from nova.transforms.fuse_loss import fuse_loss

    fuse_loss(c.module)


def _autodiff(c: Compilation) -> None:
    append_backward(c.module)


def _optimizer(c: Compilation) -> None:
    # the guard checks the gradients, which the update consumes as results
    c.grads = {n: v for r, n, v in returned(step_func(c.module)) if r == "grad"}
    if c.optimizer is None:
        return
    names = {id(p): n for n, p in c.captured.params.items()}
    c.spec = OptimizerSpec.from_torch(c.optimizer, names)
    append_optimizer(c.module, c.spec, c.step_dtype)


def _guard(c: Compilation) -> None:
    from nova.transforms.guard import guard

    guard(c.module, c.skip_nonfinite, c.grads)


def _distribute(c: Compilation) -> None:
    from nova.transforms.distribute import stage

    stage(c)  # data_parallel: the collectives (nova/transforms/distribute.py); nothing without it


def _precision(c: Compilation) -> None:
    PrecisionPass(c.precision).apply(context(), c.module)


def _concat(c: Compilation) -> None:
    from nova.transforms.concat import concat

    concat(c.module)


def _simplify(c: Compilation) -> None:
    Simplify().apply(context(), c.module)


def _transpose_matmul(c: Compilation) -> None:
    from nova.transforms.transpose_matmul import transpose_matmul

    transpose_matmul(c.module, precision=c.precision)  # a weight gradient in its parameter's layout


def _loss_grad(c: Compilation) -> None:
    from nova.transforms.loss_grad import loss_grad

    loss_grad(c.module)


def _remat(c: Compilation) -> None:
    from nova.transforms.remat import remat

    c.remat = remat(c.module, c.memory_budget) if c.recompute else []


def _norm_recompute(c: Compilation) -> None:
    from nova.transforms.norm_recompute import norm_recompute

    norm_recompute(c.module)


def _tf32_operands(c: Compilation) -> None:
    if c.device is None:
        return  # the reference target's matmuls are torch's (tf32 rounding on CUDA, fp32 on the CPU)
    from nova.transforms.tf32_operands import tf32_operands

    tf32_operands(c.module, c.precision)


def _attention_sums(c: Compilation) -> None:
    from nova.transforms.attention_sums import attention_sums

    attention_sums(c.module)


def _fuse(c: Compilation) -> None:
    from nova.transforms.fuse import fuse

    fuse(c.module)


def _configure(c: Compilation) -> None:
    if c.device is None:
        return
    from nova.transforms.configure import Configure  # the scheduler loads only for GPU targets

    Configure(c.device, c.precision).apply(context(), c.module)


def _plan_memory(c: Compilation) -> None:
    # for every target: cheap (a GPT-2 step's ~5k ops in a fraction of a second), and
    # it is what explain() reports; the GPU executable binds every buffer to it, and
    # plans the arena scratch of the launches that take one (the fused LM head's
    # logits chunk) into its gaps
    from nova.transforms.plan_memory import plan_memory

    c.memory = plan_memory(c.module, arena_scratch(c.device, c.module))


def arena_scratch(device, module: ModuleOp) -> dict | None:
    """The arena scratch plan_memory plans for a GPU target's launches (None for
    the reference target); also what a step cache hit rebuilds the plan with."""
    if device is None:
        return None
    from nova.backends.triton import planned_scratch

    return planned_scratch(step_func(module))


STAGES: list[tuple[str, Callable[[Compilation], None]]] = [
    ("capture", _capture),
    ("fold", _fold),
    ("fuse_loss", _fuse_loss),
    ("autodiff", _autodiff),
    ("optimizer", _optimizer),
    ("guard", _guard),
    ("distribute", _distribute),
    ("precision", _precision),
    ("concat", _concat),
    ("simplify", _simplify),
    ("transpose_matmul", _transpose_matmul),
    ("loss_grad", _loss_grad),
    ("remat", _remat),
    ("norm_recompute", _norm_recompute),
    ("attention_sums", _attention_sums),
    ("tf32_operands", _tf32_operands),
    ("fuse", _fuse),
    ("configure", _configure),
    ("plan_memory", _plan_memory),
]


def run(c: Compilation, dump: bool | Callable[[str, ModuleOp], str] = False) -> Compilation:
    """Runs every stage in order. ``dump`` keeps each stage's IR text (printing
    a GPT's IR five times costs about as much as compiling it, so only
    ``explain()`` asks for it): True for ``print_module``'s generic form, or a
    function of (stage name, module) giving the text to keep (explain's short form).

    The step cache (``nova.runtime.cache``; ``NOVA_STEP_CACHE=0`` turns it off):
    after its ``AFTER`` stage the IR is hashed with the options, and on a hit the
    cached final IR replaces the later stages. ``dump`` bypasses it (explain
    shows every stage)."""
    import time

    from nova.log import get_logger
    from nova.runtime import cache as step_cache

    _log = get_logger("nova.pipeline")
    names = [name for name, _ in STAGES]
    looked = None
    c.cache = "off"
    for i, (name, stage) in enumerate(STAGES):
        t0 = time.perf_counter()
        stage(c)
        if SETTINGS.verify_each_stage:
            c.module.verify()
        c.times[name] = time.perf_counter() - t0
        if dump:
            c.stages[name] = dump(name, c.module) if callable(dump) else print_module(c.module)
        if name == step_cache.AFTER and SETTINGS.step_cache and not dump:
            t0 = time.perf_counter()
            looked = step_cache.lookup(c, names)
            c.times["cache.lookup"] = time.perf_counter() - t0
            if isinstance(looked, str):
                _log.info("step cache off for this compile: %s", looked)
                looked = None
                continue
            c.cache = looked.status
            if looked.module is not None:
                t0 = time.perf_counter()
                step_cache.restore(c, looked, names[i + 1 :])
                c.times["cache.restore"] = time.perf_counter() - t0
                break
    else:
        if looked is not None:
            t0 = time.perf_counter()
            step_cache.save(c, looked)
            c.times["cache.store"] = time.perf_counter() - t0
    if looked is not None:
        _log.info("step cache %s: %s", c.cache, looked.path)
    if c.cache != "hit":  # a hit's IR was verified as it was read (cache.load)
        c.module.verify()
    return c
