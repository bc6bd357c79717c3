"""Configurator rule 8f's wave tail compiled on a Hopper GPU, at the GPT-2 batch-8 shapes the
rule cuts (tests/schedule/test_configurator_wave_tail.py): the configured launch's head rows
(or columns) are bit for bit the head config's product, the tail's the tail config's, both
within bf16's error of float64, into a given ``out`` and in a CUDA graph. The interpreter runs
the same at small sizes in CI: tests/kernels/test_matmul_wave_tail.py."""

import pytest
import torch

from nova.codegen.triton import matmul as mm
from nova.schedule import configurator as cf

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                                reason="needs a Hopper GPU")


def _operands(M, N, K, la, lb, g):
    a = torch.randn((K, M) if la == "col" else (M, K), device="cuda", generator=g).to(torch.bfloat16)
    b = torch.randn((N, K) if lb == "col" else (K, N), device="cuda", generator=g).to(torch.bfloat16)
    return (a.t() if la == "col" else a), (b.t() if lb == "col" else b)


@pytest.mark.parametrize("M,N,K,la,lb", [
    (8192, 768, 3072, "row", "col"), (8192, 768, 3072, "row", "row"), (8192, 768, 2304, "row", "row"),
    (3072, 768, 8192, "col", "row"), (768, 3072, 8192, "col", "row"),
])  # fmt: skip
def test_configured_tail_is_its_parts(M, N, K, la, lb):
    g = torch.Generator(device="cuda").manual_seed(M + N + K)
    a, b = _operands(M, N, K, la, lb, g)
    cfg = mm.configure(M, N, K, 1, torch.bfloat16, torch.bfloat16, "bf16", la, lb, False,
                       mm.device_spec(torch.device("cuda")))
    assert cfg.tail_at, cfg
    got = mm.matmul(a, b)  # configured: the same config
    at = cfg.tail_at
    head = mm.matmul(a, b, cfg=cf.head_config(cfg))
    part, rest = ((slice(None, at), slice(None)), (slice(at, None), slice(None))) if cfg.tail_axis == "m" else \
        ((slice(None), slice(None, at)), (slice(None), slice(at, None)))
    # the tail's config launched on the tail alone (on the whole product its split grid would be
    # more than one wave, which the launcher runs as stream-K: other sums)
    tail = mm.matmul(a[rest[0]], b[:, rest[1]], cfg=cf.tail_config(cfg, K))
    assert torch.equal(got[part], head[part]) and torch.equal(got[rest], tail)
    ref = a.double() @ b.double()
    assert (got.double() - ref).abs().max().item() < 1e-2 * ref.abs().max().item()
    out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    mm.matmul(a, b, out=out)  # compiled before the capture
    out.fill_(float("nan"))
    with torch.cuda.graph(graph):
        mm.matmul(a, b, out=out)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, got)
