"""The per-kernel cost model (nova.schedule.cost) against numbers computed by hand."""

from __future__ import annotations

import pytest
from xdsl.dialects.builtin import bf16, f32, i1

from nova.ir import dialect as nv
from nova.ir.builder import OpBuilder
from nova.ir.module import Slot, new_step, set_results
from nova.ir.types import tensor
from nova.schedule import configurator as cf
from nova.schedule import cost
from nova.schedule.devices import DEVICES
from nova.transforms.configure import Configure

H200 = DEVICES["H200"]


def _step(*slots):
    module, fn = new_step(list(slots))
    return module, fn, OpBuilder(fn.body.block)


def _finish(module, fn, loss, configure: bool = True, precision: str = "fp32"):
    set_results(fn, [("loss", "loss", loss)])
    if configure:
        from nova.ir.module import context

        Configure(H200, precision).apply(context(), module)
    return cost.kernel_costs(fn, H200, precision)


def test_matmul_bytes_flops_and_roofline():
    # [512, 256] @ [256, 1024] in bf16: FLOPs 2 M N K, bytes A + B + C once
    module, fn, b = _step(Slot("batch", "a", tensor([512, 256], bf16)), Slot("param", "w", tensor([256, 1024], bf16)))
    y = b.matmul(*fn.body.block.args)
    (k, _) = _finish(module, fn, b.reduce_sum(y, [0, 1]))
    M, K, N = 512, 256, 1024
    assert k.op == "nova.matmul" and k.kind == "matmul" and k.path == "bf16"
    assert k.flops == 2 * M * N * K == 268_435_456
    assert k.bytes == (M * K + K * N + M * N) * 2 == 1_835_008
    # the configurator's own count of the same matmul
    plan = cf.plan_matmul(M, N, K, 1, "bf16", "bf16", "bf16", "ieee", device=H200)
    assert (k.flops, k.bytes) == (plan.flops, plan.bytes) and plan.config.split_k == 1
    assert k.intensity == pytest.approx(268_435_456 / 1_835_008)
    assert k.memory_s == pytest.approx(1_835_008 / 4.24e12)
    assert k.compute_s == pytest.approx(268_435_456 / 790e12)
    assert k.launch_s == cf.LAUNCH_SECONDS == 2e-6
    # 0.433 us of DRAM, 0.340 us of tensor cores, 2 us of launch
    assert k.predicted_s == pytest.approx(1_835_008 / 4.24e12 + 2e-6)
    assert k.bound == "launch"


def test_matmul_epilogue_and_split_k():
    # a skinny-M, long-K tf32 matmul: the configurator splits K; the bias add rides in the
    # epilogue (the fuse stage's nova.fused "contraction": one kernel of kind matmul)
    from xdsl.dialects.builtin import StringAttr

    from nova.transforms.fuse import fuse

    M, K, N = 128, 8192, 128
    module, fn, b = _step(Slot("batch", "a", tensor([M, K], f32)), Slot("param", "w", tensor([K, N], f32)),
                          Slot("param", "bias", tensor([N], f32)))  # fmt: skip
    a, w, bias = fn.body.block.args
    y = b.add(b.matmul(a, w), bias)
    set_results(fn, [("loss", "loss", b.reduce_sum(y, [0, 1]))])
    module.attributes["nova.precision"] = StringAttr("tf32")
    fuse(module)
    ks = _finish(module, fn, fn.body.block.last_op.operands[0], precision="tf32")
    k = ks[0]
    cfg = cost.config_of(fn.body.block.first_op)
    assert k.op == "nova.fused" and k.kind == "matmul" and cfg.kind == "matmul"
    assert cfg.split_k > 1 and k.ops == 2 and len([x for x in ks if x.op == "nova.add"]) == 0
    assert k.path == "tf32"
    assert k.flops == 2 * M * N * K + M * N
    # A, B, the bias, C; then the split's f32 partials written and read once; each staged
    # operand copied once more, read and written, in a launch of its own
    staged = [x for x, name in ((M * K, "stage_a"), (K * N, "stage_b")) if name in cfg.instruction]
    assert k.bytes == (M * K + K * N + N + M * N) * 4 + 2 * cfg.split_k * M * N * 4 + 2 * sum(staged) * 4
    assert k.launches == 2 + len(staged)  # the copies, the split kernel, its reduction


