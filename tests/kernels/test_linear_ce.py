"""The fused LM head + loss lowering (nova/codegen/triton/linear_ce.py) against the
reference executor's chunked implementation: forward and backward, several
chunks with a partial last one, a row loop over the vocabulary in several column
blocks, ignore_index, label smoothing, bias, a batch of padding, bf16; and the
merged loss-with-gradients lowering bit for bit against the two separate ones."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from xdsl.dialects.builtin import bf16, f32, i64

from nova.backends.reference import IMPLS
from nova.codegen.triton.linear_ce import (
    lower_linear_cross_entropy,
    lower_linear_cross_entropy_backward,
    lower_linear_cross_entropy_with_grad,
)
from nova.ir import dialect as nv
from nova.ir.builder import OpBuilder
from nova.ir.module import Slot, new_step
from nova.ir.types import tensor
from nova.schedule.config import LoweringConfig

N, D, V = 7, 16, 37


def _ops(elem, bias_elem, props, loss_elem):
    slots = [Slot("batch", "g", tensor([], loss_elem)), Slot("param", "h", tensor([N, D], elem)),
             Slot("param", "w", tensor([V, D], elem)), Slot("batch", "t", tensor([N], i64))]
    if bias_elem is not None:
        slots.append(Slot("param", "b", tensor([V], bias_elem)))
    _, fn = new_step(slots)
    b = OpBuilder(fn.body.block)
    g, *xs = fn.body.block.args
    fwd = b.create(nv.LinearCrossEntropyOp, xs, props, tensor([], loss_elem))
    bwd = b.create(nv.LinearCrossEntropyBackwardOp, [g, *xs], props)
    merged_ops[fwd] = b.create(nv.LinearCrossEntropyWithGradOp, [g, *xs], props, tensor([], loss_elem))
    return fwd, bwd


merged_ops: dict = {}  # _ops's forward op -> the nova.linear_cross_entropy_with_grad of the same operands


def merged(fwd):
    return merged_ops[fwd]


CASES = [  # (id, head dtype, bias dtype, props, targets)
    ("mean", f32, None, {"reduction": "mean"}, None),
    ("sum-bias-smoothing", f32, f32, {"reduction": "sum", "label_smoothing": 0.1}, None),
    ("mean-ignore-class3", f32, f32, {"reduction": "mean", "ignore_index": 3}, None),
    ("all-ignored", f32, f32, {"reduction": "mean"}, torch.full((N,), -100)),
    ("bf16", bf16, None, {"reduction": "mean"}, None),
    ("bf16-f32-bias", bf16, f32, {"reduction": "mean", "label_smoothing": 0.1}, None),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_linear_cross_entropy_matches_reference(device, case):
    _, elem, bias_elem, props, targets = case
    props = {"ignore_index": -100, "chunk": 3, **props}
    fwd, bwd = _ops(elem, bias_elem, props, f32)
    dt = torch.bfloat16 if elem == bf16 else torch.float32
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(N, D, generator=gen).to(dt)
    w = (torch.randn(V, D, generator=gen) * 0.5).to(dt)
    t = torch.randint(0, V, (N,), generator=gen) if targets is None else targets
    if targets is None:
        t[2] = props["ignore_index"]
    bias = [torch.randn(V, generator=gen)] if bias_elem is not None else []
    g = torch.tensor(1.7)
    xs = [h, w, t, *bias]
    want = IMPLS[nv.LinearCrossEntropyOp](fwd, xs)[0]
    want_grads = IMPLS[nv.LinearCrossEntropyBackwardOp](bwd, [g, *xs])
    dev = [x.to(device) for x in xs]
    got = lower_linear_cross_entropy(fwd, None, max_block=16).launch(dev)[0]  # V = 37: three column blocks
    got_grads = lower_linear_cross_entropy_backward(bwd, None, max_block=16).launch([g.to(device), *dev])
    tol = dict(rtol=2e-2, atol=2e-2) if dt == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.cpu(), want, equal_nan=True, **tol)
    if targets is not None:
        assert torch.isnan(got).item()
    assert len(got_grads) == len(want_grads) == 2 + len(bias)
    for name, a, b in zip(("dh", "dw", "dbias"), got_grads, want_grads):
        assert a.dtype == b.dtype, name
        torch.testing.assert_close(a.cpu(), b, msg=name, **tol)
        if targets is not None:
            assert not a.any(), name  # a batch of padding: gradients 0


def test_out_of_range_targets_are_masked(device):
    """Ids past either end of the vocabulary (some far enough to fault if read)
    raise nothing in the launch and address no memory; as in the reference, the
    loss is NaN and the gradients finite (a bad row: the plain softmax)."""
    props = {"ignore_index": -100, "reduction": "mean", "chunk": 3}
    fwd, bwd = _ops(f32, f32, props, f32)
    gen = torch.Generator().manual_seed(1)
    h, w, bias = torch.randn(N, D, generator=gen), torch.randn(V, D, generator=gen), torch.randn(V, generator=gen)
    t = torch.randint(0, V, (N,), generator=gen)
    t[[1, 3, 4, 6]] = torch.tensor([V, -1, 2**40, -(2**40)])
    g = torch.tensor(1.3)
    xs = [h, w, t, bias]
    dev = [x.to(device) for x in xs]
    (loss,) = lower_linear_cross_entropy(fwd, None, max_block=16).launch(dev)
    assert torch.isnan(loss).item()
    got = lower_linear_cross_entropy_backward(bwd, None, max_block=16).launch([g.to(device), *dev])
    want = IMPLS[nv.LinearCrossEntropyBackwardOp](bwd, [g, *xs])
    for name, a, b in zip(("dh", "dw", "dbias"), got, want):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a.cpu(), b, msg=name, rtol=1e-5, atol=1e-6)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1).view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (NaNs too)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


WITH_GRAD_CASES = [  # (id, head, bias, props, chunk): 7 rows in chunks that do not divide them
    ("f32-mean", f32, None, {"reduction": "mean"}, 3),
    ("f32-sum-bias-smoothing", f32, f32, {"reduction": "sum", "label_smoothing": 0.1}, 4),
    ("f32-ignore-class3-one-chunk", f32, f32, {"reduction": "mean", "ignore_index": 3}, 16),
    ("bf16", bf16, None, {"reduction": "mean"}, 2),
    ("bf16-f32-bias-smoothing", bf16, f32, {"reduction": "mean", "label_smoothing": 0.2}, 3),
    ("bf16-bf16-bias-sum", bf16, bf16, {"reduction": "sum"}, 5),
]


@pytest.mark.parametrize("case", WITH_GRAD_CASES, ids=[c[0] for c in WITH_GRAD_CASES])
def test_with_grad_is_the_forward_and_backward_bit_for_bit(device, case):
    """One pass (one logits matmul and one row kernel per chunk) gives exactly the
    forward's loss and the backward's gradients; ignored and out-of-range targets too."""
    _, elem, bias_elem, props, chunk = case
    props = {"ignore_index": -100, "chunk": chunk, **props}
    fwd, bwd = _ops(elem, bias_elem, props, f32)
    both = merged(fwd)
    dt = torch.bfloat16 if elem == bf16 else torch.float32
    gen = torch.Generator().manual_seed(5)
    h = torch.randn(N, D, generator=gen).to(dt)
    w = (torch.randn(V, D, generator=gen) * 0.5).to(dt)
    t = torch.randint(0, V, (N,), generator=gen)
    t[2] = props["ignore_index"]
    t[5] = 3  # ignored where ignore_index is 3
    bias = [torch.randn(V, generator=gen).to(torch.bfloat16 if bias_elem == bf16 else torch.float32)] if bias_elem else []
    g = torch.tensor(1.7, device=device)
    xs = [x.to(device) for x in (h, w, t, *bias)]
    (loss,) = lower_linear_cross_entropy(fwd, None, max_block=16).launch(xs)
    grads = lower_linear_cross_entropy_backward(bwd, None, max_block=16).launch([g, *xs])
    kernel = lower_linear_cross_entropy_with_grad(both, None, max_block=16)
    got = kernel.launch([g, *xs])
    assert len(got) == 1 + len(grads) == 3 + len(bias)
    for name, a, b in zip(("loss", "dh", "dw", "dbias"), got, [loss, *grads]):
        assert same_bits(a, b), name
    # the reference's merged op is its two ops bit for bit, too (the same chunk code)
    cpu = [x.cpu() for x in xs]
    want = IMPLS[nv.LinearCrossEntropyOp](fwd, cpu) + IMPLS[nv.LinearCrossEntropyBackwardOp](bwd, [g.cpu(), *cpu])
    for name, a, b in zip(("loss", "dh", "dw", "dbias"), IMPLS[nv.LinearCrossEntropyWithGradOp](both, [g.cpu(), *cpu]), want):
        assert same_bits(a, b), name
    # the row losses beside the backward's scratch
    assert kernel.arena_scratch_bytes > lower_linear_cross_entropy_backward(bwd, None, max_block=16).arena_scratch_bytes


def test_a_tf32_head_writes_its_logits_gradient_rounded_and_gives_the_same_bits(device, monkeypatch):
    """An f32 head under the tf32 policy without a bias: the row kernel writes d rounded to
    tf32 (``PREROUND_TF32``) and dh's matmul takes it as ``prerounded``: every result bit
    for bit the lowering that lets the matmuls round d; with a bias (its column sum reads
    the unrounded d) nothing is rounded early."""
    from nova.codegen.triton import linear_ce

    props = {"ignore_index": -100, "reduction": "mean", "chunk": 3}
    gen = torch.Generator().manual_seed(11)
    xs = [x.to(device) for x in (torch.randn(N, D, generator=gen), torch.randn(V, D, generator=gen),
                                 torch.randint(0, V, (N,), generator=gen))]  # fmt: skip
    g = torch.tensor(1.3, device=device)
    fwd, _ = _ops(f32, None, props, f32)
    outs = []
    for early in (True, False):
        monkeypatch.setattr(linear_ce, "PREROUND_TF32", early)
        kernel = lower_linear_cross_entropy_with_grad(merged(fwd), None, precision="tf32", max_block=16)
        assert ("tf32_rn(d)" in kernel.source) == early
        outs.append(kernel.launch([g, *xs]))
    for name, a, b in zip(("loss", "dh", "dw"), *outs):
        assert same_bits(a, b), name
    monkeypatch.setattr(linear_ce, "PREROUND_TF32", True)
    with_bias, _ = _ops(f32, f32, props, f32)
    assert "tf32_rn(" not in lower_linear_cross_entropy_with_grad(merged(with_bias), None, precision="tf32").source
    assert "tf32_rn(" not in lower_linear_cross_entropy_with_grad(merged(fwd), None, precision="fp32").source


def _smoothed_bf16_head(device, seed: int):
    """(the forward op, the loss's cotangent, the operands) of a bf16 head with an f32 bias
    and label smoothing, for the row kernel's variants: V 37 at block 16 is several column
    blocks a row, the last one ragged."""
    props = {"ignore_index": -100, "reduction": "mean", "chunk": 3, "label_smoothing": 0.1}
    gen = torch.Generator().manual_seed(seed)
    xs = [x.to(device) for x in (torch.randn(N, D, generator=gen).to(torch.bfloat16),
                                 torch.randn(V, D, generator=gen).to(torch.bfloat16),
                                 torch.randint(0, V, (N,), generator=gen), torch.randn(V, generator=gen))]  # fmt: skip
    fwd, _ = _ops(bf16, f32, props, f32)
    return fwd, torch.tensor(0.9, device=device), xs


@pytest.mark.parametrize("variant", [(True, False), (False, True), (True, True)], ids=["reversed", "evict", "both"])
def test_the_row_kernel_variants_give_the_same_bits(device, monkeypatch, variant):
    """The gradient pass walking the row backwards (``GRAD_PASS_REVERSED``) and the
    eviction hints (``KEEP_ROWS_IN_L2``) are in the source and change no bit of the
    loss or the gradients (several column blocks a row: V 37 at block 16, a ragged last one)."""
    from nova.codegen.triton import linear_ce

    reverse, keep = variant
    fwd, g, xs = _smoothed_bf16_head(device, seed=13)
    outs = []
    for on in (False, True):
        monkeypatch.setattr(linear_ce, "GRAD_PASS_REVERSED", reverse and on)
        monkeypatch.setattr(linear_ce, "KEEP_ROWS_IN_L2", keep and on)
        kernel = lower_linear_cross_entropy_with_grad(merged(fwd), None, max_block=16)
        assert ("c0 = (2 - i) * BLOCK" in kernel.source) == (reverse and on)
        assert ('eviction_policy="evict_last"' in kernel.source) == (keep and on)
        outs.append(kernel.launch([g, *xs]))
    for name, a, b in zip(("loss", "dh", "dw", "dbias"), *outs):
        assert same_bits(a, b), name


@pytest.mark.parametrize("bias", [False, True])
def test_a_tf32_head_rounds_its_weight_once_and_gives_the_same_bits(device, monkeypatch, bias):
    """An f32 head under the tf32 policy (``HOIST_WEIGHT_TF32``): the weight rounded to tf32
    once a launch, w and w^T dense (both K contiguous), which every chunk's logits and dh
    take as ``prerounded``: every result bit for bit the lowering whose matmuls round w
    themselves, the forward's too; under fp32 nothing is rounded."""
    from nova.codegen.triton import linear_ce
    from nova.codegen.triton import matmul as mm

    props = {"ignore_index": -100, "reduction": "mean", "chunk": 3}
    gen = torch.Generator().manual_seed(12)
    xs = [x.to(device) for x in (torch.randn(N, D, generator=gen), torch.randn(V, D, generator=gen),
                                 torch.randint(0, V, (N,), generator=gen))]  # fmt: skip
    if bias:
        xs.append(torch.randn(V, generator=gen).to(device))
    g = torch.tensor(0.7, device=device)
    fwd, _ = _ops(f32, f32 if bias else None, props, f32)
    copies = []
    real = mm.stage_tf32
    monkeypatch.setattr(mm, "stage_tf32",
                        lambda src, dst, record=None: copies.append(tuple(src.shape)) or real(src, dst, record))
    outs, weights = [], []
    for hoist in (True, False):
        monkeypatch.setattr(linear_ce, "HOIST_WEIGHT_TF32", hoist)
        copies.clear()
        both = lower_linear_cross_entropy_with_grad(merged(fwd), None, precision="tf32", max_block=16)
        got = both.launch([g, *xs])
        weights.append(sorted(c for c in copies if set(c[1:]) == {V, D}))
        got += lower_linear_cross_entropy(fwd, None, precision="tf32", max_block=16).launch(xs)
        outs.append(got)
    for name, a, b in zip(("loss", "dh", "dw", "dbias", "forward loss")[:len(outs[0])], *outs):
        assert same_bits(a, b), name
    assert weights[0] == [(1, D, V), (1, V, D)]  # once each, whatever the chunks' configs stage
    monkeypatch.setattr(linear_ce, "HOIST_WEIGHT_TF32", True)
    copies.clear()
    lower_linear_cross_entropy_with_grad(merged(fwd), None, precision="fp32", max_block=16).launch([g, *xs])
    assert copies == []


def test_with_grad_with_out_of_range_targets(device):
    """Bad targets: the loss NaN, the gradients the plain softmax, as the separate lowerings."""
    props = {"ignore_index": -100, "reduction": "mean", "chunk": 3}
    fwd, bwd = _ops(f32, f32, props, f32)
    gen = torch.Generator().manual_seed(2)
    h, w, bias = torch.randn(N, D, generator=gen), torch.randn(V, D, generator=gen), torch.randn(V, generator=gen)
    t = torch.randint(0, V, (N,), generator=gen)
    t[[1, 4]] = torch.tensor([V, -(2**40)])
    g = torch.tensor(0.9, device=device)
    xs = [x.to(device) for x in (h, w, t, bias)]
    want = lower_linear_cross_entropy(fwd, None, max_block=16).launch(xs)
    want += lower_linear_cross_entropy_backward(bwd, None, max_block=16).launch([g, *xs])
    got = lower_linear_cross_entropy_with_grad(merged(fwd), None, max_block=16).launch([g, *xs])
    assert torch.isnan(got[0]).item()
    for name, a, b in zip(("loss", "dh", "dw", "dbias"), got, want):
        assert same_bits(a, b), name


def test_with_grad_runs_one_logits_matmul_and_one_row_kernel_per_chunk(device, monkeypatch):
    """The point of the merged op: per chunk one h @ w^T and one row kernel (the
    forward and the backward each run both per chunk)."""
    from nova.codegen.triton import linear_ce

    props = {"ignore_index": -100, "reduction": "mean", "chunk": 3}
    fwd, bwd = _ops(f32, None, props, f32)
    matmuls, rows = [], []
    real_matmul, real_load = linear_ce.mm.matmul, linear_ce.load_kernel

    class Counted:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            rows.append(self.name)
            return self.kernel[grid]

    monkeypatch.setattr(linear_ce.mm, "matmul", lambda a, b, *r, **kw: matmuls.append(tuple(b.shape)) or real_matmul(a, b, *r, **kw))
    monkeypatch.setattr(linear_ce, "load_kernel", lambda src, n: (Counted(n, real_load(src, n)[0]), *real_load(src, n)[1:]))
    gen = torch.Generator().manual_seed(3)
    xs = [x.to(device) for x in (torch.randn(N, D, generator=gen), torch.randn(V, D, generator=gen),
                                 torch.randint(0, V, (N,), generator=gen))]  # fmt: skip
    lower_linear_cross_entropy_with_grad(merged(fwd), None, max_block=16).launch([torch.tensor(1.0, device=device), *xs])
    chunks = 3  # 7 rows in chunks of 3
    assert matmuls.count((D, V)) == chunks  # the logits: h[chunk] @ w^T
    assert matmuls.count((V, D)) == chunks  # dh = d @ w
    assert rows.count("lce_rows_with_grad") == chunks and not {"lce_rows", "lce_rows_backward"} & set(rows)
    assert rows.count("lce_scale") == rows.count("lce_final") == 1


def test_the_lowering_configures_each_distinct_matmul_once(device, monkeypatch):
    """The dh and dw matmuls' schedules are asked of the configurator once per shape
    and layout (a full chunk and the last one), not at every launch: two launches of
    7 rows in chunks of 3 ask for dh and dw of rows 3 and 1, and the accumulation's."""
    from nova.codegen.triton import linear_ce

    asked = []
    real = linear_ce.configure_matmul
    monkeypatch.setattr(linear_ce, "configure_matmul", lambda *a, **kw: asked.append((*a[:3], kw.get("epilogue", False))) or real(*a, **kw))
    fwd, _ = _ops(f32, None, {"ignore_index": -100, "reduction": "mean", "chunk": 3}, f32)
    gen = torch.Generator().manual_seed(3)
    xs = [x.to(device) for x in (torch.randn(N, D, generator=gen), torch.randn(V, D, generator=gen),
                                 torch.randint(0, V, (N,), generator=gen))]  # fmt: skip
    kernel = lower_linear_cross_entropy_with_grad(merged(fwd), None, max_block=16)
    first = kernel.launch([torch.tensor(1.0, device=device), *xs])
    n = len(asked)
    again = kernel.launch([torch.tensor(1.0, device=device), *xs])
    assert len(asked) == n and len(set(asked)) == n
    assert {(3, D, V, False), (1, D, V, False), (V, D, 3, False), (V, D, 3, True), (V, D, 1, True)} == set(asked)
    assert all(torch.equal(x, y) for x, y in zip(first, again, strict=True))


@pytest.mark.parametrize("split_k", [1, 2], ids=["one-pass", "split-k"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_dw_accumulates_in_the_matmul_epilogue_bit_for_bit(device, dtype, split_k):
    """dw += d^T @ h[chunk] as the matmul's epilogue over the old accumulator (in place)
    is the matmul's f32 product added to it afterwards, bit for bit: ragged tiles, d^T
    read column-major as the lowering reads it, one-pass and split-K; and the last
    chunk's sum stored into a bf16 dw is that f32 sum rounded."""
    from nova.codegen.triton import matmul as mm
    from nova.codegen.triton.linear_ce import accumulate, accumulate_into
    from nova.schedule.config import LoweringConfig

    cfg = LoweringConfig(kind="matmul", block_m=16, block_n=16, block_k=16, group_m=1, split_k=split_k,
                         persistent=False, num_warps=4, num_stages=2, instruction="mma")  # fmt: skip
    gen = torch.Generator().manual_seed(7)
    rows, vocab, width = 40, 37, 20  # K = 40 rows of a chunk, M = V, N = D: no dim a multiple of the tile
    d = torch.randn(rows, vocab, generator=gen).to(dtype).to(device)
    h = torch.randn(rows, width, generator=gen).to(dtype).to(device)
    acc = torch.randn(vocab, width, generator=gen).to(device)
    part = mm.matmul(d.t(), h, cfg=cfg, out_dtype=torch.float32)
    want = acc + part
    again = acc.clone()
    (got,) = mm.matmul_epilogue(d.t(), h, accumulate(vocab, width), [acc], torch.float32, cfg=cfg, outs=[acc])
    assert got is acc
    assert same_bits(acc, want)
    # as the lowering launches it (the launcher's configuration, as an epilogue kernel)
    # against the launcher's plain matmul added in
    want = again + mm.matmul(d.t(), h, out_dtype=torch.float32)
    before = again.clone()
    accumulate_into(again, d.t(), h, "ieee")
    assert same_bits(again, want)
    # the last chunk into a 16-bit dw: the f32 sum rounded once, as copying it into dw rounds it
    # (the accumulator only read)
    out16 = torch.empty(vocab, width, dtype=torch.bfloat16, device=device)
    accumulate_into(before, d.t(), h, "ieee", accumulate(vocab, width, torch.bfloat16), out=out16)
    assert same_bits(out16, want.to(torch.bfloat16))


class TiedLM(torch.nn.Module):
    """Embedding, LayerNorm and a head tied to the embedding with a bias of its own;
    label smoothing and ignored targets."""

    def __init__(self, vocab=37, d=16):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.ln = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab)
        self.head.weight = self.emb.weight

    def forward(self, x, y):
        logits = self.head(self.ln(self.emb(x)))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-1, label_smoothing=0.1)


def test_a_step_with_the_merged_head_is_the_step_without_it(monkeypatch):
    """On the Triton backend in bf16 (an f32 bias on a bf16 head), the LM head in
    chunks of 6 rows over 16 tokens: with the loss_grad stage's merged op (its
    scratch planned in the arena), every loss and parameter after two AdamW steps is
    bit-identical to the step with the forward and backward ops."""
    import copy

    import nova
    from nova import pipeline
    from nova.ir.module import step_func
    from nova.transforms import fuse_loss

    monkeypatch.setattr(fuse_loss, "fuse_loss", functools.partial(fuse_loss.fuse_loss, chunk=6))
    torch.manual_seed(0)
    merged_model = TiedLM()
    plain_model = copy.deepcopy(merged_model)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 37, (2, 8), generator=g), torch.randint(0, 37, (2, 8), generator=g)) for _ in range(2)]
    for x, y in batches:
        y[0, :2] = -1

    def train(model):
        step = nova.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-2), backend="triton", precision="bf16")
        losses = [step(x, y) for x, y in batches]
        return losses, [op.name for op in step_func(step._last.compilation.module).body.block.ops]

    with monkeypatch.context() as m:
        m.setattr(pipeline, "STAGES", [s for s in pipeline.STAGES if s[0] != "loss_grad"])
        want, plain_ops = train(plain_model)
    got, ops = train(merged_model)
    assert "nova.linear_cross_entropy_with_grad" in ops and "nova.linear_cross_entropy" not in ops
    assert "nova.linear_cross_entropy_backward" in plain_ops
    for a, b in zip(got, want):
        assert same_bits(a, b)
    for p, q in zip(merged_model.parameters(), plain_model.parameters(), strict=True):
        assert same_bits(p.detach(), q.detach())


