"""What reaches the user from capture is either a compiled step or one of
Nova's own errors (UnsupportedError listing every op with its source line,
CaptureError for the contract): never an internal exception (an xDSL
VerifyException, a KeyError, TypeError or AttributeError from a converter).
Each module below once crashed capture with an internal exception."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nova


class Net(nn.Module):
    def __init__(self, body):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16)
        self.body = body

    def forward(self, ids, y):
        h = self.body(self, ids, self.emb(ids))
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def position_ids(m, ids, h):  # was: VerifyException nova.add expected a floating-point tensor (i64 + int)
    pos = torch.arange(ids.shape[1]) + 1
    return h + (pos - 1).float()[None, :, None]


def bool_logic(m, ids, h):  # was: no conversion of __and__ / bitwise_not
    keep = (ids > 2) & ~(ids == 7)
    return h.masked_fill(~keep[..., None], 0.0)


def train_dropout(m, ids, h):  # was: TypeError 'OpResult' object is not subscriptable (native_dropout)
    return torch.ops.aten.native_dropout(h, 0.0, True)[0]


def cumsum_mask(m, ids, h):  # was: no conversion of cumsum (position ids from a padding mask)
    pos = (ids != 0).long().cumsum(-1) - 1
    return h + pos[..., None].float() * 0.01


def label_pad(m, ids, h):  # was: no conversion of pad / where.ScalarOther
    shifted = F.pad(ids, (0, 1), value=-100)[:, 1:]
    return torch.where(shifted[..., None] == -100, 0.0, h)


def rotary(m, ids, h):  # was: no conversion of cat / cos / sin
    ang = torch.arange(ids.shape[1])[:, None].float() * torch.ones(4)
    emb = torch.cat([ang, ang], -1)
    x1, x2 = h[..., :4], h[..., 4:]
    return h * emb.cos() + torch.cat([-x2, x1], -1) * emb.sin()


def gather_rows(m, ids, h):  # was: no conversion of gather / index.Tensor
    idx = ids.clamp(max=7)[..., None].expand(-1, -1, 8)
    return torch.gather(h, 2, idx) + h[:, torch.arange(ids.shape[1]).flip(0)] + h.flip(1, 2)


def _heads(h):
    return h.view(2, 6, 4, 2).transpose(1, 2)  # [B, H=4, T, D=2]


def sdpa_gqa_masks(m, ids, h):  # SDPA with enable_gqa, a boolean and an additive attn_mask, and a scale
    q = _heads(h)
    kv = q[:, :2]  # 2 key/value heads for 4 query heads
    pad = (ids != 0)[:, None, None, :]  # [B, 1, 1, Tk] padding mask
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    a = F.scaled_dot_product_attention(q, kv, kv, attn_mask=pad & causal, enable_gqa=True, scale=0.3)
    bias = torch.zeros(6, 6).masked_fill(~causal, float("-inf")) + 0.1 * torch.arange(6.0)
    b = F.scaled_dot_product_attention(q, q, q, attn_mask=bias.to(h.dtype))
    return (a + b).transpose(1, 2).reshape(2, 6, 8)


def repeat_kv(m, ids, h):  # transformers' repeat_kv: expand + reshape of the key/value heads
    q = _heads(h)
    kv = q[:, :2, None].expand(2, 2, 2, 6, 2).reshape(2, 4, 6, 2)
    return F.scaled_dot_product_attention(q, kv, kv, is_causal=True).transpose(1, 2).reshape(2, 6, 8)


def rms_norm_silu(m, ids, h):  # RMSNorm as the models write it, a gated SiLU MLP
    x = h.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    x = x.to(h.dtype)
    return F.silu(x) * x + torch.clamp(x, -0.5, 0.5) + torch.minimum(x, x.flip(-1))


def decomposed(m, ids, h):  # ops Nova has no converter for, taken through PyTorch's decomposition table
    d = torch.diff(h, dim=1, prepend=h[:, :1])
    t = torch.stack([h.tril(), h.triu(1)], 0).sum(0)
    r = F.rms_norm(h, (8,), eps=1e-6)
    e = torch.einsum("btd,bsd->bts", h, h) @ h * 0.1
    ri = h.repeat_interleave(2, dim=-1)[..., ::2]
    return d + t + r + e + ri + F.mse_loss(h, h.flip(1)) + F.hardtanh(h * 3) + F.leaky_relu(h)


def int32_positions(m, ids, h):  # was: TypeError nova does not support tensors of dtype torch.int32 (RoBERTa, BLOOM)
    mask = ids.ne(0).int()  # RoBERTa's position ids
    pos = (torch.cumsum(mask, dim=1).type_as(mask) + 2) * mask
    powers = torch.arange(1, 5, dtype=torch.int32)  # BLOOM's ALiBi exponents
    slopes = torch.pow(torch.tensor(0.5, dtype=h.dtype), powers)
    return h * slopes.repeat(2)[None, None, :] + (pos.long() + 1).to(h.dtype)[..., None]


def scatter_and_pow(m, ids, h):  # was: no conversion of copy, slice_scatter, select_scatter, pow.Scalar, reciprocal
    shifted = h.new_zeros(h.shape)  # T5's _shift_right, on floats (a gradient through it) and on ids
    shifted[:, 1:] = h[:, :-1].clone()
    shifted[:, 0] = 2.0
    shifted[..., ::3] = h[..., ::3] * 2  # a stepped slice written
    lab = ids.new_zeros(ids.shape)
    lab[:, 1:] = ids[:, :-1].clone()
    lab[:, 0] = 5
    slopes = torch.pow(2.0, -torch.arange(1, 9, dtype=h.dtype))  # MPT's ALiBi slopes
    return shifted * slopes + torch.reciprocal(h.abs() + 1) + lab.masked_fill(lab == 3, 0)[..., None].to(h.dtype)


WORKS = [position_ids, bool_logic, train_dropout, cumsum_mask, label_pad, rotary, gather_rows, sdpa_gqa_masks,
         repeat_kv, rms_norm_silu, decomposed, int32_positions, scatter_and_pow]  # fmt: skip


def _batch():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 16, (2, 6), generator=g), torch.randint(0, 16, (2, 6), generator=g)


@pytest.mark.parametrize("body", WORKS, ids=lambda f: f.__name__)
def test_former_crashes_now_compile_and_match_eager(body):
    """The loss and every gradient (one SGD step at lr 1 moves each parameter by -grad) in float64."""
    torch.manual_seed(0)
    model = Net(body).double()
    ids, y = _batch()
    ids[1, -2:] = 0  # padding for the masks that look for it
    expected = model(ids, y)
    expected.backward()
    want = {n: (p - p.grad).detach() for n, p in model.named_parameters()}
    step = nova.compile(model, torch.optim.SGD(model.parameters(), lr=1.0), backend="reference")
    got = step(ids, y)
    torch.testing.assert_close(got, expected.detach(), rtol=1e-12, atol=0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), want[n], rtol=1e-10, atol=1e-12, msg=n)


def int32_input(m, ids, h):
    return h


def sdpa_rank3(m, ids, h):
    return F.scaled_dot_product_attention(h, h, h)


def sort_and_erfinv(m, ids, h):
    return torch.erfinv(torch.tanh(h)).sort(-1).values


def ce_3d(m, ids, h):
    return h + F.cross_entropy(h.transpose(1, 2), ids.clamp(max=7), reduction="none").sum()


def int_bitwise(m, ids, h):
    return h + (ids & 3)[..., None].float()


def int32_of_ids(m, ids, h):  # token ids are a step argument: nothing bounds ids * 7 in int32
    return h + (ids.int() * 7).float()[..., None]


def int32_of_floats(m, ids, h):  # a float's truncation to int32 is unbounded (eager: undefined past the range)
    return h + (h * 1e3).int().to(h.dtype)


REJECTED = {
    int32_of_ids: ["torch.int32 values", "cannot prove", "unbounded"],
    int32_of_floats: ["torch.int32 values", "cannot prove"],
    sdpa_rank3: ["[B, H, T, D]"],
    sort_and_erfinv: ["erfinv", "sort"],
    ce_3d: ["cross_entropy"],
    int_bitwise: ["bitwise and"],
}


@pytest.mark.parametrize("body", list(REJECTED), ids=lambda f: f.__name__)
def test_unsupported_code_is_one_unsupported_error_with_locations(body):
    model = Net(body)
    step = nova.compile(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(nova.UnsupportedError) as e:
        step(*_batch())
    for word in REJECTED[body]:
        assert word in str(e.value), str(e.value)
    assert all("node" in where and "test_capture_errors.py" in where for _, where in e.value.problems), e.value.problems


def _halve_weight(m, ids, h):  # a parameter written in place by the forward
    with torch.no_grad():
        m.head.weight.mul_(0.5)
    return h


def _double_batch(m, ids, h):  # a batch tensor written in place by the forward
    ids.mul_(2)
    return h


@pytest.mark.parametrize("body,what", [(_halve_weight, "parameter_mutation 'head.weight'"),
                                       (_double_batch, "user_input_mutation 'ids'")])  # fmt: skip
def test_a_forward_writing_a_parameter_or_its_batch_is_refused(body, what):
    """A buffer the forward writes is a step result (tests/numerics/test_batch_norm.py); a
    parameter or a batch tensor is not: refused by name, nothing written."""
    model = Net(body)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    step = nova.compile(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ids, y = _batch()
    kept = ids.clone()
    with pytest.raises(nova.UnsupportedError, match=f"model forward mutates {what}"):
        step(ids, y)
    assert torch.equal(ids, kept)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


class Weighted(nn.Module):  # a third batch tensor: per-token weights, given as int16 (eager takes them)
    def __init__(self):
        super().__init__()
        self.net = Net(int32_input)

    def forward(self, ids, y, w):
        return self.net(ids, y) * w.float().mean()


def test_a_batch_of_an_unsupported_dtype_is_named():
    model = Weighted()
    step = nova.compile(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ids, y = _batch()
    w = torch.ones(2, 6, dtype=torch.complex64)
    with pytest.raises(nova.UnsupportedError, match=r"complex64 .*and int32, int16, int8 and uint8 batches\)"):
        step(ids, y, w)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16])
def test_a_narrow_int_batch_trains_as_its_int64_copy(dtype):
    """Per-token weights given as uint8 / int8 / int16 (as image pixels or quantized labels come),
    captured as the step's int64 argument and copied in widened: bit for bit the step given
    the int64 copy, and eager's loss and parameters."""
    g = torch.Generator().manual_seed(1)
    lo, hi = int(torch.iinfo(dtype).min), int(torch.iinfo(dtype).max)
    batches = [(*_batch(), torch.randint(lo, hi + 1, (2, 6), generator=g).to(dtype)) for _ in range(3)]
    _trains_as_eager_and_as_its_int64_copy(Weighted, batches, "reference")


