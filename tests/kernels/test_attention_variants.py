"""``scripts/attention_variants.py --dry``: the measurement script's whole logic (SDPA
reference, the checks, Nova's default and grid variants of the forward, dK/dV, dQ and
delta kernels, the JSON) on a tiny shape through the Triton interpreter. The timings
mean nothing; the plumbing and the correctness figures do."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "attention_variants.py"
DRY = ["--batch", "1", "--heads", "1", "--seq", "64", "--dim", "16", "--dry"]


def script():
    spec = importlib.util.spec_from_file_location("attention_variants", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_script(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter process (TRITON_INTERPRET=1 whatever this one
    runs with: the dry run is the CPU's), the repo on the path."""
    env = dict(os.environ, TRITON_INTERPRET="1", NOVA_COMMIT="testcommit", NOVA_CACHE_DIR=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                          cwd=SCRIPT.parents[1])
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def test_dry_run_rows_carry_checked_errors(tmp_path):
    argv = DRY + ["--out", str(tmp_path)]
    run_script(f"import runpy, sys; sys.argv = {['x', *argv]!r}; runpy.run_path({str(SCRIPT)!r}, run_name='__main__')",
               tmp_path)
    doc = json.loads((tmp_path / "attention_variants_testcommit.json").read_text())
    assert doc["shape"] == {"batch": 1, "heads": 1, "seq": 64, "dim": 16, "causal": True, "dtype": "bfloat16",
                            "scale": 0.25}
    assert {"device", "torch", "triton", "commit", "rows", "summary"} <= set(doc)
    rows = doc["rows"]
    kinds = {(r["kernel"], r["default"]) for r in rows}
    for kind in ("nova_fwd", "nova_bwd", "nova_dkdv", "nova_dq", "nova_delta"):
        assert (kind, True) in kinds, kind
    assert {r["kernel"] for r in rows if r.get("backend") == "math"} == {"sdpa_fwd", "sdpa_bwd"}
    written = {"nova_fwd": {"o", "lse"}, "nova_bwd": {"dq", "dk", "dv"}, "nova_dkdv": {"dk", "dv"},
               "nova_dq": {"dq"}, "nova_delta": {"delta"}, "sdpa_fwd": {"o"}, "sdpa_bwd": {"dq", "dk", "dv"}}
    for r in rows:
        assert r["status"] == "ok", r
        assert set(r["max_abs_err"]) == written[r["kernel"]], r
        for k, e in r["max_abs_err"].items():
            assert math.isfinite(e) and 0 <= e <= r["tol"][k] and r["tol"][k] > 0, r
        assert r["ms"] > 0
    mod = script()
    # the grid rows, with the tiles the kernels ran at (the backward's set exactly, not capped)
    for kernel, grid in (("nova_fwd", "fwd"), ("nova_dkdv", "dkdv"), ("nova_dq", "dq")):
        ran = [tuple(r["effective"].values()) for r in rows if r["kernel"] == kernel and not r["default"]
               and not r["flags"]]
        assert sorted(ran) == sorted(mod.DRY_GRIDS[grid]), (kernel, ran)
    # every source variant: at the default schedule and at the dry list's (checked, ok above)
    flagged = [(r["kernel"], r["flags"][0]) for r in rows if r["flags"]]
    assert sorted(flagged) == ([("nova_bwd", "fused_bwd")] * 2 + [("nova_bwd", "tma_bwd")] * 2
                               + [("nova_fwd", "fma_scale")] * 2 + [("nova_fwd", "tma_kv")] * 2)
    assert doc["summary"]["nova_bwd_best_parts_ms"] > 0 and doc["summary"]["fwd_sdpa_over_nova_best"] > 0


def test_dry_run_tf32_prerounded(tmp_path):
    """``--precision tf32 --prerounded``: f32 inputs rounded to tf32, every Nova row checked
    ok against the f32 reference, the JSON named and described as such; --prerounded alone
    is refused."""
    argv = DRY + ["--precision", "tf32", "--prerounded", "--source-flags", "--out", str(tmp_path)]
    run_script(f"import runpy, sys; sys.argv = {['x', *argv]!r}; runpy.run_path({str(SCRIPT)!r}, run_name='__main__')",
               tmp_path)
    doc = json.loads((tmp_path / "attention_variants_tf32_prerounded_testcommit.json").read_text())
    assert doc["shape"]["dtype"] == "float32" and doc["precision"] == "tf32" and doc["prerounded"] is True
    nova = [r for r in doc["rows"] if r["kernel"].startswith("nova_")]
    assert nova and all(r["status"] == "ok" for r in nova), nova
    with pytest.raises(SystemExit):
        script().parse(DRY + ["--prerounded"])


def test_check_flags_wrong_results():
    mod = script()
    gen = torch.Generator().manual_seed(0)
    ref = {"o": torch.randn(2, 3, 8, 4, generator=gen), "dq": torch.randn(2, 3, 8, 4, generator=gen)}
    tol = mod.tolerances(ref)
    assert tol["o"] == mod.REL_TOL * float(ref["o"].abs().max())
    assert mod.tolerances(ref, {"o": 1.0})["o"] == mod.SDPA_FACTOR  # SDPA's own error widens it
    good = {k: (v.to(torch.bfloat16)) for k, v in ref.items()}  # a bf16 rounding: within tolerance
    assert mod.check(good, ref, tol)["ok"]
    off = dict(good, dq=good["dq"].clone())
    off["dq"][1, 2, 3, 0] += 0.1 * float(ref["dq"].abs().max())  # one element wrong
    res = mod.check(off, ref, tol)
    assert not res["ok"] and res["wrong"] == ["dq"] and res["max_abs_err"]["dq"] > tol["dq"]
    nan = dict(good, o=good["o"].clone())
    nan["o"][0, 0, 0, 0] = float("nan")
    assert mod.check(nan, ref, tol)["wrong"] == ["o"]
    assert mod.check({"o": good["o"][:1]}, ref, tol)["wrong"] == ["o"]  # a wrong shape


def test_a_wrong_kernel_is_reported_wrong_and_not_timed(tmp_path):
    """The Nova kernels lowered with twice the reference's scale: every Nova row is
    wrong and carries no time (SDPA's rows, checked against the true scale, stay ok)."""
    code = f"""
import json, sys
sys.argv = ["x"]
import runpy
mod = runpy.run_path({str(SCRIPT)!r})
opts = mod["parse"]({DRY!r} + ["--out", {str(tmp_path)!r}])
bench = mod["Bench"](opts)
bench.sdpa_rows()
bench.scale *= 2  # the ops the Nova rows lower now compute another function
bench.nova_rows()
print(json.dumps(bench.rows))
"""
    rows = json.loads(run_script(code, tmp_path).stdout.strip().splitlines()[-1])
    nova = [r for r in rows if r["kernel"].startswith("nova_") and r["kernel"] != "nova_delta"]
    assert nova and all(r["status"] == "wrong" and r["ms"] is None and r["wrong"] for r in nova), nova
    assert all(r["status"] == "ok" for r in rows if r["kernel"].startswith("sdpa_"))
