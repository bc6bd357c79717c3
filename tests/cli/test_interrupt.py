"""Ctrl-C during ``nova train`` keeps the run: the last completed step is saved,
metrics.json and loss.png are written, the way to resume is printed, and the
resumed run is the uninterrupted one, bit for bit."""

import json
import os
import signal
import subprocess
import sys

import torch

import nova.cli.train as train_mod
from nova.cli import checkpoint
from nova.cli.main import main

TINY = ["--engine", "eager", "--n-layer", "1", "--n-head", "2", "--n-embd", "32",
        "--block-size", "16", "--batch-size", "8", "--threads", "1"]
# dropout: the step draws from torch's RNG, so the saved RNG state must be the pre-step one
ARGS = ["--steps", "12", "--dropout", "0.1", "--eval-interval", "4", "--ckpt-interval", "100"]


def interrupt_at_call(monkeypatch, n: int) -> None:
    """The n-th step call consumes some RNG, then is interrupted before it updates anything."""
    real = train_mod.make_step
    calls = [0]

    def make_step(*args):
        step = real(*args)

        def interrupted(x, y):
            calls[0] += 1
            if calls[0] == n:
                torch.rand(3)  # as a dropout mask drawn before Ctrl-C would
                raise KeyboardInterrupt
            return step(x, y)

        return interrupted

    monkeypatch.setattr(train_mod, "make_step", make_step)


def test_interrupted_run_saves_and_resumes_exactly(tmp_path, capsys, monkeypatch):
    assert main(["train", *TINY, "--out", str(tmp_path / "full"), *ARGS]) == 0
    full = json.loads((tmp_path / "full" / "metrics.json").read_text())
    capsys.readouterr()

    out = tmp_path / "part"
    interrupt_at_call(monkeypatch, 7)
    assert main(["train", *TINY, "--out", str(out), *ARGS]) == 130
    stdout = capsys.readouterr().out
    assert "interrupted at step 6 of 12" in stdout
    assert f"continue with: nova train --out {out} --resume" in stdout
    assert checkpoint.load(out / "checkpoint.pt")["step"] == 6  # no step lost (ckpt-interval is 100)
    part = json.loads((out / "metrics.json").read_text())
    assert part["interrupted"] and part["steps_done"] == 6 and len(part["train_loss"]) == 6
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]

    monkeypatch.undo()
    assert main(["train", *TINY, "--out", str(out), "--resume"]) == 0
    resumed = json.loads((out / "metrics.json").read_text())
    assert resumed["train_loss"] == full["train_loss"]  # exact: the interrupted step ran again, same batch and mask
    assert resumed["val_loss"] == full["val_loss"] and not resumed["interrupted"]


def test_interrupt_during_the_first_step_saves_step_zero(tmp_path, capsys, monkeypatch):
    interrupt_at_call(monkeypatch, 1)
    assert main(["train", *TINY, "--out", str(tmp_path), *ARGS]) == 130
    assert checkpoint.load(tmp_path / "checkpoint.pt")["step"] == 0
    assert json.loads((tmp_path / "metrics.json").read_text())["train_loss"] == []


def test_sigint_to_a_running_process(tmp_path):
    # The real signal path: the first SIGINT lets the step in flight finish, then the run saves and exits 130.
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "nova.cli.main", "train", *TINY, "--out", str(out),
           "--steps", "100000", "--eval-interval", "5"]
    # A shell's background job starts with SIGINT ignored, which nova respects; give the child the default.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        lines = []
        for line in proc.stdout:  # wait until the loop is running (it prints a line per evaluation)
            lines.append(line)
            if line.startswith("step "):
                break
        assert lines and lines[-1].startswith("step "), "".join(lines) + proc.stderr.read()
        os.kill(proc.pid, signal.SIGINT)
        rest, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "interrupt: stopping after this step" in err
    assert "--resume" in rest
    done = checkpoint.load(out / "checkpoint.pt")["step"]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["interrupted"] and metrics["steps_done"] == done >= 5
    assert len(metrics["train_loss"]) == done