class Inverted(nn.Module):  # uint8 arithmetic on a uint8 batch: 255 - w stays in range, w + 1 may wrap
    def __init__(self, wrap: bool):
        super().__init__()
        self.net, self.wrap = Net(int32_input), wrap

    def forward(self, ids, y, w):
        v = w + 1 if self.wrap else 255 - w
        return self.net(ids, y) * v.float().mean()


def test_uint8_arithmetic_is_taken_where_it_cannot_wrap():
    """uint8 values are captured in int64: ``255 - w`` is proved within uint8's range and
    matches eager; ``w + 1`` could wrap at 255 in eager and is refused."""
    ids, y = _batch()
    w = torch.tensor([[0, 1, 7, 128, 254, 255]] * 2, dtype=torch.uint8)
    torch.manual_seed(0)
    model = Inverted(wrap=False).double()
    want = Inverted(wrap=False).double()
    want.load_state_dict(model.state_dict())
    step = nova.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), backend="reference")
    torch.testing.assert_close(step(ids, y, w), want(ids, y, w).detach(), rtol=1e-12, atol=0)
    wraps = Inverted(wrap=True)
    step = nova.compile(wraps, torch.optim.SGD(wraps.parameters(), lr=0.1))
    with pytest.raises(nova.UnsupportedError, match="cannot prove"):
        step(ids, y, w)


