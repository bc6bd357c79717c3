"""The FlashAttention-2 lowerings (nova.attention and nova.attention_backward)
against the reference executor, through the Triton interpreter on the CPU (the
real compiler on a GPU). Sequence lengths are ragged (not multiples of the 16-row
tiles the tests force), head dims are padded (24 -> 32), and causal masks are top-left
aligned like SDPA's is_causal, with Tq < Tk and Tq > Tk."""

from __future__ import annotations

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
        assert rel_err(o, r) < RTOL[dtype], (what, i, rel_err(o, r))


def forward_and_backward(q, k, v, causal, scale, cfg=None, precision="fp32", grad=None):
    """Runs both lowerings on (q, k, v) and checks them against the reference;
    returns the kernels' (out, lse) and (dq, dk, dv)."""
    fwd, bwd = lowerings()
    dtype = q.dtype
    props = {"causal": causal, "scale": scale}
    op = build(nv.AttentionOp, [q, k, v], props)
    outs = fwd(op, cfg, precision=precision).launch([q, k, v])
    refs = IMPLS[nv.AttentionOp](op, [q, k, v])
    check(outs, refs, dtype, "forward")
    g = grad if grad is not None else rand(*q.shape, dtype=dtype, device=q.device, gen=torch.Generator().manual_seed(9))
    ins = [g, q, k, v, refs[0], refs[1]]
    op = build(nv.AttentionBackwardOp, ins, props)
    grads = bwd(op, cfg, precision=precision).launch(ins)
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
def test_attention_unequal_lengths_padded_head_dim(device, causal):
    """Tq < Tk and Tq > Tk (top-left causal: late queries see every key), D = 24."""
    for tq, tk in ((20, 45), (45, 20)):
        q, k, v = qkv(1, 1, tq, tk, 24, torch.float32, device, seed=tq)
        forward_and_backward(q, k, v, causal, 24**-0.5, SMALL)


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
    assert (kv.block_m, kv.block_n, q.block_m, q.block_n) == (32, 128, 128, 32)
    assert kv.num_stages == q.num_stages == 2 and "KV_BLOCK_N = tl.constexpr(128)" in kernel.source


def test_attention_ops_registered():
    from nova.codegen.triton import attention  # noqa: F401
    from nova.codegen.triton.lowering import LOWERINGS

    assert nv.AttentionOp in LOWERINGS and nv.AttentionBackwardOp in LOWERINGS


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
    return cases


def test_kernels_build_for_sm90():
    """The generated text compiles to sm_90 cubins, f64 dots included (no GPU needed)."""
    out = run_sm90_build(__file__).split()
    assert out.count("attention_fwd") == 3 and out.count("attention_bwd_dkdv") == 3 and out.count("attention_bwd_dq") == 3


if __name__ == "__main__":
    print(" ".join(build_for_sm90(sm90_cases())))
