"""``nova explain``: the train command's GPT compiled, one step run, every stage's IR shown."""

import re
import sys
import tomllib
from pathlib import Path

import pytest

from nova.cli.explain import split_stages
from nova.cli.main import main

SMALL = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--block-size", "8", "--batch-size", "2",
         "--device", "cpu"]


def test_explain_prints_every_stage(capsys):
    from nova.pipeline import STAGES

    assert main(["explain", *SMALL]) == 0
    captured = capsys.readouterr()
    stages = split_stages(captured.out)
    assert [name for name, _ in stages] == [name for name, _ in STAGES]
    capture_ir = dict(stages)["capture"]
    assert "tensor<96x32xf32>" in capture_ir  # c_attn's weight: 3 * n_embd x n_embd, from the flags
    assert "backend reference" in captured.err and "one step ran" in captured.err


def test_explain_writes_one_file_per_stage(tmp_path, capsys):
    assert main(["explain", *SMALL, "--out-dir", str(tmp_path / "ir")]) == 0
    from nova.pipeline import STAGES

    files = sorted(p.name for p in (tmp_path / "ir").iterdir())
    assert files == [f"{i:02d}-{name}.mlir" for i, (name, _) in enumerate(STAGES)]  # the pipeline's own order
    listed = capsys.readouterr().out.splitlines()
    assert len(listed) == len(files) and all(re.fullmatch(r"\S+\.mlir  \d+ lines", line) for line in listed)
    k = [name for name, _ in STAGES].index("optimizer")
    optimizer_ir = (tmp_path / "ir" / f"{k:02d}-optimizer.mlir").read_text()
    assert "train_step" in optimizer_ir and "// =====" not in optimizer_ir


def test_explain_the_model_of_a_run(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--engine", "eager", "--n-layer", "1", "--n-head", "2", "--n-embd", "24",
                 "--block-size", "8", "--batch-size", "2", "--threads", "1", "--steps", "1", "--out", str(run)]) == 0
    capsys.readouterr()
    assert main(["explain", "--out", str(run), "--device", "cpu", "--batch-size", "3"]) == 0
    capture_ir = dict(split_stages(capsys.readouterr().out))["capture"]
    assert "tensor<72x24xf32>" in capture_ir  # the checkpoint's n_embd 24
    assert "tensor<3x8xi64>" in capture_ir  # the checkpoint's block size 8, the flag's batch size 3


@pytest.mark.parametrize("flags,message", [
    (["--out", "/nonexistent/run"], "--out: no checkpoint at /nonexistent/run/checkpoint.pt"),
    ([*SMALL, "--n-head", "3"], "is not divisible by --n-head 3"),
    ([*SMALL, "--backend", "bogus"], "--backend must be one of"),
    ([*SMALL, "--device", "gpu"], "--device 'gpu' is not a torch device name"),
])
def test_explain_bad_flags(capsys, flags, message):
    assert main(["explain", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nova explain: error: ") and message in err and err.count("\n") == 1


def test_explain_model_flags_clash_with_a_run(tmp_path, capsys):
    assert main(["explain", "--out", str(tmp_path), "--n-embd", "64"]) == 2
    assert "--out takes the model from its checkpoint; drop --n-embd" in capsys.readouterr().err


def test_triton_is_a_main_dependency_on_linux():
    # `nova bench` and the GPU backend import triton: the README's plain install must bring it.
    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    triton = [d for d in project["dependencies"] if d.replace(" ", "").startswith("triton")]
    assert triton == ["triton==3.6.0; platform_system == 'Linux'"]
    assert project["scripts"]["nova"] == "nova.cli.main:main"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="triton is a dependency on Linux only")
def test_triton_is_installed_here():
    import importlib.metadata

    assert importlib.metadata.version("triton") == "3.6.0"


def test_bench_without_triton_is_one_line(tmp_path, capsys, monkeypatch):
    pytest.importorskip("nova.schedule.configurator")
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` now fails as if not installed
    assert main(["bench", "matmul", "--dry-run", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nova bench: error: this benchmark needs Triton") and err.count("\n") == 1


def _png_drawn(path: Path) -> None:
    import matplotlib.image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    img = matplotlib.image.imread(str(path))
    assert img.shape[:2] == (450, 1000) and img[..., :3].std() > 0.05  # a drawn figure, not a blank canvas


def test_explain_shows_the_memory_plan_and_draws_its_timeline(tmp_path, capsys):
    assert main(["explain", *SMALL, "--plots", str(tmp_path / "plots")]) == 0
    out = capsys.readouterr().out
    head = out[:out.index("// ===== after stage:")]
    assert head.startswith("// memory plan:\n// predicted peak ")
    assert re.search(r"// largest live set at step \d+ of \d+: nova\.\w+ \(", head)  # the op, then its nova.loc
    assert "// the 10 largest buffers:" in head and head.count("offset ") == 10
    assert f"// memory timeline: {tmp_path / 'plots' / 'memory_timeline.png'}" in head
    _png_drawn(tmp_path / "plots" / "memory_timeline.png")
    plan_ir = dict(split_stages(out))["plan_memory"]
    assert "nova.memory_plan = {arena_bytes = " in plan_ir and 'nova.storage = ["arena"]' in plan_ir


def test_explain_with_out_dir_puts_the_plan_on_stderr(tmp_path, capsys):
    assert main(["explain", *SMALL, "--out-dir", str(tmp_path / "ir")]) == 0
    captured = capsys.readouterr()
    assert "// predicted peak " in captured.err and "predicted peak" not in captured.out


def test_explain_plots_must_be_a_directory(tmp_path, capsys):
    (tmp_path / "f").write_text("")
    assert main(["explain", *SMALL, "--plots", str(tmp_path / "f")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nova explain: error: --plots ") and err.endswith("is a file, not a directory\n")
