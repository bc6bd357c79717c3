"""nova.verify: does the compiled step train what eager PyTorch trains?

    report = nova.verify(model, optimizer, (x, y), steps=3)
    print(report)          # a table: per step the loss and the worst parameter / state differences
    assert report.ok

Two deep copies of the user's model and optimizer are made; one is stepped by
``nova.compile``, the other by eager ``loss.backward(); optimizer.step()``
(under ``torch.autocast(bfloat16)`` for ``precision="bf16"``, with tf32 matmuls
allowed for ``"tf32"``). After every step the loss, every parameter and every
optimizer-state tensor are compared. The user's objects are never stepped.

Every difference is one number, the *relative difference*

    rel(nova, eager) = ||nova - eager|| / max(||eager||, TINY)

with Euclidean norms over all elements of the tensor, computed in float64 (for
the loss, a scalar, that is |a - b| / max(|b|, TINY)). It is the measure of
tests/numerics and tests/gpu, so their measured bounds carry over. A NaN or inf
that is not in the same place with the same value on both sides is an infinite
difference.

Adam-family updates move each element by about lr * sign(g), whatever |g| is,
so an element whose gradient is at rounding-noise level gets its update's sign
from rounding, and two correct executions differ there by up to 2 lr. The
gradient each Adam step normalized is read back from ``exp_avg`` (before and
after the step) on both sides; elements where both are below
``NOISE_FLOOR[precision] * max|g|`` of their tensor, and not both exactly zero,
(or every element of a tensor whose largest gradient is itself below that
fraction of the model's largest) are excluded from the parameter and state comparison from the step they appear
on, and the report counts them per parameter (for example the key slice of a
GPT's ``c_attn.bias``, whose true gradient is exactly zero because softmax
ignores a per-query constant). SGD is linear in g and compares every element.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from dataclasses import dataclass, field

import torch

TINY = 1e-30


@dataclass(frozen=True)
class Tolerance:
    """Largest relative differences (see the module docstring) a correct step shows."""

    loss: float
    param: float
    state: float
    why: str


# Why each bound. Measured figures: 3-5 steps of the MLP LM and the bias-carrying GPT (SDPA and
# hand-written attention) from the same weights on the CPU, AdamW, three batch sets; SGD is tighter.
TOLERANCES = {
    # float64 parameters: the two sides differ only in summation order (measured <= 4e-13);
    # 1e-9 leaves room for longer runs and larger tensors.
    "float64": Tolerance(1e-9, 1e-9, 1e-8, "float64: summation-order rounding only (measured <= 4e-13)"),
    # float32: measured <= 2.7e-5 (parameters) and 3e-5 (state); the suite's 50 AdamW steps stay
    # under 2.7e-5 too. State is held to 10x, as in the suite (exp_avg_sq squares the gradient).
    "fp32": Tolerance(1e-4, 1e-4, 1e-3, "fp32: f32 rounding (measured <= 3e-5)"),
    # tf32 (GPU; on the CPU it is fp32): operands rounded to 10 mantissa bits. The loss and SGD's
    # parameters to 5e-4 as in tests/gpu/gpu_steps.py. Adam's parameters to 2e-2: elements whose
    # gradient is under tf32's noise take their update's sign from it, so two correct tf32 runs
    # (even cuBLAS against cuBLAS) differ there by 2 lr (README, "Measured on the H200").
    "tf32": Tolerance(5e-4, 5e-4, 5e-3, "tf32: 10-bit operands (tests/gpu tolerance)"),
    "tf32-adam": Tolerance(5e-4, 2e-2, 2e-1, "tf32 + Adam: sign noise of small gradients (README)"),
    # bf16 against eager autocast: 8-bit mantissas. Loss measured <= 4e-5, held to 2e-2 as in the
    # suite and tests/gpu. Parameters measured <= 3.4e-2 and state <= 2.7e-2: zero-initialised bias
    # vectors of the attention models move by +-lr per Adam step, so their small gradients' bf16
    # error decides their direction (the README's known gap, up to 0.25 without the noise floor).
    "bf16": Tolerance(2e-2, 1e-1, 1e-1, "bf16 vs autocast: 8-bit mantissas (measured <= 3.4e-2)"),
}

# |g| below this fraction of its tensor's max|g| (on both sides) is rounding noise, for Adam only.
# float64: the key slice of c_attn.bias, whose true gradient is 0, measures 3e-18 of max|g| (the
# smallest real elements 3e-5); 1e-12 excludes exactly that slice. fp32: that slice is 2e-9, but
# zero-initialised biases still differ by up to 7e-4 with a floor of 1e-6 and 2.7e-5 with 1e-5;
# 1e-4 (about 1e3 units of roundoff, ~1% of the elements) leaves margin. bf16 (8 mantissa bits):
# biases differ by up to 0.5 with 1e-4, 0.25 with 1e-3, 3.4e-2 with 3e-3 (~15% of the elements).
# tf32 (10 bits, unmeasured: the CPU has no tf32) sits between, at 1e-3.
NOISE_FLOOR = {"float64": 1e-12, "fp32": 1e-4, "tf32": 1e-3, "tf32-adam": 1e-3, "bf16": 3e-3}
# A tensor whose largest |g| is below this fraction of the model's largest is noise as a whole
# (a key bias: softmax ignores it, its true gradient is 0, and its own max is noise too).
# Measured on transformers' BERT (tests/hf_models.py): its key biases' max |g| is 2e-12 of the
# model's max in fp32 and 5e-21 in float64; its smallest real tensors (query biases) 8e-6 in both.
# The floors sit between, about a thousand times from each; tf32 and bf16 (unmeasured: the CPU
# has neither) get one and two orders more room for their coarser rounding.
WHOLE_TENSOR_FLOOR = {"float64": 1e-14, "fp32": 1e-8, "tf32": 1e-7, "tf32-adam": 1e-7, "bf16": 1e-6}


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / max(||b||, TINY) (Euclidean norms over all elements, in float64);
    b is the reference (eager)."""
    a, b = a.detach().to(torch.float64), b.detach().to(torch.float64).to(a.device)
    if a.shape != b.shape:
        return float("inf")
    if a.numel() == 0:
        return 0.0
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    if not torch.equal(fa, fb):
        return float("inf")
    na, nb = a[~fa], b[~fb]
    if not ((na == nb) | (na.isnan() & nb.isnan())).all():
        return float("inf")  # non-finite values that are not the same on both sides
    a, b = a[fa], b[fb]
    if a.numel() == 0:
        return 0.0
    return ((a - b).norm() / b.norm().clamp_min(TINY)).item()


