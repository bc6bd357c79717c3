"""Device descriptions for the Analytic Configurator.

A ``DeviceSpec`` holds the handful of hardware numbers the configurator's model is
written in: SM count, shared memory, registers, threads, L2 size, DRAM bandwidth and
the peak rate of each arithmetic path. ``DEVICES`` is a table of known GPUs;
``from_torch_device`` describes the live GPU (structure from the driver, rates from
the table). Nothing here needs CUDA to import.

Rates are *effective* where the project has measured them (the H200, the H100) and datasheet
values elsewhere; the comment beside each number says which. The configurator only
uses rates through ratios (the ridge point flops / bandwidth, a tile's share of the
machine), so a uniformly derated datasheet changes little, but a measured number is
always preferred to a datasheet one.

Sources, cited by letter beside the numbers:
  [CG]   CUDA C++ Programming Guide, "Technical Specifications per Compute
         Capability" (smem per SM / per block, registers, threads, blocks per SM).
  [H200] NVIDIA H200 Tensor Core GPU datasheet (SXM column; dense = without sparsity).
  [H100] NVIDIA H100 Tensor Core GPU datasheet (SXM5 column) and the Hopper
         architecture whitepaper (132 SMs on SXM5, 50 MB L2).
  [A100] NVIDIA A100 Tensor Core GPU datasheet (80GB SXM column) and the Ampere
         GA100 whitepaper (108 SMs, 40 MB L2).
  [GA10x] NVIDIA Ampere GA102 whitepaper: per-SM tensor rates of GeForce Ampere
         (dense FP16/BF16 with FP32 accumulate = 512 FLOP/clk/SM, TF32 = 256,
         FP32 FMA = 256, FP64 = 1/64 of FP32); RTX 3060 spec page: 28 SMs,
         1.777 GHz boost, 192-bit GDDR6 at 15 Gbps = 360 GB/s, 3 MB L2.
  [M]    Measured on the project's H200 (copy bandwidth; cuBLAS bf16 and tf32
         GEMM throughput at large square shapes).
  [M-H100] The same three measured on an H100 SXM5 lent in the H200's place
         (``python scripts/device_rates.py``, 2026-12-06:
         bench/results/runs/device_rates_h100_b04da52.json; 2 GiB copy, torch.mm at
         n = 4096, 8192, 16384, the best n).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

KiB = 1024
MiB = 1024 * KiB

PATHS = ("bf16", "tf32", "fp32", "fp64")  # arithmetic paths with a peak rate each


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    compute_capability: tuple[int, int]
    sm_count: int
    smem_per_sm: int  # bytes of shared memory an SM can give to resident blocks
    smem_per_block: int  # bytes one block may use (the opt-in maximum)
    regs_per_sm: int  # 32-bit registers per SM
    max_threads_per_sm: int
    max_blocks_per_sm: int
    l2_bytes: int
    mem_bandwidth: float  # bytes/s, effective (see the table for measured vs datasheet)
    bf16_flops: float  # FLOP/s on 16-bit tensor cores with fp32 accumulate (dense)
    tf32_flops: float  # FLOP/s on tf32 tensor cores (dense)
    fp32_flops: float  # FLOP/s of fp32 FMA on the CUDA cores
    fp64_flops: float  # FLOP/s of fp64 FMA on the CUDA cores (not the fp64 tensor cores)
    tensor_core_generation: int  # 3 = Ampere (mma.sync), 4 = Hopper (wgmma)
    warp_size: int = 32
    max_regs_per_thread: int = 255  # [CG]: every compute capability from 3.5 on
    has_tma: bool = False  # Tensor Memory Accelerator: cc >= 9.0
    has_wgmma: bool = False  # warpgroup MMA: sm_90a only

    @property
    def num_sms(self) -> int:  # the name the Triton launcher code uses
        return self.sm_count

    def flops(self, path: str) -> float:
        """Peak FLOP/s of one arithmetic path: "bf16" | "tf32" | "fp32" | "fp64"."""
        if path not in PATHS:
            raise ValueError(f"unknown arithmetic path {path!r}; expected one of {PATHS}")
        return getattr(self, f"{path}_flops")

    def ridge(self, path: str) -> float:
        """Roofline ridge point in FLOP/byte: below it an op is bound by DRAM bandwidth."""
        return self.flops(path) / self.mem_bandwidth


TFLOP = 1e12

DEVICES: dict[str, DeviceSpec] = {
    "H200": DeviceSpec(
        name="NVIDIA H200",
        compute_capability=(9, 0),
        sm_count=132,  # [H200]: same GH100 configuration as the H100 SXM5
        smem_per_sm=228 * KiB,  # [CG] cc 9.0
        smem_per_block=227 * KiB,  # [CG] cc 9.0 opt-in maximum (1 KiB per block is reserved)
        regs_per_sm=64 * 1024,  # [CG]
        max_threads_per_sm=2048,  # [CG]
        max_blocks_per_sm=32,  # [CG]
        l2_bytes=60 * MiB,  # torch.cuda.get_device_properties(...).L2_cache_size on the project's H200 (~60 MB)
        mem_bandwidth=4.24e12,  # [M] device-to-device copy; [H200] datasheet says 4.8 TB/s
        bf16_flops=790 * TFLOP,  # [M] cuBLAS bf16 GEMM; [H200] datasheet 989 TFLOP/s dense
        tf32_flops=372 * TFLOP,  # [M] cuBLAS tf32 GEMM; [H200] datasheet 494 TFLOP/s dense
        fp32_flops=67 * TFLOP,  # [H200] datasheet (not measured)
        fp64_flops=34 * TFLOP,  # [H200] datasheet FP64 (non-tensor; not measured)
        tensor_core_generation=4,
        has_tma=True,
        has_wgmma=True,
    ),
    "H100": DeviceSpec(
        name="NVIDIA H100 80GB HBM3",  # the SXM5 part's driver name
        compute_capability=(9, 0),
        sm_count=132,  # [H100] SXM5
        smem_per_sm=228 * KiB,  # [CG] cc 9.0
        smem_per_block=227 * KiB,  # [CG]
        regs_per_sm=64 * 1024,  # [CG]
        max_threads_per_sm=2048,  # [CG]
        max_blocks_per_sm=32,  # [CG]
        l2_bytes=50 * MiB,  # [H100] 50 MB; PyTorch reports 52428800 bytes
        mem_bandwidth=3.01e12,  # [M-H100] device-to-device copy; [H100] datasheet 3.35 TB/s
        bf16_flops=777 * TFLOP,  # [M-H100] cuBLAS bf16 GEMM; [H100] datasheet 989 TFLOP/s dense
        tf32_flops=379 * TFLOP,  # [M-H100] cuBLAS tf32 GEMM; [H100] datasheet 494 TFLOP/s dense
        fp32_flops=67 * TFLOP,  # [H100] datasheet
        fp64_flops=34 * TFLOP,  # [H100] datasheet FP64 (non-tensor)
        tensor_core_generation=4,
        has_tma=True,
        has_wgmma=True,
    ),
    "A100": DeviceSpec(
        name="NVIDIA A100-SXM4-80GB",
        compute_capability=(8, 0),
        sm_count=108,  # [A100]
        smem_per_sm=164 * KiB,  # [CG] cc 8.0
        smem_per_block=163 * KiB,  # [CG] cc 8.0 opt-in maximum
        regs_per_sm=64 * 1024,  # [CG]
        max_threads_per_sm=2048,  # [CG]
        max_blocks_per_sm=32,  # [CG]
        l2_bytes=40 * MiB,  # [A100] 40 MB
        mem_bandwidth=2.039e12,  # [A100] datasheet, 80GB SXM (not measured)
        bf16_flops=312 * TFLOP,  # [A100] datasheet dense
        tf32_flops=156 * TFLOP,  # [A100] datasheet dense
        fp32_flops=19.5 * TFLOP,  # [A100] datasheet
        fp64_flops=9.7 * TFLOP,  # [A100] datasheet FP64 (non-tensor)
        tensor_core_generation=3,
    ),
    "RTX3060": DeviceSpec(
        name="NVIDIA GeForce RTX 3060",
        compute_capability=(8, 6),
        sm_count=28,  # [GA10x]
        smem_per_sm=100 * KiB,  # [CG] cc 8.6
        smem_per_block=99 * KiB,  # [CG] cc 8.6 opt-in maximum
        regs_per_sm=64 * 1024,  # [CG]
        max_threads_per_sm=1536,  # [CG] cc 8.6
        max_blocks_per_sm=16,  # [CG] cc 8.6
        l2_bytes=3 * MiB,  # [GA10x]
        mem_bandwidth=360e9,  # [GA10x] 192 bit x 15 Gbps (not measured)
        bf16_flops=28 * 512 * 1.777e9,  # [GA10x] 25.5 TFLOP/s dense, fp32 accumulate
        tf32_flops=28 * 256 * 1.777e9,  # [GA10x] 12.7 TFLOP/s dense
        fp32_flops=28 * 256 * 1.777e9,  # [GA10x] 12.7 TFLOP/s (128 FMA lanes x 2 FLOP)
        fp64_flops=28 * 4 * 1.777e9,  # [GA10x] 1/64 of fp32: 0.2 TFLOP/s
        tensor_core_generation=3,
    ),
}

# driver name (torch.cuda.get_device_properties(d).name) -> table key. Exact names
# only: an H100 PCIe or an A100 40GB has other SM counts or bandwidths, and a
# wrong rate is worse than an error that asks for one.
_DRIVER_NAMES = {
    "NVIDIA H200": "H200",
    "NVIDIA H100 80GB HBM3": "H100",
    "NVIDIA A100-SXM4-80GB": "A100",
    "NVIDIA GeForce RTX 3060": "RTX3060",
}


# [CG] (max resident threads, max resident blocks) per SM, used for GPUs the table
# lacks when torch does not report them; unknown capabilities get the smaller pair
_CC_LIMITS = {(7, 0): (2048, 32), (7, 5): (1024, 16), (8, 0): (2048, 32), (8, 6): (1536, 16),
              (8, 7): (1536, 16), (8, 9): (1536, 24), (9, 0): (2048, 32)}
_CC_DEFAULT = (1536, 16)


def lookup(name: str) -> DeviceSpec | None:
    """The table entry for a table key ("H200") or a driver name ("NVIDIA H200")."""
    if name in DEVICES:
        return DEVICES[name]
    key = _DRIVER_NAMES.get(name.strip())
    return DEVICES[key] if key else None


def from_properties(
    props,
    *,
    flops: dict[str, float] | None = None,
    mem_bandwidth: float | None = None,
) -> DeviceSpec:
    """A DeviceSpec from a ``torch.cuda.get_device_properties`` result (or anything
    with the same attributes). Structure (SMs, shared memory, L2, registers, threads)
    comes from ``props``; rates come from the table entry matched by name, or from
    ``flops`` ({"bf16", "tf32", "fp32", "fp64"} -> FLOP/s) and ``mem_bandwidth``
    (bytes/s), which also override the table when given."""
    name = str(props.name)
    cc = (int(props.major), int(props.minor))
    known = lookup(name)
    if known is None and (flops is None or mem_bandwidth is None):
        raise ValueError(
            f"unknown GPU {name!r} (compute capability {cc[0]}.{cc[1]}): the Analytic Configurator "
            f"needs its peak rates and memory bandwidth. Known GPUs: {sorted(_DRIVER_NAMES)}. "
            f"Pass flops={{'bf16': ..., 'tf32': ..., 'fp32': ..., 'fp64': ...}} (FLOP/s) and "
            f"mem_bandwidth=... (bytes/s), or add the GPU to nova.schedule.devices.DEVICES."
        )
    if flops is not None:
        missing = [p for p in PATHS if p not in flops]
        if missing:
            raise ValueError(f"flops for {name!r} lacks the paths {missing}; give all of {list(PATHS)}")

    sms = int(props.multi_processor_count)
    rates = {p: (flops[p] if flops is not None else known.flops(p)) for p in PATHS}
    if known is not None and flops is None and sms != known.sm_count:
        # fewer SMs than the table (a MIG slice, a cut-down SKU): compute rates are
        # per SM, so they scale; the bandwidth share of a slice is unknown and kept
        rates = {p: r * sms / known.sm_count for p, r in rates.items()}
    bandwidth = mem_bandwidth if mem_bandwidth is not None else known.mem_bandwidth

    def prop(attr, fallback):
        value = getattr(props, attr, None)
        return int(value) if value else fallback

    smem_sm = prop("shared_memory_per_multiprocessor", known.smem_per_sm if known else 0)
    # the opt-in per-block maximum, where torch exposes it; otherwise the table's
    # value, else the default 48 KiB a block gets without opting in
    smem_block = prop(
        "shared_memory_per_block_optin",
        known.smem_per_block if known else prop("shared_memory_per_block", 48 * KiB),
    )
    base = known or DeviceSpec(
        name=name,
        compute_capability=cc,
        sm_count=sms,
        smem_per_sm=smem_sm,
        smem_per_block=smem_block,
        regs_per_sm=64 * 1024,  # [CG]: 64K 32-bit registers per SM for every cc >= 5.0
        max_threads_per_sm=_CC_LIMITS.get(cc, _CC_DEFAULT)[0],
        max_blocks_per_sm=_CC_LIMITS.get(cc, _CC_DEFAULT)[1],
        l2_bytes=0,
        mem_bandwidth=bandwidth,
        bf16_flops=rates["bf16"],
        tf32_flops=rates["tf32"],
        fp32_flops=rates["fp32"],
        fp64_flops=rates["fp64"],
        tensor_core_generation=4 if cc[0] >= 9 else 3 if cc[0] == 8 else 2,
    )
    return replace(
        base,
        name=name,
        compute_capability=cc,
        sm_count=sms,
        smem_per_sm=smem_sm,
        smem_per_block=smem_block,
        regs_per_sm=prop("regs_per_multiprocessor", base.regs_per_sm),
        max_threads_per_sm=prop("max_threads_per_multi_processor", base.max_threads_per_sm),
        l2_bytes=prop("L2_cache_size", base.l2_bytes),
        warp_size=prop("warp_size", base.warp_size),
        mem_bandwidth=bandwidth,
        bf16_flops=rates["bf16"],
        tf32_flops=rates["tf32"],
        fp32_flops=rates["fp32"],
        fp64_flops=rates["fp64"],
        has_tma=cc[0] >= 9,  # TMA: cc 9.0 and later
        has_wgmma=cc == (9, 0),  # wgmma exists on sm_90a only (Blackwell uses tcgen05)
    )


def from_torch_device(
    device=None,
    *,
    flops: dict[str, float] | None = None,
    mem_bandwidth: float | None = None,
) -> DeviceSpec:
    """The DeviceSpec of a live CUDA device (``None``: the current one). Raises a
    RuntimeError without CUDA and a ValueError for a GPU the table does not know
    unless ``flops`` and ``mem_bandwidth`` are given (see ``from_properties``)."""
    import torch

    if device is not None and not isinstance(device, int):
        device = torch.device(device)
        if device.type != "cuda":
            raise RuntimeError(f"from_torch_device: {device} is not a CUDA device; use DEVICES[name] to describe a GPU")
    if not torch.cuda.is_available():
        raise RuntimeError(
            "from_torch_device: CUDA is not available on this machine; describe the target GPU "
            f"with nova.schedule.devices.DEVICES[name] (one of {sorted(DEVICES)}) instead"
        )
    return from_properties(torch.cuda.get_device_properties(device), flops=flops, mem_bandwidth=mem_bandwidth)


__all__ = ["DeviceSpec", "DEVICES", "PATHS", "lookup", "from_properties", "from_torch_device", "KiB", "MiB"]
