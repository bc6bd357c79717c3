"""What each spawned rank of the data-parallel tests runs (imported by name in the
children: torch.multiprocessing's spawn passes the parent's sys.path on)."""

from __future__ import annotations

import copy
import json
import os
import traceback
from pathlib import Path

import torch
import torch.distributed as dist


def init(rank: int, world: int, tmp: str) -> None:
    torch.set_num_threads(1)
    if os.environ.get("TRITON_INTERPRET") == "1":  # inherited from the test process (tests/conftest.py)
        import triton_interpreter

        triton_interpreter.drop_dead_work()
    # a FileStore in the test's own tmp dir: no port to collide on
    store = dist.FileStore(os.path.join(tmp, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=_timeout())


def _finish() -> None:
    """No rank tears its process group down while another may still be in a
    collective with it (gloo aborts the process then). Then the process ends at
    once: its result file is written, and the interpreter's teardown would run
    the destructors of objects still holding the destroyed group (a DDP reducer's:
    "terminate called without an active exception", SIGABRT, once in a few runs
    on a loaded 2-core CI machine), which is not what the tests check."""
    import gc
    import sys

    gc.collect()  # DDP modules and their reducers go while the group still exists
    try:
        if dist.is_initialized():
            try:
                dist.barrier()
            finally:
                dist.destroy_process_group()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _timeout():
    import datetime

    return datetime.timedelta(seconds=120)


def build(model: str, dtype: torch.dtype, frozen: bool):
    from nova.models import GPT, MLPLM, MLPLMConfig, gpt_tiny

    torch.manual_seed(0)
    if model == "mlp":
        m = MLPLM(MLPLMConfig(vocab_size=37, block_size=8, n_layer=2, n_embd=12, hidden=20))
    else:
        m = GPT(gpt_tiny(vocab_size=29, block_size=8, n_layer=2, n_head=2, n_embd=16))  # tied wte / lm_head
    m = m.to(dtype)
    if frozen:
        # a frozen weight in the middle of the backward, and a frozen bias
        names = dict(m.named_parameters())
        for n in list(names)[2:4]:
            names[n].requires_grad_(False)
    return m


def batch(step: int, rank: int, vocab: int, block: int, n: int = 3):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, vocab, (n, block), generator=g)
    y = torch.randint(0, vocab, (n, block), generator=g)
    return x, y


def flat(params) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).double() for p in params])


def train(rank: int, world: int, tmp: str, cases: list[dict]) -> None:
    """Per case: Nova with data_parallel against DistributedDataParallel on the same
    per-rank batches; writes the worst differences to tmp/result-<rank>.json."""
    out = {}
    try:
        init(rank, world, tmp)
        import nova
        from nova.runtime.distributed import DataParallel

        for case in cases:
            dtype = getattr(torch, case["dtype"])
            saved = torch.get_default_dtype()
            torch.set_default_dtype(dtype)  # torch.optim's step dtype follows it
            try:
                out[case["name"]] = _one(rank, world, case, dtype, nova, DataParallel)
            finally:
                torch.set_default_dtype(saved)
    except Exception:  # noqa: BLE001  (reported to the parent, which fails the test)
        out["error"] = traceback.format_exc()
    Path(tmp, f"result-{rank}.json").write_text(json.dumps(out))
    _finish()


