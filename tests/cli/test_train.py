"""``nova train`` end to end, with tiny settings and the eager engine (fast, and
independent of the compiler): the harness itself is what is tested here."""

import io
import json
import math

import pytest

from nova.cli import checkpoint
from nova.cli.main import main
from nova.cli.progress import ProgressBar

TINY = ["--engine", "eager", "--n-layer", "1", "--n-head", "2", "--n-embd", "32",
        "--block-size", "16", "--batch-size", "8", "--threads", "1"]


def train(out, *extra):
    assert main(["train", *TINY, "--out", str(out), *extra]) == 0
    return json.loads((out / "metrics.json").read_text())


def test_loss_falls_and_outputs_are_written(tmp_path, capsys):
    # The loss sits near the unigram entropy for a while before context starts to pay off.
    m = train(tmp_path, "--steps", "500", "--lr", "1e-2", "--eval-interval", "250")
    assert m["initial_val_loss"] == pytest.approx(math.log(256), abs=0.1)
    assert m["final_val_loss"] < m["unigram_entropy"] - 0.3
    assert m["bits_per_byte"] == pytest.approx(m["final_val_loss"] / math.log(2))
    assert [s for s, _ in m["val_loss"]] == [0, 250, 500]
    assert len(m["train_loss"]) == 500 and m["sample"].startswith("Once upon a time")
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert checkpoint.load(tmp_path / "checkpoint.pt")["step"] == 500
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # atomic writes leave no temps
    out = capsys.readouterr().out
    assert "val loss" in out and "bits/byte" in out and "ln(256)" in out


def test_resume_gives_the_same_losses(tmp_path):
    # Dropout makes the run consume torch's RNG too, so its state must be restored.
    args = ["--steps", "16", "--dropout", "0.1", "--eval-interval", "8", "--ckpt-interval", "100"]
    full = train(tmp_path / "full", *args)
    part = train(tmp_path / "part", *args, "--stop-at", "7")
    assert len(part["train_loss"]) == 7 and part["sample"] is None
    resumed = train(tmp_path / "part", *args, "--resume")
    assert resumed["train_loss"] == full["train_loss"]  # exact: same bits, not just close
    assert resumed["val_loss"] == full["val_loss"]


def test_resume_rejects_a_different_model(tmp_path, capsys):
    train(tmp_path, "--steps", "2")
    assert main(["train", *TINY, "--out", str(tmp_path), "--resume", "--n-embd", "64"]) == 2
    assert "--n-embd cannot change on resume" in capsys.readouterr().err


def test_resume_without_checkpoint_is_an_error(tmp_path, capsys):
    assert main(["train", *TINY, "--out", str(tmp_path), "--resume"]) == 2
    assert "no checkpoint" in capsys.readouterr().err


def test_data_file(tmp_path):
    text = "the quick brown fox jumps over the lazy dog. " * 200
    (tmp_path / "fox.txt").write_text(text)
    m = train(tmp_path / "out", "--data", str(tmp_path / "fox.txt"), "--steps", "30", "--lr", "1e-2")
    assert m["config"]["data"] == str(tmp_path / "fox.txt")
    assert m["final_val_loss"] < m["initial_val_loss"] - 1.0


@pytest.mark.parametrize("content,message", [(None, "data file not found: "), ("tiny", "fewer than block_size")])
def test_bad_data_is_a_clear_error(tmp_path, capsys, content, message):
    path = tmp_path / "data.txt"
    if content is not None:
        path.write_text(content)
    assert main(["train", *TINY, "--out", str(tmp_path / "out"), "--data", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nova train: error:") and message in err
    assert "Traceback" not in err


def test_progress_bar_redraws_one_line():
    assert ProgressBar.render(5, 10, 1.5, 1234.0, width=10) == "[#####-----] step 5/10  loss 1.5000  1,234 tok/s"
    stream = io.StringIO()
    bar = ProgressBar(3, stream=stream, enabled=True)
    for i in range(1, 4):
        bar.update(i, 2.0, None, force=True)
    bar.close()
    text = stream.getvalue()
    assert text.count("\r") == 3 and text.endswith("\n") and text.count("\n") == 1
    quiet = io.StringIO()
    ProgressBar(3, stream=quiet).update(1, 2.0, None)  # StringIO is not a terminal: no bar
    assert quiet.getvalue() == ""


def test_nova_engine_matches_eager(tmp_path):
    # The harness drives the compiled step exactly as it drives eager PyTorch.
    args = ["--steps", "6", "--eval-interval", "3", "--dropout", "0.0"]
    eager = train(tmp_path / "eager", *args)
    compiled = train(tmp_path / "nova", *args, "--engine", "nova", "--backend", "reference")
    for (s1, l1), (s2, l2) in zip(eager["train_loss"], compiled["train_loss"], strict=True):
        assert s1 == s2 and l2 == pytest.approx(l1, rel=1e-4)
    assert compiled["engine"] == "nova"


def test_resume_rejects_changed_data(tmp_path, capsys):
    data = tmp_path / "d.txt"
    data.write_text("abcdefghij" * 100)
    train(tmp_path / "out", "--data", str(data), "--steps", "4", "--stop-at", "2")
    data.write_text("klmnopqrst" * 100)
    assert main(["train", *TINY, "--out", str(tmp_path / "out"), "--resume"]) == 2
    assert "training text differs" in capsys.readouterr().err
