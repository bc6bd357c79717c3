"""The executable: a compiled step as step time replays it.

Compile time leaves three things (XLA's buffer assignment plus its thunk list):

  arena        one device allocation; every intermediate of the step is a view of
               it at the offset ``plan_memory`` gave it (the plan's ``arena``
               and ``input`` placements; a permuted placement is the permuted
               view of its slice, a window a strided view of its cat's buffer)
  slots        static addresses for what changes between calls: the batch tensors
               (arena slots the call copies into), and one small buffer holding
               every hyper-parameter and seed (filled by ONE host-to-device copy)
  launch list  every kernel with its input and output tensors bound once; views
               (transpose, broadcast, slice, reshape) are made at bind time and
               launch nothing, nor does a cat assembled from windows (its pieces'
               kernels wrote them there); 0-d constants are computed at bind time

Parameters, optimizer state and model buffers are the caller's tensors, bound as
they are; the plan's ``inplace`` results are computed straight into them. The
returned loss (and gradients, status counts) live in persistent tensors outside
the arena; the caller copies what it hands out.

A step call is then: copy the batch into its slots, one H2D copy of the scalars,
and either every launch of the list, or the replay of one CUDA graph captured
from that list (on the second call: the first runs the list eagerly, which
compiles every Triton kernel outside capture). Where capture fails, the reason
is logged once and the list is run from then on. The list and the graph run the
same kernels on the same addresses, so they compute bit-identical steps.

Rebinding: the launch list holds the external tensors' addresses. When a
parameter's or a state tensor's storage changes (``p.data = ...``, an optimizer
``load_state_dict``), ``bind`` builds the list again and drops the graph.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from xdsl.ir import SSAValue

from nova.ir.module import arg_slots, result_slots, return_op
from nova.ir.types import elem_of, numel, shape_of, to_torch_dtype
from nova.log import get_logger
from nova.transforms.plan_memory import EXTERNAL_ROLES, TORCH_BLOCK, UPDATED_ROLES, MemoryPlan, _align, placed_view, window_view

_LOG = get_logger(__name__)
_DATA_PTR = torch.Tensor.data_ptr
SCALAR_ROWS = 16  # host rows of hyper-parameters and seeds in flight (see Executable._write_scalars)


@dataclass
class Launch:
    name: str
    run: Callable[..., list[torch.Tensor]]  # (inputs, outs) -> outs
    ins: list[torch.Tensor]
    outs: list[torch.Tensor]
    scratch: torch.Tensor | None = None  # a planned arena slice for the launch's scratch
    kernel: bool = False  # a generated kernel's launch (not a copy, not a collective): compile_ahead walks it
    caller_outs: tuple[int, ...] = ()  # the outputs that are the caller's tensors (parameters, state), in place

    def __call__(self, outs: list[torch.Tensor] | None = None) -> None:
        outs = self.outs if outs is None else outs
        if self.scratch is None:
            self.run(self.ins, outs)
        else:
            self.run(self.ins, outs, scratch=self.scratch)


def _empty(v: SSAValue, device) -> torch.Tensor:
    return torch.empty(shape_of(v.type), dtype=to_torch_dtype(elem_of(v.type)), device=device)


def _reshape_copy(ins: list[torch.Tensor], outs: list[torch.Tensor]) -> list[torch.Tensor]:
    outs[0].view(ins[0].shape).copy_(ins[0])
    return outs


def _copy_into(ins: list[torch.Tensor], outs: list[torch.Tensor]) -> list[torch.Tensor]:
    outs[0].copy_(ins[0])
    return outs


class Executable:
    """See the module docstring. ``program`` is a ``nova.backends.triton.TritonProgram``
    (its steps: the launch order ``plan_memory`` planned), ``plan`` its MemoryPlan."""

    def __init__(self, program, plan: MemoryPlan, device: torch.device, cuda_graph: bool = True):
        self.program, self.plan, self.device = program, plan, torch.device(device)
        fn = program.fn
        self.block = fn.body.block
        self.slots = arg_slots(fn)
        self.results = result_slots(fn)
        self.returned = list(return_op(fn).operands)
        self.external = [i for i, s in enumerate(self.slots) if s.role in EXTERNAL_ROLES]
        self.arg_of = {s.name: i for i, s in enumerate(self.slots) if s.role in EXTERNAL_ROLES}
        self.batch_args = [i for i, s in enumerate(self.slots) if s.role == "batch"]
        self.hyper_args = [i for i, s in enumerate(self.slots) if s.role == "hyper"]
        self.seed_args = [i for i, s in enumerate(self.slots) if s.role == "seed"]
        self.arena: torch.Tensor | None = None  # allocated at the first bind (and again after release())
        # hyper-parameters (f64) then seeds (i64), 8 bytes each: one H2D copy per call
        n = len(self.hyper_args) + len(self.seed_args)
        self.scalars = torch.zeros(max(n, 1), dtype=torch.float64, device=self.device)
        # the host side: SCALAR_ROWS pinned rows used in turn, each free again once the
        # event recorded after its copy has completed (the copy reads it asynchronously)
        self._rows: list[tuple[torch.Tensor, object]] | None = None  # (pinned row, its numpy view)
        self._row_events: list = [None] * SCALAR_ROWS  # per launch in turn: recorded after it (CUDA)
        self.last_event = None  # the last launch's event (CUDA): it has finished once this completes
        self._row = 0
        self.want_graph = cuda_graph and self.device.type == "cuda"
        self.graph_failed: str | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.launches: list[Launch] = []
        self.bound: list[int] | None = None  # the data pointers of the external tensors the list holds
        self.arguments: list[torch.Tensor] = []  # every argument as bound (the batch slots, the scalar views)
        self.inputs: list[torch.Tensor] = []  # the batch slots
        self.outputs: list[torch.Tensor] = []  # one per result
        self.runs = 0  # eager runs of the bound list (the graph is captured after one)
        self.ahead: dict | None = None  # compile_ahead's figures, once it has walked the list

    # --- binding -----------------------------------------------------------
    def _arena_view(self, v: SSAValue, offset: int) -> torch.Tensor:
        dtype = to_torch_dtype(elem_of(v.type))
        shape = shape_of(v.type)
        return self.arena[offset:offset + numel(shape) * dtype.itemsize].view(dtype).view(shape)

    def _storage(self, v: SSAValue, ext: Sequence[torch.Tensor]) -> torch.Tensor:
        p = self.plan.placements[v]
        if p.kind == "arena" and p.perm is not None:  # its buffer holds v.permute(perm) densely
            shape = shape_of(v.type)
            held = self._arena_view(v, p.offset).view([shape[d] for d in p.perm])
            return placed_view(held, p.perm)
        if p.kind == "arena":
            return self._arena_view(v, p.offset)
        if p.kind == "window":  # its window of a cat's buffer holds v.permute(perm), or v flattened
            root = self._arena_view(p.root, self.plan.placements[p.root].offset)
            return window_view(root, p.window, p.perm, shape_of(v.type))
        if p.kind == "inplace":
            return ext[self.arg_of[p.arg]]
        if p.kind in ("output", "const", "empty"):
            return _empty(v, self.device)
        raise AssertionError(f"a kernel result placed as {p.kind!r}")

    def bind(self, ext: Sequence[torch.Tensor]) -> None:
        """Binds the launch list to ``ext`` (one tensor per argument; only the
        param / state / buffer entries are read). Cheap when nothing changed."""
        ptrs = list(map(_DATA_PTR, map(ext.__getitem__, self.external)))  # C-level iteration: this runs every call
        if self.bound is not None and ptrs == self.bound:
            return
        if self.arena is None:
            self.arena = torch.empty(max(_align(self.plan.arena_bytes, TORCH_BLOCK), TORCH_BLOCK),
                                     dtype=torch.uint8, device=self.device)  # fmt: skip
        for i in self.external:
            want = (shape_of(self.slots[i].type), to_torch_dtype(elem_of(self.slots[i].type)))
            if (tuple(ext[i].shape), ext[i].dtype) != want or ext[i].device != self.device:
                s = self.slots[i]
                raise ValueError(f"{s.role} {s.name} is {ext[i].dtype}{list(ext[i].shape)} on {ext[i].device}; the "
                                 f"step was compiled for {want[1]}{list(want[0])} on {self.device}")  # fmt: skip
            if not ext[i].is_contiguous():
                s = self.slots[i]
                raise ValueError(f"{s.role} {s.name} is not contiguous (strides {tuple(ext[i].stride())}): "
                                 "the compiled step reads and writes it as a dense tensor")  # fmt: skip
        if self.bound is not None:
            _LOG.info("a parameter or state tensor was replaced: the launch list is bound again")
        self.graph = None
        env: dict[SSAValue, torch.Tensor] = {}
        for i, (a, s) in enumerate(zip(self.block.args, self.slots, strict=True)):
            if s.role in EXTERNAL_ROLES:
                env[a] = ext[i]
            elif s.role == "batch":
                env[a] = self._arena_view(a, self.plan.placements[a].offset)
            elif s.role == "hyper":
                env[a] = self.scalars[self.hyper_args.index(i)]
            elif s.role == "seed":
                env[a] = self.scalars.view(torch.int64)[len(self.hyper_args) + self.seed_args.index(i)]
            else:
                raise AssertionError(f"argument role {s.role}")
        self.inputs = [env[self.block.args[i]] for i in self.batch_args]
        launches: list[Launch] = []
        for st in self.program.steps:
            ins = [env[v] for v in st.inputs]
            run = st.run
            if st.is_view:
                if self.plan.placements[st.outputs[0]].kind == "view":  # made once, launches nothing
                    env[st.outputs[0]] = st.run(ins)[0]
                    continue
                run = _reshape_copy  # a reshape the strides do not allow: a copy into its buffer
            if self.plan.placements[st.outputs[0]].assembled:  # a cat of the windows its pieces were written to
                env[st.outputs[0]] = self._storage(st.outputs[0], ext)
                continue
            outs = [self._storage(r, ext) for r in st.outputs]
            caller = tuple(i for i, r in enumerate(st.outputs) if self.plan.placements[r].kind == "inplace")
            launch = Launch(st.op.name, run, ins, outs, kernel=run is st.run and (st.kernel is not None or st.sources
                            is not None), caller_outs=caller)  # fmt: skip
            if st.op in self.plan.scratch_at:  # its scratch is planned in the arena too
                off, size = self.plan.scratch_at[st.op]
                launch.scratch = self.arena[off:off + size]
            if all(self.plan.placements[r].kind == "const" for r in st.outputs):
                launch()  # a 0-d constant: computed once
            else:
                launches.append(launch)
            env.update(zip(st.outputs, outs, strict=True))
        self.outputs = []
        for s, v in zip(self.results, self.returned, strict=True):
            t = env[v]
            if s.role in UPDATED_ROLES:
                target = ext[self.arg_of[s.name]]
                if not _same(t, target):
                    launches.append(Launch("copy back " + s.name, _copy_into, [t], [target]))
                self.outputs.append(target)
            elif self.plan.placements.get(v) is not None and self.plan.placements[v].kind == "output":
                self.outputs.append(t)
            else:  # a view, an argument or a value another result shares: its own copy
                out = _empty(v, self.device)
                launches.append(Launch("copy out " + s.name, _copy_into, [t], [out]))
                self.outputs.append(out)
        self.launches = launches
        self.bound = ptrs
        self.arguments = [env[a] for a in self.block.args]
        self.runs = 0
        if self.ahead is None:  # the first bind, before any batch is copied in: the walk may overwrite the arena
            self.compile_ahead()

    def release(self) -> None:
        """Frees the arena, the launch list and the graph (another program of the same
        step runs now: one arena at a time, not one per cached program). The next
        call binds again, and captures the graph again one call later."""
        self.graph, self.launches, self.bound, self.arena = None, [], None, None
        self.inputs, self.outputs, self.arguments, self.runs = [], [], [], 0

    # --- running -----------------------------------------------------------
    def run(self, args: Sequence, copy_out: tuple | None = None) -> list[torch.Tensor]:
        """One step. ``args``: one entry per argument: tensors for params, state,
        buffers and the batch, Python numbers for hyper-parameters and seeds.
        Returns the persistent result tensors (param / state results are the bound
        tensors themselves, updated in place; the rest are overwritten by the next step).
        ``copy_out``: see ``launch``."""
        self.bind(args)
        return self.launch([args[i] for i in self.batch_args], [args[i] for i in self.hyper_args],
                           [args[i] for i in self.seed_args], copy_out)  # fmt: skip

    def launch(self, batch: Sequence[torch.Tensor], hyper: Sequence[float], seeds: Sequence[int],
               copy_out: tuple | None = None) -> list[torch.Tensor]:  # fmt: skip
        """``run`` after its ``bind``: the batch into its slots, the scalars, then the
        graph (or the list). The caller (``run``, or a step whose steady state holds:
        ``nova.runtime.steady``) knows the list is bound to the tensors it updates.

        ``copy_out`` (host row, device tensor): copied after the step without waiting
        (the guard's counts, ``CompiledStep``), before the launch's one event
        (``last_event``), which also frees this launch's scalar row. With it the caller
        promises that the launch ``SCALAR_ROWS`` before this one has completed
        (``CompiledStep`` reads the guard of every step before it has 16 in flight), so
        the row is reused without asking the device; without it, the event of that
        launch is waited for (at once unless the host is that far ahead)."""
        if len(batch) != len(self.inputs):
            raise ValueError(f"the step takes {len(self.inputs)} batch tensors, got {len(batch)}")
        cuda = self.device.type == "cuda"
        k, self._row = self._row, (self._row + 1) % SCALAR_ROWS
        event = self._row_events[k]
        if event is not None and copy_out is None:
            event.synchronize()
        torch._foreach_copy_(self.inputs, batch)  # one dispatch (on CUDA one multi-tensor kernel), not one per tensor
        if self.hyper_args or self.seed_args:
            self._write_scalars(hyper, seeds, k)
        if self.graph is not None:
            self.graph.replay()
        elif self.want_graph and self.graph_failed is None and self.runs >= 1:
            self._capture()
            if self.graph is not None:
                self.graph.replay()
            else:
                self._run_list()
        else:
            self._run_list()
        if copy_out is not None:
            copy_out[0].copy_(copy_out[1], non_blocking=cuda)
        if cuda:
            if event is None:
                event = self._row_events[k] = torch.cuda.Event()
            event.record()  # after the scalars' copy, the step and the copy out: one event per launch
        self.last_event = event if cuda else None
        return self.outputs

    def _run_list(self) -> None:
        for launch in self.launches:
            launch()
        self.runs += 1

    def compile_ahead(self) -> None:
        """Every kernel of the list compiled on a thread pool before the first run
        (``nova.runtime.compile_ahead``): the list walked once with no kernel compiled
        or launched for the first time; a launch writing the caller's tensors writes
        views of the arena instead (nothing in the arena is live before a call
        copies its batch in), so the walk leaves parameters and state as they were. Once per
        executable (kernels stay compiled); not off CUDA or under the interpreter. A
        program's collectives are no kernel launches and are not walked; a launch that
        reads one's results finishes it first, and none was issued: nothing to wait for."""
        import time

        from nova.config import triton_interpreted
        from nova.runtime.compile_ahead import ahead, threads

        self.ahead = {}  # walked (or not to be): once
        workers = threads()
        if self.device.type != "cuda" or triton_interpreted() or workers < 2:
            return
        t0 = time.perf_counter()
        walked, stats = self._walk(ahead(workers))
        self.ahead = {"launches": walked, "kernels": stats["submitted"], "launchers": stats["launchers"],
                      "threads": workers, "seconds": time.perf_counter() - t0}  # fmt: skip
        _LOG.info("compiled %d kernels (%d launchers) of %d launches on %d threads in %.1f s", stats["submitted"],
                  self.ahead["launchers"], walked, workers, self.ahead["seconds"])  # fmt: skip

    def _walk(self, context) -> tuple[int, dict]:
        """Every kernel launch of the list once inside ``context`` (``compile_ahead.ahead``),
        the caller's tensors among its outputs replaced by views of the arena. Returns
        (launches walked, the context's counts: ``submitted`` kernels, ``launchers``)."""
        walked = 0
        with context as stats:
            for launch in self.launches:
                if not launch.kernel:
                    continue
                outs, end = list(launch.outs), 0
                for i in launch.caller_outs:
                    o = outs[i]
                    n = o.numel() * o.element_size()
                    if end + n > self.arena.numel():
                        break  # (never for a step that updates in place: its arena holds the gradients)
                    outs[i] = self.arena[end:end + n].view(o.dtype).view(o.shape)
                    end = _align(end + n, 256)
                else:
                    launch(outs)
                    walked += 1
        return walked, stats

    def _write_scalars(self, hyper: Sequence[float], seeds: Sequence[int], k: int) -> None:
        """Row ``k`` of the pinned host rows (free: ``launch`` saw to it) to the device."""
        cuda = self.device.type == "cuda"
        if self._rows is None:
            rows = torch.zeros((SCALAR_ROWS, self.scalars.numel()), dtype=torch.float64, pin_memory=cuda)
            # views made once: the per-call writes are plain numpy stores into pinned memory
            self._rows = [(r, r.numpy()) for r in rows.unbind()]
        row, host = self._rows[k]
        nh = len(hyper)
        host[:nh] = hyper
        if seeds:
            host.view("int64")[nh:nh + len(seeds)] = seeds
        self.scalars.copy_(row, non_blocking=cuda)

    def _capture(self) -> None:
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                for launch in self.launches:
                    launch()
        except Exception as e:  # noqa: BLE001  (any capture failure: say why once, run the list)
            self.graph_failed = f"{type(e).__name__}: {e}"
            _LOG.warning("the step cannot be captured as a CUDA graph (%s): it runs as a launch list of %d kernels",
                         self.graph_failed, len(self.launches))  # fmt: skip
            torch.cuda.synchronize(self.device)
            return
        self.graph = graph

    @property
    def mode(self) -> str:
        """``graph`` once captured, else ``launch list`` (and why, when capture failed)."""
        if self.graph is not None:
            return "graph"
        return "launch list" + (f" (capture failed: {self.graph_failed})" if self.graph_failed else "")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype)  # fmt: skip
