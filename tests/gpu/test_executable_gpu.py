"""The executable on the H200: CUDA-graph replay against the launch list bit for bit,
the device-side guard (a bad id, a non-finite step) leaving parameters and optimizer
state untouched, and the fused LM head + cross-entropy against PyTorch's unfused
linear + cross_entropy at GPT-2's vocabulary."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import nova

from gpu_steps import TOL, make_model, make_optimizer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _batches(n, B=4, T=32, V=256, seed=1):
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randint(0, V, (B, T), device="cuda", generator=g)
        y = torch.randint(0, V, (B, T), device="cuda", generator=g)
        y[0, :3] = -1
        out.append((x, y))
    return out


def _snapshot(model, opt):
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    return params, state


def _assert_same(model, opt, snap):
    params, state = snap
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), params[n]), f"parameter {n} changed"
    assert {id(p) for p in opt.state} == set(state), "optimizer state entries were added or removed"
    for p, s in opt.state.items():
        for k, v in s.items():
            assert torch.equal(v, state[id(p)][k]), f"optimizer state {k} changed"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["sdpa", "manual"])
def test_graph_replay_is_bit_identical_to_the_launch_list(kind, precision):
    a = make_model(kind).cuda()
    b = copy.deepcopy(a)
    step_a = nova.compile(a, make_optimizer("adamw", a.parameters()), precision=precision, cuda_graph=True)
    step_b = nova.compile(b, make_optimizer("adamw", b.parameters()), precision=precision, cuda_graph=False)
    for i, (x, y) in enumerate(_batches(6)):
        la, lb = step_a(x, y), step_b(x, y)
        assert torch.equal(la, lb), f"step {i}: loss {la.item()} vs {lb.item()}"
    assert step_a.mode == "graph" and step_b.mode == "launch list", (step_a.mode, step_b.mode)
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), f"parameter {n} differs between graph replay and the launch list"


def test_a_bad_id_leaves_parameters_and_state_unchanged():
    model = make_model("sdpa").cuda()
    opt = make_optimizer("adamw", model.parameters())
    step = nova.compile(model, opt)
    batches = _batches(4)
    for x, y in batches[:3]:  # the third call replays the graph
        step(x, y)
    step.check()
    snap = _snapshot(model, opt)
    x, y = batches[3]
    x = x.clone()
    x[1, 5] = 256  # one past the vocabulary
    step(x, y)
    with pytest.raises(IndexError, match="out of range"):
        step.check()
    _assert_same(model, opt, snap)
    step(*batches[0])  # the step goes on training from the unchanged state
    step.check()


def test_a_call_never_waits_for_the_device():
    """No synchronizing CUDA call inside a step call (torch's sync debug mode raises
    on one): the guard is read through a pinned copy and an event query."""
    model = make_model("sdpa").cuda()
    opt = make_optimizer("adamw", model.parameters())
    step = nova.compile(model, opt, skip_nonfinite=True)
    batches = _batches(6)
    for x, y in batches[:3]:  # compile, first state, graph capture
        step(x, y)
    step.check()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for x, y in batches[3:]:
            step(x, y)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    step.check()
    assert step.mode == "graph" and step.skipped_steps == 0


def test_steps_launched_after_a_bad_one_write_nothing_either():
    model = make_model("sdpa").cuda()
    opt = make_optimizer("adamw", model.parameters())
    step = nova.compile(model, opt)
    batches = _batches(4)
    for x, y in batches[:3]:
        step(x, y)
    step.check()
    snap = _snapshot(model, opt)
    x, y = batches[3]
    x = x.clone()
    x[0, 7] = -1
    step(x, y)  # step 4 fails on the device
    raised = None
    try:
        for x, y in batches[:3]:  # good steps: launched before step 4 was read, or after it raised
            step(x, y)
        step.check()
    except IndexError as e:
        raised = str(e)
    assert raised is not None and raised.startswith("step 4 of this compiled step failed"), raised
    _assert_same(model, opt, snap)


def test_skip_nonfinite_skips_the_step_and_counts_it():
    model = make_model("sdpa").cuda()
    opt = make_optimizer("adamw", model.parameters())
    step = nova.compile(model, opt, skip_nonfinite=True)
    batches = _batches(3)
    step(*batches[0])
    step(*batches[1])
    snap = _snapshot(model, opt)
    with torch.no_grad():  # an inf in one weight: the loss and its gradients are not finite
        w = model.transformer.h[0].mlp.c_fc.weight
        keep = w[0, 0].clone()
        w[0, 0] = float("inf")
        snap[0]["transformer.h.0.mlp.c_fc.weight"][0, 0] = float("inf")
    step(*batches[2])
    step.check()
    assert step.skipped_steps == 1
    _assert_same(model, opt, snap)
    with torch.no_grad():
        w[0, 0] = keep
    step(*batches[2])
    step.check()
    assert step.skipped_steps == 1


def test_fused_lm_head_matches_unfused_linear_cross_entropy():
    """GPT-2's vocabulary and width, 8 x 1024 tokens: Nova's fused head (forward and
    backward, bf16 operands) against eager autocast linear + cross_entropy."""
    torch.manual_seed(0)
    V, D, N = 50304, 768, 8 * 1024

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(D, D)
            self.head = torch.nn.Linear(D, V, bias=False)

        def forward(self, h, y):
            return F.cross_entropy(self.head(self.proj(h)), y, ignore_index=-1)

    ref = Head().cuda()
    mine = copy.deepcopy(ref)
    h = torch.randn(N, D, device="cuda")
    y = torch.randint(0, V, (N,), device="cuda")
    y[:100] = -1
    opt_ref = torch.optim.SGD(ref.parameters(), lr=1.0)
    step = nova.compile(mine, torch.optim.SGD(mine.parameters(), lr=1.0), precision="bf16")
    loss = step(h, y)
    assert "nova.linear_cross_entropy" in step.explain(ir=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref_loss = ref(h, y)
    ref_loss.backward()
    grads = {n: p.grad.float().clone() for n, p in ref.named_parameters()}
    opt_ref.step()
    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < TOL["bf16"]
    for (n, p), q in zip(mine.named_parameters(), ref.parameters()):
        # both took one SGD step of lr 1 from the same weights: the updates are the gradients
        err = ((p - q).norm() / grads[n].norm()).item()
        assert err < TOL["bf16"], f"{n}: update differs by {err:.3e} of the gradient"


def test_kernels_compiled_ahead_on_threads_train_as_compiled_one_by_one(monkeypatch):
    """The first call compiles every kernel on a thread pool before it runs
    (``nova.runtime.compile_ahead``); a second step of the same shapes finds them
    compiled, so its walk launches them for real on an arena of garbage, the in-place
    updates included (into views of the arena). Both train bit for bit as a step
    whose walk is off (NOVA_COMPILE_THREADS=1), all three on the same kernels: a walk
    that touched a parameter or a state tensor would show."""
    from nova.models import GPT, gpt_tiny

    torch.manual_seed(0)
    a = GPT(gpt_tiny(n_layer=2, n_embd=48, n_head=3, block_size=24, vocab_size=96)).cuda()  # shapes no other test has
    models = [a, copy.deepcopy(a), copy.deepcopy(a)]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in models]
    steps = [nova.compile(m, o, precision="bf16") for m, o in zip(models, opts, strict=True)]
    batches = _batches(3, B=2, T=24, V=96)
    first = {n: p.detach().clone() for n, p in a.named_parameters()}
    losses: list[list[torch.Tensor]] = [[], [], []]
    for k, threads in enumerate(("4", "4", "1")):
        monkeypatch.setenv("NOVA_COMPILE_THREADS", threads)
        losses[k].append(steps[k](*batches[0]))
    ahead = [s._last.executable.ahead for s in steps]
    assert ahead[0]["kernels"] > 10 and ahead[0]["threads"] == 4, ahead[0]
    assert 1 <= ahead[0]["launchers"] <= ahead[0]["kernels"], ahead[0]  # distinct launch signatures, on the pool
    assert ahead[1]["kernels"] == 0 and ahead[1]["launches"] == ahead[0]["launches"], ahead[1]
    assert ahead[2] == {}, "NOVA_COMPILE_THREADS=1: no walk"
    for x, y in batches[1:]:
        for s, ls in zip(steps, losses, strict=True):
            ls.append(s(x, y))
    for i in range(3):
        assert torch.equal(losses[0][i], losses[1][i]) and torch.equal(losses[0][i], losses[2][i]), i
    for (n, p), q, r in zip(a.named_parameters(), models[1].parameters(), models[2].parameters(), strict=True):
        assert torch.equal(p, q) and torch.equal(p, r), n
    assert any(not torch.equal(p, first[n]) for n, p in a.named_parameters()), "the steps trained"