@pytest.mark.parametrize("M, N, K, stream_k", [(768, 3072, 32768, True), (768, 768, 32768, False)])
def test_a_split_the_launcher_runs_as_stream_k_says_so(M, N, K, stream_k, monkeypatch):
    # GPT-2's bf16 weight gradients at batch 32: 768x3072 (72 tiles of 128x256) splits past one
    # wave of the H200's 132 SMs, which the launcher runs as stream-K; 768x768 (18 tiles) keeps
    # its split within one wave, a plain split (rule 8f's wave tail off: the next test)
    from nova.codegen.triton import matmul as mm

    monkeypatch.setattr(cf, "WAVE_TAIL", False)

    module, fn, b = _step(Slot("batch", "a", tensor([M, K], bf16)), Slot("param", "w", tensor([K, N], bf16)))
    y = b.matmul(*fn.body.block.args)
    (k, _) = _finish(module, fn, b.reduce_sum(y, [0, 1]))
    cfg = cost.config_of(fn.body.block.first_op)
    assert cfg.split_k > 1 and not cfg.persistent
    waves = mm.cdiv(M, cfg.block_m) * mm.cdiv(N, cfg.block_n) * cfg.split_k / H200.sm_count
    assert (waves > 1) == stream_k == mm.runs_stream_k(M, N, K, 1, cfg, H200.sm_count, f32=False)
    assert k.config == cost.schedule_summary(cfg).replace(f"split{cfg.split_k}", f"split{cfg.split_k} stream-K"
                                                          if stream_k else f"split{cfg.split_k}")
    assert ("stream-K" in k.config) == stream_k


def test_elementwise_reads_a_broadcast_operand_once():
    # x[64, 1024] * broadcast(s[1024]): 64 Ki elements of x, 1 Ki of s (a view of it), 64 Ki written
    module, fn, b = _step(Slot("batch", "x", tensor([64, 1024], f32)), Slot("param", "s", tensor([1024], f32)))
    x, s = fn.body.block.args
    y = b.mul(x, b.broadcast_to(s, [64, 1024]))
    ks = _finish(module, fn, b.reduce_sum(y, [0, 1]))
    mul = next(k for k in ks if k.op == "nova.mul")
    assert mul.kind == "elementwise" and mul.path == "fp32"
    assert mul.bytes == (65536 + 1024 + 65536) * 4 == 528_384
    assert mul.flops == 65536 and mul.launches == 1
    assert mul.memory_s == pytest.approx(528_384 / 4.24e12)
    assert mul.bound == "launch"  # 0.125 us of DRAM against 2 us of launch
    assert not any(k.op == "nova.broadcast_to" for k in ks)  # a view launches nothing


def test_large_elementwise_is_memory_bound():
    module, fn, b = _step(Slot("batch", "x", tensor([8192, 8192], f32)), Slot("batch", "m", tensor([8192, 8192], i1)))
    x, m = fn.body.block.args
    y = b.where(m, x, b.scalar(0.0, x))
    ks = _finish(module, fn, b.reduce_sum(y, [0, 1]))
    where = next(k for k in ks if k.op == "nova.where")
    n = 8192 * 8192
    assert where.bytes == n * 1 + n * 4 + 4 + n * 4  # mask, x, the 0-d zero, the result
    assert where.bound == "memory" and where.predicted_s == pytest.approx(where.bytes / 4.24e12 + 2e-6)


