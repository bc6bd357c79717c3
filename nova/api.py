"""CompiledStep: binds the user's module and optimizer to compiled programs.

One call runs forward, backward and the optimizer update. Arguments are
gathered from the live objects by the IR's argument roles (parameters and
buffers by identity, optimizer state in PyTorch's layout, hyper-parameters
from ``param_groups`` at every call), the program runs, and only when it has
finished are the results written back, so a failed step leaves parameters
and optimizer state as they were.

No silent wrong result:
- the program is selected by a key over everything it was built from: batch
  shapes, every parameter's and buffer's identity, dtype, shape, device and
  ``requires_grad``, the optimizer's structure, train/eval mode; replacing a
  tensor, ``.to()``/``.double()``, freezing or unfreezing compiles another
  program (logged under ``nova.api`` with the reason); the last
  ``SETTINGS.program_cache_size`` programs are kept (LRU);
- optimizer state is checked (shape, dtype, device) before anything runs, and
  the write-back is all-or-nothing: every value is prepared first, the commit
  itself is only same-shape copies and dict stores, and a SIGINT arriving during
  it (main thread) is deferred and re-raised once it is complete;
- compilation is serialized process-wide (torch.export is not thread-safe) and
  each step serializes its own calls, so steps may be called from many threads.

A step that must not take effect is decided on the device (the guard stage,
``nova.transforms.guard``): an embedding id or a class target out of range, and
with ``skip_nonfinite`` a non-finite loss or gradient, make every parameter and
state result its old value. The program returns the counts as ``status``
results, and the host reads them
- on the reference backend right after the run (nothing is written back then);
- on the Triton backend lazily, so that no step waits for the device: at the
  start of the next call, in ``check()``, ``explain()`` and ``skipped_steps``.
  Bad ids raise ``IndexError`` naming the step that failed; that step's device
  writes were its old values, and the optimizer-state entries it created are
  taken out again.
"""

from __future__ import annotations

import _signal
import operator
import os
import signal
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from nova import pipeline
from nova.backends.reference import run_function
from nova.config import SETTINGS, triton_interpreted
from nova.errors import BatchError, CaptureError
from nova.ir.module import arg_slots, result_slots, step_func
from nova.ir.types import elem_of, shape_of, to_torch_dtype
from nova.log import get_logger
from nova.runtime import distributed
from nova.runtime.executable import SCALAR_ROWS
from nova.runtime.steady import Steady
from nova.transforms.guard import BAD_IDS, FAILED, GUARD, NONFINITE, SKIPPED, describe_bad_ids
from nova.transforms.optimizer import group_structure
from nova.transforms.optimizer import hyper_values
from nova.transforms.precision import PRECISIONS

log = get_logger("nova.api")

# bumped whenever any module, parameter or buffer is registered (assigned) in this
# process: the program key's fingerprint walks the model again only then
_registrations = [0]


def _registered(*_) -> None:
    _registrations[0] += 1


for _register in (torch.nn.modules.module.register_module_module_registration_hook,
                  torch.nn.modules.module.register_module_parameter_registration_hook,
                  torch.nn.modules.module.register_module_buffer_registration_hook):  # fmt: skip
    _register(_registered)

# torch.export (and xDSL's contexts) are not safe to run from two threads at once
_COMPILE_LOCK = threading.RLock()

BACKENDS = ("reference", "triton", "auto")


@dataclass
class Program:
    compilation: pipeline.Compilation
    kernels: object | None = None  # nova.backends.triton.TritonProgram for the GPU backend
    executable: object | None = None  # nova.runtime.executable.Executable: the kernels bound to the memory plan

    def __post_init__(self):
        # read from the IR's attributes once (xDSL attribute access is slow per call)
        self.args = arg_slots(self.fn)
        self.results = result_slots(self.fn)
        self.status_at = [i for i, s in enumerate(self.results) if s.role == "status"]
        self.seen_state: dict[int, torch.Tensor] = {}  # argument index -> the state tensor checked last call
        self.gather: _GatherPlan | None = None  # the executable's argument sources, built at its first call

    @property
    def fn(self):
        return step_func(self.compilation.module)

    def run(self, args: list, precision: str) -> list[torch.Tensor]:
        if self.executable is not None:
            return self.executable.run(args)
        return run_function(self.fn, args, precision)


@dataclass
class _GatherPlan:
    """Where each argument of an executable's program comes from, resolved once."""

    fixed: list  # params (detached aliases) and buffers (the key pins their identity); None elsewhere
    params: list[tuple[int, torch.Tensor]]  # (argument, the parameter itself): its alias follows p.data = ...
    batch: list[tuple[int, int]]  # (argument, batch position)
    hyper: list[tuple[int, str]]  # (argument, hyper-parameter name)
    momentum_fresh: list[tuple[int, torch.Tensor]]  # (argument, param): 1.0 until its buffer exists
    seeds: list[int]
    state: list[tuple[int, torch.Tensor, str, str]]  # (argument, param, state name, key)
    guard: list[tuple[int, str]]  # (argument, guard name): the step's device-side memory of failures
    by_param: list[tuple[torch.Tensor, list[tuple[int, str, str]]]] | None = None  # state, one lookup per param

    @staticmethod
    def of(prog: "Program") -> "_GatherPlan":
        cap = prog.compilation.captured
        g = _GatherPlan([None] * len(prog.args), [], [], [], [], [], [], [])
        for i, s in enumerate(prog.args):
            if s.role == "param":
                g.fixed[i] = cap.params[s.name].detach()
                g.params.append((i, cap.params[s.name]))
            elif s.role == "buffer":
                g.fixed[i] = cap.buffers[s.name]
            elif s.role == "batch":
                g.batch.append((i, cap.batch_names.index(s.name)))
            elif s.role == "seed":
                g.seeds.append(i)
            elif s.role == "hyper" and s.name.endswith("::momentum_buffer_fresh"):
                g.momentum_fresh.append((i, cap.params[s.name.split("::")[0]]))
            elif s.role == "hyper":
                g.hyper.append((i, s.name))
            elif s.role == "state":
                pname, key = s.name.split("::")
                g.state.append((i, cap.params[pname], s.name, key))
            elif s.role == GUARD:
                g.guard.append((i, s.name))
            else:
                raise AssertionError(f"unknown argument role {s.role}")
        groups: dict[int, tuple] = {}
        for i, p, name, key in g.state:
            groups.setdefault(id(p), (p, []))[1].append((i, name, key))
        g.by_param = list(groups.values())
        return g


