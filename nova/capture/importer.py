"""Capture: trace the model's forward + loss with torch.export and import the
graph into ``func.func @train_step`` of the nova dialect.

torch.export (non-strict) records ATen ops with static shapes, lifts
parameters, buffers and constants to inputs, and keeps a stack trace per
node, which becomes each op's ``nova.loc`` so errors can point at user code.
Every op Nova cannot convert is collected, and one ``UnsupportedError`` lists
them all before anything runs.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass, field

import torch
from torch.export.graph_signature import InputKind, OutputKind
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp, i64
from xdsl.ir import SSAValue

from nova.capture.aten import CONVERTERS, IGNORED, WIDENED_INTS, Ctx, Unsupported, int_span
from nova.capture.int_range import bounds, fits
from nova.errors import CaptureError, UnsupportedError
from nova.ir.builder import OpBuilder
from nova.ir.module import Slot, add_arg, new_step, set_results
from nova.ir.types import elem_of, from_torch_dtype, is_float, shape_of, tensor, to_torch_dtype
from nova.log import get_logger
from nova.runtime.collector import paused

SEED = "dropout.seed"
_LOG = get_logger("nova.capture")


@dataclass
class Captured:
    module: ModuleOp
    fn: func.FuncOp
    # name in the IR -> the tensor object it binds to (params and buffers by
    # identity with the user's module, so in-place updates reach the model)
    params: dict[str, torch.nn.Parameter] = field(default_factory=dict)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    batch_names: list[str] = field(default_factory=list)


def _location(node: torch.fx.Node) -> str:
    """Where a node came from: the owning submodule, the node, and the source
    line torch.export recorded (it keeps only the innermost frame, and none
    for some ops)."""
    stack = node.meta.get("nn_module_stack") or {}
    if stack:
        path, kind = list(stack.values())[-1]
        kind = getattr(kind, "__name__", str(kind)).rsplit(".", 1)[-1]
        owner = f"{path or '<root>'} ({kind})"
    else:
        owner = "<root>"
    where = f"{owner}, node {node.name}"
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)', node.meta.get("stack_trace") or "")
    if frames:
        path, line, _, code = frames[-1]
        where += f", {path}:{line}: {code.strip()}"
    return where


def _tensor_slot(role: str, name: str, t: torch.Tensor) -> Slot:
    if role == "batch" and t.dtype in WIDENED_INTS:  # widened exactly; the step copies it in as int64
        return Slot(role, name, tensor(t.shape, i64))
    try:
        elem = from_torch_dtype(t.dtype)
    except TypeError:
        raise UnsupportedError([(
            f"{role} tensor of dtype {t.dtype} (Nova takes float16, bfloat16, float32, float64, int64 and bool"
            f"{', and int32, int16, int8 and uint8 batches' if role == 'batch' else ''})", name,
        )]) from None  # fmt: skip
    return Slot(role, name, tensor(t.shape, elem))


def _check_widened(node: torch.fx.Node, value, memo: dict) -> None:
    """An op that eager computes in int32, int16, int8 or uint8 (captured in i64: ``aten.WIDENED_INTS``)
    is exact only if its values cannot leave that dtype's range, where eager would wrap:
    ``int_range`` must prove it, or the op is refused."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dtype not in WIDENED_INTS or not isinstance(value, SSAValue):
        return
    if not fits(value, int_span(val.dtype), memo):
        b = bounds(value, memo)
        raise Unsupported(f"{val.dtype} values that Nova (computing them in int64) cannot prove stay within "
                          f"{val.dtype}'s range ({'unbounded' if b is None else f'bounds {list(b)}'}), where eager "
                          "would wrap; compute them in int64")


def export(model: torch.nn.Module, batch: tuple) -> torch.export.ExportedProgram:
    try:
        return torch.export.export(model, tuple(batch), strict=False)
    except Exception as e:  # torch raises many types; name the stage and keep the cause
        raise CaptureError(f"tracing the model with torch.export failed: {type(e).__name__}: {e}") from e


def _unconverted(ep: torch.export.ExportedProgram) -> set:
    return {
        n.target for n in ep.graph.nodes
        if n.op == "call_function" and n.target not in CONVERTERS and n.target not in IGNORED
        and n.target is not operator.getitem
    }  # fmt: skip


