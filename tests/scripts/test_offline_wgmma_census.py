"""scripts/offline_wgmma_census.py without a GPU: the 46M MLP's 384x1536x8192 tf32 weight
gradient as the configurator schedules it for the H100 (128x256x32 split 7, B alone staged,
A through registers: the config that raced on an H100 at e1ea8b7) compiles for sm_90a with
a register-A wgmma that ``matmul.SETTLE_REGISTER_A`` (on) waits on each K-step: no write
into a pending wgmma's registers. The same config as it was then, unsettled, compiles into
such writes (24 in its two-pass split kernel; its stream-K form had 29 in the H100's own
SASS, scripts/wgmma_census.py, and 29 offline), which fail the run; with both operands
staged (rule 9a, ``TF32_SHARED_OPERANDS`` on) no wgmma reads A from registers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "offline_wgmma_census.py"
LAUNCH = {"M": 384, "N": 1536, "K": 8192, "layouts": ["col", "row"], "prerounded": ["a", "b"],
          "precision": "tf32-rn", "device": "H100"}
RACED = {"kind": "matmul", "block_m": 128, "block_n": 256, "block_k": 32, "group_m": 2, "split_k": 7,
         "num_warps": 8, "num_stages": 4, "instruction": "wgmma+tma+stage_b", "regime": "compute-bound"}


def test_configured_weight_gradient_is_clean_and_the_raced_config_is_found(tmp_path):
    launches = tmp_path / "launches.json"
    shared = dict(RACED, instruction="wgmma+tma+stage_a+stage_b")
    launches.write_text(json.dumps([LAUNCH, dict(LAUNCH, config=RACED, settle=False), dict(LAUNCH, config=RACED),
                                    dict(LAUNCH, config=shared)]))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["NOVA_CACHE_DIR"] = str(tmp_path / "cache")
    r = subprocess.run([sys.executable, str(SCRIPT), "--launches", str(launches)], capture_output=True, text=True,
                       env=env, timeout=600)
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    assert r.returncode == 1, r.stdout + r.stderr  # hazards found
    assert not any("error" in x for x in lines), lines
    # the split's main kernels (18 tiles x 7 splits, one wave: the two-pass form; its reduction has no wgmma)
    # (the configured kernel is the settled RACED one: recorded once)
    configured, raced, shared = [x for x in lines if x["kernel"] == "matmul_kernel"]
    assert configured["register_a"] is True and configured["hazards"] == 0
    # ptxas's resources for sm_90a: a 128x256 fp32 accumulator over 8 warps is 128 registers a thread at least
    assert all(128 <= x["registers"] <= 255 and x["spill_bytes"] == 0 for x in (configured, raced, shared))
    assert raced["register_a"] is True and raced["hazards"] == 24
    assert shared["register_a"] is False and shared["hazards"] == 0