def test_reduction_row_sum_and_softmax():
    module, fn, b = _step(Slot("batch", "x", tensor([4096, 1024], f32)))
    (x,) = fn.body.block.args
    p = b.one(nv.SoftmaxOp, [x], {"dim": 1})
    ks = _finish(module, fn, b.reduce_sum(p, [1]))
    soft, total = ks
    assert soft.op == "nova.softmax" and soft.kind == "reduction"
    assert soft.bytes == 2 * 4096 * 1024 * 4 and soft.flops == 5 * 4096 * 1024
    assert total.op == "nova.reduce_sum"
    assert total.bytes == (4096 * 1024 + 4096) * 4 and total.flops == 4096 * 1024
    assert total.launches == 1  # 4096 rows: one program per row, no split


def test_column_reduction_split_counts_its_partials():
    # a bias gradient [8192, 768] summed over tokens: the column schedule splits the reduced axis
    module, fn, b = _step(Slot("batch", "g", tensor([8192, 768], f32)))
    (g,) = fn.body.block.args
    (k,) = _finish(module, fn, b.reduce_sum(g, [0]))
    split = cost.config_of(fn.body.block.first_op).split_k
    assert split > 1
    assert k.bytes == (8192 * 768 + 768) * 4 + 2 * split * 768 * 4 and k.launches == 2


def test_attention_flops_flash_count():
    B, H, T, D = 2, 4, 256, 64
    qt = tensor([B, H, T, D], bf16)
    module, fn, b = _step(Slot("batch", "q", qt), Slot("batch", "k", qt), Slot("batch", "v", qt))
    q, k_, v = fn.body.block.args
    att = b.create(nv.AttentionOp, [q, k_, v], {"causal": True, "scale": 0.125})
    ks = _finish(module, fn, b.reduce_sum(b.cast(att.results[0], f32), [0, 1, 2, 3]))
    k = ks[0]
    assert k.kind == "attention" and k.path == "bf16"
    assert k.flops == 4 * B * H * T * T * D // 2  # causal: half the (query, key) pairs
    assert k.bytes == 4 * B * H * T * D * 2 + B * H * T * 4  # q, k, v, o in bf16, the f32 log-sum-exp


def test_fused_group_is_one_kernel_of_its_operands_and_results():
    from nova.transforms.fuse import fuse

    # y = (x * 2 + x) * w: three elementwise ops of [1024, 256], one 0-d constant recomputed inside
    module, fn, b = _step(Slot("batch", "x", tensor([1024, 256], f32)), Slot("param", "w", tensor([1024, 256], f32)))
    x, w = fn.body.block.args
    y = b.mul(b.add(b.scale(x, 2.0), x), w)
    set_results(fn, [("loss", "loss", b.reduce_sum(y, [0, 1])), ("loss", "y", y)])  # y read twice: a kernel of its own
    (group,) = fuse(module)
    from nova.ir.module import context

    Configure(H200, "fp32").apply(context(), module)
    ks = cost.kernel_costs(fn, H200, "fp32")
    k = next(k for k in ks if k.op == "nova.fused")
    n = 1024 * 256
    assert k.kind == "fused" and k.ops == len(group.inner_ops())
    assert k.bytes == 3 * n * 4  # x and w read once, y written once: the intermediates stay in registers
    assert k.flops == 3 * n  # mul, add, mul over n elements (the constant is no work per element)
    assert k.launches == 1