class _Key(NamedTuple):
    """What selects a program: everything it was built from."""

    batch: tuple  # (shape, dtype) per batch tensor
    params: tuple  # (name, id, dtype, shape, device, requires_grad) per parameter name
    buffers: tuple  # (name, id, dtype, shape, device) per buffer name
    optimizer: tuple  # the optimizer's structure (CompiledStep._spec_key)
    training: tuple  # (module name, training) per module: model.eval(), or one submodule's


_PARAMETERS_OF, _MODULES_OF, _BUFFERS_OF = (operator.attrgetter(a) for a in ("_parameters", "_modules", "_buffers"))
_DATA_PTR, _REQUIRES_GRAD = torch.Tensor.data_ptr, operator.attrgetter("requires_grad")
_TRAINING = operator.attrgetter("training")


def _tensor_sig(name: str, t: torch.Tensor) -> tuple:
    return (name, id(t), t.dtype, tuple(t.shape), t.device)


def _why(old: _Key | None, new: _Key) -> str:
    """Why ``new`` needs a program ``old``'s does not serve, for the log."""
    if old is None:
        return "first call"
    reasons = []
    if old.batch != new.batch:
        reasons.append(f"new batch shape {[s for s, _ in new.batch]} (was {[s for s, _ in old.batch]})")
    for what, o, n in (("parameter", old.params, new.params), ("buffer", old.buffers, new.buffers)):
        od, nd = {e[0]: e for e in o}, {e[0]: e for e in n}
        if od.keys() != nd.keys():
            added, gone = sorted(nd.keys() - od.keys()), sorted(od.keys() - nd.keys())
            reasons.append(f"{what}s added {added} / removed {gone}")
        common = [k for k in nd if k in od and od[k] != nd[k]]
        replaced = [k for k in common if od[k][1] != nd[k][1]]
        if replaced:
            reasons.append(f"{what}s replaced: {replaced}")
        changed = [k for k in common if od[k][1] == nd[k][1] and od[k][2:5] != nd[k][2:5]]
        if changed:
            reasons.append(f"{what} dtype/shape/device changed: "
                           + ", ".join(f"{k} {od[k][2]}{list(od[k][3])}@{od[k][4]} -> {nd[k][2]}{list(nd[k][3])}@{nd[k][4]}"
                                       for k in changed))  # fmt: skip
        flipped = [k for k in common if what == "parameter" and od[k][1:5] == nd[k][1:5] and od[k][5] != nd[k][5]]
        if flipped:
            reasons.append(f"requires_grad changed: {[f'{k}={nd[k][5]}' for k in flipped]}")
    if old.optimizer != new.optimizer:
        reasons.append("optimizer structure changed (param groups or structural options)")
    if old.training != new.training:
        flipped = [f"{n or '(the model)'} {'train' if t else 'eval'}" for (n, t), (_, u) in zip(new.training, old.training)
                   if t != u] if len(old.training) == len(new.training) else []  # fmt: skip
        reasons.append(f"train/eval mode changed: {', '.join(flipped) or 'modules added or removed'}")
    return "; ".join(reasons) or "evicted from the program cache earlier"


class _Received(list):
    def append_frame(self, signum, frame) -> None:
        self.append(frame)


class _DeferSigint:
    """Holds back SIGINT during the commit (main thread only: Python delivers
    signals there), then hands it to the previous handler (KeyboardInterrupt)."""

    def __enter__(self):
        self.previous, self.received = None, _Received()
        if threading.current_thread() is threading.main_thread():
            try:  # _signal: signal.signal's C function (its wrapper converts enums on every call)
                self.previous = _signal.signal(signal.SIGINT, self.received.append_frame)
            except ValueError:  # not the main interpreter
                self.previous = None
        return self

    def __exit__(self, *exc):
        if self.previous is None:
            return False
        _signal.signal(signal.SIGINT, self.previous)
        if self.received and exc[0] is None:
            if callable(self.previous):
                self.previous(signal.SIGINT, self.received[0])
            elif self.previous == signal.SIG_DFL:
                raise KeyboardInterrupt
        return False


# steps whose guard the host has not read yet, at most: a host this far ahead of the
# device waits for the oldest (backpressure, as CUDA's own launch queue would apply).
# Executable.launch reuses its scalar rows on this promise: at most as many steps in flight as rows
PENDING_STEPS = SCALAR_ROWS


@dataclass
class _Pending:
    """A step whose status the host has not read yet."""

    call: int  # which step it was (1-based, counting the steps that ran)
    status: dict[str, torch.Tensor]  # "bad_ids" (and "nonfinite"): 0-d counts (the reference backend's)
    prog: Program
    args: list[torch.Tensor]  # its arguments: the error message recomputes the bad ids from them
    stored: list[tuple]  # the ("store", param, key, tensor) writes that created optimizer-state entries
    guard: torch.Tensor | None = None  # the executable's: [failed, skipped] after the step, a host copy
    event: object | None = None  # recorded after that copy (None: the copy is complete already)
    batch: tuple = ()  # the caller's batch tensors of an executable step (they replace the batch slots in args)

    def step_args(self) -> list[torch.Tensor]:
        """The step's arguments, the caller's own batch tensors in the batch positions."""
        if not self.batch:
            return self.args
        args = list(self.args)
        for i, k in self.prog.gather.batch:
            args[i] = self.batch[k]
        return args

    def ready(self) -> bool:
        if self.event is None or self.event.query():  # cudaEventQuery: never waits
            self.event = None  # complete: nothing to wait for
            return True
        return False

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()
            self.event = None


