"""The steady state of a compiled step: what the fast path of a call checks.

A training loop calls its step again and again with new batch contents and, at
most, new hyper-parameter values (an LR scheduler). Everything else a program
was built from stays as it was. So after a call that ran an executable,
``CompiledStep`` records a ``Steady`` snapshot of everything that call's full
path read (the program key, the gather of the arguments, the executable's
binding); the next call compares it, and when it holds, replays at once: the
batch into its slots, the scalars in one copy, the graph. Any difference sends
the call down the full path, which records a new snapshot.

The comparisons are C-level loops (``map`` over builtin callables and list
equality on ints: no Python frame per element), because this runs every call
and a GPT-2 step has 148 parameters, 444 state tensors and 150 modules. (torch's
C++ check of data pointers, ``torch._C._tensors_data_ptrs_at_indices_equal``,
measured 12x slower than ``map(Tensor.data_ptr, ...)`` on the H200 host: 0.45 ms
for 593 tensors, its arguments converted element by element.)

  batch          the count, and each tensor's class, shape, dtype and device
  registrations  torch's global module / parameter / buffer registration hooks
                 (``nova.api._registrations``): anything assigned to a module
  structure      the sizes of every module's non-empty ``_parameters``,
                 ``_modules`` and ``_buffers``: something deleted (an entry
                 added to an empty one goes through a registration hook)
  training       every module's ``training`` flag (``model.eval()``, or one
                 submodule's)
  tensors        every parameter's and buffer's ``data_ptr`` (``p.data = ...``
                 keeps the object and moves its storage) and every parameter's
                 ``requires_grad`` (freezing)
  optimizer      the structure of ``param_groups``: the list's length, each
                 group's parameters (list equality, which compares identical
                 elements without calling ``Tensor.__eq__``; ids where a group
                 holds a one-element parameter, whose ``__eq__`` would compare
                 values) and its structural options (``optimizer.STRUCTURAL``,
                 momentum on or off); the ``state`` mapping itself
                 (``load_state_dict`` makes a new one) and the ``data_ptr`` of
                 every value of its per-parameter dicts, in order: an entry
                 added or removed, replaced by another tensor (``state[p][k] =
                 t``, a ``.to(device)``) or given other storage (``t.data =
                 ...``). (A value replaced by another tensor over the very same
                 memory is no change: the executable's writes land in it all the
                 same.)

Identities are compared by ``id`` on objects the snapshot holds a reference to,
so an id cannot be reused by a new object while the snapshot lives.
"""

from __future__ import annotations

import itertools
import operator

import torch

from nova.transforms.optimizer import group_structure

_DATA_PTR = torch.Tensor.data_ptr
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_TRAINING = operator.attrgetter("training")
_DICT_VALUES = dict.values
_CHAIN = itertools.chain.from_iterable


class Steady:
    """A snapshot taken after a full call of ``step`` that ran ``prog``'s executable
    (``of``), and its check (``holds``)."""

    __slots__ = ("prog", "exe", "batch", "registrations", "mods", "dicts", "lens", "training", "watch", "ptrs",
                 "params", "grads", "groups", "state", "hyper_names",
                 "hyper_base", "seeds")  # fmt: skip

    @classmethod
    def of(cls, step, prog, batch: tuple, registrations: int) -> Steady | None:
        """The snapshot, or None where the executable is not bound to exactly the
        optimizer's current state tensors (the next call takes the full path)."""
        exe, model, opt = prog.executable, step.model, step.optimizer
        g = prog.gather
        state = opt.state
        for i, p, _name, key in g.state:  # the executable holds these tensors (or aliases of them)
            v = (state.get(p) or {}).get(key)
            if not isinstance(v, torch.Tensor) or _DATA_PTR(v) != _DATA_PTR(exe.arguments[i]):
                return None
        entries = list(state.values())
        if not all(isinstance(v, torch.Tensor) for e in entries for v in e.values()):
            return None  # a state value that is not a tensor: no pointer to compare, the full path checks it
        s = cls.__new__(cls)
        s.prog, s.exe = prog, exe
        s.batch = [(type(t), t.shape, t.dtype, t.device) for t in batch]
        s.registrations = registrations
        s.mods = list(model.modules())
        s.dicts = [d for m in s.mods for d in (m._parameters, m._modules, m._buffers) if d]
        s.lens = list(map(len, s.dicts))
        s.training = list(map(_TRAINING, s.mods))
        s.params = [p for _, p in model.named_parameters(remove_duplicate=False)]
        buffers = [b for _, b in model.named_buffers(remove_duplicate=False)]
        s.watch = s.params + buffers  # then the state values, in order (holds)
        s.ptrs = list(map(_DATA_PTR, s.watch + list(_CHAIN(map(_DICT_VALUES, entries)))))
        s.grads = list(map(_REQUIRES_GRAD, s.params))
        s.groups = [(list(gr["params"]), any(p.numel() == 1 for p in gr["params"]), group_structure(gr))
                    for gr in opt.param_groups]
        s.state = state
        # the hyper-parameters in the executable's order: read each call, except the
        # SGD momentum buffers' "fresh" flags, fixed while the state is (it holds)
        s.hyper_names, s.hyper_base = [], []
        fresh = {i: p for i, p in g.momentum_fresh}
        for j, i in enumerate(exe.hyper_args):
            if i in fresh:
                s.hyper_base.append(0.0 if "momentum_buffer" in state.get(fresh[i], {}) else 1.0)
            else:
                s.hyper_base.append(0.0)
                s.hyper_names.append((j, prog.args[i].name))
        s.seeds = len(exe.seed_args)
        return s

    def holds(self, step, batch: tuple, registrations: int) -> bool:
        """Whether nothing the snapshot recorded has changed (see the module docstring)."""
        if len(batch) != len(self.batch):
            return False
        for t, (cls, shape, dtype, device) in zip(batch, self.batch):
            if type(t) is not cls or t.shape != shape or t.dtype is not dtype or t.device != device:
                return False
        opt = step.optimizer
        if not (registrations == self.registrations
                and list(map(len, self.dicts)) == self.lens
                and list(map(_TRAINING, self.mods)) == self.training
                and list(map(_REQUIRES_GRAD, self.params)) == self.grads
                and opt.state is self.state
                and self._groups_hold(opt.param_groups)):  # fmt: skip
            return False
        try:
            return list(map(_DATA_PTR, self.watch + list(_CHAIN(map(_DICT_VALUES, self.state.values()))))) == self.ptrs
        except TypeError:  # a state value that is no tensor any more
            return False

    def _groups_hold(self, groups: list) -> bool:
        if len(groups) != len(self.groups):
            return False
        for gr, (params, by_id, structure) in zip(groups, self.groups):
            now = gr["params"]
            if by_id:
                if list(map(id, now)) != list(map(id, params)):
                    return False
            else:
                try:
                    if now != params:  # identical elements compare without Tensor.__eq__
                        return False
                except RuntimeError:  # Tensor.__eq__ of two different parameters (its bool is ambiguous)
                    return False
            if group_structure(gr) != structure:
                return False
        return True

    def hyper(self, values: dict[str, float]) -> list[float]:
        """The executable's hyper-parameter list, from ``hyper_values``' dict."""
        out = list(self.hyper_base)
        for j, name in self.hyper_names:
            out[j] = values[name]
        return out
