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


WORKS = [position_ids, bool_logic, train_dropout, cumsum_mask, label_pad, rotary, gather_rows]


def _batch():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 16, (2, 6), generator=g), torch.randint(0, 16, (2, 6), generator=g)


@pytest.mark.parametrize("body", WORKS, ids=lambda f: f.__name__)
def test_former_crashes_now_compile_and_match_eager(body):
    torch.manual_seed(0)
    model = Net(body).double()
    ids, y = _batch()
    expected = model(ids, y)
    step = nova.compile(model, torch.optim.SGD(model.parameters(), lr=0.0), backend="reference")
    with torch.no_grad():
        got = step(ids, y)
    torch.testing.assert_close(got, expected.detach(), rtol=1e-12, atol=0)


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


REJECTED = {
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


def test_a_batch_of_an_unsupported_dtype_is_named():
    model = Net(int32_input)
    step = nova.compile(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ids, y = _batch()
    with pytest.raises(nova.UnsupportedError, match="int32"):
        step(ids.int(), y)
