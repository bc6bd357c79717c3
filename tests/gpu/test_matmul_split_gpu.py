"""Split-K adding its splits up in the kernel (``matmul.SERIAL_SPLIT``, ``matmul.LAST_SPLIT_SUMS``)
on the H200, at the
GPT-2 124M bf16 step's split shapes (the weight gradients at batch 32, K = 32768 tokens,
and the LM head's dh, K = the vocabulary), as the configurator schedules them: bit for bit
the two-pass form, launch after launch and in a CUDA graph replayed twice (each launch's
locks or counts start from zero), and within bf16 rounding of float64; and the same shapes
as stream-K (``matmul.STREAM_K_SPLIT``)."""

import pytest
import torch

from nova.codegen.triton import matmul as mm

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

# (M, N, K, A's layout): the step's dW = x^T dy (A a transposed activation), dh = dlogits W
# (768 x 2304 x 32768 runs unsplit since configurator.ONE_WAVE_SPLIT_MIN_GAIN)
SHAPES = [(768, 3072, 32768, "col"), (3072, 768, 32768, "col"), (768, 768, 32768, "col"), (4096, 768, 50304, "row")]


def _operands(M, N, K, la, g):
    a = (torch.randn(K, M, device="cuda", generator=g).t() if la == "col"
         else torch.randn(M, K, device="cuda", generator=g)).to(torch.bfloat16)
    return a, torch.randn(K, N, device="cuda", generator=g).to(torch.bfloat16)


def _launches_and_replays(a, b, rec: dict):
    """C of a first launch (its sources into ``rec``), of a second, and of a CUDA graph of
    the launch replayed once and then again: (first, second, first replay, second replay)."""
    got = mm.matmul(a, b, record=rec)
    again = mm.matmul(a, b)
    graph_out = torch.empty_like(got)
    mm.matmul(a, b, out=graph_out)  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mm.matmul(a, b, out=graph_out)
    graph_out.zero_()
    graph.replay()
    first = graph_out.clone()
    graph.replay()
    return got, again, first, graph_out


# mode -> (the knob, what its kernel's source holds)
MODES = {"serial": ("SERIAL_SPLIT", "atomic_cas"), "last": ("LAST_SPLIT_SUMS", "atomic_add")}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("M,N,K,la", SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k, _ in SHAPES])
def test_in_kernel_split_sums_are_the_two_pass_split_on_the_step_shapes(M, N, K, la, mode, monkeypatch):
    knob, marker = MODES[mode]
    monkeypatch.setattr(mm, "STREAM_K_SPLIT", False)  # the split kernel's forms (stream-K: the test below)
    monkeypatch.setattr(mm, "SERIAL_SPLIT", False)
    monkeypatch.setattr(mm, "LAST_SPLIT_SUMS", False)
    monkeypatch.setattr(mm, knob, True)  # (both off as shipped: matmul.SERIAL_SPLIT, LAST_SPLIT_SUMS)
    g = torch.Generator(device="cuda").manual_seed(M + N)
    a, b = _operands(M, N, K, la, g)
    rec: dict = {}
    got, again, first, graph_out = _launches_and_replays(a, b, rec)
    src = open(next(iter(rec))).read()
    assert marker in src, "the configurator did not split this shape: the test no longer covers it"
    monkeypatch.setattr(mm, knob, False)
    want = mm.matmul(a, b)
    torch.cuda.synchronize()
    assert torch.equal(got, want), (got.double() - want.double()).abs().max().item()
    assert torch.equal(again, want) and torch.equal(first, want) and torch.equal(graph_out, want)
    ref = a.double() @ b.double()
    assert (got.double() - ref).abs().max().item() <= 2 ** -7 * ref.abs().max().item()


@pytest.mark.parametrize("M,N,K,la", SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k, _ in SHAPES])
def test_stream_k_on_the_step_shapes(M, N, K, la, monkeypatch):
    """``matmul.STREAM_K_SPLIT`` (on as shipped) at the step's split shapes: the same bits
    launch after launch and in a CUDA graph replayed twice (the shares' tables built at the
    first launch), within bf16 rounding of float64 and of the two-pass split (its sums'
    chunks differ). Split grids of one wave keep the split (768x768: 18 tiles x 7 splits on
    132 SMs). Its time: scripts/epilogue_variants.py stream-k."""
    assert mm.STREAM_K_SPLIT
    g = torch.Generator(device="cuda").manual_seed(M + N)
    a, b = _operands(M, N, K, la, g)
    rec: dict = {}
    got, again, first, graph_out = _launches_and_replays(a, b, rec)
    streamed = any("matmul_streamk" in open(p).read() for p in rec)
    assert streamed == ((M, N) != (768, 768)), "stream-K where a split grid is more than one wave, only there"
    monkeypatch.setattr(mm, "STREAM_K_SPLIT", False)
    split = mm.matmul(a, b)
    torch.cuda.synchronize()
    assert torch.equal(again, got) and torch.equal(first, got) and torch.equal(graph_out, got)
    ref = a.double() @ b.double()
    scale = ref.abs().max().item()
    assert (got.double() - ref).abs().max().item() <= 2 ** -7 * scale
    assert (got.double() - split.double()).abs().max().item() <= 2 ** -7 * scale