def _trains_as_eager_and_as_its_int64_copy(make, batches, backend: str) -> None:
    """Three SGD steps of ``make()`` on each of ``batches`` (argument tuples holding a narrow-int
    tensor): Nova's loss and parameters as eager's, and bit for bit the step given the tensors
    widened to int64."""
    dtype = torch.float64 if backend == "reference" else torch.float32
    torch.manual_seed(0)
    model, twin, wide = (make().to(dtype) for _ in range(3))
    twin.load_state_dict(model.state_dict())
    wide.load_state_dict(model.state_dict())
    step = nova.compile(model, torch.optim.SGD(model.parameters(), lr=0.5), backend=backend)
    step64 = nova.compile(wide, torch.optim.SGD(wide.parameters(), lr=0.5), backend=backend)
    opt = torch.optim.SGD(twin.parameters(), lr=0.5)
    tol = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    for args in batches:
        loss = step(*args)
        assert torch.equal(loss, step64(*(a.long() if not a.is_floating_point() else a for a in args)))
        opt.zero_grad()
        want = twin(*args)
        want.backward()
        opt.step()
        torch.testing.assert_close(loss, want.detach(), **tol)
    for (n, a), b, c in zip(model.named_parameters(), twin.parameters(), wide.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), **tol, msg=n)
        assert torch.equal(a, c), n


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_an_int32_batch_trains_as_eager_does_and_as_its_int64_copy(backend):
    """int32 token ids (an embedding's indices: eager takes them) are captured as the
    step's int64 argument, copied in widened (exact): the same loss and parameters as
    eager over 3 SGD steps, and bit for bit the step given the int64 ids. The interpreted
    Triton backend copies the batch into its arena, casting there."""
    batches = []
    for _ in range(3):
        ids, y = _batch()
        batches.append((ids.int(), y))
    _trains_as_eager_and_as_its_int64_copy(lambda: Net(int32_input), batches, backend)


def test_int32_arithmetic_on_an_int32_batch_is_refused():
    """An int32 batch holds any int32 value: ``ids + 1`` could wrap in eager (int32) where
    Nova would compute it in int64, so capture refuses it (``int_range``); int64 ids are not
    at risk and compile."""
    model = Net(lambda m, ids, h: h + (ids + 1).float()[..., None])
    step = nova.compile(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ids, y = _batch()
    with pytest.raises(nova.UnsupportedError, match="cannot prove"):
        step(ids.int(), y)
    step(ids, y)
