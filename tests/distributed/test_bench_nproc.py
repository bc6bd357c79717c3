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


def test_one_rank_under_torchrun_is_data_parallel(tmp_path):
    """``torchrun --nproc-per-node 1 bench/gpt2.py``: data parallelism over one rank (the
    DDP wrappers and Nova's collectives, where no link is crossed), not the plain step."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
           str(repo / "bench" / "gpt2.py"), "--dry-run", "--steps", "2", "--warmup", "1", "--precision", "fp32",
           "--data-parallel", "zero1", "--out", str(tmp_path)]  # fmt: skip
    done = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (path,) = tmp_path.glob("*_np1_zero1.json")
    doc = json.loads(path.read_text())
    assert doc["config"]["nproc"] == 1 and doc["config"]["data_parallel"] == "zero1"
    assert [r["error"] for r in doc["rows"]] == [None, None]
    assert doc["rows"][1]["max_rel_loss_diff"] < 1e-5
