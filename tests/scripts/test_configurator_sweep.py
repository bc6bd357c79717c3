"""``scripts/configurator_sweep.py``: its random shapes pass the configurator's legality checks
(a few hundred here, 40,000 a run by hand), and a planted fault is reported and fails it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "configurator_sweep.py"


def _module():
    spec = importlib.util.spec_from_file_location("configurator_sweep", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_sweep_passes_and_reports_a_fault(monkeypatch, capsys):
    mod = _module()
    monkeypatch.setattr(sys, "argv", ["x", "--seed", "7", "--shapes", "400"])
    assert mod.main() == 0
    assert "400 shapes, 0 failing" in capsys.readouterr().out
    from nova.schedule import configurator as cf

    real = cf.plan_matmul

    def wide(*args, **kw):  # every plan one tile too wide for a 16-column C
        p = real(*args, **kw)
        return p if args[1] > 16 else p.__class__(**{**p.__dict__, "config": p.config.__class__(
            **{**p.config.to_dict(), "block_n": 256})})

    monkeypatch.setattr(cf, "plan_matmul", wide)
    with pytest.raises(AssertionError, match="block_n"):
        mod.check(64, 8, 64, 1, "bf16", "bfloat16", "H100", False, ("row", "row"))
