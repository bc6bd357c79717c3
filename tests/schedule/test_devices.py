"""Device descriptions: the table, matching a live device's properties, and the
errors for what cannot be described."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from nova.schedule.devices import DEVICES, PATHS, DeviceSpec, KiB, MiB, from_properties, from_torch_device, lookup


def props(name="NVIDIA H200", major=9, minor=0, sms=132, **extra):
    """A stand-in for torch.cuda.get_device_properties(...)."""
    base = dict(
        name=name,
        major=major,
        minor=minor,
        multi_processor_count=sms,
        shared_memory_per_multiprocessor=228 * KiB,
        shared_memory_per_block_optin=227 * KiB,
        shared_memory_per_block=48 * KiB,
        L2_cache_size=60 * MiB,
        regs_per_multiprocessor=65536,
        max_threads_per_multi_processor=2048,
        warp_size=32,
    )
    base.update(extra)
    return SimpleNamespace(**base)


@pytest.mark.parametrize("key", sorted(DEVICES))
def test_table_entries_are_consistent(key):
    d = DEVICES[key]
    assert d.sm_count > 0 and d.num_sms == d.sm_count
    # [CG]: the per-block opt-in maximum is the per-SM amount less the 1 KiB reservation
    assert d.smem_per_sm - d.smem_per_block == 1 * KiB
    assert d.regs_per_sm == 64 * 1024 and d.warp_size == 32
    assert d.l2_bytes >= 1 * MiB and d.mem_bandwidth > 1e11
    for p in PATHS:
        assert d.flops(p) > 0 and d.ridge(p) == d.flops(p) / d.mem_bandwidth
    # tensor cores beat FMA, tf32 is half the 16-bit rate or less, fp64 FMA is the slowest
    assert d.bf16_flops > d.fp32_flops > d.fp64_flops and d.tf32_flops <= d.bf16_flops / 2 + 1
    hopper = d.compute_capability == (9, 0)
    assert d.has_wgmma == hopper and d.has_tma == hopper and d.tensor_core_generation == (4 if hopper else 3)
    hash(d)  # frozen and hashable: usable as a cache key


def test_h200_numbers():
    d = DEVICES["H200"]
    assert (d.sm_count, d.smem_per_sm, d.smem_per_block) == (132, 228 * KiB, 227 * KiB)
    assert d.l2_bytes == 60 * MiB and d.compute_capability == (9, 0)
    assert d.mem_bandwidth == pytest.approx(4.24e12)  # measured copy, not the 4.8 TB/s datasheet
    assert d.bf16_flops == pytest.approx(790e12) and d.tf32_flops == pytest.approx(372e12)
    assert d.fp32_flops == pytest.approx(67e12)
    r = DEVICES["RTX3060"]
    assert (r.sm_count, r.smem_per_sm, r.smem_per_block, r.l2_bytes) == (28, 100 * KiB, 99 * KiB, 3 * MiB)
    assert r.mem_bandwidth == pytest.approx(360e9) and r.max_threads_per_sm == 1536


def test_flops_rejects_unknown_path():
    with pytest.raises(ValueError, match="unknown arithmetic path"):
        DEVICES["H200"].flops("fp8")


def test_lookup_by_key_and_driver_name():
    assert lookup("H200") is DEVICES["H200"]
    assert lookup("NVIDIA H200") is DEVICES["H200"]
    assert lookup("NVIDIA A100-SXM4-80GB") is DEVICES["A100"]
    assert lookup("NVIDIA H100 PCIe") is None  # other SM count and bandwidth than the SXM entry


def test_from_properties_known_gpu_takes_structure_from_the_driver():
    d = from_properties(props(L2_cache_size=62914560, shared_memory_per_block_optin=200 * KiB))
    assert d.name == "NVIDIA H200" and d.l2_bytes == 62914560 and d.smem_per_block == 200 * KiB
    assert d.bf16_flops == DEVICES["H200"].bf16_flops and d.mem_bandwidth == DEVICES["H200"].mem_bandwidth
    assert d.has_wgmma and d.has_tma
    assert d == replace(DEVICES["H200"], smem_per_block=200 * KiB, l2_bytes=62914560)


def test_from_properties_fewer_sms_scales_compute_not_bandwidth():
    d = from_properties(props(sms=66))  # e.g. a MIG slice
    assert d.sm_count == 66
    assert d.bf16_flops == pytest.approx(DEVICES["H200"].bf16_flops / 2)
    assert d.mem_bandwidth == DEVICES["H200"].mem_bandwidth


def test_from_properties_missing_optional_fields_fall_back_to_the_table():
    p = props()
    del p.shared_memory_per_block_optin, p.regs_per_multiprocessor
    d = from_properties(p)
    assert d.smem_per_block == 227 * KiB and d.regs_per_sm == 65536


def test_unknown_gpu_needs_explicit_rates():
    p = props(name="NVIDIA Imaginary X1", major=10, minor=0, sms=148)
    with pytest.raises(ValueError, match=r"unknown GPU 'NVIDIA Imaginary X1'.*flops=.*mem_bandwidth="):
        from_properties(p)
    with pytest.raises(ValueError, match="unknown GPU"):
        from_properties(p, flops={k: 1e15 for k in PATHS})  # no bandwidth
    with pytest.raises(ValueError, match=r"lacks the paths \['fp64'\]"):
        from_properties(p, flops={"bf16": 2e15, "tf32": 1e15, "fp32": 8e13}, mem_bandwidth=8e12)
    d = from_properties(p, flops={"bf16": 2e15, "tf32": 1e15, "fp32": 8e13, "fp64": 4e13}, mem_bandwidth=8e12)
    assert isinstance(d, DeviceSpec) and d.sm_count == 148 and d.compute_capability == (10, 0)
    assert d.has_tma and not d.has_wgmma  # wgmma is sm_90a only
    assert d.ridge("bf16") == pytest.approx(2e15 / 8e12)


def test_explicit_rates_override_the_table():
    d = from_properties(props(), mem_bandwidth=4.8e12)
    assert d.mem_bandwidth == 4.8e12 and d.bf16_flops == DEVICES["H200"].bf16_flops


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_from_torch_device_without_cuda_raises_clearly():
    with pytest.raises(RuntimeError, match="CUDA is not available.*DEVICES"):
        from_torch_device()
    with pytest.raises(RuntimeError, match="not a CUDA device"):
        from_torch_device("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_from_torch_device_on_the_live_gpu():
    try:
        d = from_torch_device()
    except ValueError as e:  # a GPU the table does not know: the error says what to pass
        assert "flops=" in str(e)
        return
    p = torch.cuda.get_device_properties(torch.cuda.current_device())
    assert d.sm_count == p.multi_processor_count and d.l2_bytes == p.L2_cache_size