# ----------------------------------------------------------------------------
# the row statistics from the logits matmul's epilogue (ROW_STATS_FROM_LOGITS)

_TILE = LoweringConfig(kind="matmul", block_m=16, block_n=16, block_k=16, group_m=1, num_warps=4, num_stages=2,
                       instruction="mma")  # V = 37: three column tiles, the last one ragged

STATS_CASES = [  # (id, head, precision, props, chunk, targets to set)
    ("bf16-mean", bf16, "bf16", {"reduction": "mean"}, 3, {2: -100}),
    ("bf16-sum-one-chunk", bf16, "bf16", {"reduction": "sum"}, 16, {}),
    ("bf16-ignore-class3-out-of-range", bf16, "bf16", {"reduction": "mean", "ignore_index": 3}, 2,
     {1: 37, 4: -(2**40), 5: 3}),
    ("f32-mean", f32, "fp32", {"reduction": "mean"}, 3, {2: -100}),
    ("tf32-mean", f32, "tf32", {"reduction": "mean"}, 3, {1: 37}),  # d rounded to tf32, the weight rounded once
]


def _stats_case(case, seed: int):
    """A STATS_CASES case's (forward op, backward op, h, w, targets, precision, chunk): a head
    of its type, its targets set where it says."""
    _, head, precision, props, chunk, bad = case
    fwd, bwd = _ops(head, None, {"ignore_index": -100, "chunk": chunk, **props}, f32)
    dt = torch.bfloat16 if head == bf16 else torch.float32
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=gen).to(dt)
    w = (torch.randn(V, D, generator=gen) * 0.5).to(dt)
    t = torch.randint(0, V, (N,), generator=gen)
    for i, v in bad.items():
        t[i] = v
    return fwd, bwd, h, w, t, precision, chunk