def _one(rank, world, case, dtype, nova, DataParallel) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = build(case["model"], dtype, case.get("frozen", False))
    if rank == 1 and case.get("perturb"):
        with torch.no_grad():  # DDP and Nova both start from rank 0's values
            for p in model.parameters():
                p.add_(1.0)
    ref_model = copy.deepcopy(model)
    ddp = DDP(ref_model)
    opt_kind = case.get("optimizer", "adamw")

    def make_opt(params):
        params = [p for p in params if p.requires_grad]
        if opt_kind == "sgd":
            return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01)
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)  # an ulp of a tiny gradient can flip an Adam step: +-lr

    opt, ref_opt = make_opt(model.parameters()), make_opt(ddp.parameters())
    dp = DataParallel(case["mode"], bucket_bytes=case.get("bucket_bytes"))
    step = nova.compile(model, opt, backend=case.get("backend", "reference"), data_parallel=dp,
                        skip_nonfinite=case.get("skip_nonfinite", False))
    vocab, block = (37, 8) if case["model"] == "mlp" else (29, 8)
    worst = {"loss": 0.0, "param": 0.0}
    skipped = 0
    for s in range(case.get("steps", 20)):
        x, y = batch(s, rank, vocab, block)
        bad = case.get("bad_step") == s and rank == 1
        if bad and case.get("bad") == "ids":
            x = x.clone()
            x[0, 0] = vocab + 5
        if bad and case.get("bad") == "nonfinite":
            y = y.clone()
            y[:] = -1  # every target ignored (the models' ignore_index): a mean over no rows is NaN
        if case.get("bad_step") == s:
            if case.get("bad") == "ids":
                try:
                    step(x, y)
                    step.check()  # the Triton backend reads its guard later: here, waiting
                except IndexError:
                    skipped += 1
            else:
                step(x, y)
                skipped = step.skipped_steps  # no error: a skipped step
            continue  # DDP takes no step either
        loss = step(x, y)
        ref_opt.zero_grad(set_to_none=True)
        ref_loss = ddp(x, y)
        ref_loss.backward()
        ref_opt.step()
        worst["loss"] = max(worst["loss"], abs(float(loss) - float(ref_loss.detach())))
        d = (flat(model.parameters()) - flat(ref_model.parameters())).abs().max().item()
        worst["param"] = max(worst["param"], d)
    mine = flat(model.parameters())
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    worst["ranks_identical"] = all(torch.equal(every[0], e) for e in every)
    worst["skipped"] = skipped
    if case["mode"] == "zero1" or case.get("compare_state"):
        full = step.full_optimizer_state()
        ref = ref_opt.state_dict()
        sd = 0.0
        assert full["state"].keys() == ref["state"].keys(), (sorted(full["state"]), sorted(ref["state"]))
        for i, entry in ref["state"].items():
            assert full["state"][i].keys() == entry.keys(), (i, full["state"][i].keys(), entry.keys())
            for k, v in entry.items():
                got = full["state"][i][k]
                assert tuple(got.shape) == tuple(v.shape), (i, k, got.shape, v.shape)
                sd = max(sd, (got.double() - v.double()).abs().max().item())
        worst["state"] = sd
        if case["mode"] == "zero1":
            # the per-rank state is 1/W of it (plus the padding to a multiple of W)
            local = sum(v.numel() for e in opt.state.values() for k, v in e.items() if k != "step")
            whole = sum(v.numel() for e in ref["state"].values() for k, v in e.items() if k != "step")
            worst["state_fraction"] = local / whole
            # a round trip: load the gathered state back, one more step on both
            step.load_full_optimizer_state(full)
            x, y = batch(99, rank, vocab, block)
            loss = step(x, y)
            ref_opt.zero_grad(set_to_none=True)
            ref_loss = ddp(x, y)
            ref_loss.backward()
            ref_opt.step()
            worst["after_load"] = (flat(model.parameters()) - flat(ref_model.parameters())).abs().max().item()
    plan = step._last.compilation.distributed
    worst["buckets"] = [[b.nbytes, len(b.names)] for b in plan.buckets]
    worst["explain"] = step.explain() if case.get("explain") else ""
    return worst


def differs(rank: int, world: int, tmp: str) -> None:
    """Rank 1 compiles another model: every rank must refuse it at compile time."""
    out = {}
    try:
        init(rank, world, tmp)
        import nova

        model = build("mlp", torch.float32, frozen=rank == 1)  # rank 1: two frozen parameters
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        try:
            nova.compile(model, opt, backend="reference", data_parallel="ddp")
            out["error"] = "compiled"
        except Exception as e:  # noqa: BLE001
            out["raised"] = f"{type(e).__name__}: {e}"
    except Exception:  # noqa: BLE001
        out["error"] = traceback.format_exc()
    Path(tmp, f"result-{rank}.json").write_text(json.dumps(out))
    _finish()


def ddp_average(rank: int, world: int, tmp: str) -> None:
    """nova.all_reduce(average) of one bucket against DistributedDataParallel's
    gradients of the same bucket layout, bit for bit (gloo's ring sums a buffer in
    chunks, so with 3 ranks the layout decides the order of the sum)."""
    out = {}
    try:
        init(rank, world, tmp)
        from xdsl.dialects.builtin import f32, f64

        from nova.ir import dialect as nv
        from nova.ir.builder import OpBuilder
        from nova.ir.module import Slot, new_step
        from nova.ir.types import tensor
        from nova.runtime import distributed

        for dtype, elem in ((torch.float64, f64), (torch.float32, f32)):
            torch.manual_seed(0)
            m = torch.nn.Linear(50, 40).to(dtype)
            local = copy.deepcopy(m)
            ddp = torch.nn.parallel.DistributedDataParallel(m)
            torch.manual_seed(rank + 1)
            x = torch.randn(7, 50, dtype=dtype)
            ddp(x).square().sum().backward()
            local(x).square().sum().backward()
            _, fn = new_step([Slot("param", "w", tensor([40, 50], elem)), Slot("param", "b", tensor([40], elem))])
            op = OpBuilder(fn.body.block).create(nv.AllReduceOp, list(fn.body.block.args),
                                                 {"world_size": world, "bucket": 0, "average": True})
            got = distributed.run(op, [local.weight.grad, local.bias.grad])
            out[str(dtype)] = [torch.equal(got[0], m.weight.grad), torch.equal(got[1], m.bias.grad)]
            del ddp  # its reducer goes now, while the process group exists
    except Exception:  # noqa: BLE001
        out["error"] = traceback.format_exc()
    Path(tmp, f"result-{rank}.json").write_text(json.dumps(out))
    _finish()