@dataclass
class StepResult:
    """One step's comparison. ``params`` / ``state``: name -> relative difference
    (state names are ``"<param>::<key>"``)."""

    step: int
    loss: float
    eager_loss: float
    loss_diff: float
    params: dict[str, float]
    state: dict[str, float]
    tolerance: Tolerance

    @property
    def worst_param(self) -> tuple[str, float]:
        return max(self.params.items(), key=lambda kv: kv[1], default=("-", 0.0))

    @property
    def worst_state(self) -> tuple[str, float]:
        return max(self.state.items(), key=lambda kv: kv[1], default=("-", 0.0))

    @property
    def ok(self) -> bool:
        t = self.tolerance
        return self.loss_diff <= t.loss and self.worst_param[1] <= t.param and self.worst_state[1] <= t.state

    def failures(self) -> list[str]:
        """One line per value over its tolerance, naming it."""
        t, out = self.tolerance, []
        if not self.loss_diff <= t.loss:
            out.append(f"step {self.step}: loss differs by {self.loss_diff:.3e} > {t.loss:g}")
        out += [f"step {self.step}: parameter {n} differs by {d:.3e} > {t.param:g}" for n, d in self.params.items()
                if not d <= t.param]  # fmt: skip
        out += [f"step {self.step}: optimizer state {n} differs by {d:.3e} > {t.state:g}"
                for n, d in self.state.items() if not d <= t.state]  # fmt: skip
        return out