@pytest.mark.parametrize("case", STATS_CASES, ids=[c[0] for c in STATS_CASES])
def test_row_statistics_from_the_logits_epilogue(device, monkeypatch, case):
    """The three lowerings with the statistics from the logits' epilogue against the
    reference, the merged op bit for bit the two separate ones (the same statistics), and
    against the two-pass row kernel within f32 rounding (the logits are the same bits; the
    sum of exponentials is added in another order); bf16, f32 and tf32 heads."""
    from nova.codegen.triton import linear_ce

    fwd, bwd, h, w, t, precision, _ = _stats_case(case, 11)
    bad = case[5]
    g = torch.tensor(1.3)
    cpu = [h, w, t]
    xs = [x.to(device) for x in cpu]

    def run():
        kw = dict(precision=precision, max_block=16)
        (loss,) = lower_linear_cross_entropy(fwd, _TILE, **kw).launch(xs)
        grads = lower_linear_cross_entropy_backward(bwd, _TILE, **kw).launch([g.to(device), *xs])
        kernel = lower_linear_cross_entropy_with_grad(merged(fwd), _TILE, **kw)
        return [loss, *grads], kernel.launch([g.to(device), *xs]), kernel

    monkeypatch.setattr(linear_ce, "ROW_STATS_F32", True)  # f32 heads too (the switch's own test is below)
    monkeypatch.setattr(linear_ce, "ROW_STATS_FROM_LOGITS", False)
    two_pass, _, plain_kernel = run()
    monkeypatch.setattr(linear_ce, "ROW_STATS_FROM_LOGITS", True)
    separate, both, kernel = run()
    assert "statistics of 3 column tiles" in kernel.source and "statistics of" not in plain_kernel.source
    assert linear_ce.stats_cols_of(merged(fwd), _TILE) == 16
    assert kernel.arena_scratch_bytes > plain_kernel.arena_scratch_bytes  # the two [chunk, 3] buffers
    for name, a, b in zip(("loss", "dh", "dw"), both, separate, strict=True):
        assert same_bits(a, b), name
    want = IMPLS[nv.LinearCrossEntropyOp](fwd, cpu) + IMPLS[nv.LinearCrossEntropyBackwardOp](bwd, [g, *cpu])
    ref_tol = {"bf16": 2e-2, "tf32": 2e-2, "fp32": 1e-5}[precision]  # the reference's f32 matmul against tf32's
    for name, a, r, p in zip(("loss", "dh", "dw"), both, want, two_pass, strict=True):
        torch.testing.assert_close(a.cpu(), r, rtol=ref_tol, atol=ref_tol, equal_nan=True, msg=name)
        # the two-pass kernel's results: its d differs by f32 rounding (bf16: an ulp of a rounded d)
        torch.testing.assert_close(a.cpu(), p.cpu(), rtol=1e-2 if a.dtype == torch.bfloat16 else 1e-5,
                                   atol=1e-3 if a.dtype == torch.bfloat16 else 1e-6, equal_nan=True, msg=name)
    assert torch.isnan(both[0]).item() == bool({37, -(2**40)} & set(bad.values()))