class CompiledStep:
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, precision: str = "fp32",
                 backend: str = "auto", skip_nonfinite: bool = False, cuda_graph: bool = True,
                 memory_budget: int | str | None = None, data_parallel=None, remat: bool = True):  # fmt: skip
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        model_params = {id(p) for p in model.parameters()}
        for g, group in enumerate(optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                if id(p) not in model_params:
                    raise CaptureError(
                        f"optimizer param_groups[{g}] parameter {i} (shape {tuple(p.shape)}) is not a parameter "
                        "of the model: Nova updates only the model's own parameters"
                    )
        self.model, self.optimizer, self.precision = model, optimizer, precision
        device = next(model.parameters()).device
        if backend == "auto":
            backend = "triton" if device.type == "cuda" else "reference"
        if backend == "triton" and device.type != "cuda" and not triton_interpreted():
            raise ValueError(
                f"backend='triton' needs the model on a CUDA device (it is on {device}); "
                "on the CPU use backend='reference' (or TRITON_INTERPRET=1 to run the kernels in Triton's interpreter)"
            )
        self.backend = backend
        self._programs: OrderedDict[_Key, Program] = OrderedDict()  # least recently used first
        self._batch_sig: list[tuple[torch.dtype, torch.device, int]] | None = None
        self._last: Program | None = None
        self._last_key: _Key | None = None
        self._lock = threading.RLock()  # one call of this step at a time
        self._walk: tuple | None = None  # (registrations, modules, parameters) for the key's fingerprint
        self._fast: tuple | None = None  # (fingerprint, key) of the last call
        self.skip_nonfinite = bool(skip_nonfinite)
        self.cuda_graph = bool(cuda_graph)
        self.memory_budget = parse_bytes(memory_budget, "memory_budget")
        if not isinstance(remat, bool):
            raise TypeError(f"remat must be True or False, got {remat!r}")
        if not remat and self.memory_budget is not None:
            raise ValueError("memory_budget needs remat=True: the budget is met by recomputing more of the forward, "
                             "and remat=False recomputes nothing")
        self.remat = remat
        self.data_parallel = distributed.configure(data_parallel, model)  # None, or checked across the ranks
        self._calls = 0  # steps run
        self._skipped = 0  # steps the guard kept from writing because of a non-finite loss or gradient
        self._pending: deque[_Pending] = deque()  # executable steps whose guard is unread, oldest first
        self._guard: torch.Tensor | None = None  # [failed, skipped] on the device (guard.py), updated in place
        self._guard_host: list[torch.Tensor] | None = None  # PENDING_STEPS host rows its copies land in (pinned)
        self._guard_cuda = False
        self._guard_next = 0  # the host row the next step's guard goes to
        self._steady: Steady | None = None  # what the last full call read (the fast path's check)

    # --- batch checks ------------------------------------------------------
    def _check_batch(self, batch: tuple) -> None:
        if not batch:
            raise BatchError("the step needs at least one batch tensor")
        for i, t in enumerate(batch):
            if not isinstance(t, torch.Tensor):
                raise BatchError(f"batch element {i} is a {type(t).__name__}, not a tensor")
        device = next(self.model.parameters()).device
        sig = [(t.dtype, t.device, t.dim()) for t in batch]
        for i, (dt, dev, rank) in enumerate(sig):
            if dev != device:
                raise BatchError(f"batch element {i} is on {dev}, but the model's parameters are on {device}")
        if self._batch_sig is not None:
            if len(sig) != len(self._batch_sig):
                raise BatchError(f"the step was compiled for {len(self._batch_sig)} batch tensors, got {len(sig)}")
            for i, (got, want) in enumerate(zip(sig, self._batch_sig)):
                if got[0] != want[0]:
                    raise BatchError(f"batch element {i} has dtype {got[0]}, the step takes {want[0]}")
                if got[2] != want[2]:
                    raise BatchError(f"batch element {i} has rank {got[2]}, the step takes rank {want[2]}")

    # --- compilation -------------------------------------------------------
    def _key(self, batch: tuple) -> _Key:
        """The program key, through a cheap fingerprint: when no module, parameter or
        buffer was registered anywhere since (torch's global registration hooks),
        every module has as many of each as before, and every parameter has the same
        storage and requires_grad, the full key (a walk of every named parameter and
        buffer) is the one computed last time."""
        m = self.model
        if self._walk is None or self._walk[0] != _registrations[0]:
            mods = list(m.modules())
            self._walk = (_registrations[0], mods, [p for _, p in m.named_parameters(remove_duplicate=False)])
        _, mods, plist = self._walk
        # map() over C callables: no Python frame per module or parameter (this runs every call)
        fast = (_registrations[0], tuple((tuple(t.shape), t.dtype) for t in batch), tuple(map(_TRAINING, mods)),
                self._spec_key(),
                tuple(map(len, map(_PARAMETERS_OF, mods))), tuple(map(len, map(_MODULES_OF, mods))),
                tuple(map(len, map(_BUFFERS_OF, mods))), tuple(map(_DATA_PTR, plist)),
                tuple(map(_REQUIRES_GRAD, plist)))  # fmt: skip
        if self._fast is not None and self._fast[0] == fast:
            return self._fast[1]
        key = self._full_key(batch)
        self._fast = (fast, key)
        return key

    def _full_key(self, batch: tuple) -> _Key:
        m = self.model
        params = tuple((*_tensor_sig(n, p), p.requires_grad) for n, p in m.named_parameters(remove_duplicate=False))
        buffers = tuple(_tensor_sig(n, b) for n, b in m.named_buffers(remove_duplicate=False))
        training = tuple((n, sub.training) for n, sub in m.named_modules(remove_duplicate=False))
        return _Key(tuple((tuple(t.shape), t.dtype) for t in batch), params, buffers, self._spec_key(), training)

    def _program(self, batch: tuple) -> Program:
        key = self._key(batch)
        if key is self._last_key and self._last is not None:
            return self._last  # the same key object as last call (the fingerprint held): no hashing of it
        prog = self._programs.get(key)
        if prog is not None:
            self._programs.move_to_end(key)
        else:
            log.info("compiling a program for %s: %s", type(self.model).__name__, _why(self._last_key, key))
            with _COMPILE_LOCK:
                c = pipeline.Compilation(self.model, batch, self.optimizer, self.precision, _step_dtype())
                c.device = self._device_spec()
                c.skip_nonfinite = self.skip_nonfinite
                c.memory_budget = self.memory_budget
                c.recompute = self.remat
                c.data_parallel = self.data_parallel
                prog = Program(pipeline.run(c))
                if self.backend == "triton":
                    from nova.backends.triton import TritonProgram
                    from nova.runtime.executable import Executable

                    t0 = time.perf_counter()
                    prog.kernels = TritonProgram(prog.fn, self.precision)
                    c.memory.scratch_bytes, c.memory.scratch_what = prog.kernels.scratch(c.memory.scratch_at)
                    device = next(self.model.parameters()).device
                    prog.executable = Executable(prog.kernels, c.memory, device, cuda_graph=self.cuda_graph)
                    c.times["lower"] = time.perf_counter() - t0  # the kernel sources and the launch list
            self._programs[key] = prog
            while len(self._programs) > SETTINGS.program_cache_size:
                old, _ = self._programs.popitem(last=False)
                log.info("program cache full (NOVA_PROGRAM_CACHE_SIZE=%d): dropped the least recently used "
                         "program (batch %s)", SETTINGS.program_cache_size, [s for s, _ in old.batch])  # fmt: skip
        if self._last is not None and self._last is not prog and self._last.executable is not None:
            # one arena at a time: a step alternating batch shapes would otherwise hold one per program
            self._last.executable.release()
        self._last_key = key
        return prog

    def _device_spec(self):
        if self.backend != "triton":
            return None
        from nova.schedule.devices import DEVICES, from_torch_device

        device = next(self.model.parameters()).device
        # under the interpreter the kernels are scheduled for the H200 they will run on
        return from_torch_device(device) if device.type == "cuda" else DEVICES["H200"]

    def _spec_key(self) -> tuple:
        # the structure of the optimizer (not its values) selects the program
        out = []
        for group in self.optimizer.param_groups:
            out.append(tuple(map(id, group["params"])))
            out.append(group_structure(group))
        return tuple(out)

    # --- running -----------------------------------------------------------
    def __call__(self, *batch: torch.Tensor) -> torch.Tensor:
        with self._lock:
            if self._pending:
                self._poll()  # the guard of every earlier step that has finished (no waiting)
            steady = self._steady
            if steady is not None and steady.holds(self, batch, _registrations[0]):
                return self._replay(steady, batch)
            self._steady = None
            return self._call(batch)

    def _replay(self, s: Steady, batch: tuple) -> torch.Tensor:
        """The fast path (``nova.runtime.steady``): nothing the last full call read has
        changed, so its executable is bound to the right tensors and its state checks
        hold; only the batch, the hyper-parameters and the seeds are new."""
        hyper = s.hyper(hyper_values(self.optimizer, s.prog.compilation.spec))
        seeds = [int(torch.randint(0, 2**31 - 1, (), dtype=torch.int64)) for _ in range(s.seeds)]
        row = self._guard_row(s.prog)  # (may read the oldest step's guard first: raises if it failed)
        self._calls += 1
        with _DeferSigint(), torch.no_grad():  # enqueued and queued for its guard read, or neither
            outs = s.exe.launch(batch, hyper, seeds, None if row is None else (row, self._guard))
            self._queue(s.prog, s.exe, batch, row)
        self.optimizer._opt_called = True  # type: ignore[attr-defined]
        return outs[0].clone()  # the executable's loss tensor is overwritten by the next step

    def _call(self, batch: tuple) -> torch.Tensor:
        """The full path of a call: the batch checked, the program found by its key
        (compiled on a miss), every argument gathered and checked, the commit."""
        self._check_batch(batch)
        prog = self._program(batch)
        registrations = _registrations[0]  # after a compile: torch.export registers modules of its own
        if self._batch_sig is None:
            self._batch_sig = [(t.dtype, t.device, t.dim()) for t in batch]
        self._last = prog
        exe = prog.executable
        if exe is not None:
            args, fresh_state, moved = self._bound_args(prog, batch)
        else:
            args, fresh_state, moved = self._gather(prog, batch)
        row = self._guard_row(prog) if exe is not None else None
        self._calls += 1
        pending = None
        with torch.no_grad():
            if exe is not None:
                # the executable writes params and state in place as it launches: a Ctrl-C
                # waits until the whole step is enqueued (the guard decides on the device)
                with _DeferSigint():
                    outs = exe.run(args, None if row is None else (row, self._guard))
                    pending = self._queue(prog, exe, batch, row)
            else:
                outs = prog.run(args, self.precision)
            if exe is None:
                status = {prog.results[i].name: outs[i] for i in prog.status_at}
                if not self._took_effect(_Pending(self._calls, status, prog, args, []), None):
                    return outs[0].detach()  # skipped (non-finite): nothing is written back
            writes = self._prepare_write_back(prog, outs, fresh_state, moved, in_place=exe is not None)
            with _DeferSigint():
                _commit(writes, self.optimizer.state)
            if pending is not None:
                # its guard is read when the step has finished, not now (that would wait for the
                # device). New state entries are stored at once, so that optimizer.state after a good
                # step is complete without a check (a checkpoint may be saved between calls),
                # and taken out again if the step turns out to have failed. (A state tensor
                # moved to the device keeps its value through a failed step: it stays.)
                pending.stored = [w for w in writes if w[0] == "store" and w[4]]
        # what optimizer.step() records, so LR schedulers see a stepped optimizer
        self.optimizer._opt_called = True  # type: ignore[attr-defined]
        if exe is None:
            return outs[0].detach()
        self._steady = Steady.of(self, prog, batch, registrations)
        # the executable's loss tensor is overwritten by the next step: the caller gets a copy
        return outs[0].detach().clone()

    # --- the guard's status --------------------------------------------------
    def check(self) -> None:
        """Raises the deferred error of the last step, if it failed. On the Triton
        backend a step's checks (ids in range; with ``skip_nonfinite``, a finite loss
        and gradients) run on the device and the host reads them lazily: at the next
        call, or here (this waits for the last step to finish). A failed step wrote
        nothing: parameters and optimizer state are as they were before it. On the
        reference backend every call checks its own step, so this never raises."""
        with self._lock:
            self._settle("check()")

    @property
    def skipped_steps(self) -> int:
        """Steps that wrote nothing because their loss or a gradient was not finite
        (``skip_nonfinite=True``). Reading it waits for the last step (and raises
        its deferred error, if it had one)."""
        with self._lock:
            self._settle("skipped_steps")
            return self._skipped

    def _guard_views(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The guard arguments (``guard.py``): views of one [failed, skipped] tensor on
        ``device``, zero until a step fails or is skipped (one copy reads both)."""
        if self._guard is None or self._guard.device != device:
            self._guard = torch.zeros(2, dtype=torch.int64, device=device)
            self._guard_cuda = pin = device.type == "cuda"
            self._guard_host = list(torch.zeros((PENDING_STEPS, 2), dtype=torch.int64, pin_memory=pin).unbind())
            self._guard_next = 0
        return {FAILED: self._guard[0], SKIPPED: self._guard[1]}

    def _guard_row(self, prog: Program) -> torch.Tensor | None:
        """The host row the next step's guard is copied to (``Executable.launch``'s
        ``copy_out``), or None for a program without a guard (nothing to check: no
        ids, no targets, no skip_nonfinite; it cannot fail). With 16 steps in
        flight the oldest is read first (backpressure, as CUDA's own launch queue
        would apply): if it failed, this call raises before it runs."""
        if not prog.gather.guard:
            return None
        if len(self._pending) >= PENDING_STEPS:
            self._settle_one(self._pending[0], f"the next call ({PENDING_STEPS} steps were in flight)")
        k = self._guard_next
        self._guard_next = (k + 1) % PENDING_STEPS
        return self._guard_host[k]

    def _queue(self, prog: Program, exe, batch: tuple, row: torch.Tensor | None) -> _Pending | None:
        """The step just launched, whose guard ``row`` receives after it (the launch's
        event says when): read by a later call, without waiting."""
        if row is None:
            return None
        # the arguments as bound (bind makes a new list when it binds again) and the caller's batch:
        # the error path alone puts them together (the batch slots are overwritten by the next call)
        p = _Pending(self._calls, {}, prog, exe.arguments, [], row, exe.last_event, batch)
        self._pending.append(p)
        return p

    def _poll(self) -> None:
        """Reads the guard of every step that has finished, oldest first, without
        waiting; a step that created optimizer-state entries is waited for (the next
        step would update those entries: a failure found later could not take them
        out), which happens on the first step only."""
        while self._pending and (self._pending[0].ready() or self._pending[0].stored):
            self._settle_one(self._pending[0], "the next call")

    def _settle(self, where: str) -> None:
        """Reads the guard of every launched step (waits for the last one)."""
        while self._pending:
            self._settle_one(self._pending[0], where)

    def _settle_one(self, p: _Pending, where: str) -> None:
        p.wait()
        self._pending.popleft()
        failed, skipped = (int(v) for v in p.guard.tolist())  # a host tensor: no device read
        if failed:
            later = [q.call for q in self._pending]
            for q in [p, *self._pending]:
                with _DeferSigint():
                    _forget(q.stored, self.optimizer.state)
            self._pending.clear()
            self._guard.zero_()  # the device forgets the failure: the next call runs normally
            self._skipped = max(self._skipped, skipped)
            self._raise_bad_ids(p, failed, where, later)
        if skipped > self._skipped:
            with _DeferSigint():
                _forget(p.stored, self.optimizer.state)
            self._skipped = skipped
            log.warning("step %d: non-finite values in the loss or gradients: skipped (parameters and "
                        "optimizer state unchanged; %d step(s) skipped so far)", p.call, self._skipped)  # fmt: skip

    def _raise_bad_ids(self, p: _Pending, bad: int, deferred_to: str | None, later: list[int] = ()) -> None:
        details = describe_bad_ids(p.prog.fn, p.step_args()) or [
            f"{bad} id(s) out of range (not found again in the step's inputs: were they changed since?)"]
        when = f" (reported at {deferred_to}: the Triton backend checks ids on the device without waiting)"
        also = ""
        if later:
            also = (f"; step{'s' if len(later) > 1 else ''} {', '.join(map(str, later))}, launched before this "
                    "was read, wrote nothing either")  # fmt: skip
        if deferred_to and deferred_to.startswith("the next call"):
            also += "; this call did not run either"
        raise IndexError(f"step {p.call} of this compiled step failed: {'; '.join(details)}. It wrote "
                         f"nothing: parameters and optimizer state are as before it"
                         f"{when if deferred_to else ''}{also}")  # fmt: skip

    def _took_effect(self, p: _Pending, deferred_to: str | None) -> bool:
        """Reads a reference step's status right after its run: raises IndexError
        for bad ids; counts and logs a non-finite step (False); True for a step that
        took effect."""
        if not p.status:
            return True  # a program built without the guard
        counts = torch.stack([p.status[k] for k in sorted(p.status)]).tolist()  # one read
        found = dict(zip(sorted(p.status), counts))
        bad, nonfinite = found.get(BAD_IDS, 0), found.get(NONFINITE, 0)
        if not bad and not nonfinite:
            return True
        with _DeferSigint():
            _forget(p.stored, self.optimizer.state)
        if bad:
            self._raise_bad_ids(p, bad, deferred_to)
        self._skipped += 1
        log.warning("step %d: %d non-finite value(s) in the loss or gradients: skipped (parameters and "
                    "optimizer state unchanged; %d step(s) skipped so far)", p.call, nonfinite, self._skipped)  # fmt: skip
        return False

    def _bound_args(self, prog: Program, batch: tuple):
        """``_gather`` for the executable, per call only what can change: the batch,
        the hyper-parameters, the seeds and the state tensors (a state tensor seen
        before is not checked again: the executable compares its storage)."""
        g = prog.gather
        if g is None:
            g = prog.gather = _GatherPlan.of(prog)
        for i, p in g.params:
            if _DATA_PTR(g.fixed[i]) != _DATA_PTR(p):  # p.data = ... moved its storage (same shape: same key)
                g.fixed[i] = p.detach()
        args = list(g.fixed)
        for i, k in g.batch:
            args[i] = batch[k]
        if g.guard:
            views = self._guard_views(prog.executable.device)
            for i, name in g.guard:
                args[i] = views[name]
        if g.hyper:
            hyper = hyper_values(self.optimizer, prog.compilation.spec)
            for i, name in g.hyper:
                args[i] = hyper[name]
        state = self.optimizer.state
        for i, p in g.momentum_fresh:
            args[i] = 0.0 if "momentum_buffer" in state.get(p, {}) else 1.0
        for i in g.seeds:
            # one draw from torch's default generator per step: torch.manual_seed reproduces runs
            args[i] = int(torch.randint(0, 2**31 - 1, (), dtype=torch.int64))
        fresh: dict[str, torch.Tensor] = {}
        moved: dict[str, torch.Tensor] = {}
        seen = prog.seen_state
        for p, items in g.by_param:
            entry = state.get(p)  # Tensor.__hash__ is a Python call: once per parameter
            for i, name, key in items:
                v = entry.get(key) if entry is not None else None
                if v is not None and seen.get(i) is v:
                    args[i] = v
                else:
                    self._bind_state(prog, args, fresh, moved, i, p, name, key, v)
        return args, fresh, moved

    def _bind_state(self, prog: Program, args: list, fresh: dict, moved: dict, i: int, p: torch.Tensor, name: str,
                    key: str, v) -> None:  # fmt: skip
        """A state argument not seen last call: checked, moved to the device, or created."""
        if v is None:
            t = torch.zeros((), dtype=_step_dtype(), device=p.device) if key == "step" else distributed.fresh_state(p, prog.args[i].type)
            fresh[name] = t
        else:
            s = prog.args[i]
            t = _checked_state(name.split("::")[0], key, v, p, to_torch_dtype(elem_of(s.type)), shape_of(s.type))
            if t.data_ptr() != v.data_ptr():
                moved[name] = t
            else:
                prog.seen_state[i] = v
        args[i] = t

    def _gather(self, prog: Program, batch: tuple):
        """The reference executor's arguments: ``(args, fresh, {})``, ``fresh`` the
        state entries this step creates."""
        c = prog.compilation
        device = next(self.model.parameters()).device
        hyper = hyper_values(self.optimizer, c.spec)
        by_name = {n: p for n, p in c.captured.params.items()}
        fresh: dict[str, torch.Tensor] = {}
        args = []
        hyper_at: list[tuple[int, float]] = []  # (argument index, value): filled from one device tensor below
        for s in prog.args:
            if s.role == "param":
                args.append(by_name[s.name].detach())
            elif s.role == "buffer":
                args.append(c.captured.buffers[s.name])
            elif s.role == "batch":  # in the argument's dtype: a narrow-int batch widened to int64 (the
                t = batch[c.captured.batch_names.index(s.name)]  # executable's copy casts the same way)
                args.append(t.to(to_torch_dtype(elem_of(s.type))))
            elif s.role == "seed":
                # one draw from torch's default generator per step: torch.manual_seed reproduces runs
                args.append(torch.randint(0, 2**31 - 1, (), dtype=torch.int64).to(device))
            elif s.role == "hyper":
                if s.name.endswith("::momentum_buffer_fresh"):
                    p = by_name[s.name.split("::")[0]]
                    value = 0.0 if "momentum_buffer" in self.optimizer.state.get(p, {}) else 1.0
                else:
                    value = hyper[s.name]
                hyper_at.append((len(args), float(value)))
                args.append(None)
            elif s.role == "state":
                pname, key = s.name.split("::")
                p = by_name[pname]
                v = self.optimizer.state.get(p, {}).get(key)
                if v is not None:
                    args.append(_checked_state(pname, key, v, p, to_torch_dtype(elem_of(s.type)), shape_of(s.type)))
                else:
                    t = torch.zeros((), dtype=_step_dtype(), device=device) if key == "step" else distributed.fresh_state(p, s.type)
                    fresh[s.name] = t
                    args.append(t)
            elif s.role == GUARD:
                # the reference step is read right after it runs: nothing failed before it
                args.append(torch.zeros((), dtype=torch.int64, device=device))
            else:
                raise AssertionError(f"unknown argument role {s.role}")
        if hyper_at:
            # every hyper-parameter in one host-to-device copy (not one tensor and copy each):
            # each argument is a 0-d view of it, read fresh at every call (LR schedulers work)
            values = torch.tensor([v for _, v in hyper_at], dtype=torch.float64).to(device)
            for k, (i, _) in enumerate(hyper_at):
                args[i] = values[k]
        return args, fresh, {}

    def _prepare_write_back(self, prog: Program, outs: list[torch.Tensor], fresh: dict, moved: dict,
                            in_place: bool = False) -> list[tuple]:  # fmt: skip
        """Every write of the commit, checked and materialised: ``("copy", dst, src)``
        with equal shapes and dtypes, or ``("store", param, key, tensor, created)``.
        ``in_place`` (the executable): the results of params and existing state are
        the bound tensors themselves, already written; fresh and moved state tensors
        are stored as they are (the executable keeps writing into them), ``step``
        included: on the device, as torch keeps it for capturable or fused optimizers."""
        by_name = prog.compilation.captured.params
        state = self.optimizer.state
        writes: list[tuple] = []
        if in_place and not fresh and not moved:
            return writes  # the executable wrote every param and state in place
        for s, v in zip(prog.results, outs, strict=True):
            if s.role == "param":
                dst = by_name[s.name]
                if v.shape != dst.shape or v.dtype != dst.dtype:
                    raise AssertionError(f"program result for {s.name} is {v.dtype}{list(v.shape)}, "
                                         f"the parameter {dst.dtype}{list(dst.shape)}")  # fmt: skip
                if not (in_place and v.data_ptr() == dst.data_ptr()):
                    writes.append(("copy", dst, v))
            elif s.role == "buffer":  # a buffer the forward writes (batch norm's running statistics)
                dst = prog.compilation.captured.buffers[s.name]
                if not (in_place and v.data_ptr() == dst.data_ptr()):
                    writes.append(("copy", dst, v))
            elif s.role == "state":
                pname, key = s.name.split("::")
                p = by_name[pname]
                cur = state.get(p, {}).get(key)
                if in_place and (s.name in fresh or s.name in moved):
                    writes.append(("store", p, key, v, s.name in fresh))
                elif in_place and cur is not None and v.data_ptr() == cur.data_ptr():
                    continue  # written in place
                elif s.name not in fresh and cur is not None:
                    # an existing entry, checked in _gather: updated in place (a 1-element step keeps its layout)
                    writes.append(("copy", cur, v.to(cur.dtype).reshape(cur.shape)))
                elif key == "step":
                    # PyTorch's layout: a 0-d CPU tensor (unless capturable/fused)
                    writes.append(("store", p, key, v.detach().to("cpu").clone(), True))
                else:
                    writes.append(("store", p, key, v.detach().clone(memory_format=torch.preserve_format), True))
        return writes

    # --- introspection -----------------------------------------------------
    def explain(self, plots: str | os.PathLike | None = None, ir: bool = False,
                ir_dir: str | os.PathLike | None = None, measure: bool = False, top: int = 10) -> str:  # fmt: skip
        """A readable summary of the last-used program, as ``//`` lines: the program
        and how it runs; the pipeline's stages with the ops of ``@train_step`` after
        each (and the kernels, once configured); the fusion groups; every kernel's
        bytes, FLOPs, roofline bound and predicted time (``nova.schedule.cost``), the
        ``top`` most expensive of them, with the measured time beside the predicted
        one after ``profile()`` (``measure=True`` profiles first: CUDA only); the
        memory plan and the remat choices.

        The stages run again with every stage's IR kept in the short form of
        ``nova.ir.pretty`` (each source location once, at the top): ``ir=True``
        appends it after ``// ===== after stage: NAME =====`` headers, ``ir_dir``
        writes it to ``NN-STAGE.mlir`` files there. ``plots``: a directory that
        receives ``memory_timeline.png`` and, on the Triton backend, ``roofline.png``
        (every kernel on the device's roofline). Reads the last step's deferred
        status first (``check()``: it may raise)."""
        from nova import explain as ex
        from nova.transforms import remat
        from nova.transforms.plan_memory import plot_timeline, report

        if self._last is None:
            raise RuntimeError("explain() needs one call of the step first (the batch shapes select the program)")
        if measure:
            self.profile()
        with self._lock:
            self._settle("explain()")
        prog = self._last
        last = prog.compilation
        c = pipeline.Compilation(self.model, last.batch, self.optimizer, self.precision, last.step_dtype)
        c.device = last.device
        c.skip_nonfinite = last.skip_nonfinite
        c.memory_budget = last.memory_budget
        c.recompute = last.recompute
        c.data_parallel = self.data_parallel
        with self._lock, _COMPILE_LOCK:
            stats = ex.run_stages(c)
        # the launch scratch is known from the lowered kernels of the program that ran
        c.memory.scratch_bytes, c.memory.scratch_what = last.memory.scratch_bytes, last.memory.scratch_what
        kernels = measured = None
        if last.device is not None:
            from nova.schedule.cost import kernel_costs

            kernels = kernel_costs(prog.fn, last.device, self.precision, last.memory.placements)
            profiled = getattr(self, "_profile", None)
            if profiled is not None and profiled[0] is prog:
                measured = profiled[1].by_index()
        batch = ", ".join(f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in last.batch)
        head = [f"program: {type(self.model).__name__}, batch {batch}, precision {self.precision}, backend "
                f"{self.backend}" + (f", scheduled for {last.device.name}" if last.device is not None else "")
                + f"; runs as: {self.mode}"]  # fmt: skip
        ahead = prog.executable.ahead if prog.executable is not None else None
        if ahead:  # nova.runtime.compile_ahead walked its launch list
            head.append(f"kernels compiled before the first run: {ahead['kernels']} (and {ahead.get('launchers', 0)} "
                        f"launchers) on {ahead['threads']} threads in {ahead['seconds']:.1f} s "
                        f"({ahead['launches']} launches walked)")  # fmt: skip
        memory = [*report(c.memory), *remat.report(c.remat), *distributed.report(c)]
        if plots is not None:
            path = Path(plots) / "memory_timeline.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            plot_timeline(c.memory, path)
            memory.append(f"memory timeline: {path}")
            if kernels is not None:
                ex.plot_roofline(kernels, last.device, Path(plots) / "roofline.png", measured)
                memory.append(f"roofline: {Path(plots) / 'roofline.png'}")
        text = ex.summary(head, stats, last.module, kernels, last.device, measured, memory, top)
        if ir_dir is not None:
            paths = ex.write_ir(c.stages, ir_dir)
            text += f"// the IR of every stage: {len(paths)} files in {ir_dir} ({paths[0].name} ... {paths[-1].name})\n"
        if ir:
            text += ex.stage_text(c.stages)
        return text

    def profile(self, *batch: torch.Tensor, repeat: int = 3, clock=None):
        """Measures every kernel of a step with CUDA events, beside the cost model's
        prediction (``nova.runtime.profile``; ``explain()`` shows it afterwards).
        With ``batch``, ``step(*batch)`` runs first (a real training step, as any
        call); then the launch list that call bound is run ``repeat`` times, one pair
        of events around each launch, the device kept ahead of the host, and every
        parameter, optimizer-state and guard tensor is put back as it was: profiling
        itself changes nothing. Returns a ``nova.runtime.profile.Measured`` (median
        seconds per launch). Needs the Triton backend on a CUDA device (``clock``:
        a stand-in for the device's events, for tests); anywhere else it raises
        ``MeasureError`` before running anything."""
        from nova.runtime.profile import MeasureError, measure
        from nova.schedule.cost import kernel_costs

        device = next(self.model.parameters()).device
        if clock is None and (self.backend != "triton" or device.type != "cuda"):
            raise MeasureError(
                f"profile() times the Triton backend's kernels with CUDA events; this step runs on the {self.backend} "
                f"backend on {device}" + (" (Triton's interpreter on the CPU)" if self.backend == "triton" else "")
                + ": measuring needs a CUDA device, and nothing was run or measured")  # fmt: skip
        if batch:
            self(*batch)
        if self._last is None:
            raise RuntimeError("profile() needs one call of the step first (or a batch: profile(*batch))")
        with self._lock:
            self._settle("profile()")
            prog = self._last
            if prog.executable is None:
                raise MeasureError(f"profile(): the last-used program has no executable (backend {self.backend})")
            c = prog.compilation
            kernels = kernel_costs(prog.fn, c.device, self.precision, c.memory.placements)
            result = measure(prog.executable, kernels, c.device.mem_bandwidth, clock, repeat)
        self._profile = (prog, result)
        return result

    # --- data parallelism (nova.runtime.distributed) -----------------------
    def full_optimizer_state(self) -> dict:
        """``optimizer.state_dict()`` in PyTorch's layout; under zero1 the shards of
        every rank gathered (a collective: every rank calls it)."""
        with self._lock:
            self._settle("full_optimizer_state()")
            return distributed.full_optimizer_state(self.optimizer, self.data_parallel)

    def load_full_optimizer_state(self, state_dict: dict) -> None:
        """Loads a state dict in PyTorch's layout (under zero1 each rank keeps its shard)."""
        with self._lock:
            self._settle("load_full_optimizer_state()")
            distributed.load_full_optimizer_state(self.optimizer, self.data_parallel, state_dict)

    def global_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The mean over the ranks of each rank's ``loss`` (a collective)."""
        return distributed.global_loss(loss)

    def kernel_sources(self) -> dict[str, str]:
        """The generated Triton source of every kernel of the last-used program."""
        if self._last is None or self._last.kernels is None:
            raise RuntimeError("kernel_sources() needs a step run with backend='triton'")
        return self._last.kernels.sources()

    @property
    def memory_plan(self):
        """The last-used program's ``nova.transforms.plan_memory.MemoryPlan``
        (``peak_bytes``: the predicted peak of a step)."""
        if self._last is None:
            raise RuntimeError("memory_plan needs one call of the step first (the batch shapes select the program)")
        return self._last.compilation.memory

    @property
    def mode(self) -> str:
        """How the last-used program runs: ``reference`` (op by op with torch),
        ``graph`` (one CUDA graph replay) or ``launch list`` (its kernels one by one,
        and why, where a graph could not be captured)."""
        if self._last is None or self._last.executable is None:
            return "reference" if self.backend == "reference" else "not run yet"
        return self._last.executable.mode

    @property
    def compile_report(self) -> dict:
        """Where the last-used program's compile went, in seconds: ``stages`` (each
        pipeline stage, and the step cache's lookup, restore or store), ``pipeline``
        (their sum), ``lower`` (kernel sources and launch list), ``ahead`` (the kernels
        compiled on the thread pool before the first run: ``kernels``, ``launchers``, ``threads``,
        ``seconds``; empty before the first run or where there was no walk) and
        ``cache`` (the step cache's status)."""
        if self._last is None:
            raise RuntimeError("compile_report needs one call of the step first (the batch shapes select the program)")
        c = self._last.compilation
        stages = {k: round(v, 4) for k, v in c.times.items() if k != "lower"}
        ahead = self._last.executable.ahead if self._last.executable is not None else None
        return {"stages": stages, "pipeline": round(sum(stages.values()), 4), "lower": round(c.times.get("lower", 0.0), 4),
                "ahead": dict(ahead or {}), "cache": c.cache}

    @property
    def num_programs(self) -> int:
        return len(self._programs)


def _checked_state(pname: str, key: str, v, p: torch.Tensor, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    """An existing ``optimizer.state[p][key]`` as the program's argument, or a clear
    error: a wrong shape would be broadcast silently, another dtype or device would
    be computed in and written back into silently."""
    where = f"optimizer.state[{pname!r}][{key!r}]"
    if not isinstance(v, torch.Tensor):
        raise CaptureError(f"{where} is a {type(v).__name__}, not a tensor (torch.optim keeps tensors)")
    if key == "step":
        # torch keeps a 0-d float tensor on the CPU (on the parameter's device when capturable)
        if v.numel() != 1 or not v.is_floating_point():
            raise CaptureError(f"{where} must be a one-element float tensor, got {v.dtype}{list(v.shape)}")
        return v.detach().reshape(()).to(device=p.device, dtype=dtype)
    if tuple(v.shape) != tuple(shape) or v.dtype != dtype or v.device != p.device:
        raise CaptureError(f"{where} is {v.dtype}{list(v.shape)} on {v.device}; the parameter is "
                           f"{dtype}{list(shape)} on {p.device} (nothing was run or written)")  # fmt: skip
    return v.detach()


def _forget(stored: list[tuple], state) -> None:
    """Takes out the optimizer-state entries a failed step created (the ones it
    stored, if nothing replaced them since), so that ``optimizer.state`` is as it
    was before the step: the gate kept every existing tensor's value, but a new
    entry (zero moments, step 0) did not exist then."""
    for _, p, key, t, *_ in stored:
        entry = state.get(p)
        if entry is not None and entry.get(key) is t:
            del entry[key]
            if not entry:
                del state[p]


def _commit(writes: list[tuple], state) -> None:
    """The write-back: nothing in here can fail on checked inputs (same-shape,
    same-dtype, same-device copies and dict stores), so it is all-or-nothing."""
    for w in writes:
        if w[0] == "copy":
            w[1].copy_(w[2])
        else:
            state[w[1]][w[2]] = w[3]  # state is a defaultdict in torch.optim.Optimizer


def _step_dtype() -> torch.dtype:
    # torch.optim's _get_scalar_dtype()
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_bytes(value: int | str | None, what: str) -> int | None:
    """``12884901888``, ``"12GiB"``, ``"500 MiB"``, ``"1.5GB"`` -> bytes (None stays None)."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    elif isinstance(value, str):
        text = value.strip().upper().replace(" ", "")
        digits = text.rstrip("KMGIB")
        unit = text[len(digits):]
        try:
            n = int(float(digits) * _UNITS[unit])
        except (ValueError, KeyError):
            raise ValueError(f"{what} must be a number of bytes or a size like '12GiB' or '500MB', "
                             f"got {value!r}") from None  # fmt: skip
    else:
        raise TypeError(f"{what} must be an int (bytes) or a string like '12GiB', got {type(value).__name__}")
    if n <= 0:
        raise ValueError(f"{what} must be positive, got {value!r}")
    return n


def compile(model: torch.nn.Module, optimizer: torch.optim.Optimizer, precision: str = "fp32",
            backend: str = "auto", skip_nonfinite: bool = False, cuda_graph: bool = True,
            memory_budget: int | str | None = None, data_parallel=None, remat: bool = True) -> CompiledStep:  # fmt: skip
    """Compiles ``model``'s forward + loss, its gradient and ``optimizer``'s
    update into one step. ``step(*batch)`` runs it and returns the loss.
    ``skip_nonfinite``: a step whose loss or a gradient is NaN or inf writes
    nothing (no error; counted in ``step.skipped_steps`` and logged).
    ``cuda_graph`` (Triton backend on CUDA): replay the step as one CUDA graph
    from its second call (False: launch its kernels one by one; same results).
    ``memory_budget`` (bytes, or a size like ``"12GiB"``): the remat stage
    recomputes more of the forward in the backward until the plan's predicted
    peak fits, or compiling raises naming the smallest peak it can reach.
    ``data_parallel`` (ddp, zero1 or a ``nova.DataParallel``): one rank of a
    torch.distributed job, gradients averaged over the ranks (``docs/distributed.md``).
    ``remat=False``: the backward reads every activation the forward kept, none
    recomputed (the remat stage's default rule off): faster where the recomputes
    cost time, at a higher peak (the 46M MLP LM at batch 8 on an H100: +1.4% tokens/s
    for +0.24 GiB; GPT-2 124M bf16 at batch 32: +2.0% for +3.8 GiB). The same
    results either way: a recompute is bit-identical."""
    return CompiledStep(model, optimizer, precision, backend, skip_nonfinite, cuda_graph, memory_budget,
                        data_parallel, remat)