@dataclass
class VerifyReport:
    """What ``nova.verify`` found: ``ok``, ``steps`` (a ``StepResult`` each), ``failures()``."""

    precision: str
    backend: str
    dtype: torch.dtype
    tolerance: Tolerance
    steps: list[StepResult] = field(default_factory=list)
    excluded: dict[str, int] = field(default_factory=dict)  # noise-driven elements, per parameter

    @property
    def ok(self) -> bool:
        return bool(self.steps) and all(s.ok for s in self.steps)

    def __bool__(self) -> bool:
        return self.ok

    def failures(self) -> list[str]:
        return [line for s in self.steps for line in s.failures()]

    def as_dicts(self) -> list[dict]:
        """Per-step numbers as plain data (one dict per step)."""
        return [dict(step=s.step, loss=s.loss, eager_loss=s.eager_loss, loss_diff=s.loss_diff,
                     worst_param=s.worst_param, worst_state=s.worst_state, ok=s.ok,
                     params=dict(s.params), state=dict(s.state)) for s in self.steps]  # fmt: skip

    def __str__(self) -> str:
        t = self.tolerance
        head = (f"nova.verify: {'OK' if self.ok else 'FAILED'}  precision={self.precision} backend={self.backend} "
                f"dtype={str(self.dtype).replace('torch.', '')}  tolerance: loss {t.loss:g}, "
                f"params {t.param:g}, state {t.state:g} (||nova-eager|| / ||eager||)")  # fmt: skip
        rows = [("step", "nova loss", "eager loss", "loss diff", "worst param", "diff", "worst state", "diff", "")]
        for s in self.steps:
            (pn, pd), (sn, sd) = s.worst_param, s.worst_state
            rows.append((str(s.step), f"{s.loss:.6g}", f"{s.eager_loss:.6g}", f"{s.loss_diff:.1e}", pn, f"{pd:.1e}",
                         sn, f"{sd:.1e}", "ok" if s.ok else "FAIL"))  # fmt: skip
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [head] + ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        if self.excluded:
            most = sorted(self.excluded.items(), key=lambda kv: -kv[1])
            ex = ", ".join(f"{n} ({k})" for n, k in most[:3]) + (", ..." if len(most) > 3 else "")
            lines.append(f"not compared, gradient below rounding noise: {sum(self.excluded.values())} elements "
                         f"of {len(most)} parameters: {ex}")  # fmt: skip
        fails = self.failures()
        lines += fails[:10] + ([f"... and {len(fails) - 10} more"] if len(fails) > 10 else [])
        return "\n".join(lines)

    __repr__ = __str__


# --- copies -----------------------------------------------------------------


def _param_names(model: torch.nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}  # tied parameters: their first name


def copy_pair(model: torch.nn.Module, optimizer: torch.optim.Optimizer):
    """A deep copy of ``model`` and a new optimizer of ``optimizer``'s class over the
    copy's parameters, with the same param_groups and a deep copy of the state."""
    names = _param_names(model)
    clone = copy.deepcopy(model)
    by_name = dict(clone.named_parameters())
    groups = []
    for g, group in enumerate(optimizer.param_groups):
        params = []
        for i, p in enumerate(group["params"]):
            if id(p) not in names:
                raise ValueError(f"optimizer param_groups[{g}] parameter {i} (shape {tuple(p.shape)}) "
                                 "is not a parameter of the model")  # fmt: skip
            params.append(by_name[names[id(p)]])
        groups.append({**{k: copy.deepcopy(v) for k, v in group.items() if k != "params"}, "params": params})
    cls = type(optimizer)
    accepted = inspect.signature(cls).parameters
    opt = cls(groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted and k != "params"})
    # deep copy: load_state_dict keeps tensors that already have the right dtype and device,
    # so without it the copy would step the user's own state tensors
    opt.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    return clone, opt


