"""``nova bench matmul --shapes gpt2``: the matmul launches of a compiled step
(bench/step_matmuls.py) against the launches the Triton backend really makes, the
cached GPT-2 124M list against a fresh compile, and the benchmark's dry run."""

from __future__ import annotations

import functools
import json
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

import nova
from nova.models import GPT, GPTConfig
from nova.transforms.fuse_loss import DEFAULT_CHUNK

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

BENCH = Path(__file__).resolve().parents[2] / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))
import step_matmuls as sm  # noqa: E402

from nova.cli.bench import bench_matmul_main, load_benchmark  # noqa: E402


def _operand_key(t: torch.Tensor, aligned: bool) -> tuple:
    return tuple(t.shape), tuple(t.stride()), aligned


def _row_key(r: dict) -> tuple:
    elt = torch.empty((), dtype=getattr(torch, r["dtype"])).element_size()
    ops = [(tuple(r[x]["shape"]), tuple(r[x]["strides"]), r[x]["offset"] * elt % 16 == 0) for x in ("a", "b")]
    return (*ops, r["out_dtype"], r["bias"], json.dumps(r["config"], sort_keys=True), tuple(r.get("prerounded", ())))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the launches are recorded through the interpreter")
@pytest.mark.parametrize("precision", ["bf16", "tf32"])
def test_extracted_launches_are_the_launches_the_step_makes(monkeypatch, precision):
    """A 1-layer GPT with biases, its LM head in chunks of 8 rows over 20 tokens (two
    full chunks and a short one): the step run through the interpreter calls
    matmul with exactly the operands (shapes, strides, 16-byte alignment), output
    dtypes, biases, configs and prerounded operands (tf32: the tf32_operands stage's,
    the LM head's hoisted weight and d) that step_matmuls reads off its final IR."""
    from nova.codegen.triton import matmul as mm
    from nova.transforms import fuse_loss

    monkeypatch.setattr(fuse_loss, "fuse_loss", functools.partial(fuse_loss.fuse_loss, chunk=8))
    calls = []
    real = mm.matmul

    def recording(a, b, bias=None, cfg=None, precision=None, out=None, out_dtype=None, **kw):
        y = real(a, b, bias, cfg, precision, out, out_dtype, **kw)
        used = cfg or mm.configure(a.shape[-2], b.shape[-1], a.shape[-1], 1, a.dtype, y.dtype, precision,
                                   mm.layout(a), mm.layout(b), bias is not None, mm.device_spec(a.device))
        calls.append((_operand_key(a, a.data_ptr() % 16 == 0), _operand_key(b, b.data_ptr() % 16 == 0),
                      str(y.dtype).removeprefix("torch."), bias is not None, json.dumps(used.to_dict(), sort_keys=True),
                      tuple(sorted(kw.get("prerounded", ())))))
        return y

    real_epilogue = mm.matmul_epilogue

    def recording_epilogue(a, b, epilogue, inputs, out_dtype, cfg=None, precision=None, outs=None, **kw):
        ys = real_epilogue(a, b, epilogue, inputs, out_dtype, cfg, precision, outs, **kw)
        used = cfg or mm.configure(a.shape[-2], b.shape[-1], a.shape[-1], 1, a.dtype, out_dtype, precision,
                                   mm.layout(a), mm.layout(b), False, mm.device_spec(a.device))  # the LM head's dw +=
        calls.append((_operand_key(a, a.data_ptr() % 16 == 0), _operand_key(b, b.data_ptr() % 16 == 0),
                      str(out_dtype).removeprefix("torch."), False, json.dumps(used.to_dict(), sort_keys=True),
                      tuple(sorted(kw.get("prerounded", ())))))
        return ys

    monkeypatch.setattr(mm, "matmul", recording)
    monkeypatch.setattr(mm, "matmul_epilogue", recording_epilogue)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, block_size=10, n_layer=1, n_head=1, n_embd=16))
    step = nova.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-3), precision=precision, backend="triton")
    x = torch.randint(0, 32, (2, 10))
    step(x, x)
    launches = sm.step_matmuls(step._last.compilation.module, precision)
    assert len(launches) == len(calls) == 12 + 3 * 3  # 12 per layer; LM head (merged): 3 chunks x logits, dh, dw
    # the forward's linears take their bias (and GELU, residual) in the epilogue, and so do the LM head's
    # later chunks (dw +=); in bf16 the two projections' bias and residual adds are the next LayerNorms'
    # prologues instead (the fuse stage's row stores)
    assert sum(bool(r["epilogue"]) for r in launches) >= (4 if precision == "bf16" else 5)
    assert Counter(_row_key(r) for r in launches) == Counter(calls)
    assert (precision == "tf32") == any(r.get("prerounded") for r in launches)  # under tf32 some, under bf16 none
    rows = [r["chunk_rows"] for r in launches if r["source"].endswith(":dw")]
    assert rows == [8, 8, 4]
    for r in launches:
        # the configure stage's config is configure_matmul of the recorded arguments
        assert sm.configured(r["configure"]).to_dict() == r["config"], r["source"]
    merged = sm.distinct(launches)
    assert sum(r["count"] for r in merged) == len(launches) and len(merged) < len(launches)


