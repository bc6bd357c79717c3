"""``nova bench gpt2 --dry-run --nproc 2``: the benchmark relaunches itself through
torchrun (--standalone: a free port), 2 gloo ranks train the tiny GPT with eager
DistributedDataParallel and Nova's data_parallel side by side, rank 0 writes the
results. Timings mean nothing; the plumbing and the loss agreement are checked."""

from __future__ import annotations

import json

from nova.cli.main import main as nova_main


def test_dry_run_with_two_ranks(tmp_path):
    argv = ["bench", "gpt2", "--dry-run", "--nproc", "2", "--steps", "2", "--warmup", "1", "--precision", "fp32",
            "--out", str(tmp_path)]
    assert nova_main(argv) == 0
    (path,) = tmp_path.glob("*_np2_ddp.json")
    doc = json.loads(path.read_text())
    assert doc["config"]["nproc"] == 2 and doc["config"]["data_parallel"] == "ddp"
    eager, nova_row = doc["rows"]
    assert (eager["engine"], nova_row["engine"]) == ("eager", "nova")
    assert eager["error"] is None and nova_row["error"] is None
    # rank 0's losses: Nova's averaged gradients follow DDP's step for step
    assert nova_row["max_rel_loss_diff"] < 1e-5