def test_row_statistics_only_where_they_apply(monkeypatch):
    """A bias, label smoothing, no config or (without ROW_STATS_F32) an f32 head keep the two-pass
    row kernel; 16-bit and f32 heads take the statistics as shipped."""
    from nova.codegen.triton import linear_ce

    assert linear_ce.ROW_STATS_FROM_LOGITS and linear_ce.ROW_STATS_F32  # as shipped: every head
    plain = {"ignore_index": -100, "chunk": 3, "reduction": "mean"}
    assert linear_ce.stats_cols_of(_ops(bf16, None, plain, f32)[0], _TILE) == 16
    assert linear_ce.stats_cols_of(_ops(f32, None, plain, f32)[0], _TILE) == 16
    monkeypatch.setattr(linear_ce, "ROW_STATS_F32", False)
    assert linear_ce.stats_cols_of(_ops(f32, None, plain, f32)[0], _TILE) == 0
    assert linear_ce.stats_cols_of(_ops(bf16, None, plain, f32)[0], _TILE) == 16
    assert linear_ce.stats_cols_of(_ops(bf16, None, plain, f32)[0], None) == 0
    assert linear_ce.stats_cols_of(_ops(bf16, f32, plain, f32)[0], _TILE) == 0
    assert linear_ce.stats_cols_of(_ops(bf16, None, {**plain, "label_smoothing": 0.1}, f32)[0], _TILE) == 0
    monkeypatch.setattr(linear_ce, "ROW_STATS_FROM_LOGITS", False)
    assert linear_ce.stats_cols_of(_ops(bf16, None, plain, f32)[0], _TILE) == 0


