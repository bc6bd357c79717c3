"""CompiledStep: binds the user's module and optimizer to compiled programs.

One call runs forward, backward and the optimizer update. Arguments are
gathered from the live objects by the IR's argument roles (parameters and
buffers by identity, optimizer state in PyTorch's layout, hyper-parameters
from ``param_groups`` at every call), the program runs, and only when it has
finished are the results written back, so a failed step leaves parameters
and optimizer state as they were.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nova import pipeline
from nova.backends.reference import precision_mode, run_function
from nova.config import triton_interpreted
from nova.errors import BatchError, CaptureError
from nova.ir.module import arg_slots, result_slots, step_func
from nova.transforms.optimizer import hyper_values
from nova.transforms.precision import PRECISIONS

BACKENDS = ("reference", "triton", "auto")


@dataclass
class Program:
    compilation: pipeline.Compilation
    kernels: object | None = None  # nova.backends.triton.TritonProgram for the GPU backend

    @property
    def fn(self):
        return step_func(self.compilation.module)

    def run(self, args: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.kernels is not None:
            return self.kernels(args)
        return run_function(self.fn, args)


class CompiledStep:
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, precision: str = "fp32",
                 backend: str = "auto"):  # fmt: skip
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
        self._programs: dict[tuple, Program] = {}
        self._batch_sig: list[tuple[torch.dtype, torch.device, int]] | None = None
        self._last: Program | None = None

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
    def _program(self, batch: tuple) -> Program:
        key = (tuple((tuple(t.shape), t.dtype) for t in batch), self._spec_key(), self.model.training)
        prog = self._programs.get(key)
        if prog is None:
            c = pipeline.Compilation(self.model, batch, self.optimizer, self.precision, _step_dtype())
            c.device = self._device_spec()
            prog = Program(pipeline.run(c))
            if self.backend == "triton":
                from nova.backends.triton import TritonProgram

                prog.kernels = TritonProgram(prog.fn, self.precision)
            self._programs[key] = prog
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
            out.append(tuple(id(p) for p in group["params"]))
            out.append(tuple(sorted((k, v) for k, v in group.items() if k in _STRUCTURAL)))
            out.append(group.get("momentum", 0) != 0)
        return tuple(out)

    # --- running -----------------------------------------------------------
    def __call__(self, *batch: torch.Tensor) -> torch.Tensor:
        self._check_batch(batch)
        prog = self._program(batch)
        if self._batch_sig is None:
            self._batch_sig = [(t.dtype, t.device, t.dim()) for t in batch]
        self._last = prog
        args, fresh_state = self._gather(prog, batch)
        with torch.no_grad(), precision_mode(self.precision):
            outs = prog.run(args)
            self._write_back(prog, outs, fresh_state)
        # what optimizer.step() records, so LR schedulers see a stepped optimizer
        self.optimizer._opt_called = True  # type: ignore[attr-defined]
        return outs[0].detach()

    def _gather(self, prog: Program, batch: tuple):
        c = prog.compilation
        device = next(self.model.parameters()).device
        hyper = hyper_values(self.optimizer, c.spec)
        by_name = {n: p for n, p in c.captured.params.items()}
        fresh: dict[str, torch.Tensor] = {}
        args = []
        for s in arg_slots(prog.fn):
            if s.role == "param":
                args.append(by_name[s.name].detach())
            elif s.role == "buffer":
                args.append(c.captured.buffers[s.name])
            elif s.role == "batch":
                args.append(batch[c.captured.batch_names.index(s.name)])
            elif s.role == "seed":
                # one draw from torch's default generator per step: torch.manual_seed reproduces runs
                args.append(torch.randint(0, 2**31 - 1, (), dtype=torch.int64).to(device))
            elif s.role == "hyper":
                if s.name.endswith("::momentum_buffer_fresh"):
                    p = by_name[s.name.split("::")[0]]
                    value = 0.0 if "momentum_buffer" in self.optimizer.state.get(p, {}) else 1.0
                else:
                    value = hyper[s.name]
                args.append(torch.tensor(value, dtype=torch.float64, device=device))
            elif s.role == "state":
                pname, key = s.name.split("::")
                st = self.optimizer.state.get(by_name[pname], {})
                if key in st and st[key] is not None:
                    args.append(st[key].to(device))
                else:
                    t = torch.zeros((), dtype=_step_dtype(), device=device) if key == "step" else torch.zeros_like(by_name[pname])
                    fresh[s.name] = t
                    args.append(t)
            else:
                raise AssertionError(f"unknown argument role {s.role}")
        return args, fresh

    def _write_back(self, prog: Program, outs: list[torch.Tensor], fresh: dict) -> None:
        by_name = prog.compilation.captured.params
        state = self.optimizer.state
        for s, v in zip(result_slots(prog.fn), outs, strict=True):
            if s.role == "param":
                by_name[s.name].copy_(v)
            elif s.role == "state":
                pname, key = s.name.split("::")
                p = by_name[pname]
                st = state[p]  # defaultdict in torch.optim.Optimizer
                if key in st and st[key] is not None:
                    st[key].copy_(v)
                elif key == "step":
                    # PyTorch's layout: a 0-d CPU tensor (unless capturable/fused)
                    st[key] = v.detach().to("cpu").clone()
                else:
                    st[key] = v.detach().clone(memory_format=torch.preserve_format)

    # --- introspection -----------------------------------------------------
    def explain(self) -> str:
        """The MLIR text of the last-used program after each pipeline stage
        (compiled again with dumping on: the stages rewrite the IR in place)."""
        if self._last is None:
            raise RuntimeError("explain() needs one call of the step first (the batch shapes select the program)")
        last = self._last.compilation
        c = pipeline.Compilation(self.model, last.batch, self.optimizer, self.precision, last.step_dtype)
        c.device = last.device
        pipeline.run(c, dump=True)
        return "\n".join(f"// ===== after stage: {name} =====\n{text}" for name, text in c.stages.items())

    def kernel_sources(self) -> dict[str, str]:
        """The generated Triton source of every kernel of the last-used program."""
        if self._last is None or self._last.kernels is None:
            raise RuntimeError("kernel_sources() needs a step run with backend='triton'")
        return self._last.kernels.sources()

    @property
    def num_programs(self) -> int:
        return len(self._programs)


# option values that change the update's structure; the rest are read each call
_STRUCTURAL = ("maximize", "amsgrad", "nesterov", "decoupled_weight_decay")


def _step_dtype() -> torch.dtype:
    # torch.optim's _get_scalar_dtype()
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def compile(model: torch.nn.Module, optimizer: torch.optim.Optimizer, precision: str = "fp32",
            backend: str = "auto") -> CompiledStep:  # fmt: skip
    """Compiles ``model``'s forward + loss, its gradient and ``optimizer``'s
    update into one step. ``step(*batch)`` runs it and returns the loss."""
    return CompiledStep(model, optimizer, precision, backend)
