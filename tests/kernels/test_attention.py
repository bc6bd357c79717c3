"""The FlashAttention-2 lowerings (nova.attention and nova.attention_backward)
against the reference executor, through the Triton interpreter on the CPU (the
real compiler on a GPU). Sequence lengths are ragged (not multiples of the 16-row
tiles the tests force), head dims are padded (24 -> 32), and causal masks are top-left
aligned like SDPA's is_causal, with Tq < Tk and Tq > Tk."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_rowwise import build, build_for_sm90, rand, rel_err, run_sm90_build  # shared kernel-test helpers

from nova.backends.reference import IMPLS
from nova.ir import dialect as nv
from nova.schedule.config import LoweringConfig

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

RTOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float64: 1e-12}
SMALL = LoweringConfig(kind="attention", block_m=16, block_n=16, num_warps=4, num_stages=1)


def lowerings():
    from nova.codegen.triton import attention

    return attention.lower_attention, attention.lower_attention_backward


def qkv(b, h, tq, tk, d, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [rand(b, h, t, d, dtype=dtype, device=device, gen=gen) for t in (tq, tk, tk)]


def check(outs, refs, dtype, what):
    for i, (o, r) in enumerate(zip(outs, refs)):
        assert o.shape == r.shape and o.dtype == r.dtype, (what, i, o.dtype, r.dtype)
        assert o.is_contiguous()
        inf = torch.isinf(r)  # lse of a row that masks every key: -inf on both sides
        assert torch.equal(torch.isinf(o), inf) and torch.equal(o[inf], r[inf]), (what, i)
        o, r = o.masked_fill(inf, 0), r.masked_fill(inf, 0)
        assert rel_err(o, r) < RTOL[dtype], (what, i, rel_err(o, r))


def forward_and_backward(q, k, v, causal, scale, cfg=None, precision="fp32", grad=None, bias=None, dropout=None,
                         **kw):
    """Runs both lowerings on (q, k, v[, bias][, seed]) and checks them against the
    reference; returns the kernels' (out, lse) and (dq, dk, dv). ``dropout``: (p,
    salt, seed) of the probabilities' dropout. ``kw``: more lowering arguments
    (source_flags, the backward's tiles)."""
    fwd, bwd = lowerings()
    dtype = q.dtype
    props = {"causal": causal, "scale": scale}
    z = [] if bias is None else [bias]
    if dropout is not None:
        props |= {"dropout": dropout[0], "salt": dropout[1]}
        z.append(torch.tensor(dropout[2], dtype=torch.int64, device=q.device))
    op = build(nv.AttentionOp, [q, k, v, *z], props)
    outs = fwd(op, cfg, precision=precision, **{k2: a for k2, a in kw.items() if k2 != "tiles"}).launch([q, k, v, *z])
    refs = IMPLS[nv.AttentionOp](op, [q, k, v, *z])
    check(outs, refs, dtype, "forward")
    g = grad if grad is not None else rand(*q.shape, dtype=dtype, device=q.device, gen=torch.Generator().manual_seed(9))
    ins = [g, q, k, v, refs[0], refs[1], *z]
    op = build(nv.AttentionBackwardOp, ins, props)
    grads = bwd(op, cfg, precision=precision, **kw).launch(ins)
    check(grads, IMPLS[nv.AttentionBackwardOp](op, ins), dtype, "backward")
    return outs, grads


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_attention_ragged_blocks(device, dtype, causal):
    """16x16 tiles over T = 37: whole, diagonal and ragged tail blocks; a second
    head and batch so the (batch, head) offsets are exercised."""
    q, k, v = qkv(2, 2, 37, 37, 16, dtype, device)
    forward_and_backward(q, k, v, causal, 0.25, SMALL)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_attention_dropout(device, dtype, causal):
    """SDPA's dropout_p: the kernels drop the probabilities the reference drops
    (``nova.rng``'s bits at the scores' flat indices, recomputed by the forward and
    both backward walks), over ragged tiles, a second batch and head, and a seed
    past 2**31 (its low 32 bits are the hash's)."""
    q, k, v = qkv(2, 2, 37, 37, 16, dtype, device)
    plain, plain_grads = forward_and_backward(q, k, v, causal, 0.25, SMALL)
    for seed in (12345, 2**40 + 99):
        outs, grads = forward_and_backward(q, k, v, causal, 0.25, SMALL, dropout=(0.3, 7, seed))
        assert torch.equal(outs[1], plain[1])  # lse is of the scores, dropout aside
        assert rel_err(outs[0], plain[0]) > 0.05 and rel_err(grads[0], plain_grads[0]) > 0.05


def test_attention_dropout_bias_padded_head_and_f64(device):
    """Dropout beside a padding-mask bias (the bias's and the seed's pointers both
    passed), Tq != Tk with a padded head dim, f64 with the default plan."""
    q, k, v = qkv(2, 2, 21, 40, 24, torch.float32, device, seed=3)
    keys = torch.ones(2, 1, 1, 40, dtype=torch.bool, device=device)
    keys[1, ..., 30:] = False
    bias = torch.zeros(keys.shape, device=device).masked_fill(~keys, float("-inf"))
    forward_and_backward(q, k, v, True, 24**-0.5, SMALL, bias=bias, dropout=(0.5, 3, 77))
    q, k, v = qkv(1, 2, 33, 33, 8, torch.float64, device, seed=4)
    forward_and_backward(q, k, v, False, 0.3, dropout=(0.1, 11, 5))


def test_attention_dropout_reference_is_torch_with_the_mask(device):
    """The reference's dropout (the oracle the kernels are held to) is torch's
    attention with ``nova.rng``'s multiplier on the probabilities: the output and,
    through autograd, every gradient (f64)."""
    from nova import rng

    q, k, v = (t.requires_grad_() for t in qkv(2, 3, 9, 9, 4, torch.float64, device, seed=5))
    z = rng.dropout_scale(4242, 5, (2, 3, 9, 9), 0.25, torch.float64, device)
    s = (q @ k.transpose(-1, -2) * 0.5).masked_fill(~torch.ones(9, 9, dtype=torch.bool, device=device).tril(), float("-inf"))
    out = (torch.softmax(s, -1) * z) @ v
    g = torch.randn(out.shape, dtype=torch.float64, device=device, generator=torch.Generator(device).manual_seed(1))
    want = torch.autograd.grad(out, (q, k, v), g)
    props = {"causal": True, "scale": 0.5, "dropout": 0.25, "salt": 5}
    seed = torch.tensor(4242, device=device)
    op = build(nv.AttentionOp, [q.detach(), k.detach(), v.detach(), seed], props)
    o, lse = IMPLS[nv.AttentionOp](op, [q.detach(), k.detach(), v.detach(), seed])
    assert torch.allclose(o, out, rtol=1e-12, atol=1e-14)
    ins = [g, q.detach(), k.detach(), v.detach(), o, lse, seed]
    got = IMPLS[nv.AttentionBackwardOp](build(nv.AttentionBackwardOp, ins, props), ins)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_attention_unequal_lengths_padded_head_dim(device, causal):
    """Tq < Tk and Tq > Tk (top-left causal: late queries see every key), D = 24."""
    for tq, tk in ((20, 45), (45, 20)):
        q, k, v = qkv(1, 1, tq, tk, 24, torch.float32, device, seed=tq)
        forward_and_backward(q, k, v, causal, 24**-0.5, SMALL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_outputs_written_in_the_layout_the_next_op_reads(device, dtype):
    """o and dq, dk, dv stored through their strides into [B, T, H, D] memory (the
    layout whose [B, T, C] reshape is a view) are bit for bit the contiguous
    launch's, and so are the gradients written into their windows of a cat's
    buffer; lse must stay contiguous, and an overlapping out is refused."""
    fwd, bwd = lowerings()
    q, k, v = qkv(2, 3, 21, 21, 16, dtype, device)
    props = {"causal": True, "scale": 0.25}
    op = build(nv.AttentionOp, [q, k, v], props)
    kernel = fwd(op, SMALL)
    o, lse = kernel.launch([q, k, v])

    def bthd():  # a [B, H, T, D] view of [B, T, H, D] memory
        return torch.full((2, 21, 3, 16), 7.0, dtype=dtype, device=device).transpose(1, 2)

    o2 = bthd()
    assert not o2.is_contiguous()
    got = kernel.launch([q, k, v], [o2, torch.empty_like(lse)])
    assert got[0] is o2 and torch.equal(o2, o) and torch.equal(got[1], lse)
    with pytest.raises(ValueError, match="contiguous"):
        kernel.launch([q, k, v], [o2, torch.empty(2, 21, 3, device=device).transpose(1, 2)])
    with pytest.raises(ValueError, match="non-overlapping"):
        kernel.launch([q, k, v], [torch.zeros((), dtype=dtype, device=device).expand(o.shape), lse])
    g = rand(*q.shape, dtype=dtype, device=device, gen=torch.Generator().manual_seed(3))
    ins = [g, q, k, v, o, lse]
    bop = build(nv.AttentionBackwardOp, ins, props)
    bkernel = bwd(bop, SMALL)
    grads = bkernel.launch(ins)
    outs = [bthd() for _ in range(3)]
    assert all(a is b for a, b in zip(bkernel.launch(ins, outs), outs, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(outs, grads, strict=True))
    # each gradient straight into its window of the split backward's cat buffer [B, T, 3H, D]
    cat = torch.full((2, 21, 9, 16), 7.0, dtype=dtype, device=device)
    windows = [cat[:, :, 3 * i:3 * i + 3].transpose(1, 2) for i in range(3)]
    bkernel.launch(ins, windows)
    assert torch.equal(cat, torch.cat([d.transpose(1, 2) for d in grads], 2))


def test_attention_default_plan_and_f64(device):
    """No config: tiles from the default table, capped to the sequence; f64 data
    takes the f64 dot with f64 statistics (lse is f64)."""
    q, k, v = qkv(1, 2, 19, 33, 8, torch.float64, device, seed=3)
    (out, lse), _ = forward_and_backward(q, k, v, True, 0.3)
    assert lse.dtype == torch.float64
    q, k, v = qkv(1, 1, 50, 50, 64, torch.bfloat16, device, seed=4)
    forward_and_backward(q, k, v, True, 0.125)


def test_attention_strided_views_no_copy(device):
    """q, k, v split from a packed [B, T, 3, H, D] projection and transposed to
    [B, H, T, D] are read in place; dO is a transposed view as well."""
    b, t, h, d = 2, 21, 3, 16
    packed = rand(b, t, 3, h, d, device=device, gen=torch.Generator().manual_seed(5))
    q, k, v = (packed[:, :, i].transpose(1, 2) for i in range(3))
    assert not q.is_contiguous()
    grad = rand(b, t, h, d, device=device, gen=torch.Generator().manual_seed(6)).transpose(1, 2)
    fwd, bwd = lowerings()
    op = build(nv.AttentionOp, [q, k, v], {"causal": True, "scale": 0.25})
    assert fwd(op, SMALL).needs_contiguous == ()
    forward_and_backward(q, k, v, True, 0.25, SMALL, grad=grad)


def padding_bias(b, tk, lengths, dtype, device):
    """[B, 1, 1, Tk]: 0 for the first lengths[i] keys of batch i, -inf after (a key
    padding mask as the capture turns a boolean SDPA mask into); length 0 masks
    every key of that batch."""
    keep = torch.arange(tk)[None, :] < torch.tensor(lengths)[:, None]
    zero = torch.zeros((), dtype=dtype)
    return torch.where(keep, zero, torch.tensor(float("-inf"), dtype=dtype)).view(b, 1, 1, tk).to(device)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy under the interpreter: -inf - -inf
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_attention_padding_mask_bias(device, dtype, causal):
    """A broadcast [B, 1, 1, Tk] padding bias read with stride 0 over heads and
    queries; batch 1 masks every key (its rows give 0 and zero gradients, as SDPA),
    batch 0 masks a tail that spans whole 16-key blocks (rows all -inf within a block)."""
    q, k, v = qkv(3, 2, 37, 37, 16, dtype, device, seed=10)
    bias = padding_bias(3, 37, [13, 0, 37], dtype, device)
    assert bias.expand(3, 2, 37, 37).stride()[1:3] == (0, 0)
    (out, lse), (dq, dk, dv) = forward_and_backward(q, k, v, causal, 0.25, SMALL, bias=bias)
    assert torch.isneginf(lse[1]).all() and not out[1].any() and not dq[1].any() and not dk[1].any()
    assert torch.isfinite(lse[0]).all() and not dk[0, :, 13:].any() and not dv[0, :, 13:].any()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_attention_float_bias_full_and_per_query(device, causal):
    """A dense float bias [B, H, Tq, Tk] (ALiBi-like, an f32 bias beside bf16 q/k/v,
    read through a transposed view), and a [1, 1, Tq, Tk] mask whose rows 3 and 30
    mask every key; Tq != Tk, ragged over 16-tiles, D padded (24 -> 32)."""
    gen = torch.Generator().manual_seed(11)
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = qkv(2, 2, 35, 21, 24, dtype, device, seed=12)
        dense = (rand(2, 2, 21, 35, gen=gen) * 2).to(device).transpose(-1, -2)  # strided [2, 2, 35, 21]
        forward_and_backward(q, k, v, causal, 24**-0.5, SMALL, bias=dense)
        mask = torch.where(torch.rand(1, 1, 35, 21, generator=gen) < 0.3, float("-inf"), 0.0)
        mask[..., [3, 30], :] = float("-inf")
        (out, lse), (dq, _, _) = forward_and_backward(q, k, v, causal, 24**-0.5, SMALL, bias=mask.to(device))
        assert torch.isneginf(lse[:, :, [3, 30]]).all() and not out[:, :, [3, 30]].any() and not dq[:, :, [3, 30]].any()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_attention_bias_default_plan_and_f64(device):
    """f64 (the natural-exp domain: the bias is added as it is) with the default tiles."""
    q, k, v = qkv(1, 2, 19, 33, 8, torch.float64, device, seed=13)
    bias = torch.randn(1, 2, 1, 33, generator=torch.Generator().manual_seed(14), dtype=torch.float64).to(device)
    bias[..., 5] = float("-inf")
    forward_and_backward(q, k, v, True, 0.3, bias=bias)


def test_attention_bias_text_only_with_bias(device):
    """Without a bias the kernels' text has no bias loads (and no dead-row guards)."""
    fwd, bwd = lowerings()
    q, k, v = qkv(1, 1, 16, 16, 16, torch.float32, device)
    plain = fwd(build(nv.AttentionOp, [q, k, v], {"causal": True, "scale": 0.25}), SMALL)
    assert "z_ptr" not in plain.source and "m_safe" not in plain.source
    z = torch.zeros(1, 1, 1, 16)
    biased = fwd(build(nv.AttentionOp, [q, k, v, z], {"causal": True, "scale": 0.25}), SMALL)
    assert "szn" in biased.source and biased.name.endswith("_bias")


def test_attention_backward_deterministic(device):
    q, k, v = qkv(1, 2, 30, 30, 16, torch.bfloat16, device, seed=7)
    fwd, bwd = lowerings()
    props = {"causal": True, "scale": 0.25}
    op = build(nv.AttentionOp, [q, k, v], props)
    out, lse = fwd(op, SMALL).launch([q, k, v])
    g = rand(*q.shape, dtype=q.dtype, device=device)
    ins = [g, q, k, v, out, lse]
    op = build(nv.AttentionBackwardOp, ins, props)
    first, again = bwd(op, SMALL).launch(ins), bwd(op, SMALL).launch(ins)
    assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_precision_policy_and_limits(device):
    fwd, bwd = lowerings()
    q, k, v = qkv(1, 1, 16, 16, 16, torch.float32, device)
    op = build(nv.AttentionOp, [q, k, v], {"causal": False, "scale": 0.25})
    assert 'input_precision="ieee"' in fwd(op, SMALL).source
    assert 'input_precision="ieee"' in fwd(op, SMALL, precision="bf16").source
    tf32 = fwd(op, SMALL, precision="tf32")
    assert 'input_precision="tf32"' in tf32.source and "ieee" not in tf32.source
    with pytest.raises(ValueError, match="precision"):
        fwd(op, SMALL, precision="fp8")
    qb = q.bfloat16()
    op = build(nv.AttentionOp, [qb, qb, qb], {"causal": False, "scale": 0.25})
    assert "input_precision" not in fwd(op, SMALL, precision="tf32").source  # 16-bit operands as they are
    big = torch.empty(1, 1, 4, 320)
    with pytest.raises(ValueError, match="D=320"):
        fwd(build(nv.AttentionOp, [big, big, big], {"causal": False, "scale": 1.0}), None)
    with pytest.raises(ValueError, match="power of two"):
        fwd(op, LoweringConfig(kind="attention", block_m=24, block_n=16))


def test_backward_caps_a_forward_sized_config():
    """The configurator sizes attention for the forward; the backward kernels take
    its tiles only as an upper bound (a 128x128 dK/dV tile would spill)."""
    fwd, bwd = lowerings()
    x = torch.empty(2, 4, 1024, 64, dtype=torch.bfloat16)
    lse = torch.empty(2, 4, 1024)
    cfg = LoweringConfig(kind="attention", block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=5)
    assert fwd(build(nv.AttentionOp, [x, x, x], {"causal": True, "scale": 0.125}), cfg).config == cfg
    kernel = bwd(build(nv.AttentionBackwardOp, [x, x, x, x, x, lse], {"causal": True, "scale": 0.125}), cfg)
    kv, q = kernel.config, kernel.extra["dq_config"]
    # the table's 16-bit small-head tiles (one warpgroup, 64 along the kept dim), 3 stages
    assert (kv.block_m, kv.block_n, q.block_m, q.block_n) == (32, 64, 64, 64)
    assert kv.num_warps == q.num_warps == 4
    assert kv.num_stages == q.num_stages == 3 and "KV_BLOCK_N = tl.constexpr(64)" in kernel.source


def test_tf32_backward_takes_its_own_row():
    """f32 operands on tf32 tensor cores take the table's tf32 row (GPT-2's head, D =
    64): dK/dV 64x128 w8 s2 and dQ 128x32 w4 s3 under the forward's 128x128 config; the
    same op under fp32 (FMA dots), or under a config for mma.sync, keeps the f32 row's
    64x32 w8 s2."""
    fwd, bwd = lowerings()
    x = torch.empty(2, 4, 1024, 64)
    lse = torch.empty(2, 4, 1024)
    cfg = LoweringConfig(kind="attention", block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3,
                         instruction="wgmma")
    op = build(nv.AttentionBackwardOp, [x, x, x, x, x, lse], {"causal": True, "scale": 0.125})

    def tiles(kernel):
        return [(c.block_m, c.block_n, c.num_warps, c.num_stages) for c in (kernel.config, kernel.extra["dq_config"])]

    assert tiles(bwd(op, cfg, precision="tf32")) == [(64, 128, 8, 2), (128, 32, 4, 3)]
    assert tiles(bwd(op, cfg, precision="fp32")) == [(64, 32, 8, 2), (64, 32, 8, 2)]
    assert tiles(bwd(op, None, precision="tf32")) == [(64, 128, 8, 2), (128, 32, 4, 3)]  # no config: the row
    # a config for mma.sync (sm_80 / sm_86: the row, measured on Hopper, spills there) keeps the f32 row
    mma = dataclasses.replace(cfg, block_n=64, num_stages=4, instruction="mma")
    assert tiles(bwd(op, mma, precision="tf32")) == [(64, 32, 8, 2), (64, 32, 8, 2)]
    assert fwd(build(nv.AttentionOp, [x, x, x], {"causal": True, "scale": 0.125}), None,
               precision="tf32").config.block_m == 128


def test_backward_tiles_set_each_kernel_on_its_own(device):
    """``tiles`` gives the dK/dV and the dQ kernel their own schedules, used as given
    (not capped by cfg, a 16x16 config here), capped only to the padded sequence; the
    kernels launched one by one through ``launch_kernels`` give launch()'s gradients."""
    fwd, bwd = lowerings()
    q, k, v = qkv(1, 2, 37, 37, 16, torch.bfloat16, device, seed=8)
    props = {"causal": True, "scale": 0.25}
    out, lse = fwd(build(nv.AttentionOp, [q, k, v], props), SMALL).launch([q, k, v])
    g = rand(*q.shape, dtype=q.dtype, device=device, gen=torch.Generator().manual_seed(2))
    ins = [g, q, k, v, out, lse]
    op = build(nv.AttentionBackwardOp, ins, props)
    kv = LoweringConfig(kind="attention", block_m=16, block_n=32, num_warps=2, num_stages=3)
    dq_cfg = LoweringConfig(kind="attention", block_m=128, block_n=16, num_warps=4, num_stages=1)
    kernel = bwd(op, SMALL, tiles={"dkdv": kv, "dq": dq_cfg})
    got = kernel.config, kernel.extra["dq_config"]
    assert [(c.block_m, c.block_n, c.num_warps, c.num_stages) for c in got] == [(16, 32, 2, 3), (64, 16, 4, 1)]
    assert "KV_BLOCK_N = tl.constexpr(32)" in kernel.source and "Q_BLOCK_M = tl.constexpr(64)" in kernel.source
    grads = kernel.launch(ins)
    check(grads, IMPLS[nv.AttentionBackwardOp](op, ins), torch.bfloat16, "backward")
    only_dq = bwd(op, SMALL, tiles={"dq": dq_cfg})  # the other kernel keeps the rule (capped by cfg)
    assert (only_dq.config.block_m, only_dq.config.block_n) == (16, 16)
    parts = [torch.full_like(q, float("nan")) for _ in range(3)]
    delta = torch.empty(2, 37, device=device)
    for name in ("delta", "dkdv", "dq"):
        kernel.extra["launch_kernels"](ins, parts, delta, (name,))
    assert all(torch.equal(a, b) for a, b in zip(parts, grads, strict=True))
    with pytest.raises(ValueError, match="unknown kernels"):
        bwd(op, SMALL, tiles={"dk": kv})


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_source_flags(device, dtype, causal):
    """Every optional source variant against the reference: ragged T = 37, D padded
    (24 -> 32), Tq != Tk; for fused_bwd both equal block counts (16-tiles) and unequal
    ones (dK/dV over 32-key blocks beside dQ over 16-query blocks: the guarded calls)."""
    from nova.codegen.triton.attention import SOURCE_FLAGS

    assert set(SOURCE_FLAGS) == {"fma_scale", "fused_bwd", "tma_kv", "tma_bwd"}  # (the TMA ones: their own test)
    kv32 = {"dkdv": LoweringConfig(kind="attention", block_m=16, block_n=32, num_warps=4, num_stages=1)}
    for tq, tk, tiles in ((37, 37, None), (37, 37, kv32), (20, 45, kv32), (45, 20, None)):
        q, k, v = qkv(1, 2, tq, tk, 24, dtype, device, seed=tq + tk)
        forward_and_backward(q, k, v, causal, 24**-0.5, SMALL, source_flags={"fma_scale", "fused_bwd"}, tiles=tiles)
    fwd, bwd = lowerings()
    op = build(nv.AttentionOp, [q, k, v], {"causal": causal, "scale": 0.25})
    assert "tl.max(s, axis=1) * " in fwd(op, SMALL, source_flags={"fma_scale"}).source
    assert "tl.max(s, axis=1) * " not in fwd(op, SMALL).source  # default off: the shipped text
    bop = build(nv.AttentionBackwardOp, [q, q, k, v, q, torch.empty(1, 2, 45, device=device)],
                {"causal": causal, "scale": 0.25})
    assert "attention_bwd_fused" in bwd(bop, SMALL, source_flags={"fused_bwd"}).source
    assert "attention_bwd_fused" not in bwd(bop, SMALL).source
    with pytest.raises(ValueError, match="unknown source flags"):
        fwd(op, SMALL, source_flags={"tma"})
    z = torch.zeros(1, 1, 1, 20, device=device)
    with pytest.raises(ValueError, match="fma_scale needs"):
        fwd(build(nv.AttentionOp, [q, k, v, z], {"causal": causal, "scale": 0.25}), SMALL, source_flags={"fma_scale"})


@pytest.mark.parametrize("case", ["bf16", "f32", "tf32", "packed", "bias-dropout", "sums-rounded"])
def test_tma_flags_are_the_pointer_kernels_bit_for_bit(device, case):
    """The ``tma_kv`` flag loads the forward's k and v tiles through TMA descriptors, ``tma_bwd``
    the tiles the backward's walks load (q and dO in dK/dV over 16-query blocks, k and v in dQ
    over 32-key blocks: two boxes): out-of-range rows (T = 37) and the padded head dim (24 -> 32)
    come back 0 as the masked pointer loads give them, so every result is the same bits. q, k, v
    as views of a packed [B, T, 3, H, D] buffer too; a layout TMA cannot address is refused, and
    so are fused_bwd with tma_bwd and float64. (f32 under "ieee": the interpreter's dot is numpy's
    matmul, whose summation order follows its operands' memory layout, so there the two agree to
    rounding, not bit for bit.)"""
    fwd, bwd = lowerings()
    dtype = torch.float32 if case in ("f32", "tf32", "sums-rounded") else torch.bfloat16
    precision = "tf32" if case in ("tf32", "sums-rounded") else "fp32"
    q, k, v = qkv(2, 2, 37, 37, 24, dtype, device, seed=11)
    z, props = [], {"causal": True, "scale": 24**-0.5}
    if case == "packed":
        buf = rand(2, 37, 3, 2, 24, dtype=dtype, device=device, gen=torch.Generator().manual_seed(4))
        q, k, v = (buf[:, :, i].transpose(1, 2) for i in range(3))
    if case == "bias-dropout":
        z = [rand(2, 1, 37, 37, dtype=dtype, device=device, gen=torch.Generator().manual_seed(5)),
             torch.tensor(7, dtype=torch.int64, device=device)]
        props |= {"dropout": 0.2, "salt": 3}

    def same(xs, ys):
        for a, b in zip(xs, ys, strict=True):
            assert torch.equal(a, b) if case != "f32" else rel_err(a, b) < 1e-6

    op = build(nv.AttentionOp, [q, k, v, *z], props)
    tma = fwd(op, SMALL, precision=precision, source_flags={"tma_kv"})
    assert "k_ptr.load([b32, h32, n0, 0])" in tma.source and "k_base" not in tma.source
    plain = fwd(op, SMALL, precision=precision)
    o, lse = plain.launch([q, k, v, *z])
    same(tma.launch([q, k, v, *z]), [o, lse])
    g = rand(*q.shape, dtype=dtype, device=device, gen=torch.Generator().manual_seed(8))
    ins = [g, q, k, v, o, lse, *z]
    bprops = props | ({"sums": True, "rounded": True} if case == "sums-rounded" else {})
    bop = build(nv.AttentionBackwardOp, ins, bprops)
    tiles = {"dq": LoweringConfig(kind="attention", block_m=16, block_n=32, num_warps=4, num_stages=1)}
    btma = bwd(bop, SMALL, precision=precision, tiles=tiles, source_flags={"tma_bwd"})
    assert "q_ptr.load([b32, h32, m0, 0])" in btma.source and "k_ptr.load([b32, h32, n0, 0])" in btma.source
    assert "q_base" not in btma.source.split("def attention_bwd_dkdv")[1].split("def attention_bwd_dq")[0]
    same(btma.launch(ins), bwd(bop, SMALL, precision=precision, tiles=tiles).launch(ins))
    if case == "packed":  # a last dim of 27 elements: 54-byte rows, no TMA
        odd = rand(2, 2, 37, 27, dtype=dtype, device=device, gen=torch.Generator().manual_seed(6))[..., :24]
        with pytest.raises(ValueError, match="TMA source flags need a unit last stride and 16-byte aligned"):
            tma.launch([q, odd, v])
        with pytest.raises(ValueError, match="TMA source flags need a unit last stride and 16-byte aligned"):
            btma.launch([g, q, odd, v, o, lse])
    if case == "bf16":
        with pytest.raises(ValueError, match="tma_bwd and fused_bwd do not combine"):
            bwd(bop, SMALL, source_flags={"tma_bwd", "fused_bwd"})
        x = q.double()
        with pytest.raises(ValueError, match="not float64"):
            fwd(build(nv.AttentionOp, [x, x, x], props), SMALL, source_flags={"tma_kv"})


def test_attention_ops_registered():
    from nova.codegen.triton import attention  # noqa: F401
    from nova.codegen.triton.lowering import LOWERINGS

    assert nv.AttentionOp in LOWERINGS and nv.AttentionBackwardOp in LOWERINGS


def test_tf32_attention_rounds_its_dot_operands_to_nearest(device):
    """Under the tf32 policy every dot operand is rounded to nearest-even tf32 first, as
    the step's matmuls round theirs: inputs already tf32 (rounded on the host) then give
    the same bits as the raw fp32 inputs, forward and backward (the incoming gradient
    and o, read outside the dots too, are the same tensors on both sides). The
    tensor cores alone would truncate instead (the interpreter keeps fp32)."""
    from nova.codegen.triton.matmul import round_to_tf32

    fwd, bwd = lowerings()
    q, k, v = qkv(1, 2, 37, 37, 16, torch.float32, device, seed=4)
    r = [round_to_tf32(x) for x in (q, k, v)]
    assert not any(torch.equal(a, b) for a, b in zip((q, k, v), r))
    props = {"causal": True, "scale": 0.25}
    op = build(nv.AttentionOp, [q, k, v], props)
    assert "tf32_rn(" not in fwd(op, SMALL).source  # the fp32 policy: exact dots
    kern = fwd(op, SMALL, precision="tf32")
    assert kern.source.count("tf32_rn(") == 2 * kern.source.count("tl.dot(") + 1  # + its definition
    raw, rounded = kern.launch([q, k, v]), kern.launch(r)
    assert all(torch.equal(a, b) for a, b in zip(raw, rounded))
    o, lse = raw
    ref_o, _ = IMPLS[nv.AttentionOp](op, [q, k, v])
    assert 0 < rel_err(o, ref_o) < 5e-3  # tf32's rounding, not fp32's
    g = round_to_tf32(rand(*q.shape, dtype=torch.float32, device=q.device, gen=torch.Generator().manual_seed(9)))
    ins = [g, q, k, v, o, lse]
    kern = bwd(build(nv.AttentionBackwardOp, ins, props), SMALL, precision="tf32")
    assert kern.source.count("tf32_rn(") == 2 * kern.source.count("tl.dot(") + 1
    grads, grads_r = kern.launch(ins), kern.launch([g, *r, o, lse])
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_r))


def test_tf32_prerounded_inputs_go_into_the_dots_as_loaded(device):
    """Inputs known rounded to tf32 (``prerounded``: the tf32_operands stage stored
    them so, ``nv.tf32_rounded``) are not rounded again: only the P and dS tiles are
    (two ``tf32_rn`` calls in each kernel that forms them), and on rounded inputs the
    kernels give the bits of the kernels that round every operand. A name that is no
    input is refused; under fp32 and for 16-bit inputs the argument changes nothing."""
    from nova.codegen.triton.attention import prerounded_inputs
    from nova.codegen.triton.matmul import round_to_tf32

    fwd, bwd = lowerings()
    q, k, v = (round_to_tf32(x) for x in qkv(1, 2, 37, 37, 16, torch.float32, device, seed=5))
    props = {"causal": True, "scale": 0.25}
    op = build(nv.AttentionOp, [q, k, v], props)
    assert prerounded_inputs(op) == frozenset()  # step arguments: nothing known rounded
    every = ("q", "k", "v", "do")
    pre = fwd(op, SMALL, precision="tf32", prerounded=every[:3])
    assert "tf32_rn(q)" not in pre.source and "tf32_rn(kt)" not in pre.source and "tf32_rn(v)" not in pre.source
    assert pre.source.count("tf32_rn(") == 1 + 2  # the definition, then p before p @ v in both key loops
    plain = fwd(op, SMALL, precision="tf32")
    outs = pre.launch([q, k, v])
    assert all(torch.equal(a, b) for a, b in zip(outs, plain.launch([q, k, v])))
    o, lse = outs
    g = round_to_tf32(rand(*q.shape, dtype=torch.float32, device=device, gen=torch.Generator().manual_seed(3)))
    ins = [g, q, k, v, o, lse]
    bop = build(nv.AttentionBackwardOp, ins, props)
    bpre = bwd(bop, SMALL, precision="tf32", prerounded=every)
    for x in ("q", "qt", "k", "kt", "v", "vt", "do", "tl.trans(do)", "tl.trans(qt)", "tl.trans(kt)"):
        assert f"tf32_rn({x})" not in bpre.source, x
    # the definition, then P and dS: pt and dst in each of dK/dV's two key loops, ds in each of dQ's
    assert bpre.source.count("tf32_rn(") == 1 + 2 * 2 + 2
    assert all(torch.equal(a, b) for a, b in zip(bpre.launch(ins), bwd(bop, SMALL, precision="tf32").launch(ins)))
    assert bwd(bop, SMALL, precision="fp32", prerounded=every).source == bwd(bop, SMALL, precision="fp32").source
    with pytest.raises(ValueError, match="not inputs"):
        fwd(op, SMALL, precision="tf32", prerounded=("o",))


def test_prerounded_inputs_follow_the_ir():
    """``prerounded_inputs`` reads ``nv.tf32_rounded`` through layout views: q from a
    ``nova.round_tf32`` (through a transpose) counts, k and v as given do not."""
    from nova.codegen.triton.attention import prerounded_inputs
    from nova.ir.builder import OpBuilder
    from nova.ir.module import Slot, new_step
    from nova.ir.types import from_torch_dtype, tensor

    t = tensor((1, 2, 8, 16), from_torch_dtype(torch.float32))
    _, fn = new_step([Slot("batch", f"x{i}", t) for i in range(3)])
    b = OpBuilder(fn.body.block)
    x, k, v = fn.body.block.args
    r = b.create(nv.RoundTf32Op, [x], {}).results[0]
    tr = b.create(nv.TransposeOp, [r], {"perm": (0, 1, 2, 3)}).results[0]
    op = b.create(nv.AttentionOp, [tr, k, v], {"causal": True, "scale": 0.25})
    assert prerounded_inputs(op) == frozenset({"q"})


_SUMS_CASES = {"f32": (torch.float32, ("dkdv", "dq")), "bf16": (torch.bfloat16, ("dkdv", "dq")),
               "bf16-dq-dot": (torch.bfloat16, ("dq",)), "bf16-no-dot": (torch.bfloat16, ()),
               "f64": (torch.float64, ("dkdv", "dq"))}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", list(_SUMS_CASES))
def test_backward_column_sums(device, case, causal, monkeypatch):
    """With ``sums`` the backward also returns each gradient's sum over batch and
    sequence [3, H, D], of the gradients as returned, in the statistics type: the
    gradients bit for bit those of the kernels without sums, and the sums those of
    the returned gradients (masked rows and padded head-dim lanes add nothing): T = 37
    ragged in 16-row blocks, D = 24 padded to 32, dK/dV over 32-key blocks beside dQ
    over 16-query blocks (unequal partial counts), and the fused_bwd variant; 16-bit tiles
    summed by a dot or by tl.sum in either kernel (``attention.SUMS_BY_DOT``)."""
    from nova.codegen.triton import attention

    dtype, by_dot = _SUMS_CASES[case]
    monkeypatch.setattr(attention, "SUMS_BY_DOT", frozenset(by_dot))
    fwd, bwd = lowerings()
    stat = torch.float64 if dtype == torch.float64 else torch.float32
    kv32 = {"dkdv": LoweringConfig(kind="attention", block_m=16, block_n=32, num_warps=4, num_stages=1)}
    for tiles, flags in ((None, ()), (kv32, ()), (kv32, ("fused_bwd",))):
        q, k, v = qkv(2, 3, 37, 37, 24, dtype, device, seed=5)
        props = {"causal": causal, "scale": 24**-0.5}
        o, lse = fwd(build(nv.AttentionOp, [q, k, v], props), SMALL).launch([q, k, v])
        g = rand(*q.shape, dtype=dtype, device=device, gen=torch.Generator().manual_seed(2))
        ins = [g, q, k, v, o, lse]
        plain = bwd(build(nv.AttentionBackwardOp, ins, props), SMALL, tiles=tiles, source_flags=flags)
        op = build(nv.AttentionBackwardOp, ins, {**props, "sums": True})
        kern = bwd(op, SMALL, tiles=tiles, source_flags=flags)
        *grads, sums = kern.launch(ins)
        assert sums.shape == (3, 3, 24) and sums.dtype == stat
        assert all(torch.equal(a, b) for a, b in zip(grads, plain.launch(ins), strict=True))
        exact = torch.stack([x.double().sum(dim=(0, 2)) for x in grads])
        assert rel_err(sums, exact) < (1e-13 if dtype == torch.float64 else 1e-6), rel_err(sums, exact)
        refs = IMPLS[nv.AttentionBackwardOp](op, ins)
        check([*grads, sums], refs, dtype, "backward with sums")
        assert kern.scratch_bytes > plain.scratch_bytes
        assert "attention_bwd_sums" in kern.source and "attention_bwd_sums" not in plain.source
        dots = kern.source.count("tl.dot(ones, ")
        assert dots == (0 if dtype != torch.bfloat16 else 2 * ("dkdv" in by_dot) + ("dq" in by_dot)) * (
            2 if flags else 1)  # (fused_bwd: the walks again as device functions)
    with pytest.raises(Exception, match="one shape"):
        k2 = rand(2, 3, 20, 24, dtype=dtype, gen=torch.Generator().manual_seed(1))
        build(nv.AttentionBackwardOp, [g, q, k2, k2, o, lse], {**props, "sums": True})


@pytest.mark.parametrize("precision", ["tf32", "fp32"])
def test_backward_rounded_gradients(device, precision):
    """With ``rounded`` (the tf32_operands stage) dq, dk, dv are stored rounded to
    nearest-even tf32: bit for bit ``round_to_tf32`` of the kernels' gradients without
    it, under either policy, with the sums (of the raw gradients: bit for bit those
    without rounding), in the split and the fused_bwd kernels, ragged and padded; the
    reference rounds the same way. Only f32 gradients can be rounded."""
    from nova.codegen.triton.matmul import round_to_tf32

    fwd, bwd = lowerings()
    q, k, v = qkv(2, 3, 37, 37, 24, torch.float32, device, seed=6)
    props = {"causal": True, "scale": 24**-0.5}
    o, lse = fwd(build(nv.AttentionOp, [q, k, v], props), SMALL, precision=precision).launch([q, k, v])
    g = rand(*q.shape, dtype=torch.float32, device=device, gen=torch.Generator().manual_seed(3))
    ins = [g, q, k, v, o, lse]
    for sums in (False, True):
        for flags in ((), ("fused_bwd",)):
            extra = {"sums": True} if sums else {}
            raw = bwd(build(nv.AttentionBackwardOp, ins, {**props, **extra}), SMALL, precision=precision,
                      source_flags=flags).launch(ins)
            op = build(nv.AttentionBackwardOp, ins, {**props, **extra, "rounded": True})
            kern = bwd(op, SMALL, precision=precision, source_flags=flags)
            got = kern.launch(ins)
            assert all(torch.equal(a, round_to_tf32(b)) for a, b in zip(got[:3], raw[:3], strict=True))
            assert not any(torch.equal(a, b) for a, b in zip(got[:3], raw[:3]))  # the rounding is not a no-op
            if sums:
                assert torch.equal(got[3], raw[3])  # the sums of the raw tiles
            ref_raw = IMPLS[nv.AttentionBackwardOp](build(nv.AttentionBackwardOp, ins, {**props, **extra}), ins)
            ref = IMPLS[nv.AttentionBackwardOp](op, ins)
            assert all(torch.equal(a, round_to_tf32(b)) for a, b in zip(ref[:3], ref_raw[:3], strict=True))
            if sums:
                assert torch.equal(ref[3], ref_raw[3])
    x = rand(1, 2, 8, 16, dtype=torch.bfloat16, gen=torch.Generator().manual_seed(1))
    with pytest.raises(Exception, match="needs f32 gradients"):
        build(nv.AttentionBackwardOp, [x, x, x, x, x, torch.empty(1, 2, 8)], {**props, "rounded": True})


def sm90_cases():
    """Forward and backward for 16-bit (wgmma), fp32 under tf32, and f64 (f64 dot)."""
    fwd, bwd = lowerings()
    cases = []
    for dtype, d, causal, precision in [(torch.bfloat16, 96, True, "fp32"), (torch.float32, 64, False, "tf32"),
                                        (torch.float64, 32, True, "fp32")]:
        x = torch.empty(2, 3, 200, d, dtype=dtype)
        lse = torch.empty(2, 3, 200, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
        props = {"causal": causal, "scale": d**-0.5}
        op = build(nv.AttentionOp, [x, x, x], props)
        cases.append((lambda op=op, p=precision: fwd(op, None, precision=p), [x, x, x]))
        ins = [x, x, x, x, x, lse]
        op = build(nv.AttentionBackwardOp, ins, props)
        cases.append((lambda op=op, p=precision: bwd(op, None, precision=p), ins))
    # with a broadcast padding bias (f32 beside bf16 data)
    x, lse = torch.empty(2, 3, 200, 64, dtype=torch.bfloat16), torch.empty(2, 3, 200)
    z = torch.empty(2, 1, 1, 200)
    props = {"causal": True, "scale": 0.125}
    op = build(nv.AttentionOp, [x, x, x, z], props)
    cases.append((lambda op=op: fwd(op, None), [x, x, x, z]))
    ins = [x, x, x, x, x, lse, z]
    op = build(nv.AttentionBackwardOp, ins, props)
    cases.append((lambda op=op: bwd(op, None), ins))
    # the source variants (SOURCE_FLAGS): the fused backward's device functions, with
    # unequal block counts (guarded calls) and equal ones
    x, lse = torch.empty(2, 3, 256, 64, dtype=torch.bfloat16), torch.empty(2, 3, 256)
    op = build(nv.AttentionOp, [x, x, x], props)
    cases.append((lambda op=op: fwd(op, None, source_flags={"fma_scale"}), [x, x, x]))
    ins = [x, x, x, x, x, lse]
    op = build(nv.AttentionBackwardOp, ins, props)
    cases.append((lambda op=op: bwd(op, None, source_flags={"fused_bwd"}), ins))
    kv = LoweringConfig(kind="attention", block_m=32, block_n=128, num_warps=4, num_stages=3)
    qc = LoweringConfig(kind="attention", block_m=128, block_n=32, num_warps=4, num_stages=3)
    cases.append((lambda op=op: bwd(op, None, source_flags={"fused_bwd"}, tiles={"dkdv": kv, "dq": qc}), ins))
    # the column sums (the attention_sums stage's op), padded head dim, beside the fused variant
    x, lse = torch.empty(2, 3, 200, 48, dtype=torch.bfloat16), torch.empty(2, 3, 200)
    op = build(nv.AttentionBackwardOp, [x, x, x, x, x, lse], {**props, "sums": True})
    cases.append((lambda op=op: bwd(op, None), [x, x, x, x, x, lse]))
    cases.append((lambda op=op: bwd(op, None, source_flags={"fused_bwd"}), [x, x, x, x, x, lse]))
    # fp32 gradients stored rounded to tf32 (the tf32_operands stage), with the sums
    x, lse = torch.empty(2, 3, 200, 48), torch.empty(2, 3, 200)
    op = build(nv.AttentionBackwardOp, [x, x, x, x, x, lse], {**props, "sums": True, "rounded": True})
    cases.append((lambda op=op: bwd(op, None, precision="tf32"), [x, x, x, x, x, lse]))
    return cases


def test_kernels_build_for_sm90():
    """The generated text compiles to sm_90 cubins, f64 dots included (no GPU needed)."""
    out = run_sm90_build(__file__).split()
    assert out.count("attention_fwd") == 5 and out.count("attention_bwd_dkdv") == 6 and out.count("attention_bwd_dq") == 6
    assert out.count("attention_bwd_fused") == 3 and out.count("attention_bwd_sums") == 3


if __name__ == "__main__":
    print(" ".join(build_for_sm90(sm90_cases())))
