"""Every mistake in what the user asked for is one line on stderr and exit status 2,
before anything is written: no traceback, no half-made output directory."""

import sys

import pytest
import torch

from nova.cli import checkpoint
from nova.cli.main import main

TINY = ["--engine", "eager", "--n-layer", "1", "--n-head", "2", "--n-embd", "32",
        "--block-size", "16", "--batch-size", "8", "--threads", "1"]


def one_line_error(capsys, command="train") -> str:
    err = capsys.readouterr().err
    assert err.startswith(f"nova {command}: error: "), err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("flags,message", [
    (["--device", "gpu"], "--device 'gpu' is not a torch device name"),
    (["--device", "cuda:99"], "--device cuda:99: "),  # no CUDA, or not 100 devices
    (["--n-head", "3"], "--n-embd 32 is not divisible by --n-head 3"),
    (["--n-head", "0"], "--n-head must be >= 1"),
    (["--dropout", "1.5"], "--dropout must be in [0, 1), got 1.5"),
    (["--dropout", "-0.1"], "--dropout must be in [0, 1)"),
    (["--lr", "-1"], "--lr must be a finite number > 0, got -1.0"),
    (["--lr", "nan"], "--lr must be a finite number > 0, got nan"),
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--threads", "0"], "--threads must be >= 1"),
    (["--engine", "nova", "--backend", "bogus"], "--backend must be one of reference, triton, auto, got 'bogus'"),
])
def test_bad_flag(tmp_path, capsys, flags, message):
    assert main(["train", *TINY, "--out", str(tmp_path / "out"), *flags]) == 2
    assert message in one_line_error(capsys)
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda(tmp_path, capsys):
    assert main(["train", *TINY, "--out", str(tmp_path), "--device", "cuda"]) == 2
    assert "--device cuda: no CUDA device is available" in one_line_error(capsys)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU this is a valid combination")
def test_triton_backend_on_the_cpu(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    flags = ["--engine", "nova", "--backend", "triton", "--device", "cpu"]
    assert main(["train", *TINY, "--out", str(tmp_path), *flags]) == 2
    assert "needs the model on a CUDA device" in one_line_error(capsys)


@pytest.mark.parametrize("content,message", [
    (b"", "data file is empty: "),
    (b"\0" * 4096, "data file holds 4096 NUL byte(s), the first at byte 0"),
    # ASCII saved as UTF-16-LE without a BOM decodes as UTF-8, with a NUL after every byte
    ("hello world, ".encode("utf-16-le") * 50, "the first at byte 1: "),
    (b"\xff\xfe not utf-8", "not UTF-8"),
])
def test_unusable_data_file(tmp_path, capsys, content, message):
    data = tmp_path / "data.txt"
    data.write_bytes(content)
    assert main(["train", *TINY, "--out", str(tmp_path / "out"), "--data", str(data)]) == 2
    assert message in one_line_error(capsys)


def test_a_run_does_not_overwrite_another(tmp_path, capsys):
    assert main(["train", *TINY, "--out", str(tmp_path), "--steps", "3", "--stop-at", "2"]) == 0
    before = (tmp_path / "checkpoint.pt").read_bytes()
    capsys.readouterr()
    assert main(["train", *TINY, "--out", str(tmp_path), "--steps", "3"]) == 2
    err = one_line_error(capsys)
    assert "checkpoint.pt already exists" in err and "--resume" in err and "--force" in err
    assert (tmp_path / "checkpoint.pt").read_bytes() == before
    # --force starts over: a new run of 1 step replaces the step-2 checkpoint
    assert main(["train", *TINY, "--out", str(tmp_path), "--steps", "1", "--force"]) == 0
    assert checkpoint.load(tmp_path / "checkpoint.pt")["step"] == 1


def test_resume_and_force_exclude_each_other(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", *TINY, "--out", str(tmp_path), "--resume", "--force"])
    assert e.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_out_is_a_file(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    assert main(["train", *TINY, "--out", str(tmp_path / "f")]) == 2
    assert "is a file, not a directory" in one_line_error(capsys)


def test_a_diverging_run_is_one_line(tmp_path, capsys, monkeypatch):
    import nova.cli.train as train_mod

    monkeypatch.setattr(train_mod, "make_step", lambda *a: lambda x, y: torch.tensor(float("nan")))
    assert main(["train", *TINY, "--out", str(tmp_path), "--steps", "2"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("nova train: loss became nan at step 1") and "Traceback" not in err


def test_interrupt_outside_the_loop_is_one_line(tmp_path, capsys, monkeypatch):
    import nova.cli.train as train_mod

    def interrupted(cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_mod, "load_data", interrupted)
    assert main(["train", *TINY, "--out", str(tmp_path)]) == 130
    assert capsys.readouterr().err.strip() == "nova train: interrupted"


def test_version(capsys):
    import nova

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"nova {nova.__version__} (torch ") and f"Python {sys.version.split()[0]}" in out


def test_package_version_matches_the_metadata():
    import importlib.metadata

    import nova

    assert importlib.metadata.version("nova") == nova.__version__


@pytest.mark.parametrize("command", [["train", *TINY, "--resume"], ["sample", "--prompt", "a"], ["explain"]])
def test_a_torn_checkpoint_is_one_line(tmp_path, capsys, command):
    torch.save({"format": checkpoint.FORMAT}, tmp_path / "checkpoint.pt")
    good = (tmp_path / "checkpoint.pt").read_bytes()
    (tmp_path / "checkpoint.pt").write_bytes(good[: len(good) // 2])  # as a copy cut short would leave it
    assert main([*command, "--out", str(tmp_path)]) == 2
    assert "checkpoint.pt cannot be read as a checkpoint" in one_line_error(capsys, command[0])
