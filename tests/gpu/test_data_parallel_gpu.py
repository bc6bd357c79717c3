"""The data-parallel path on one GPU: an NCCL process group of one rank.

No machine with two GPUs has been lent (issue 10), so this is what one GPU can
check of the NCCL path: the collectives issued on NCCL's stream from the Triton
executable, finished before their first reader, and recorded in the CUDA graph
(``step.mode == "graph"``: a capture failure would fall back to the launch list).
With one rank every collective is the identity (a sum over one rank, a scale by
1/1, a shard that is the whole tensor), so the step must be bit for bit the step
without ``data_parallel``: loss, every parameter, and the optimizer state (zero1's
gathered into PyTorch's layout). The process group is this test's own (a FileStore
in its tmp dir, torn down after), so no other test sees it."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import nova

from gpu_steps import make_model, make_optimizer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture
def nccl_one_rank(tmp_path):
    if dist.is_initialized():
        pytest.fail("a process group is already initialized: this test needs its own")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        yield
    finally:
        torch.cuda.synchronize()
        dist.destroy_process_group()


def _batches(n, B=4, T=32, V=256, seed=7):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [(torch.randint(0, V, (B, T), device="cuda", generator=g),
             torch.randint(0, V, (B, T), device="cuda", generator=g)) for _ in range(n)]  # fmt: skip


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["ddp", "zero1"])
def test_one_nccl_rank_is_the_single_process_step_bit_for_bit(nccl_one_rank, mode, precision):
    from nova.runtime.distributed import DataParallel

    a = make_model("sdpa").cuda()
    b = copy.deepcopy(a)
    opt_a, opt_b = make_optimizer("adamw", a.parameters()), make_optimizer("adamw", b.parameters())
    # a small bucket cap: several buckets, so the overlap path (issue, then finish before
    # the first reader) runs for more than one collective
    step_a = nova.compile(a, opt_a, precision=precision, cuda_graph=True,
                          data_parallel=DataParallel(mode, bucket_bytes=64 * 1024))
    step_b = nova.compile(b, opt_b, precision=precision, cuda_graph=True)
    for i, (x, y) in enumerate(_batches(6)):
        la, lb = step_a(x, y), step_b(x, y)
        assert torch.equal(la, lb), f"step {i}: loss {la.item()} with {mode} against {lb.item()} without"
    torch.cuda.synchronize()
    assert step_a.mode == "graph", f"the step with collectives runs as {step_a.mode!r}, not as a CUDA graph"
    plan = step_a._last.compilation.distributed
    assert plan.world_size == 1 and len(plan.buckets) > 1, (plan.world_size, len(plan.buckets))
    for (n, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), f"parameter {n} differs with {mode} on one NCCL rank"
    full, ref = step_a.full_optimizer_state(), opt_b.state_dict()
    assert full["state"].keys() == ref["state"].keys()
    for i, entry in ref["state"].items():
        for k, v in entry.items():
            assert torch.equal(full["state"][i][k].to(v.device), v), f"optimizer state {k} of parameter {i}"
    assert float(step_a.global_loss(la)) == float(la)