def _storages(model: torch.nn.Module, opt: torch.optim.Optimizer) -> set[int]:
    ts = [*model.parameters(), *model.buffers()]
    ts += [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return {t.untyped_storage().data_ptr() for t in ts if t.numel() > 0}


def _dropout_modules(model: torch.nn.Module) -> list[str]:
    return [f"{n or type(model).__name__} ({type(m).__name__}, p={m.p})" for n, m in model.named_modules()
            if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0]  # fmt: skip


# --- the comparison ---------------------------------------------------------


def _exp_avgs(opt: torch.optim.Optimizer) -> dict:
    return {p: st["exp_avg"].detach().clone() for p, st in opt.state.items() if "exp_avg" in st}


def _adam_gradients(opt: torch.optim.Optimizer, before: dict) -> dict:
    """The gradient each Adam step normalized (weight decay and maximize included), from
    exp_avg before and after it: m1 = b1 m0 + (1 - b1) g. Read from the state, so it is
    the same quantity for Nova (which exposes no .grad) and for eager PyTorch."""
    out = {}
    for group in opt.param_groups:
        b1 = float(group["betas"][0])
        for p in group["params"]:
            m1 = opt.state.get(p, {}).get("exp_avg")
            if m1 is not None:
                m0 = before.get(p)
                m0 = torch.zeros_like(m1, dtype=torch.float64) if m0 is None else m0.to(torch.float64)
                g = (m1.detach().to(torch.float64) - b1 * m0) / (1 - b1)
                # m1's own rounding (a few ulps of m0) is not a gradient: a decaying m with g = 0
                # (an embedding row not in the batch) reads as exactly 0, as it is
                ulps = 8 * torch.finfo(m1.dtype).eps * m0.abs() / (1 - b1)
                out[p] = torch.where(g.abs() <= ulps, torch.zeros_like(g), g)
    return out


def _batches(batch_or_batches) -> list[tuple]:
    if isinstance(batch_or_batches, torch.Tensor):
        return [(batch_or_batches,)]
    if isinstance(batch_or_batches, tuple):
        return [batch_or_batches]
    if isinstance(batch_or_batches, list) and batch_or_batches:
        return [b if isinstance(b, tuple) else (b,) for b in batch_or_batches]
    raise TypeError("batch_or_batches must be a tuple of tensors (one batch) or a non-empty list of them")


def _key(model: torch.nn.Module, precision: str) -> str:
    dtypes = {p.dtype for p in model.parameters()}
    return "float64" if dtypes == {torch.float64} and precision == "fp32" else precision


def _eager_context(model: torch.nn.Module, precision: str):
    if precision == "bf16":
        return torch.autocast(next(model.parameters()).device.type, dtype=torch.bfloat16)
    if precision == "tf32":
        from nova.backends.reference import precision_mode

        return precision_mode("tf32")
    return contextlib.nullcontext()


def verify(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch_or_batches, steps: int = 3,
           precision: str = "fp32", backend: str = "auto") -> VerifyReport:  # fmt: skip
    """Runs ``steps`` compiled steps and ``steps`` eager PyTorch steps side by side on
    deep copies of ``model`` and ``optimizer`` and compares loss, parameters and
    optimizer state after each. A batch is a tuple of tensors (the step's positional
    arguments); a list of tuples gives one batch per step, cycled. The user's model
    and optimizer are not changed. Raises ``ValueError`` for a model in training mode
    with active dropout: Nova's dropout masks are not torch's bit stream."""
    import nova

    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    batches = _batches(batch_or_batches)
    if model.training and (drop := _dropout_modules(model)):
        raise ValueError(
            "nova.verify cannot compare a model in training mode with dropout: Nova draws its masks with its "
            "own counter-based RNG (torch's distribution, not torch's bit stream), so the two sides would "
            f"drop different elements. Active dropout: {', '.join(drop)}. Call model.eval() (dropout off, "
            "as Nova compiles the eval-mode forward) or set p=0 to verify."
        )
    normalizes = isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))  # normalize the gradient
    key = _key(model, precision) + ("-adam" if precision == "tf32" and normalizes else "")
    tol, floor = TOLERANCES[key], NOISE_FLOOR[key]
    mine, opt_mine = copy_pair(model, optimizer)
    ref, opt_ref = copy_pair(model, optimizer)
    user = _storages(model, optimizer)
    if user & _storages(mine, opt_mine) or user & _storages(ref, opt_ref) or (
        _storages(mine, opt_mine) & _storages(ref, opt_ref)):  # fmt: skip
        raise AssertionError("nova.verify: the copies share storage with each other or with the user's tensors")
    compiled = nova.compile(mine, opt_mine, precision=precision, backend=backend)
    ref_params = dict(ref.named_parameters())
    noise: dict[str, torch.Tensor] = {}  # name -> bool mask of excluded elements
    report = VerifyReport(precision, compiled.backend, next(model.parameters()).dtype, tol)
    for i in range(steps):
        batch = batches[i % len(batches)]
        before = (_exp_avgs(opt_mine), _exp_avgs(opt_ref)) if normalizes else None
        rng = torch.get_rng_state()
        loss = compiled(*batch)
        if not torch.equal(rng, torch.get_rng_state()):
            raise ValueError(
                "nova.verify cannot compare this step: the compiled step draws random numbers (functional "
                "dropout in forward?), and Nova's random numbers are not torch's bit stream"
            )
        opt_ref.zero_grad(set_to_none=True)
        with _eager_context(ref, precision):
            ref_loss = ref(*batch)
        ref_loss.backward()
        opt_ref.step()
        if normalizes:
            g_mine, g_ref = _adam_gradients(opt_mine, before[0]), _adam_gradients(opt_ref, before[1])
            # a tensor whose every gradient is noise (a key bias: its true gradient is 0) has a
            # noise-level max of its own, so the floor is also taken against the model's largest
            model_max = max((g.abs().max() for g in g_ref.values() if g.numel()), default=torch.tensor(0.0))
            for (n, p), q in zip(mine.named_parameters(), ref_params.values(), strict=True):
                if p in g_mine and q in g_ref:
                    gn, ge = g_mine[p].abs().to(q.device), g_ref[q].abs()
                    small = ge.max() * floor
                    if ge.max() <= model_max.to(ge.device) * WHOLE_TENSOR_FLOOR[key]:
                        small = torch.maximum(ge.max(), gn.max().to(ge.dtype))  # all of it is noise
                    m = (gn <= small) & (ge <= small) & ~((gn == 0) & (ge == 0))
                    noise[n] = noise[n] | m if n in noise else m
        params, state = {}, {}
        for (n, p), q in zip(mine.named_parameters(), ref_params.values(), strict=True):
            keep = ~noise[n] if n in noise and noise[n].any() else None
            params[n] = rel_diff(p[keep], q[keep]) if keep is not None else rel_diff(p, q)
            s, r = opt_mine.state.get(p, {}), opt_ref.state.get(q, {})
            for k in sorted(set(s) | set(r)):
                a, b = s.get(k), r.get(k)
                if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
                    same = not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor) and a == b
                    state[f"{n}::{k}"] = 0.0 if same else float("inf")  # missing on one side
                elif keep is not None and a.shape == p.shape:
                    state[f"{n}::{k}"] = rel_diff(a[keep], b[keep])
                else:
                    state[f"{n}::{k}"] = rel_diff(a, b)
        lv, rv = loss.item(), ref_loss.item()
        report.steps.append(StepResult(i, lv, rv, rel_diff(torch.tensor(lv), torch.tensor(rv)), params, state, tol))
    report.excluded = {n: int(m.sum()) for n, m in noise.items() if m.any()}
    return report
