"""The configure stage schedules every op of the dialect (an op it has no rule for
is an error naming it, not a silent default), and the schedules it writes for the
newer ops (cumsum, cos / sin / abs, i64 arithmetic, attention with a bias,
cross-entropy with reduction "none") lower and run under the Triton interpreter
against the reference executor."""

from __future__ import annotations

import pytest
import torch
from test_rowwise import build, rand, rel_err

import nova.backends.triton  # noqa: F401  (registers every lowering)
from nova.backends.reference import IMPLS
from nova.codegen.triton.lowering import LOWERINGS, lowering_for
from nova.ir import dialect as nv
from nova.schedule.devices import DEVICES
from nova.transforms import configure as cfg_stage

H200 = DEVICES["H200"]


def test_every_op_has_a_schedule_rule_and_a_lowering():
    known = (*cfg_stage.LAYOUT_OPS, *cfg_stage.ROWWISE, *cfg_stage.ELEMENTWISE, nv.MatmulOp, nv.AttentionOp,
             nv.AttentionBackwardOp, nv.LinearCrossEntropyOp, nv.LinearCrossEntropyBackwardOp,
             nv.LinearCrossEntropyWithGradOp)  # fmt: skip
    backend_ops = [c for c in nv.NOVA_OPS if c not in nv.AUTODIFF_ONLY]
    assert [c.name for c in backend_ops if c not in known] == []
    missing = [c.name for c in backend_ops if c not in LOWERINGS and c is not nv.MatmulOp]  # matmul: the launcher
    assert missing == []


def test_an_op_without_a_rule_is_named(monkeypatch):
    op = build(nv.CosOp, [torch.ones(3)])
    monkeypatch.setattr(cfg_stage, "ELEMENTWISE", tuple(c for c in cfg_stage.ELEMENTWISE if c is not nv.CosOp))
    with pytest.raises(cfg_stage.NoScheduleError, match="nova.cos"):
        cfg_stage.configure_op(op, H200, "fp32")


def scheduled(op, inputs, **kw):
    """The op lowered with the configure stage's H200 schedule, run against the reference."""
    cfg = cfg_stage.configure_op(op, H200, "fp32")
    assert cfg is not None
    outs = lowering_for(op)(op, cfg, **kw).launch(inputs)
    refs = IMPLS[type(op)](op, [x.clone() for x in inputs])
    for o, r in zip(outs, refs, strict=True):
        assert o.shape == r.shape and o.dtype == r.dtype
        inf = torch.isinf(r) if r.is_floating_point() else torch.zeros_like(r, dtype=torch.bool)
        assert torch.equal(o[inf], r[inf])
        if r.is_floating_point():
            assert rel_err(o.masked_fill(inf, 0), r.masked_fill(inf, 0)) < 1e-5
        else:
            assert torch.equal(o, r)
    return cfg


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64], ids=str)
def test_cumsum_schedule(dtype):
    for shape, dim in (((3, 700), 1), ((9000,), 0), ((40, 6), 0)):
        x = (rand(*shape, gen=torch.Generator().manual_seed(1)) * 100).to(dtype)
        cfg = scheduled(build(nv.CumsumOp, [x], {"dim": dim, "reverse": dim == 0}), [x])
        assert cfg.kind == "reduction"


def test_unary_and_integer_schedules():
    x = rand(5, 33, gen=torch.Generator().manual_seed(2)) * 4
    for cls in (nv.CosOp, nv.SinOp, nv.AbsOp):
        assert scheduled(build(cls, [x]), [x]).kind == "elementwise"
    a, b = torch.arange(165).view(5, 33) * 2**33, torch.arange(33)
    for cls in (nv.AddOp, nv.SubOp, nv.MulOp, nv.MaximumOp):
        scheduled(build(cls, [a, b]), [a, b])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
def test_attention_with_bias_and_ce_none_schedules():
    gen = torch.Generator().manual_seed(3)
    q, k, v = (rand(1, 2, 20, 16, gen=gen) for _ in range(3))
    z = torch.zeros(1, 1, 1, 20)
    z[..., 15:] = float("-inf")
    props = {"causal": True, "scale": 0.25}
    op = build(nv.AttentionOp, [q, k, v, z], props)
    out, lse = lowering_for(op)(op, cfg_stage.configure_op(op, H200, "fp32")).launch([q, k, v, z])
    scheduled(op, [q, k, v, z])
    ins = [rand(1, 2, 20, 16, gen=gen), q, k, v, out, lse, z]
    scheduled(build(nv.AttentionBackwardOp, ins, props), ins)
    logits, target = rand(6, 10, gen=gen), torch.tensor([1, -100, 3, 9, 0, 2])
    props = {"ignore_index": -100, "reduction": "none", "label_smoothing": 0.1}
    scheduled(build(nv.CrossEntropyOp, [logits, target], props), [logits, target])
    ins = [rand(6, gen=gen), logits, target]
    scheduled(build(nv.CrossEntropyBackwardOp, ins, props), ins)


def test_fused_head_schedule_is_its_chunk_logits_matmul():
    from nova.ir.builder import OpBuilder
    from nova.ir.module import Slot, new_step
    from nova.ir.types import tensor
    from xdsl.dialects.builtin import bf16, i64

    _, fn = new_step([Slot("param", "h", tensor([8192, 768], bf16)), Slot("param", "w", tensor([50304, 768], bf16)),
                      Slot("batch", "t", tensor([8192], i64))])
    op = OpBuilder(fn.body.block).create(nv.LinearCrossEntropyOp, list(fn.body.block.args),
                                         {"ignore_index": -1, "reduction": "mean", "chunk": 4096})
    cfg = cfg_stage.configure_op(op, H200, "bf16")
    assert cfg.kind == "matmul" and cfg.block_m <= 4096 and cfg.block_n <= 50304