def decompose(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """Decomposes every op without a nova conversion through PyTorch's own
    decomposition table (torch.export's default, towards core ATen), round by
    round while that makes progress (a round also functionalizes in-place ops: a
    buffer the forward writes becomes a buffer mutation output). Ops Nova converts
    are never decomposed, so the high-level ones it fuses later (linear,
    layer_norm, attention, cross_entropy, gelu) stay whole; what is left is
    reported by ``capture``."""
    table = torch.export.default_decompositions()
    for round_ in range(_DECOMPOSE_ROUNDS):
        left = _unconverted(ep)
        todo = {op: table[op] for op in left if op in table}
        if not todo and not (round_ == 0 and left):
            break
        # a first round with nothing to decompose still runs where some op is unconverted: any
        # round also functionalizes, so an in-place op of the forward (a buffer's add_, batch
        # norm's running statistics) becomes its functional form and a buffer mutation
        try:
            ep = ep.run_decompositions(todo)
        except Exception as e:  # noqa: BLE001 - torch cannot apply one here: the ops are reported as they are
            _LOG.info("PyTorch's decompositions of %s failed (%s: %s)", sorted(map(str, todo)), type(e).__name__, e)
            break
    return ep


_DECOMPOSE_ROUNDS = 4  # a decomposition's output rarely needs more than two further rounds


def capture(model: torch.nn.Module, batch: tuple) -> Captured:
    """The model's forward + loss as @train_step. The garbage collector is paused
    meanwhile (``nova.runtime.collector``): torch.export's graphs and fake tensors
    would start a full collection of the whole process (0.35 s on CI)."""
    with paused():
        return _capture(model, batch)


def _buffer_value(buf: torch.Tensor, v: SSAValue, name: str) -> SSAValue:
    """The new value of a buffer the forward writes, checked against the buffer: it is
    written in place, in the buffer's own dtype and shape."""
    if shape_of(v.type) != tuple(buf.shape) or to_torch_dtype(elem_of(v.type)) != buf.dtype:
        raise CaptureError(f"the forward writes buffer {name!r} ({buf.dtype}{list(buf.shape)}) with a "
                           f"{v.type}: Nova writes buffers in place, in their own dtype and shape")
    return v


def _home_device(model: torch.nn.Module, batch: tuple) -> torch.device:
    """The device the step runs on: its parameters', else its batch's."""
    for t in (*model.parameters(), *batch):
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cpu")


def _capture(model: torch.nn.Module, batch: tuple) -> Captured:
    ep = decompose(export(model, batch))
    sig = ep.graph_signature
    problems: list[tuple[str, str]] = []

    mutated: list[str | None] = []  # per output: the buffer it writes (batch norm's running statistics), or None
    for spec in sig.output_specs:
        if spec.kind == OutputKind.BUFFER_MUTATION:
            mutated.append(spec.target)
        elif spec.kind != OutputKind.USER_OUTPUT:
            problems.append((f"model forward mutates {spec.kind.name.lower()} {spec.target!r}", "forward"))
        else:
            mutated.append(None)

    # --- arguments -------------------------------------------------------
    slots: list[Slot] = []
    owner: list[str] = []  # placeholder name of each slot
    seen: dict[int, str] = {}  # id(parameter) -> placeholder of its slot
    alias: dict[str, str] = {}  # tied placeholder -> placeholder of the same tensor
    cap = Captured(module=None, fn=None)  # type: ignore[arg-type]
    user_i = 0
    widened: dict[str, tuple[int, int]] = {}  # placeholders of narrow-int batch tensors: their range
    for spec in sig.input_specs:
        ph = spec.arg.name
        if spec.kind == InputKind.PARAMETER:
            t = model.get_parameter(spec.target)
            if id(t) in seen:  # a tied parameter: one argument under its first name
                alias[ph] = seen[id(t)]
                continue
            seen[id(t)] = ph
            if not t.requires_grad:  # frozen: an input like a buffer; no gradient, no update (eager: grad None)
                slots.append(_tensor_slot("buffer", spec.target, t))
                cap.buffers[spec.target] = t
            else:
                slots.append(_tensor_slot("param", spec.target, t))
                cap.params[spec.target] = t
        elif spec.kind in (InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            if spec.kind == InputKind.BUFFER:
                t = model.get_buffer(spec.target)
            else:  # a tensor the forward creates (torch.tensor(...) lands on the CPU): eager lets a 0-d CPU
                # tensor meet CUDA ones, a compiled step's launches read one device: Nova's copy moves there
                t = ep.constants[spec.target].to(_home_device(model, batch))
            name = spec.target if spec.kind == InputKind.BUFFER else f"constant.{spec.target}"
            slots.append(_tensor_slot("buffer", name, t))
            cap.buffers[name] = t
        elif spec.kind == InputKind.USER_INPUT:
            t = batch[user_i]
            if not isinstance(t, torch.Tensor):
                raise CaptureError(f"batch element {user_i} is a {type(t).__name__}, not a tensor")
            name = f"batch.{user_i}"
            slots.append(_tensor_slot("batch", name, t))
            cap.batch_names.append(name)
            if t.dtype in WIDENED_INTS:  # an i64 argument holding the narrower dtype's values (int_range, below)
                widened[ph] = int_span(t.dtype)
            user_i += 1
        else:
            problems.append((f"input kind {spec.kind.name}", ph))
            continue
        owner.append(ph)

    module, fn = new_step(slots)
    cap.module, cap.fn = module, fn
    block = fn.body.block
    env: dict[torch.fx.Node, object] = {}
    arg_of = dict(zip(owner, block.args, strict=True))
    for node in ep.graph.nodes:
        if node.op == "placeholder" and (node.name in arg_of or node.name in alias):
            env[node] = arg_of[alias.get(node.name, node.name)]

    seed: list[SSAValue] = []

    def get_seed() -> SSAValue:
        if not seed:
            seed.append(add_arg(fn, Slot("seed", SEED, tensor([], i64))))
        return seed[0]

    b = OpBuilder(block)
    cx = Ctx(b, get_seed)
    bounds_memo: dict = {arg_of[ph]: span for ph, span in widened.items()}  # int_range.bounds of the values seen
    output = None
    for node in ep.graph.nodes:
        if node.op != "call_function":
            if node.op == "output":
                output = node
            continue
        if node.target in IGNORED:
            continue
        where = _location(node)
        if node.target is operator.getitem:
            src, i = node.args
            if src in env:
                if not isinstance(env[src], tuple):
                    problems.append((f"item {i} of {src.target}, which Nova converted to one value", where))
                    continue
                env[node] = env[src][i]
            continue
        conv = CONVERTERS.get(node.target)
        if conv is None:
            problems.append((f"{node.target} (no nova conversion)", where))
            continue
        inputs = node.all_input_nodes
        if any(n not in env for n in inputs):
            continue  # downstream of an op already reported
        args = torch.fx.node.map_arg(node.args, lambda n: env[n])
        kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: env[n])
        kwargs = {k: v for k, v in kwargs.items() if k not in ("device", "layout", "pin_memory", "memory_format")}
        b.location = where
        try:
            env[node] = conv(cx, *args, **kwargs)
            _check_widened(node, env[node], bounds_memo)
        except Unsupported as e:
            problems.append((f"{node.target}: {e}", where))
        except Exception as e:  # noqa: BLE001 - a converter's own failure is still this op's problem
            # (an operand type the converter did not foresee, a verifier
            # rejecting what it built): reported with the others, never raised raw
            problems.append((f"{node.target}: cannot convert these arguments ({type(e).__name__}: {e})", where))
    b.location = None

    if problems:
        raise UnsupportedError(problems)

    outs = output.args[0]
    user = [o for o, m in zip(outs, mutated, strict=True) if m is None]
    if len(user) != 1 or not isinstance(user[0], torch.fx.Node):
        raise CaptureError(f"the model must return one scalar loss tensor; it returned {len(user)} values")
    loss = env[user[0]]
    if not isinstance(loss, SSAValue) or shape_of(loss.type) != () or not is_float(loss.type):
        raise CaptureError(f"the model must return a 0-d floating-point loss; it returned {loss.type}")
    results = [("loss", "loss", loss)]
    for o, target in zip(outs, mutated, strict=True):
        if target is not None:  # the buffer's new value: the step writes it in place, as eager's forward does
            results.append(("buffer", target, _buffer_value(cap.buffers[target], env[o], target)))
    set_results(fn, results)
    try:
        module.verify()
    except Exception as e:  # noqa: BLE001 - a converter bug must not surface as an xDSL error
        raise CaptureError(f"the captured program does not verify (a bug in Nova's capture): {e}") from e
    return cap