def test_a_reduction_group_is_its_reduction_reading_the_prologues_operands():
    from nova.backends.triton import config_of
    from nova.ir.module import context
    from nova.transforms.fuse import fuse

    # sum((x * 2 + x) * w): the chain is the sum's prologue, y is never written
    module, fn, b = _step(Slot("batch", "x", tensor([1024, 256], f32)), Slot("param", "w", tensor([1024, 256], f32)))
    x, w = fn.body.block.args
    set_results(fn, [("loss", "loss", b.reduce_sum(b.mul(b.add(b.scale(x, 2.0), x), w), [0, 1]))])
    (group,) = fuse(module)
    Configure(H200, "fp32").apply(context(), module)
    (k,) = [k for k in cost.kernel_costs(fn, H200, "fp32") if k.op == "nova.fused"]
    red = group.reduction()
    alone = cost.RULES[type(red)](red, tuple(red.operands), tuple(red.results), config_of(group), "fp32")
    n = 1024 * 256
    assert k.kind == "reduction" and alone.launches == k.launches == 2  # split: the partials' pass
    assert k.bytes == 2 * n * 4 + alone.bytes - n * 4  # x and w instead of y, the partials as alone
    assert k.flops == 3 * n + alone.flops


def test_lm_head_counts_its_chunks():
    from nova.ir.types import tensor as t

    N, D, V, chunk = 8192, 768, 50304, 2048
    module, fn, b = _step(Slot("batch", "h", t([N, D], bf16)), Slot("param", "w", t([V, D], bf16)),
                          Slot("batch", "y", t([N], nv.i64)))  # fmt: skip
    h, w, y = fn.body.block.args
    props = {"label_smoothing": 0.0, "chunk": chunk, "ignore_index": -100, "reduction": "mean"}
    loss = b.one(nv.LinearCrossEntropyOp, [h, w, y], props)
    (k,) = _finish(module, fn, loss)
    n_c = 4
    assert k.kind == "lm_head" and k.path == "bf16"
    assert k.flops == 2 * N * V * D + 5 * N * V
    assert k.bytes == N * D * 2 + n_c * V * D * 2 + 2 * N * V * 2 + 2 * N * 8 + 2 * N * 4 + 2  # bf16 loss
    assert k.launches == 2 * n_c + 1
    assert k.bound == "compute"  # 2 N V D / 790 TFLOP/s = 0.8 ms against 2.0 GB / 4.24 TB/s = 0.5 ms


def test_lm_head_with_grad_saves_the_second_logits_matmul():
    """The merged loss-with-gradients op (the loss_grad stage) against the forward +
    backward pair it replaces: one logits matmul per chunk instead of two (2 N V D
    FLOPs fewer), the logits read by one row kernel, one launch per chunk fewer."""
    from nova.ir.types import tensor as t

    N, D, V, chunk = 8192, 768, 50304, 2048
    slots = [Slot("batch", "h", t([N, D], bf16)), Slot("param", "w", t([V, D], bf16)), Slot("batch", "y", t([N], nv.i64)),
             Slot("batch", "g", t([], f32))]
    props = {"label_smoothing": 0.0, "chunk": chunk, "ignore_index": -100, "reduction": "mean"}
    module, fn, b = _step(*slots)
    h, w, y, g = fn.body.block.args
    loss = b.one(nv.LinearCrossEntropyOp, [h, w, y], props, tensor([], f32))
    dh, dw = b.create(nv.LinearCrossEntropyBackwardOp, [g, h, w, y], props).results
    fwd, bwd = _finish(module, fn, b.add(loss, b.add(b.reduce_sum(b.cast(dh, f32), [0, 1]), b.reduce_sum(b.cast(dw, f32), [0, 1]))))[:2]
    module, fn, b = _step(*slots)
    h, w, y, g = fn.body.block.args
    loss, dh, dw = b.create(nv.LinearCrossEntropyWithGradOp, [g, h, w, y], props, tensor([], f32)).results
    (both,) = _finish(module, fn, b.add(loss, b.add(b.reduce_sum(b.cast(dh, f32), [0, 1]), b.reduce_sum(b.cast(dw, f32), [0, 1]))))[:1]
    assert (fwd.op, bwd.op, both.op) == ("nova.linear_cross_entropy", "nova.linear_cross_entropy_backward",
                                         "nova.linear_cross_entropy_with_grad")
    assert both.kind == "lm_head" and both.path == "bf16"
    assert both.flops == 6 * N * V * D + 5 * N * V + 2 * N == fwd.flops + bwd.flops - 2 * N * V * D + 2 * N - 5 * N * V
    n_c = N // chunk
    # the forward's h, w and logits traffic is gone; its row losses and final sum stay
    assert both.bytes == bwd.bytes + 2 * N * 4 + N * 8 + 4
    assert both.launches == bwd.launches + 1 == fwd.launches + bwd.launches - 2 * n_c
    assert both.predicted_s < fwd.predicted_s + bwd.predicted_s


