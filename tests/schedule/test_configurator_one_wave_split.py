"""Split-K for a single wave that is more than half full (S/2 < tiles < S): the
GPT-2 step's weight gradients (M x N = 768 x 3072, K = tokens) and the fused LM
head's dh (2048 x 768, K = 50304) left up to 60 of the H200's 132 SMs idle with
no split (step 5 split only a wave at most half full, or a last wave at most half
full after full ones)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from nova.codegen.triton.matmul import split_k_plan
from nova.schedule import configurator as cf
from nova.schedule.devices import DEVICES

H200 = DEVICES["H200"]


def _model(M, N, K, cfg, dev=H200):
    """docs/configurator.md step 5: T(s) = ceil(tiles s / S) tau / s (+ partials + a launch)."""
    S = dev.sm_count
    tiles = math.ceil(M / cfg.block_m) * math.ceil(N / cfg.block_n)
    s = split_k_plan(K, cfg)[1]
    tau = 2 * cfg.block_m * cfg.block_n * K / (dev.flops("bf16") / S)
    extra = 8 * M * N * s / dev.mem_bandwidth + cf.LAUNCH_SECONDS if s > 1 else 0.0
    return tiles, s, math.ceil(tiles * s / S) * tau / s + extra


@pytest.mark.parametrize("M, N, K, a, b", [
    (3072, 768, 32768, "col", "row"),   # GPT-2 b32 weight gradient of the MLP's down projection
    (768, 3072, 32768, "col", "row"),   # ... of its up projection
    (3072, 768, 8192, "col", "row"),    # b8
    (2048, 768, 50304, "row", "row"),   # the LM head's dh chunk
])  # fmt: skip
def test_a_more_than_half_full_wave_is_split(M, N, K, a, b, monkeypatch):
    monkeypatch.setattr(cf, "STREAM_K_TILES", False)  # step 5's split model alone (5c: test_configurator_stream_k.py)
    monkeypatch.setattr(cf, "WAVE_TAIL", False)  # (8f: test_configurator_wave_tail.py)
    cfg = cf.configure_matmul(M, N, K, 1, "bfloat16", "bfloat16", "bfloat16", "bf16", a, b, False, H200)
    tiles, splits, t = _model(M, N, K, cfg)
    assert H200.sm_count / 2 < tiles < H200.sm_count
    assert splits == cfg.split_k > 1
    one = _model(M, N, K, dataclasses.replace(cfg, split_k=1))[2]
    assert t < 0.85 * one  # the model's own gain over the same tile unsplit: at least 15%
    # every split still has >= 2 K-steps of the unwidened BLOCK_K
    assert split_k_plan(K, cfg)[0] >= 2 * 64


@pytest.mark.parametrize("M, N, K", [(8192, 512, 8192), (2048, 768, 2048), (8192, 768, 768)])
def test_a_full_or_short_wave_is_not_split(M, N, K):
    """128 tiles (a wave 97% full) gain nothing from a split; 96 tiles with K = 2048
    would, but not enough to pay the partials; several waves keep step 5's tail rule."""
    cfg = cf.configure_matmul(M, N, K, 1, "bfloat16", "bfloat16", "bfloat16", "bf16", "row", "row", False, H200)
    assert cfg.split_k == 1


def test_a_one_wave_split_the_model_gains_little_on_is_not_taken(monkeypatch):
    """GPT-2's qkv weight gradient (768 x 2304 x 32768): 108 tiles of 128x128 on 132 SMs.
    The best split gains the model 4.4% (split 6); on the H200 that split ran 0.195 ms
    against 0.175 unsplit, so below ``ONE_WAVE_SPLIT_MIN_GAIN`` the tile runs unsplit; with
    the margin at 0 the split comes back. (Step 5's split model alone: 5c's stream-K is
    test_configurator_stream_k.py's.)"""
    monkeypatch.setattr(cf, "STREAM_K_TILES", False)
    M, N, K = 768, 2304, 32768
    cfg = cf.configure_matmul(M, N, K, 1, "bfloat16", "bfloat16", "bfloat16", "bf16", "col", "row", False, H200)
    tiles, splits, t = _model(M, N, K, cfg)
    assert H200.sm_count / 2 < tiles < H200.sm_count and splits == cfg.split_k == 1
    split = dataclasses.replace(cfg, block_k=64)  # step 5 splits whole BLOCK_Ks of the unwidened tile
    best = min(_model(M, N, K, dataclasses.replace(split, split_k=s))[2] for s in range(2, K // 64 // 2 + 1))
    assert 0 < 1 - best / t < cf.ONE_WAVE_SPLIT_MIN_GAIN
    monkeypatch.setattr(cf, "ONE_WAVE_SPLIT_MIN_GAIN", 0.0)
    again = cf.configure_matmul(M, N, K, 1, "bfloat16", "bfloat16", "bfloat16", "bf16", "col", "row", False, H200)
    assert again.split_k > 1 and (again.block_m, again.block_n) == (cfg.block_m, cfg.block_n)
