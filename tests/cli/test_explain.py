"""``nova explain``: the train command's GPT compiled, one step run, summarized (and every stage's IR shown)."""

import re
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from nova.cli.explain import split_stages
from nova.cli.main import main

SMALL = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--block-size", "8", "--batch-size", "2",
         "--device", "cpu"]


def test_explain_prints_a_summary(capsys):
    from nova.pipeline import STAGES

    assert main(["explain", *SMALL]) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert lines[0].startswith("// program: GPT, batch [2, 8] int64, [2, 8] int64, precision fp32, backend reference")
    assert all(line.startswith("// ") for line in lines) and "after stage:" not in captured.out
    stage_rows = [line.split()[1] for line in lines if re.match(r"//   \w+ +\d+ ops", line)]
    assert stage_rows == [name for name, _ in STAGES]
    assert "// kernels: none: the reference backend runs each op with torch" in captured.out
    assert "// memory plan:" in captured.out and len(captured.out) < 10_000


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's Triton interpreter (tests/conftest.py sets it)")
def test_explain_with_triton_lists_the_kernels(capsys):
    assert main(["explain", *SMALL, "--backend", "triton", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "// the 3 most expensive kernels (predicted):" in out
    rows = re.findall(r"^//\s+\d+  (\w+) .* (memory|compute|launch) +[\d.]+ (?:us|ms)  ", out, re.MULTILINE)
    assert len(rows) == 3 and rows[0][0] == "linear_cross_entropy_with_grad"
    assert re.search(r"// kernels on NVIDIA H200: \d+ \(\d+ launches\)", out)


def test_explain_measure_needs_cuda(capsys):
    assert main(["explain", *SMALL, "--measure"]) == 2
    err = capsys.readouterr().err
    assert err == "nova explain: error: --measure times kernels with CUDA events: it needs a CUDA device, not cpu\n"


def test_explain_ir_prints_every_stage(capsys):
    from nova.pipeline import STAGES

    assert main(["explain", *SMALL, "--ir"]) == 0
    captured = capsys.readouterr()
    stages = split_stages(captured.out)
    assert [name for name, _ in stages] == [name for name, _ in STAGES]
    capture_ir = dict(stages)["capture"]
    assert "tensor<96x32xf32>" in capture_ir  # c_attn's weight: 3 * n_embd x n_embd, from the flags
    assert "backend reference" in captured.err and "one step ran" in captured.err
    assert "site-packages" not in captured.out and '#loc0 = "' in capture_ir


def test_explain_writes_one_file_per_stage(tmp_path, capsys):
    assert main(["explain", *SMALL, "--out-dir", str(tmp_path / "ir")]) == 0
    from nova.pipeline import STAGES

    files = sorted(p.name for p in (tmp_path / "ir").iterdir())
    assert files == [f"{i:02d}-{name}.mlir" for i, (name, _) in enumerate(STAGES)]  # the pipeline's own order
    out = capsys.readouterr().out.splitlines()
    listed = [line for line in out if not line.startswith("// ")]
    assert len(listed) == len(files) and all(re.fullmatch(r"\S+\.mlir  \d+ lines", line) for line in listed)
    assert listed == [f"{tmp_path / 'ir' / f}  {(tmp_path / 'ir' / f).read_text().count(chr(10))} lines" for f in files]
    k = [name for name, _ in STAGES].index("optimizer")
    optimizer_ir = (tmp_path / "ir" / f"{k:02d}-optimizer.mlir").read_text()
    assert "train_step" in optimizer_ir and "// =====" not in optimizer_ir


def test_explain_the_model_of_a_run(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--engine", "eager", "--n-layer", "1", "--n-head", "2", "--n-embd", "24",
                 "--block-size", "8", "--batch-size", "2", "--threads", "1", "--steps", "1", "--out", str(run)]) == 0
    capsys.readouterr()
    assert main(["explain", "--out", str(run), "--device", "cpu", "--batch-size", "3", "--ir"]) == 0
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
    assert main(["explain", *SMALL, "--plots", str(tmp_path / "plots"), "--ir"]) == 0
    out = capsys.readouterr().out
    head = out[:out.index("// ===== after stage:")]
    assert "\n// memory plan:\n// predicted peak " in head
    assert re.search(r"// largest live set at step \d+ of \d+: nova\.\w+ \(", head)  # the op, then its nova.loc
    assert "// the 10 largest buffers:" in head and head.count("offset ") == 10
    assert f"// memory timeline: {tmp_path / 'plots' / 'memory_timeline.png'}" in head
    _png_drawn(tmp_path / "plots" / "memory_timeline.png")
    plan_ir = dict(split_stages(out))["plan_memory"]
    assert "// module attribute nova.memory_plan = {arena_bytes = " in plan_ir
    assert re.search(r"^  %\d+ = nova\.\w+ .* @arena\+\d+  loc\(#loc\d+\)$", plan_ir, re.MULTILINE)


def test_explain_with_out_dir_prints_the_summary_and_no_ir(tmp_path, capsys):
    assert main(["explain", *SMALL, "--out-dir", str(tmp_path / "ir")]) == 0
    captured = capsys.readouterr()
    assert "// predicted peak " in captured.out and "after stage:" not in captured.out
    from nova.pipeline import STAGES

    assert f"// the IR of every stage: {len(STAGES)} files in {tmp_path / 'ir'}" in captured.out


@pytest.mark.parametrize("flag", ["--plots", "--out-dir"])
def test_explain_plots_and_out_dir_must_be_directories(tmp_path, capsys, flag):
    (tmp_path / "f").write_text("")
    assert main(["explain", *SMALL, flag, str(tmp_path / "f")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"nova explain: error: {flag} ") and err.endswith("is a file, not a directory\n")