def test_an_f32_lm_head_under_tf32_counts_its_weight_rounding():
    """Under tf32 an f32 head's weight is rounded once a launch (linear_ce.HOIST_WEIGHT_TF32):
    w read and written rounded, once for the forward, twice (w, w^T) with the gradients;
    nothing of it under fp32 or for a bf16 head."""
    from nova.ir.types import tensor as t

    N, D, V, chunk = 4096, 768, 50304, 2048
    slots = [Slot("batch", "h", t([N, D], f32)), Slot("param", "w", t([V, D], f32)), Slot("batch", "y", t([N], nv.i64)),
             Slot("batch", "g", t([], f32))]
    props = {"label_smoothing": 0.0, "chunk": chunk, "ignore_index": -100, "reduction": "mean"}
    module, fn, b = _step(*slots)
    h, w, y, g = fn.body.block.args
    fwd = b.one(nv.LinearCrossEntropyOp, [h, w, y], props, tensor([], f32))
    bwd = b.create(nv.LinearCrossEntropyBackwardOp, [g, h, w, y], props)
    ins = [tuple(o.operands) for o in (fwd.owner, bwd)]
    outs = [tuple(o.results) for o in (fwd.owner, bwd)]
    for op, i, o, copies in zip((fwd.owner, bwd), ins, outs, (1, 2)):
        tf32 = cost.RULES[type(op)](op, i, o, None, "tf32")
        fp32 = cost.RULES[type(op)](op, i, o, None, "fp32")
        assert tf32.bytes - fp32.bytes == copies * 2 * V * D * 4, op.name
        assert tf32.launches - fp32.launches == copies, op.name


def test_every_op_that_can_become_a_kernel_has_a_rule():
    missing = [c.name for c in [*nv.NOVA_OPS, nv.FusedOp] if c not in cost.RULES and c not in nv.AUTODIFF_ONLY]
    assert missing == []


def test_a_missing_rule_names_the_op(monkeypatch):
    module, fn, b = _step(Slot("batch", "x", tensor([4, 4], f32)))
    (x,) = fn.body.block.args
    y = b.neg(x)
    monkeypatch.delitem(cost.RULES, nv.NegOp)
    with pytest.raises(cost.NoCostRule, match="no rule for nova.neg"):
        _finish(module, fn, b.reduce_sum(y, [0, 1]))


def test_a_wave_tail_counts_its_second_launch_and_partials():
    """Rule 8f on a 3072x768x8192 bf16 product (GPT-2's b8 weight-gradient shape): one wave of
    128x128 head tiles, then C's last 256 rows split 11 ways: three launches (head, tail, the
    tail's reduction), the tail's fp32 partials written and read once, and the schedule says so."""
    module, fn, b = _step(Slot("batch", "a", tensor([3072, 8192], bf16)), Slot("param", "w", tensor([8192, 768], bf16)))
    y = b.matmul(*fn.body.block.args)
    (k, _) = _finish(module, fn, b.reduce_sum(y, [0, 1]))
    cfg = cost.config_of(fn.body.block.first_op)
    assert (cfg.tail_at, cfg.tail_axis, cfg.tail_split, cfg.split_k) == (2816, "m", 11, 1)
    assert k.launches == 3
    assert k.bytes - (3072 * 8192 + 8192 * 768 + 3072 * 768) * 2 == 2 * 11 * 256 * 768 * 4
    assert k.config.endswith("| tail rows 2816+ 128x128 split11")