def test_cached_gpt2_list_is_what_the_pipeline_extracts():
    """bench/gpt2_matmul_shapes.json against a fresh 2-layer compile of the same
    GPT-2 width at batch 8: the same distinct launches (configs aside: the bench
    asks the configurator at run time), the layer launches 6x as often at 12
    layers, the LM head's as often. If this fails, the pipeline changed what the
    step launches: regenerate the file (python bench/step_matmuls.py)."""
    doc = json.loads(sm.SHAPES_JSON.read_text())
    assert doc["config"] == sm.GPT2 and doc["regenerate"] == sm.REGENERATE
    steps = {(s["precision"], s["batch"]): s for s in doc["steps"]}
    assert set(steps) == {(p, b) for p in sm.PRECISIONS for b in sm.BATCHES}
    for (p, b), s in steps.items():
        assert sum(r["count"] for r in s["shapes"]) == s["launches"] == 12 * 12 + 3 * -(-b * 1024 // DEFAULT_CHUNK)
    fresh = sm.extract(dict(sm.GPT2, n_layer=2), 8, "bf16")

    def table(step, layers):
        out = {}
        for r in step["shapes"]:
            key = sm.signature({k: v for k, v in r.items() if k not in ("config", "count")})
            per = r["count"] // layers if r["source"] == "nova.matmul" else r["count"]
            out[key] = per
        return out

    assert table(fresh, 2) == table(steps[("bf16", 8)], 12), f"the step's launches changed: run {sm.REGENERATE}"
    # at GPT-2's width too, the recorded arguments give the configure stage's config (a group's matmul
    # is configured with its epilogue: the qkv forward 8192x2304x768 with its bias takes no wave tail)
    for r in fresh["shapes"]:
        assert sm.configured(r["configure"]).to_dict() == r["config"], (r["source"], r["M"], r["N"], r["K"])
    assert any(r["configure"].get("epilogue") and r["M"] == 8192 and r["N"] == 2304 for r in fresh["shapes"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is the CPU path")
def test_gpt2_dry_run_writes_step_totals(tmp_path, monkeypatch):
    from nova.schedule import configurator as cf

    monkeypatch.setattr(cf, "STREAM_K_TILES", cf.STREAM_K_TILES)  # --set changes it: restored after the test
    argv = ["--dry-run", "--shapes", "gpt2", "--batch", "1", "--precisions", "tf32", "--search-budget", "1",
            "--out", str(tmp_path), "--set", "schedule.configurator.STREAM_K_TILES=False"]
    assert bench_matmul_main(argv) == 0
    doc = json.loads((tmp_path / "matmul_gpt2.json").read_text())
    assert doc["settings"]["switches"] == {"nova.schedule.configurator.STREAM_K_TILES": "False"}
    assert (tmp_path / "matmul_gpt2.md").read_text().startswith("# nova bench matmul --shapes gpt2")
    # the launches the step runs with a fused epilogue say so (the bench times their matmul alone)
    assert any(r["epilogue"] for r in doc["shapes"]) and not all(r["epilogue"] for r in doc["shapes"])
    assert "| matmul (epilogue) |" in (tmp_path / "matmul_gpt2.md").read_text()
    assert (tmp_path / "matmul_gpt2.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "matmul.json").exists()  # the grid's results are not overwritten
    (step,) = doc["steps"]
    assert (step["precision"], step["batch"], step["missing"]) == ("tf32", 1, 0)
    assert step["launches"] == 12 + 3 == sum(u["count"] for r in doc["shapes"] for u in r["uses"])
    assert step["nova_ms"] == pytest.approx(sum(u["count"] * r["nova"]["ms"] for r in doc["shapes"] for u in r["uses"]))
    assert step["best_ms"] <= step["nova_ms"]
    sources = {u["source"] for r in doc["shapes"] for u in r["uses"]}
    head = "nova.linear_cross_entropy_with_grad"  # the loss_grad stage's merged LM head
    assert {"nova.matmul", f"{head}:logits", f"{head}:dh", f"{head}:dw"} <= sources
    for r in doc["shapes"]:
        assert r["nova"]["rel_err"] < 5e-4 and r["cublas"]["ms"] > 0 and r["search"]["timed"] == 1
        assert r["config_as_in_step"] and set(r["variant"]) == {"tma", "splits", "staged"}
        assert len(r["id"]) == 12
    # the LM head's logits are one launch, for the loss and the gradients
    (logits,) = [r for r in doc["shapes"] if r["source"].endswith(":logits")]
    assert [u["source"] for u in logits["uses"]] == [f"{head}:logits"]
    dw = next(r for r in doc["shapes"] if r["source"].endswith(":dw"))
    assert dw["layouts"] == ["col", "row"] and dw["out_dtype"] == "float32"


def test_a_switch_that_does_not_exist_is_refused_before_any_work(tmp_path, capsys):
    assert bench_matmul_main(["--dry-run", "--shapes", "gpt2", "--out", str(tmp_path),
                              "--set", "schedule.configurator.NO_SUCH_SWITCH=1"]) == 2
    assert "has no switch NO_SUCH_SWITCH" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_step_totals_and_merge_of_parts(tmp_path):
    bench = load_benchmark("matmul")

    def row(rid, ms, best, cublas, uses):
        fig = lambda t: {"ms": t, "tflops": 1.0, "rel_err": 0.0}  # noqa: E731
        return {"id": rid, "precision": "bf16", "M": 8, "N": 8, "K": 8, "nova": fig(ms), "cublas": fig(cublas),
                "search": {"best": fig(best) if best else None, "timed": 1, "candidates": 1, "truncated": False},
                "uses": [{"precision": "bf16", "batch": b, "source": s, "count": n} for b, s, n in uses],
                "configurator_ms": 0.1, "nova_vs_cublas": cublas / ms, "nova_vs_best": (best or ms) / ms,
                "within_3pct_of_best": True}

    a = row("a", 2.0, 1.0, 1.5, [(8, "nova.matmul", 3), (32, "nova.matmul", 1)])
    b = row("b", 1.0, None, 2.0, [(8, "nova.linear_cross_entropy:logits", 2)])
    (b8, b32) = bench.step_totals([a, b])
    assert (b8["batch"], b8["launches"], b8["distinct"]) == (8, 5, 2)
    assert b8["nova_ms"] == 3 * 2.0 + 2 * 1.0 and b8["cublas_ms"] == 3 * 1.5 + 2 * 2.0
    assert b8["best_ms"] == 3 * 1.0 + 2 * 1.0  # no searched best: nova's own config is the template's best
    assert b8["by_source"]["logits"]["launches"] == 2 and b8["by_source"]["layers"]["nova_ms"] == 6.0
    assert b32["nova_ms"] == 2.0 and b32["nova_vs_cublas"] == 0.75
    # where the time against cuBLAS goes: count x (Nova - cuBLAS), largest first (b is ahead: negative)
    assert [(g["id"], g["count"], g["gap_ms"]) for g in b8["gaps"]] == [("a", 3, 1.5), ("b", 2, -2.0)]
    assert [g["gap_ms"] for g in b32["gaps"]] == [0.5]
    text = bench.markdown_gpt2({"settings": {"search_budget": 1}, "device": "d", "torch": "t", "triton": "t",
                                "git": {"commit": "c"}, "created": "now", "steps": [b8, b32], "shapes": []})
    assert "* bf16 b8: 8x8x8 matmul x3: +1.500; 8x8x8 linear_cross_entropy:logits x2: -2.000" in text
    files = []
    for i, rows in enumerate(([a], [b])):
        d = {"git": {"commit": f"c{i}"}, "settings": {"seconds": 1.0, "shapes": "gpt2"}, "shapes": rows}
        files.append(tmp_path / f"matmul_gpt2_part{i + 1}of2.json")
        files[-1].write_text(json.dumps(d))
    merged = bench.merge(files)
    assert len(merged["shapes"]) == 2 and merged["steps"][0]["launches"] == 5  # same M, N, K: kept apart by id
