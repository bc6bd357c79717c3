"""nova.verify: the compiled step against eager PyTorch, as a user-facing check.

It must pass on the models Nova supports, fail (naming the parameter) when a VJP
rule or an optimizer formula is broken, and leave the user's model and optimizer
exactly as they were. The deliberately broken compilers are monkeypatched, run
with a private NOVA_CACHE_DIR and a batch shape no other test uses, and every
such test verifies the repaired compiler again on the same inputs, so no cache
can hand a broken program to a later test unnoticed.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

import nova
import nova.transforms.optimizer as optimizer_stage
from nova.autodiff import rules
from nova.ir import dialect as nv
from nova.models import GPT, MLPLM, MLPLMConfig, gpt_tiny
from nova.verification import TOLERANCES, VerifyReport, copy_pair, rel_diff


def make_model(kind: str, dtype=torch.float64, **gpt) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "mlp":
        m = MLPLM(MLPLMConfig(vocab_size=256, block_size=32, n_layer=2, n_embd=64, hidden=128))
    else:
        m = GPT(gpt_tiny(attention=kind, **gpt))
    return m.to(dtype)


OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.01),
}


def batches(n: int, B: int = 4, T: int = 32, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x, y = torch.randint(0, 256, (B, T), generator=g), torch.randint(0, 256, (B, T), generator=g)
        y[0, :3] = -1  # ignored targets
        out.append((x, y))
    return out


@pytest.mark.parametrize("opt_name", ["adamw", "sgd"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("kind", ["mlp", "sdpa", "manual"])
def test_passes_on_supported_models(kind, dtype, opt_name):
    model = make_model(kind, dtype)
    report = nova.verify(model, OPTIMIZERS[opt_name](model.parameters()), batches(3), steps=3, backend="reference")
    assert isinstance(report, VerifyReport) and isinstance(report.ok, bool)
    assert report.ok, str(report)
    assert [s.step for s in report.steps] == [0, 1, 2]
    tol = TOLERANCES["float64" if dtype == torch.float64 else "fp32"]
    assert report.tolerance == tol
    for s in report.steps:
        assert s.loss_diff <= tol.loss and s.worst_param[1] <= tol.param and s.worst_state[1] <= tol.state
        assert set(s.params) == {n for n, _ in model.named_parameters()}
        assert math.isfinite(s.loss) and math.isfinite(s.eager_loss)


def test_bf16_against_autocast():
    model = make_model("mlp", torch.float32)
    report = nova.verify(model, OPTIMIZERS["adamw"](model.parameters()), batches(2), precision="bf16",
                         backend="reference")  # fmt: skip
    assert report.ok, str(report)
    assert report.tolerance == TOLERANCES["bf16"]
    # bf16 really ran on both sides: the loss is not the fp32 loss
    fp32 = nova.verify(model, OPTIMIZERS["adamw"](model.parameters()), batches(2), steps=1, backend="reference")
    assert fp32.steps[0].eager_loss != report.steps[0].eager_loss


def test_user_model_and_optimizer_untouched():
    model = make_model("sdpa", torch.float64)
    opt = OPTIMIZERS["adamw"](model.parameters())
    # existing state (and grads): load_state_dict would alias these tensors without a deep copy
    x, y = batches(1, seed=7)[0]
    model(x, y).backward()
    opt.step()
    params = {n: (p, p.detach().clone(), p.grad.clone()) for n, p in model.named_parameters()}
    state = {id(p): {k: (v, v.clone()) for k, v in st.items()} for p, st in opt.state.items()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    group_params = [list(g["params"]) for g in opt.param_groups]
    report = nova.verify(model, opt, batches(3), steps=3, backend="reference")
    assert report.ok, str(report)
    for n, p in model.named_parameters():
        obj, value, grad = params[n]
        assert p is obj and torch.equal(p.detach(), value) and torch.equal(p.grad, grad), n
    assert {id(p) for p in opt.state} == set(state)
    for p, st in opt.state.items():
        assert set(st) == set(state[id(p)])
        for k, v in st.items():
            obj, value = state[id(p)][k]
            assert v is obj and torch.equal(v, value), k
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == groups
    assert [list(g["params"]) for g in opt.param_groups] == group_params
    assert all(a is b for g, h in zip(opt.param_groups, group_params) for a, b in zip(g["params"], h))
    assert model.training


def test_copies_rebind_and_share_no_storage():
    model = make_model("sdpa", torch.float64)
    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0, "lr": 3e-4}]  # fmt: skip
    opt = torch.optim.AdamW(groups, lr=1e-3, betas=(0.8, 0.95))
    x, y = batches(1, seed=7)[0]
    model(x, y).backward()
    opt.step()
    clone, opt2 = copy_pair(model, opt)
    assert type(opt2) is torch.optim.AdamW
    clone_params = {id(p) for p in clone.parameters()}
    assert all(id(p) in clone_params for g in opt2.param_groups for p in g["params"])
    assert clone.lm_head.weight is clone.transformer.wte.weight  # tied stays tied
    for g, h in zip(opt.param_groups, opt2.param_groups):
        assert {k: v for k, v in g.items() if k != "params"} == {k: v for k, v in h.items() if k != "params"}
    user = {t.untyped_storage().data_ptr() for t in model.parameters()}
    user |= {v.untyped_storage().data_ptr() for st in opt.state.values() for v in st.values()}
    for (n, p), q in zip(model.named_parameters(), clone.parameters()):
        assert q.untyped_storage().data_ptr() not in user, n
        for k, v in opt2.state[q].items():
            assert v.untyped_storage().data_ptr() not in user, (n, k)
            assert torch.equal(v, opt.state[p][k]), (n, k)


def test_rel_diff_definition():
    b = torch.tensor([3.0, 4.0])  # ||b|| = 5
    assert rel_diff(torch.tensor([3.0, 4.5]), b) == pytest.approx(0.1)  # ||a - b|| / ||b|| = 0.5 / 5
    assert rel_diff(b, b) == 0.0
    assert rel_diff(torch.tensor([1e-31]), torch.tensor([0.0])) == pytest.approx(0.1)  # ||b|| floored at 1e-30
    nan = float("nan")
    assert rel_diff(torch.tensor([nan, 3.0, 4.5]), torch.tensor([nan, 3.0, 4.0])) == pytest.approx(0.1)  # same NaN
    assert rel_diff(torch.tensor([nan, 1.0]), torch.tensor([1.0, 1.0])) == math.inf
    assert rel_diff(torch.tensor([math.inf]), torch.tensor([-math.inf])) == math.inf
    assert rel_diff(torch.ones(2), torch.ones(3)) == math.inf


def test_batches_cycle_and_single_batch():
    model = make_model("mlp", torch.float64)
    bs = batches(2)
    cycled = nova.verify(model, OPTIMIZERS["sgd"](model.parameters()), bs, steps=3, backend="reference")
    spelled = nova.verify(model, OPTIMIZERS["sgd"](model.parameters()), [bs[0], bs[1], bs[0]], steps=3,
                          backend="reference")  # fmt: skip
    assert [s.eager_loss for s in cycled.steps] == [s.eager_loss for s in spelled.steps]
    one = nova.verify(model, OPTIMIZERS["sgd"](model.parameters()), bs[0], steps=2, backend="reference")
    assert one.ok and len(one.steps) == 2 and one.steps[0].eager_loss == cycled.steps[0].eager_loss
    with pytest.raises(TypeError):
        nova.verify(model, OPTIMIZERS["sgd"](model.parameters()), [], backend="reference")


def test_report_table_and_data():
    model = make_model("mlp", torch.float64)
    report = nova.verify(model, OPTIMIZERS["adamw"](model.parameters()), batches(2), steps=2, backend="reference")
    text = str(report)
    lines = text.splitlines()
    assert lines[0].startswith("nova.verify: OK") and "precision=fp32" in lines[0] and "dtype=float64" in lines[0]
    assert lines[1].split()[:4] == ["step", "nova", "loss", "eager"]
    assert lines[2].split()[0] == "0" and lines[3].split()[0] == "1" and lines[2].split()[-1] == "ok"
    rows = report.as_dicts()
    assert [r["step"] for r in rows] == [0, 1]
    assert rows[0]["worst_param"][0] in rows[0]["params"] and rows[0]["loss_diff"] == report.steps[0].loss_diff
    assert report.failures() == [] and bool(report) is True


def test_key_bias_noise_is_excluded_and_counted():
    # the key slice of c_attn.bias has an exactly zero true gradient (tests/numerics/test_step_equivalence.py):
    # under Adam both sides step it by +-lr on rounding noise, so verify leaves out exactly those elements
    model = make_model("sdpa", torch.float64)
    report = nova.verify(model, OPTIMIZERS["adamw"](model.parameters()), batches(3), backend="reference")
    assert report.ok, str(report)
    assert report.excluded == {f"transformer.h.{i}.attn.c_attn.bias": 64 for i in range(2)}
    assert "not compared, gradient below rounding noise: 128 elements" in str(report)
    sgd = nova.verify(model, OPTIMIZERS["sgd"](model.parameters()), batches(3), backend="reference")
    assert sgd.ok and sgd.excluded == {}  # SGD is linear in the gradient: everything is compared


# --- dropout ------------------------------------------------------------------


def test_dropout_in_training_mode_is_refused_naming_the_module():
    model = make_model("manual", torch.float64, dropout=0.1)
    opt = OPTIMIZERS["sgd"](model.parameters())
    with pytest.raises(ValueError, match=r"transformer\.drop \(Dropout, p=0\.1\)") as e:
        nova.verify(model, opt, batches(1), backend="reference")
    assert "bit stream" in str(e.value) and "model.eval()" in str(e.value)
    model.eval()
    report = nova.verify(model, opt, batches(2), steps=2, backend="reference")
    assert report.ok, str(report)
    assert not model.training


class FunctionalDropout(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8, dtype=torch.float64)

    def forward(self, x, y):  # no nn.Dropout module to find: only the step's RNG use shows it
        return F.cross_entropy(F.dropout(self.lin(x), 0.5, training=True), y)


def test_functional_dropout_is_refused():
    torch.manual_seed(0)
    model = FunctionalDropout()
    x, y = torch.randn(4, 8, dtype=torch.float64), torch.randint(0, 8, (4,))
    with pytest.raises(ValueError, match="draws random numbers"):
        nova.verify(model, OPTIMIZERS["sgd"](model.parameters()), (x, y), backend="reference")


# --- deliberately broken compilers ---------------------------------------------------

BROKEN_BATCH = dict(B=3, T=16, seed=11)  # a shape no other test compiles


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NOVA_CACHE_DIR", str(tmp_path / "cache"))


def _verify_broken_then_repaired(monkeypatch, model, opt, break_it):
    data = batches(2, **BROKEN_BATCH)
    assert nova.verify(model, opt, data, steps=2, backend="reference").ok  # healthy before
    with monkeypatch.context() as m:
        break_it(m)
        broken = nova.verify(model, opt, data, steps=2, backend="reference")
    repaired = nova.verify(model, opt, data, steps=2, backend="reference")
    assert repaired.ok, "a broken program outlived its monkeypatch:\n" + str(repaired)
    return broken


def test_broken_vjp_rule_fails_naming_the_parameter(monkeypatch, private_cache):
    # doubling the cotangent of a MulOp's first operand (attention's score scaling, LayerNorm's and
    # GELU's products, ...) corrupts the gradients that flow through it; SGD puts them into the weights
    original = rules.VJP_RULES[nv.MulOp]

    def doubled(b, op, cts):
        out = original(b, op, cts)
        return [b.scale(out[0], 2.0) if out[0] is not None else None, *out[1:]]

    model = make_model("manual", torch.float64, bias=False)
    opt = OPTIMIZERS["sgd"](model.parameters())
    report = _verify_broken_then_repaired(
        monkeypatch, model, opt, lambda m: m.setitem(rules.VJP_RULES, nv.MulOp, doubled)
    )
    assert not report.ok and not report.steps[0].ok
    names = {n for n, _ in model.named_parameters()}
    name, diff = report.steps[0].worst_param
    assert name in names and diff > 1e-6, str(report)
    assert f"step 0: parameter {name} differs by {diff:.3e} > 1e-09" in report.failures()
    assert report.steps[0].worst_state[0] in {f"{n}::momentum_buffer" for n in names}
    # the first loss is computed before any update: it still matches, the damage is in the update
    assert report.steps[0].loss_diff <= report.tolerance.loss
    lines = str(report).splitlines()
    assert lines[0].startswith("nova.verify: FAILED") and lines[2].split()[-1] == "FAIL" and name in str(report)


def test_broken_optimizer_formula_fails_naming_the_parameter(monkeypatch, private_cache):
    # AdamW without its decoupled weight decay: every parameter is off by lr * wd * p per step
    original = optimizer_stage._adam

    def no_weight_decay(b, gs, h, p, grad, st):
        return original(b, gs, {**h, "weight_decay": b.scalar(0.0, h["weight_decay"])}, p, grad, st)

    model = make_model("mlp", torch.float64)
    opt = OPTIMIZERS["adamw"](model.parameters())
    report = _verify_broken_then_repaired(
        monkeypatch, model, opt, lambda m: m.setattr(optimizer_stage, "_adam", no_weight_decay)
    )
    assert not report.ok
    failed = {line.split()[3] for line in report.failures() if " parameter " in line}
    assert "head.weight" in failed and "wte.weight" in failed, report.failures()


def test_broken_sgd_momentum_fails_naming_the_state(monkeypatch, private_cache):
    # SGD with dampening ignored: the momentum buffer (optimizer state) goes wrong from step 2
    original = optimizer_stage._sgd

    def undamped(b, gs, h, p, grad, st, fresh):
        return original(b, gs, {**h, "dampening": b.scalar(0.0, h["dampening"])}, p, grad, st, fresh)

    model = make_model("mlp", torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, dampening=0.5)
    report = _verify_broken_then_repaired(
        monkeypatch, model, opt, lambda m: m.setattr(optimizer_stage, "_sgd", undamped)
    )
    assert report.steps[0].ok  # the first step copies the gradient into the buffer: no dampening yet
    assert not report.steps[1].ok
    assert report.steps[1].worst_state[0].endswith("::momentum_buffer")
    assert any("optimizer state" in f and "::momentum_buffer" in f for f in report.failures())

