"""Configurator step 5c: a split that the launcher runs as stream-K is modeled as stream-K
(docs/configurator.md, 5c), at step 3's tile only."""

from __future__ import annotations

import pytest

from nova.codegen.triton import matmul as mm
from nova.schedule import configurator as cf
from nova.schedule.devices import DEVICES

# the tf32 step's qkv weight gradient, transposed by transpose_matmul (B = x, stored rounded)
QKV_DW = dict(M=2304, N=768, batch=1, dtype_a="float32", dtype_b="float32", out_dtype="float32",
              precision="tf32-rn", a_layout="col", b_layout="row", prerounded=("b",))


def _plan(K, device, **kw):
    return cf.plan_matmul(K=K, device=device, **{**QKV_DW, **kw})


def _runs_stream_k(plan, M, N, device) -> bool:
    c = plan.config
    return mm.stream_k_applies(M, N, c.split_k, c, DEVICES[device].sm_count, f32=True) and not c.persistent


@pytest.mark.parametrize("device", ["H100", "H200"])
def test_the_qkv_weight_gradient_keeps_its_wide_tile_as_stream_k(device):
    """54 tiles of 128x256 on 132 SMs: step 4 halved it to 128x128 (108 tiles, one wave of
    whole K); stream-K shares the 128x256 tiles' K-steps over every SM."""
    p = _plan(32768, device)
    c = p.config
    assert (c.block_m, c.block_n) == (128, 256) and c.split_k >= 2
    assert p.tiles == 54 and p.tiles * c.split_k > DEVICES[device].sm_count
    assert _runs_stream_k(p, 2304, 768, device)


def test_the_switch_off_gives_the_split_model_alone(monkeypatch):
    on = _plan(32768, "H100").config
    monkeypatch.setattr(cf, "STREAM_K_TILES", False)
    off_plan = _plan(32768, "H100")
    off = off_plan.config
    # the split model alone: 128x256 split 2 in one wave (108 programs, not stream-K; rule 4c
    # keeps the tile: its A goes through registers, which costs a 128x128 tile twice as much
    # a product)
    assert (off.block_m, off.block_n, off.split_k) == (128, 256, 2) != (on.block_m, on.block_n, on.split_k)
    assert not _runs_stream_k(off_plan, 2304, 768, "H100")
    # the launcher's own switch off: the configurator does not model what will not run
    monkeypatch.setattr(cf, "STREAM_K_TILES", True)
    monkeypatch.setattr(mm, "STREAM_K_SPLIT", False)
    assert _plan(32768, "H100").config == off


def test_an_epilogue_launch_never_takes_it():
    """The launcher runs stream-K only without an epilogue: a fused group keeps the tile grid
    or a split the split model chose."""
    p = _plan(32768, "H100", epilogue=True)
    assert not _runs_stream_k(p, 2304, 768, "H100")


@pytest.mark.parametrize("device", ["H100", "H200"])
def test_a_one_wave_split_the_model_prefers_is_kept(device):
    """bf16 768x768x32768 (GPT-2's attention projection weight gradient): 18 tiles split 7,
    126 programs in one wave, measured faster than stream-K (0.066 against 0.075 ms, H100)."""
    p = cf.plan_matmul(768, 768, 32768, 1, "bfloat16", "bfloat16", "bfloat16", "bf16", "col", "row", False, device)
    c = p.config
    assert c.split_k > 1 and p.tiles * c.split_k <= DEVICES[device].sm_count


def test_a_chosen_stream_k_config_is_never_persistent(monkeypatch):
    """Rule 8d's persistent split form would take a both-staged tf32 split; the stream-K
    launch takes only the tile grid's config."""
    taken = 0
    for K in (8192, 16384, 32768, 65536):
        for prerounded in (("b",), ("a", "b")):
            p = _plan(K, "H200", prerounded=prerounded, a_layout="row")
            c = p.config
            if c.split_k > 1 and p.tiles * c.split_k > 132:
                taken += 1
                assert not c.persistent, (K, prerounded, c)
    assert taken >= 4
    monkeypatch.setattr(cf, "STREAM_K_TILES", False)  # without 5c, 8d's split form takes the both-staged one
    assert _plan(32768, "H200", prerounded=("a", "b"), a_layout="row").config.persistent


@pytest.mark.parametrize("device", ["H100", "H200"])
def test_rule_4c_keeps_the_batch_8_qkv_weight_gradient_wide(device, monkeypatch):
    """GPT-2 tf32 at batch 8: 2304x768x8192, A = dqkv^T through registers (M-major). Without
    rule 4c step 4 halves it to 128x128 unsplit (0.196 ms on an H100 at c527b90); with it,
    128x256 run as stream-K (0.156, cuBLAS 0.156). Off: the old choice again."""
    p = _plan(8192, device, prerounded=("a", "b"))
    assert (p.config.block_m, p.config.block_n) == (128, 256) and _runs_stream_k(p, 2304, 768, device)
    monkeypatch.setattr(cf, "TF32_REGISTER_A_BY_TILE", False)
    old = _plan(8192, device, prerounded=("a", "b")).config
    assert (old.block_m, old.block_n, old.split_k) == (128, 128, 1)
