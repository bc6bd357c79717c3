"""The trained model is usable: best.pt keeps the lowest-val step, a rising val
loss is reported, ``nova sample`` continues a prompt, and the Python in
docs/cli.md that loads a checkpoint runs as written."""

import json
import random
import re
from pathlib import Path

import pytest
import torch

from nova.cli import checkpoint
from nova.cli.main import main

TINY = ["--engine", "eager", "--n-layer", "1", "--n-head", "2", "--n-embd", "32",
        "--block-size", "16", "--batch-size", "8", "--threads", "1"]
DOCS = Path(__file__).parents[2] / "docs" / "cli.md"


@pytest.fixture(scope="module")
def overfit_run(tmp_path_factory):
    """A run whose val loss falls, then rises: the train part is one sentence over
    and over, the val part (the file's last 10%) random letters of the same
    alphabet. The more surely the model predicts the sentence, the worse it does there."""
    tmp = tmp_path_factory.mktemp("overfit")
    rnd = random.Random(0)
    text = "the cat sat on the mat. " * 40 + "".join(rnd.choice("the cat sonm.") for _ in range(110))
    (tmp / "data.txt").write_text(text)
    out = tmp / "out"
    assert main(["train", *TINY, "--out", str(out), "--data", str(tmp / "data.txt"),
                 "--steps", "100", "--lr", "1e-2", "--eval-interval", "10"]) == 0
    return out, json.loads((out / "metrics.json").read_text())


def test_best_checkpoint_and_overfitting_note(overfit_run, capsys):
    out, m = overfit_run
    val = dict((s, v) for s, v in m["val_loss"])
    best_step = min((s for s in val if s > 0), key=val.get)
    assert (m["best_val_step"], m["best_val_loss"]) == (best_step, val[best_step])
    assert m["overfitting"] and m["final_val_loss"] > m["best_val_loss"] * 1.1  # well above: not a wobble
    assert best_step < 100
    best = checkpoint.load(out / "best.pt")
    assert best["step"] == best_step and checkpoint.load(out / "checkpoint.pt")["step"] == 100
    # best.pt holds the model of that step: its val loss is the recorded one
    assert best["history"]["val"][-1] == [best_step, val[best_step]]


def test_overfitting_is_said_during_the_run(tmp_path, capsys):
    rnd = random.Random(0)
    tail = "".join(rnd.choice("the cat sonm.") for _ in range(110))
    (tmp_path / "d.txt").write_text("the cat sat on the mat. " * 40 + tail)
    assert main(["train", *TINY, "--out", str(tmp_path / "o"), "--data", str(tmp_path / "d.txt"),
                 "--steps", "100", "--lr", "1e-2", "--eval-interval", "10"]) == 0
    out = capsys.readouterr().out
    assert out.count("note: val loss is rising above its best") == 1  # said once, not at every evaluation
    assert re.search(r"overfitting the val loss rose from \d\.\d{4} \(step \d+\)", out)
    assert "best.pt" in out


def test_a_run_that_keeps_improving_is_not_called_overfitting(tmp_path):
    assert main(["train", *TINY, "--out", str(tmp_path), "--steps", "20", "--lr", "1e-2", "--eval-interval", "10"]) == 0
    m = json.loads((tmp_path / "metrics.json").read_text())
    assert m["val_loss"][2][1] < m["val_loss"][1][1]  # the premise: val still falling at the end
    assert not m["overfitting"] and m["best_val_step"] == 20


def test_sample_continues_the_prompt(overfit_run, capsys):
    out, _ = overfit_run
    args = ["sample", "--out", str(out), "--prompt", "the cat ", "--tokens", "40", "--seed", "3"]
    assert main(args) == 0
    first = capsys.readouterr()
    assert first.out.startswith("the cat ") and len(first.out.encode()) > len("the cat ") + 20
    assert "best.pt (step" in first.err
    assert main(args) == 0
    assert capsys.readouterr().out == first.out  # same seed, same text
    assert main([*args, "--checkpoint", "last"]) == 0
    assert "checkpoint.pt (step 100" in capsys.readouterr().err


@pytest.mark.parametrize("flags,message", [
    (["--prompt", ""], "--prompt must not be empty"),
    (["--prompt", "a", "--tokens", "0"], "--tokens must be >= 1"),
    (["--prompt", "a", "--temperature", "0"], "--temperature must be > 0"),
])
def test_sample_bad_flags(overfit_run, capsys, flags, message):
    out, _ = overfit_run
    assert main(["sample", "--out", str(out), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nova sample: error: ") and message in err and err.count("\n") == 1


def test_sample_without_a_run(tmp_path, capsys):
    assert main(["sample", "--out", str(tmp_path), "--prompt", "hi"]) == 2
    assert "no checkpoint in" in capsys.readouterr().err


def test_sample_rejects_a_file_that_is_not_a_checkpoint(tmp_path, capsys):
    torch.save({"format": "something else"}, tmp_path / "checkpoint.pt")
    assert main(["sample", "--out", str(tmp_path), "--prompt", "hi"]) == 2
    assert "is not a nova train checkpoint" in capsys.readouterr().err


def test_the_documented_python_runs(overfit_run, capsys):
    out, _ = overfit_run
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.S)
    assert len(blocks) == 2
    for code in blocks:
        exec(compile(code.replace("runs/train", str(out)), str(DOCS), "exec"), {})
    printed = capsys.readouterr().out
    assert printed.startswith("step ") and "Once upon a time" in printed