# ----------------------------------------------------------------------------
# d formed in dh's and dw's prologues from the logits (D_PROLOGUE, D_PROLOGUE_F32)

_MATMULS = {  # the backward's matmul configs, forced (None: the configurator's for the CPU)
    "configured": None,
    "split-tma": LoweringConfig(kind="matmul", block_m=16, block_n=16, block_k=16, group_m=2, split_k=2, num_warps=4,
                                num_stages=2, instruction="wgmma+tma"),
    "persistent-tma": LoweringConfig(kind="matmul", block_m=16, block_n=16, block_k=16, group_m=2, persistent=True,
                                     num_warps=4, num_stages=2, instruction="wgmma+tma"),
}


@pytest.mark.parametrize("matmuls", list(_MATMULS))
@pytest.mark.parametrize("case", STATS_CASES, ids=[c[0] for c in STATS_CASES])
def test_d_formed_in_the_matmuls_prologues_is_bit_for_bit(device, monkeypatch, case, matmuls):
    """The backward and the merged lowering with d formed from the logits by dh's and dw's
    prologues against the row kernel writing d over the logits: every result bit for bit
    (d is each logit's same expression; the matmuls keep their tiles, K steps and splits:
    stream-K, which the prologue's launch does not take, is off in both); the row kernel of
    the prologue's form writes no d, and the launch holds each row's lse and weight."""
    from nova.codegen.triton import linear_ce
    from nova.codegen.triton import matmul as mm

    fwd, bwd, h, w, t, precision, chunk = _stats_case(case, 12)
    xs = [torch.tensor(0.7).to(device), *(x.to(device) for x in (h, w, t))]
    monkeypatch.setattr(linear_ce, "ROW_STATS_F32", True)
    monkeypatch.setattr(mm, "STREAM_K_SPLIT", False)
    forced = _MATMULS[matmuls]
    if forced is not None:
        staged = "+stage_a+stage_b" if precision == "tf32" else ""
        monkeypatch.setattr(linear_ce, "configure_matmul", lambda *a, **k: dataclasses.replace(
            forced, instruction=forced.instruction + staged))

    def run():
        kw = dict(precision=precision, max_block=16)
        backward = lower_linear_cross_entropy_backward(bwd, _TILE, **kw)
        merged_kernel = lower_linear_cross_entropy_with_grad(merged(fwd), _TILE, **kw)
        return [*backward.launch(xs), *merged_kernel.launch(xs)], merged_kernel

    plain, plain_kernel = run()
    monkeypatch.setattr(linear_ce, "D_PROLOGUE", True)
    monkeypatch.setattr(linear_ce, "D_PROLOGUE_F32", True)
    got, kernel = run()
    assert linear_ce.uses_d_prologue(merged(fwd), _TILE) and "def lce_rows_lse_with_grad" in kernel.source
    assert any("A from a prologue" in open(p).read() for p in kernel.extra["matmul_sources"] if p != "tf32_stage")
    assert kernel.arena_scratch_bytes >= plain_kernel.arena_scratch_bytes + 2 * chunk * 4  # lse and weight a row
    for name, a, b in zip(("dh", "dw", "loss", "dh (merged)", "dw (merged)"), got, plain, strict=True):
        assert a.dtype == b.dtype and same_bits(a, b), name


def test_d_prologue_only_with_the_row_statistics(monkeypatch):
    """Off as shipped (not yet timed); on, only where the logits carry their row statistics
    and the lowering has gradients."""
    from nova.codegen.triton import linear_ce

    assert not linear_ce.D_PROLOGUE and not linear_ce.D_PROLOGUE_F32
    plain = {"ignore_index": -100, "chunk": 3, "reduction": "mean"}
    fwd, bwd = _ops(bf16, None, plain, f32)
    assert not linear_ce.uses_d_prologue(merged(fwd), _TILE)
    monkeypatch.setattr(linear_ce, "D_PROLOGUE", True)
    assert linear_ce.uses_d_prologue(merged(fwd), _TILE) and linear_ce.uses_d_prologue(bwd, _TILE)
    assert not linear_ce.uses_d_prologue(fwd, _TILE) and not linear_ce.uses_d_prologue(bwd, None)
    assert not linear_ce.uses_d_prologue(_ops(f32, None, plain, f32)[1], _TILE)  # f32 heads: D_PROLOGUE_F32
    assert not linear_ce.uses_d_prologue(_ops(bf16, f32, plain, f32)[1], _TILE)  # a bias: no statistics
