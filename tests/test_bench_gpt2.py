"""``nova bench gpt2 --dry-run``: the benchmark's plumbing (same weights and batches
for every engine, loss comparison, compile times, OOM rows, JSON + PNG) on a tiny GPT
on the CPU with eager and Nova's reference backend. Its timings mean nothing and
nothing here asserts one."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

from nova.cli.bench import load_benchmark
from nova.cli.errors import RunFailed, UsageError
from nova.cli.main import main as nova_main

bench = load_benchmark("gpt2")

ROW_KEYS = {"engine", "precision", "batch", "seq", "layers", "width", "tok_s", "peak_gib", "compile_s",
            "compile_warm_s", "oom", "max_rel_loss_diff", "step_ms_median"}


def _opts(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    return p.parse_args(list(argv))


def test_dry_run_through_the_cli_writes_complete_results(tmp_path):
    assert nova_main(["bench", "gpt2", "--dry-run", "--precision", "fp32", "--out", str(tmp_path)]) == 0
    stem = "gpt2_dry_l2w64h4_v256_fp32_b2_t32"
    assert (tmp_path / f"{stem}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    doc = json.loads((tmp_path / f"{stem}.json").read_text(), parse_constant=lambda c: pytest.fail(f"JSON has {c}"))
    assert {"device", "versions", "commit", "config", "rows"} <= set(doc) and doc["dry_run"]
    assert set(doc["versions"]) == {"torch", "triton", "python", "nova"} and doc["versions"]["torch"] == torch.__version__
    assert doc["commit"] and doc["loss_reference"] == "eager, this run"
    c = doc["config"]
    assert (c["layers"], c["heads"], c["width"], c["vocab"], c["seq"], c["batch"]) == (2, 4, 64, 256, 32, 2)
    assert c["switches"] == {}  # the shipped step
    assert [r["engine"] for r in doc["rows"]] == ["eager", "nova"]
    n = c["warmup"] + c["steps"]
    for r in doc["rows"]:
        assert ROW_KEYS <= set(r)
        assert not r["oom"] and r["error"] is None
        assert (r["precision"], r["batch"], r["seq"], r["layers"], r["width"]) == ("fp32", 2, 32, 2, 64)
        assert r["tok_s"] > 0 and r["step_ms_median"] > 0 and len(r["step_ms"]) == c["steps"]
        assert r["peak_gib"] is None  # no CUDA allocator on the CPU
        assert len(r["losses"]) == n and all(math.isfinite(v) for v in r["losses"])
        # random next-token targets over 256 ids: about ln 256 at the start, and the steps differ
        assert abs(r["losses"][0] - math.log(256)) < 0.3 and len(set(r["losses"])) == n
    eager, nova_row = doc["rows"]
    assert eager["compile_s"] is None and eager["max_rel_loss_diff"] == 0.0
    assert nova_row["compile_s"] > 0 and nova_row["compile_warm_s"] > 0
    # where the cold compile went: every pipeline stage timed, within the first step's time
    rep = nova_row["compile_report"]
    assert {"capture", "autodiff", "plan_memory"} <= set(rep["stages"]) and rep["cache"] in {"off", "miss"}  # never a hit
    assert 0 < rep["pipeline"] <= nova_row["first_step_s"] and rep["ahead"] == {}  # no walk on the CPU
    # same weights, same batches: fp32 Nova follows eager step for step (a different batch
    # or weight copy would differ by ~1e-2); the warm copy's first step is step 0 again
    assert nova_row["max_rel_loss_diff"] < 1e-5
    assert abs(nova_row["warm_first_loss"] - nova_row["losses"][0]) < 1e-5 * nova_row["losses"][0]


def test_out_of_memory_is_a_row_and_the_next_engine_runs(tmp_path, monkeypatch):
    build = bench.build

    def eager_runs_out(engine, *args):
        if engine == "eager":
            raise bench._OOM("CUDA out of memory. Tried to allocate 2.00 GiB")
        return build(engine, *args)

    monkeypatch.setattr(bench, "build", eager_runs_out)
    paths = bench.run_args(_opts("--dry-run", "--steps", "1", "--out", str(tmp_path)), log=lambda s: None)
    doc = json.loads(paths[0].read_text())
    eager, nova_row = doc["rows"]
    assert eager["oom"] and eager["tok_s"] is None and "out of memory" in eager["error"]
    assert not nova_row["oom"] and nova_row["error"] is None and nova_row["tok_s"] > 0
    assert doc["loss_reference"] is None and nova_row["max_rel_loss_diff"] is None  # no reference: no claim
    assert paths[1].is_file()


def test_a_failing_engine_is_recorded_and_the_run_fails(tmp_path, monkeypatch):
    build = bench.build

    def nova_breaks(engine, *args):
        if engine == "nova":
            raise ValueError("broken on purpose")
        return build(engine, *args)

    monkeypatch.setattr(bench, "build", nova_breaks)
    with pytest.raises(RunFailed, match="nova: ValueError: broken on purpose"):
        bench.run_args(_opts("--dry-run", "--steps", "1", "--out", str(tmp_path)), log=lambda s: None)
    doc = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert doc["rows"][0]["error"] is None and doc["rows"][1]["error"].startswith("ValueError")
    assert not doc["rows"][1]["oom"]
    assert not bench._is_oom(ValueError("broken")) and bench._is_oom(RuntimeError("CUDA error: out of memory"))


def test_a_variant_by_set_is_recorded_and_named(tmp_path, monkeypatch):
    """--set flips a module switch for the run (a variant measured beside the rivals): the
    results record every changed switch, and the file's name is not the shipped step's."""
    from nova.transforms import transpose_matmul

    monkeypatch.setattr(transpose_matmul, "ENABLED", transpose_matmul.ENABLED)  # restored at teardown
    item = "transforms.transpose_matmul.ENABLED=True"
    opts = _opts("--dry-run", "--steps", "1", "--engines", "nova", "--set", item, "--out", str(tmp_path))
    assert bench._argv(opts)[-3:-1] == ["--set", item]  # the ranks torchrun starts get it too
    (path, *_) = bench.run_args(opts, log=lambda s: None)
    doc = json.loads(path.read_text())
    assert doc["config"]["switches"] == {"nova.transforms.transpose_matmul.ENABLED": "True"}
    assert path.name.startswith("gpt2_dry_l2w64h4_v256_bf16_b2_t32_sw") and doc["rows"][0]["error"] is None
    with pytest.raises(UsageError, match="--set: .*has no switch NOPE"):
        bench.run(_opts("--dry-run", "--set", "transforms.transpose_matmul.NOPE=1"), log=lambda s: None)


def test_presets_and_result_names():
    cases = [
        (["--model", "124m", "--batch", "32"], (12, 12, 768), "gpt2_124m_bf16_b32"),
        (["--batch", "8"], (12, 12, 768), "gpt2_124m_bf16_b8"),
        (["--model", "355m", "--batch", "8", "--cap-gib", "12"], (24, 16, 1024), "gpt2_355m_bf16_b8_cap12"),
        (["--layers", "6", "--precision", "tf32", "--seq", "512"], (6, 12, 768), "gpt2_l6w768h12_tf32_b8_t512"),
        (["--engines", "nova,eager"], (12, 12, 768), "gpt2_124m_bf16_b8_eager-nova"),
        (["--model", "mlp46m", "--precision", "tf32"], (6, 1, 384), "mlp_lm_mlp46m_tf32_b8"),
    ]
    for argv, (layers, heads, width), stem in cases:
        cfg = bench.resolve(_opts(*argv))
        assert (cfg["layers"], cfg["heads"], cfg["width"], cfg["vocab"]) == (layers, heads, width, 50304)
        assert bench.result_stem(cfg, dry_run=False) == stem
    assert bench.resolve(_opts("--engines", "nova,eager"))["engines"] == ["eager", "nova"]  # eager first
    mlp = bench.new_model(bench.resolve(_opts("--model", "mlp46m")))
    assert type(mlp).__name__ == "MLPLM" and mlp.blocks[0].fc_in.weight.shape == (1536, 384)
    assert 44e6 < sum(p.numel() for p in mlp.parameters()) < 48e6  # the paper's 46M (two untied vocab matrices)
    with pytest.raises(UsageError, match="divisible"):
        bench.resolve(_opts("--width", "100"))
    with pytest.raises(UsageError, match="warmup"):
        bench.resolve(_opts("--warmup", "0"))
    with pytest.raises(SystemExit):
        _opts("--engines", "jax")


def test_batches_are_random_and_the_same_for_every_engine():
    cfg = bench.resolve(_opts("--dry-run"))
    b = bench.Batches(cfg, torch.device("cpu"))
    b.reset()
    first = [b.next() for _ in range(3)]
    b.reset()
    again = [b.next() for _ in range(3)]
    for (x, y), (x2, y2) in zip(first, again):
        assert torch.equal(x, x2) and torch.equal(y, y2)
        assert x.shape == y.shape == (cfg["batch"], cfg["seq"]) and x.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1])  # next-token targets
        assert x.unique().numel() > 16 and 0 <= int(x.min()) and int(x.max()) < cfg["vocab"]
    assert not torch.equal(first[0][0], first[1][0])
