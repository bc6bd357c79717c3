"""tf32_operands: a value only tf32 matmuls read is stored rounded by its producer.

IR first (compiled for the H200 under tf32: where ``nova.round_tf32`` goes, where it
does not, and that the fuse stage puts every one into its producer's kernel with the
raw value no output), then the reference executor's rounding against the matmul
template's, then whole Triton steps in the interpreter with and without the stage,
bit for bit."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nova
from nova import pipeline
from nova.backends.reference import run_function
from nova.codegen.triton.matmul import round_to_tf32
from nova.ir import dialect as nv
from nova.ir.module import step_func
from nova.models import GPT, MLPLM, GPTConfig, MLPLMConfig
from nova.schedule.devices import DEVICES
from nova.transforms import tf32_operands as tf32_stage
from nova.transforms.tf32_operands import tf32_operands


def _mlp():
    torch.manual_seed(0)
    return MLPLM(MLPLMConfig(vocab_size=64, block_size=8, n_layer=2, n_embd=32, hidden=64))


def _gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=32, attention="manual"))


def _gpt_sdpa():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=32))


class Residual(nn.Module):
    """h = fc1(ln(x)) is read by fc2 and by the residual add; ln(x) only by fc1."""

    def __init__(self):
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x, y):
        h = self.fc1(self.ln(x))
        return F.mse_loss(self.fc2(h) + h, y)


def _compile(model, batch, precision="tf32", device="H200", stop_after=None):
    c = pipeline.Compilation(model, batch, torch.optim.SGD(model.parameters(), lr=0.1), precision, torch.float32)
    c.device = DEVICES[device] if device else None
    saved = pipeline.SETTINGS
    pipeline.SETTINGS = dataclasses.replace(saved, step_cache=False)
    try:
        if stop_after is None:
            return pipeline.run(c)
        for name, stage in pipeline.STAGES:
            stage(c)
            if name == stop_after:
                return c
    finally:
        pipeline.SETTINGS = saved


def _tokens():
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    return x, x.roll(1, 1)


def _readers(v):
    out = []
    for u in v.uses:
        out += _readers(u.operation.results[0]) if isinstance(u.operation, nv.VIEW_OPS) else [u.operation]
    return out


def test_values_only_tf32_matmuls_read_are_rounded_where_they_are_made():
    c = _compile(_mlp(), _tokens(), stop_after="tf32_operands")
    block = step_func(c.module).body.block
    rounds = [o for o in block.ops if isinstance(o, nv.RoundTf32Op) and o.operands[0] not in block.args]
    # (a weight's rounded copy for its K-major readers: the test after this one)
    # per layer: the LayerNorm's output, the GELU output (fc2's A), GELU's backward (dX1's, dW1's A);
    # and the last LayerNorm's output, the fused LM head's h (its logits' A, its weight gradient's B)
    assert len(rounds) == 2 * 3 + 1
    for r in rounds:
        raw = r.operands[0]
        assert r.prev_op is raw.owner  # right after its producer
        assert all(nv.column_sum(u.operation) for u in raw.uses if u.operation is not r)  # a bias gradient's sum
        readers = _readers(r.results[0])
        assert readers and all(isinstance(o, (nv.MatmulOp, nv.LinearCrossEntropyWithGradOp)) for o in readers)
    assert sum(isinstance(o, nv.LinearCrossEntropyWithGradOp) for r in rounds for o in _readers(r.results[0])) == 1
    assert {type(r.operands[0].owner) for r in rounds} == {nv.LayerNormOp, nv.GeluOp, nv.GeluBackwardOp}


def test_weights_read_k_major_get_one_rounded_copy_for_those_readers():
    """A weight the forward's x @ W^T reads K-major (B with K contiguous) gets one
    ``nova.round_tf32`` of the step argument, read through its own views by exactly
    those matmuls; the optimizer and the input gradient's matmul (W read N-major, which
    the launcher stages anyway) read the raw argument. After the fuse stage the copies
    of one shape are one multi-tensor launch, and the forward matmuls take B as
    prerounded."""
    from nova.transforms.configure import operand_layout

    c = _compile(_mlp(), _tokens(), stop_after="tf32_operands")
    block = step_func(c.module).body.block
    rounds = [o for o in block.ops if isinstance(o, nv.RoundTf32Op) and o.operands[0] in block.args]
    weights = {r.operands[0] for r in rounds}
    assert len(weights) == len(rounds) == 2 * 2  # fc_in and fc_out of each layer

    def reads(v):  # (reader, operand index, the value it reads) through views
        for u in v.uses:
            if isinstance(u.operation, nv.VIEW_OPS):
                yield from reads(u.operation.results[0])
            else:
                yield u.operation, u.index, v

    for r in rounds:
        got = list(reads(r.results[0]))
        assert got and all(isinstance(m, nv.MatmulOp) and operand_layout(v) == ("row", "col")[i] for m, i, v in got)
        raw = [(m, i, v) for m, i, v in reads(r.operands[0]) if m is not r]
        assert any(not isinstance(m, nv.MatmulOp) for m, _, _ in raw)  # the optimizer's update
        assert not any(isinstance(m, nv.MatmulOp) and operand_layout(v) == ("row", "col")[i] for m, i, v in raw)
    c = _compile(_mlp(), _tokens())
    ops = list(step_func(c.module).body.block.ops)
    batches = [o for o in ops if isinstance(o, nv.FusedOp)
               and all(isinstance(i, nv.RoundTf32Op) for i in o.inner_ops()) and set(o.operands) <= set(o.parent.args)]
    assert sorted(len(g.results) for g in batches) == [2, 2]
    # the four forward matmuls (alone or heading an epilogue group) read them, as rounded values
    readers = {o for o in ops if not isinstance(o, nv.VIEW_OPS) and any(_from(v, g) for v in o.operands for g in batches)}
    assert len(readers) == 4
    assert all(nv.tf32_rounded(v) for o in readers for v in o.operands if any(_from(v, g) for g in batches))


def _from(v, op) -> bool:
    """``v`` is a result of ``op`` or a view of one."""
    while getattr(v, "owner", None) is not op:
        if not isinstance(getattr(v, "owner", None), nv.VIEW_OPS):
            return False
        v = v.owner.operands[0]
    return True


def test_a_value_read_by_anything_but_a_matmul_keeps_its_bits():
    x, y = torch.randn(4, 16), torch.randn(4, 16)
    c = _compile(Residual(), (x, y), stop_after="tf32_operands")
    block = step_func(c.module).body.block
    ops = list(block.ops)
    rounds = [o for o in ops if isinstance(o, nv.RoundTf32Op) and o.operands[0] not in block.args]
    # ln(x) (fc1 and fc1's weight gradient read it) and dh = dy W2 + dy (fc1's backward matmuls and
    # its bias gradient's sum); fc1's output h, which fc2 and the residual add read, stays raw
    assert [type(r.operands[0].owner) for r in rounds] == [nv.LayerNormOp, nv.AddOp]
    assert rounds[0].operands[0].owner in ops[: ops.index(rounds[1])] and all(
        isinstance(o, nv.MatmulOp) for r in rounds for o in _readers(r.results[0]))
    # h: the forward value both a matmul and an add read (through views)
    shared = [o.results[0] for o in ops if o.results and {type(r) for r in _readers(o.results[0])} >= {nv.MatmulOp, nv.AddOp}]
    assert shared and not any(isinstance(r, nv.RoundTf32Op) for v in shared for r in _readers(v))


def _attention_backwards(c) -> list:
    return [o for o in step_func(c.module).body.block.ops if isinstance(o, nv.AttentionBackwardOp)]


def test_an_attention_backwards_gradients_are_rounded_by_its_kernels(monkeypatch):
    """GPT's packed qkv: dq, dk, dv reach only the cat that the qkv projection's input
    and weight gradients read (its bias gradient is the op's sums by then): the op
    stores them rounded, and both matmuls take the cat as prerounded. Not without
    the attention_sums stage (the cat's column sum would read rounded values), nor
    under bf16, nor with ``ROUND_ATTENTION_GRADIENTS`` off."""
    c = _compile(_gpt_sdpa(), _tokens(), stop_after="tf32_operands")
    (att,) = _attention_backwards(c)
    assert att.props()["rounded"] and att.props()["sums"]
    ops = list(step_func(c.module).body.block.ops)
    (cat,) = [o for o in ops if isinstance(o, nv.CatOp) and all(_from(x, att) for x in o.operands)]
    readers = _readers(cat.results[0])
    assert len(readers) == 2 and all(isinstance(r, nv.MatmulOp) for r in readers)
    assert all(nv.tf32_rounded(r.operands[0]) for r in readers)  # A: dqkv, and dqkv^T for the weight gradient
    assert nv.prerounded_operands(*readers[0].operands, "tf32-rn")[0] == "a"

    saved = list(pipeline.STAGES)
    try:
        pipeline.STAGES[:] = [s for s in saved if s[0] != "attention_sums"]
        (att,) = _attention_backwards(_compile(_gpt_sdpa(), _tokens(), stop_after="tf32_operands"))
        assert not att.props()["rounded"] and not att.props()["sums"]
    finally:
        pipeline.STAGES[:] = saved
    (att,) = _attention_backwards(_compile(_gpt_sdpa(), _tokens(), precision="bf16", stop_after="tf32_operands"))
    assert not att.props()["rounded"]
    monkeypatch.setattr(tf32_stage, "ROUND_ATTENTION_GRADIENTS", False)
    (att,) = _attention_backwards(_compile(_gpt_sdpa(), _tokens(), stop_after="tf32_operands"))
    assert not att.props()["rounded"] and att.props()["sums"]


def test_a_second_rounded_store_for_the_k_major_a_of_a_value_read_raw_too(monkeypatch):
    """``ROUND_SECOND_STORE``: the residual gradient (the LayerNorm backward's kernel adds
    it up; the next layer's adds and the weight gradient read it raw) also gets a
    rounded copy for the down projection's input gradient, which reads it as a K-major
    A: the fuse stage puts the rounding into that kernel, which then stores both; the
    matmul takes A prerounded (read in place, staged for free); the plan's peak is
    unchanged. Off: no such copy."""
    monkeypatch.setattr(tf32_stage, "ROUND_ARGUMENTS", False)
    plain = _compile(_mlp(), _tokens())
    monkeypatch.setattr(tf32_stage, "ROUND_SECOND_STORE", True)
    c = _compile(_mlp(), _tokens())
    ops = list(step_func(c.module).body.block.ops)
    assert not any(isinstance(o, nv.RoundTf32Op) for o in ops)
    both = []
    for g in (o for o in ops if isinstance(o, nv.FusedOp)):
        yielded = list(g.body.block.last_op.operands)
        for r in (i for i in g.inner_ops() if isinstance(i, nv.RoundTf32Op)):
            if r.operands[0] in yielded:  # the raw value stored too: a second store
                assert r.results[0] in yielded and any(isinstance(i, nv.LayerNormBackwardOp) for i in g.inner_ops())
                both.append(g.results[yielded.index(r.results[0])])
    assert len(both) == 2  # the residual gradient of each of the two blocks
    for v in both:
        readers = _readers(v)
        assert readers and all(isinstance(m, nv.MatmulOp) for m in readers)
        assert all(nv.prerounded_operands(*m.operands, "tf32-rn")[:1] == ("a",) for m in readers)
    assert c.memory.peak_bytes == plain.memory.peak_bytes
    before = sum(isinstance(o, nv.MatmulOp) and nv.tf32_rounded(o.operands[0]) for o in step_func(plain.module).walk())
    after = sum(isinstance(o, nv.MatmulOp) and nv.tf32_rounded(o.operands[0]) for o in step_func(c.module).walk())
    assert after == before + 2


@pytest.mark.parametrize("precision,device", [("fp32", "H200"), ("bf16", "H200"), ("tf32", None)])
def test_no_rounding_but_tf32_on_the_triton_target(precision, device):
    c = _compile(_mlp(), _tokens(), precision=precision, device=device)
    assert not any(isinstance(o, nv.RoundTf32Op) for o in step_func(c.module).walk())
    assert tf32_operands(c.module, precision if device else "fp32") == 0


@pytest.mark.parametrize("make", [_mlp, _gpt])
def test_fuse_puts_every_rounding_into_its_producers_kernel(make, monkeypatch):
    """No rounding is a kernel of its own, none stores the raw value beside the
    rounded one, the plan's peak is the same as without the stage, and the matmuls
    reading them take them as prerounded (``nv.tf32_rounded``)."""
    monkeypatch.setattr(tf32_stage, "ROUND_ARGUMENTS", False)  # the weights' copies: the test above
    c = _compile(make(), _tokens())
    ops = list(step_func(c.module).body.block.ops)
    assert not any(isinstance(o, nv.RoundTf32Op) for o in ops)
    inside = 0
    for g in (o for o in ops if isinstance(o, nv.FusedOp)):
        yielded = list(g.body.block.last_op.operands)
        for r in (i for i in g.inner_ops() if isinstance(i, nv.RoundTf32Op)):
            inside += 1
            assert r.operands[0] not in yielded and r.results[0] in yielded
    assert inside > 0
    taken = 0
    for o in ops:
        if isinstance(o, nv.MatmulOp):
            taken += sum(nv.tf32_rounded(v) for v in o.operands)
        elif isinstance(o, nv.FusedOp) and o.contraction() is not None:
            args = o.body.block.args
            taken += sum(nv.tf32_rounded(o.operands[args.index(v)]) for v in o.contraction().operands)
    assert taken >= inside
    saved = list(pipeline.STAGES)
    try:
        pipeline.STAGES[:] = [s for s in saved if s[0] != "tf32_operands"]
        plain = _compile(make(), _tokens())
    finally:
        pipeline.STAGES[:] = saved
    assert c.memory.peak_bytes == plain.memory.peak_bytes


def test_the_reference_rounds_as_the_matmul_template_does():
    from nova.ir.builder import OpBuilder
    from nova.ir.module import Slot, new_step, set_results
    from nova.ir.types import tensor
    from xdsl.dialects.builtin import f32

    x = torch.randn(4096) * torch.logspace(-30, 30, 4096)
    bits = torch.tensor([0x3F801000, 0x3F803000, 0x3F800FFF, 0x7F7FFFFF, 0x00001FFF], dtype=torch.int32)
    x = torch.cat([x, bits.view(torch.float32), torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0])])
    module, fn = new_step([Slot("batch", "x", tensor([x.numel()], f32))])
    b = OpBuilder(fn.body.block)
    set_results(fn, [("loss", "y", b.one(nv.RoundTf32Op, [fn.body.block.args[0]]))])
    (y,) = run_function(fn, [x])
    want = round_to_tf32(x)
    assert torch.equal(y.view(torch.int32)[:-3], want.view(torch.int32)[:-3])
    assert torch.isnan(y[-3]) and torch.equal(y[-2:].view(torch.int32), x[-2:].view(torch.int32))
    # 1 + half a tf32 ulp ties down to 1 (even), 1 + 1.5 ulp up to 1 + 2 ulp; just below half: down
    assert (y[-10].item(), y[-9].item(), y[-8].item()) == (1.0, 1 + 2**-9, 1.0)
    assert not torch.equal(y[:-3], x[:-3]) and torch.equal(round_to_tf32(y).view(torch.int32), y.view(torch.int32))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's steps: the GPU runs tests/gpu")
@pytest.mark.parametrize("make,second", [(_mlp, False), (_gpt, False), (_gpt_sdpa, False), (_mlp, True)],
                         ids=["mlp", "gpt", "gpt_sdpa", "mlp-second-store"])
def test_triton_steps_with_and_without_the_stage_are_bit_identical(make, second, monkeypatch):
    """The matmuls saw rounded operands before (rounded in the kernel or staged);
    now the producer rounds and the matmul reads them as they are: the same bits.
    ``second`` (``ROUND_SECOND_STORE`` too): the last block's residual gradient then
    has an epilogue in the final LayerNorm backward's kernel, which also takes its
    bias gradient's column sum (an order of fp32 sums of its own): one step, every
    weight and the loss bit for bit, the biases within fp32 rounding."""
    monkeypatch.setattr(tf32_stage, "ROUND_SECOND_STORE", second)
    runs = []
    for with_stage in (True, False):
        model = make()
        saved = list(pipeline.STAGES)
        try:
            if not with_stage:
                pipeline.STAGES[:] = [s for s in saved if s[0] != "tf32_operands"]
            step = nova.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-2), precision="tf32",
                                backend="triton")
            g = torch.Generator().manual_seed(3)
            losses = []
            for _ in range(1 if second else 2):
                x = torch.randint(0, 64, (2, 8), generator=g)
                losses.append(step(x, x.roll(1, 1)).item())
        finally:
            pipeline.STAGES[:] = saved
        runs.append((losses, [p.detach().clone() for p in model.parameters()], step.kernel_sources()))
    (l1, p1, s1), (l2, p2, _) = runs
    assert l1 == l2
    if second:
        assert all(torch.equal(a, b) for a, b in zip(p1, p2, strict=True) if a.dim() > 1)
        assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-9) for a, b in zip(p1, p2, strict=True))
    else:
        assert all(torch.equal(a, b) for a, b in zip(p1, p2, strict=True))
    assert any("prerounded" in s or "rounded to tf32 before the kernel" in s for s in s1.values())


class _Block(nn.Module):
    """GPT-2's MLP at its width: LayerNorm, 768 -> 3072, GELU, 3072 -> 768."""

    def __init__(self):
        super().__init__()
        self.ln, self.fc, self.proj = nn.LayerNorm(768), nn.Linear(768, 3072), nn.Linear(3072, 768)

    def forward(self, x, y):
        return F.mse_loss(self.proj(F.gelu(self.fc(self.ln(x)))), y)


def test_the_configure_stage_counts_a_prerounded_k_major_operand_as_staged(monkeypatch):
    """The configure stage passes the operands stored rounded (``prerounded``), as the
    backend launches them: the input gradient through fc, A = GELU's backward (stored
    rounded, K-major) at 16384 x 768 x 3072, is configured as the staged path with A read
    in place, so rule 8d's persistent loop applies (on the H200); the cost model counts
    B's staging copy and not A's."""
    from nova.schedule import cost
    from nova.transforms.configure import operand_layout

    monkeypatch.setattr(tf32_stage, "ROUND_ARGUMENTS", False)  # B (a weight) staged, as this test is about A
    torch.manual_seed(0)
    x, y = torch.randn(16384, 768), torch.randn(16384, 768)
    c = _compile(_Block(), (x, y), stop_after="configure")
    found = []
    for o in step_func(c.module).body.block.ops:
        head = o.contraction() if isinstance(o, nv.FusedOp) else o if isinstance(o, nv.MatmulOp) else None
        if not isinstance(head, nv.MatmulOp):
            continue
        args = list(o.body.block.args) if o is not head else None
        lhs, rhs = (o.operands[args.index(v)] for v in head.operands) if args else head.operands
        a, b = head.operands[0].type.get_shape(), head.operands[1].type.get_shape()
        if (a[-2], b[-1], a[-1]) == (16384, 768, 3072) and nv.tf32_rounded(lhs) and operand_layout(lhs) == "row":
            found.append((o, lhs, rhs))
    assert found, "no input gradient reads a prerounded K-major A"
    for o, lhs, rhs in found:
        cfg = cost.config_of(o)
        assert "+stage_a" in cfg.instruction and "+stage_b" in cfg.instruction, cfg
        if isinstance(o, nv.MatmulOp):  # no epilogue: rule 8d's persistent loop
            assert cfg.persistent, cfg
        assert cost.read_in_place(lhs, rhs) == {"a"}
        counted = cost.cost_of(o, o.operands, o.results, "tf32")
        monkeypatch.setattr(cost, "read_in_place", lambda lhs, rhs: set())
        copied = cost.cost_of(o, o.operands, o.results, "tf32")
        monkeypatch.undo()
        assert (copied.bytes - counted.bytes, copied.launches - counted.launches) == (2 * 16384 * 3072 * 4, 1)
