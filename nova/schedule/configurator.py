"""The Analytic Configurator: from an op's shapes, dtypes and layouts and a
``DeviceSpec`` to a ``LoweringConfig``, by arithmetic alone.

No search over timed candidates, no timing, no randomness: every choice follows
from a formula over the shape and the device's numbers, and every threshold below
names the hardware fact (or the measurement) it comes from. ``docs/configurator.md``
states the whole model with its equations; keep the two in step.

Entry points: ``configure_matmul`` (and ``plan_matmul``, which also returns the
intermediate quantities), ``configure_reduction``, ``configure_elementwise``,
``configure_attention``; ``CONFIGURATORS`` maps a kernel kind to its function.
"""

from __future__ import annotations

import math
import dataclasses
from dataclasses import dataclass

from nova.schedule.config import LoweringConfig
from nova.schedule.devices import DEVICES, KiB, DeviceSpec, lookup

# --------------------------------------------------------------------------- hardware facts
# Each constant is a fact of the hardware or of the compiler, not a tuning knob.

LINE_BYTES = 128  # L2 cache line; also the widest shared-memory swizzle of wgmma / TMA
VECTOR_BYTES = 16  # widest per-thread global load (ld.global.v4.b32 / 128-bit)
WARPGROUP = 4  # warps in a wgmma warpgroup = the 4 SM sub-partitions, one warp each
WGMMA_M = 64  # rows of one wgmma instruction: BLOCK_M must be a multiple on that path
MIN_DOT = 16  # tl.dot: every block dim a power of two >= 16
MAX_BOX = 256  # TMA box and wgmma N: at most 256 elements along a dim
MAX_STAGES = 5  # the deepest ring nova bench's matmul search times; deeper only adds bytes in flight
MAX_WARPS = 8  # 8 warps x 32 threads x ~230 registers (the 128-register accumulators
# measured below) is ~59K of the 64K-register file: one such block per SM
# Register model of the Triton 3.6 matmul template, per instruction family, from
# `cuobjdump --dump-resource-usage` of offline builds (ptxas for sm_90a / sm_80 / sm_86;
# "acc" = fp32 accumulator registers per thread = BM BN / (32 warps)):
#   wgmma: acc 16 -> 48-56 regs, 32 -> 64-72, 64 -> 117-128, 128 -> 193-232
#   mma:   acc 2-8 -> 37-54, 16 -> 54-72, 32 -> 80-128, 64 -> 128-188,
#          128 -> 237-255 (at the 255 cap in 2 of 4 builds, with a 16-byte stack frame)
#   fma:   acc 32 -> 96-128, 64 -> 168-188
# so the accumulator budget per thread is 128 registers on wgmma and 64 on mma / fma
# (the largest below the 255 cap with room to spare), and regs ~= a * acc + b fits
# every build of its family within -25% / +27%: (budget, a, b)
REG_MODEL = {"wgmma": (128, 1.5, 32), "mma": (64, 1.75, 40), "fma": (64, 1.75, 40)}
REG_ALLOC_UNIT = 256  # registers are allocated per warp in units of 256 ([CG], cc >= 5)
# shared memory bookkeeping: Triton 3.6's sm_90 cubins declare 1 KiB of static shared
# memory (cuobjdump: SHARED:1024) on top of the dynamic ring; the driver also reserves
# 1 KiB per resident block ([CG] cc >= 8.0: smem_per_sm - smem_per_block = 1 KiB).
# The TMA variant adds its mbarriers next to the ring (measured: 32-56 bytes above
# the ring at 4-5 stages), so every ring budget keeps BARRIER_SMEM free: room for 16
# eight-byte mbarriers, two per stage at MAX_STAGES plus the epilogue's
# Calibrated on the H200 run of nova bench matmul (bench/results/matmul.json, see
# docs/configurator.md "Calibration"): a K-step of at most STAGE_BYTES_MAX of operands
# (BLOCK_K up to two 128-byte lines per row), and a ring whose bytes in flight
# reach IN_FLIGHT_SECONDS of the SM's share of DRAM bandwidth (Little's law)
STAGE_BYTES_MAX = 48 * KiB
IN_FLIGHT_SECONDS = 2.5e-6
# Triton 3.6 feeds tf32 wgmma only K-major shared-memory operands (PTX: wgmma .tf32
# has no transpose); a row-major B ([K, N], N contiguous) tile is therefore pulled
# through registers and re-stored transposed, so B tiles wider than one 64-column
# warpgroup slice cost more than their reuse saves (measured: every searched-best tf32
# config has BLOCK_N <= 64)
TF32_NMAJOR_MAX_BN = 64
# The staged tf32 path (precision "tf32-rn" on wgmma + TMA): a copy kernel rounds an
# operand to nearest tf32 and writes it K-major, so the main kernel reads both tiles
# straight from TMA into wgmma. Measured on the H200 (bench/tf32_paths.py, 9 shapes):
# the register path for an N-major B ran at 0.40-0.55 of the staged path on
# compute-bound shapes, i.e. it costs ~1.2 x the tensor-core time T_mma extra; rounding
# a K-major A in registers (instead of staging it) cost 0.19-0.24 x T_mma. Staging an
# operand of X bytes costs one read and one write of it plus one launch. Each operand
# is staged where that costs less than the penalty it removes.
TF32_REGISTER_B_PENALTY = 1.2
TF32_REGISTER_A_PENALTY = 0.2
# An N-major B left unstaged beside an M-major A (a weight gradient: A = X^T, B = dY, both
# stored with K outermost) puts both tiles through registers each K-step. Measured on an
# H100 (bench/results/runs/matmul_mlp46m_tf32_b8_longk_search225_h100_b5d6c09.json, the 46M
# MLP's weight gradients, K = 8192): 384x1536 unstaged 0.143 ms at best against 0.076 with B
# staged (128x256x32 sk7, its 35 us copy included), 1536x384 0.141 against 0.060: the
# register path cost ~3.5 x T_mma more than the staged kernel, not 1.2
TF32_REGISTER_BOTH_PENALTY = 3.5
# A K-major B (col) left unstaged is still rounded in the kernel: wgmma reads B only
# from shared memory, so the rounded tile goes shared -> registers -> shared each
# K-step. Measured (bench/results/matmul_gpt2.json, tf32 32768x2304x768 row/col):
# 128x256x32 unstaged 0.656 ms against 0.444 ms staged, ~0.7 x T_mma extra; taken as
# half T_mma (A, which wgmma may read from registers, costs TF32_REGISTER_A_PENALTY
# whatever its layout: dw 50304x768x2048 col/row ran at 0.470 ms with A rounded in
# registers against 0.624 ms with A staged too)
TF32_ROUND_B_PENALTY = 0.5
# Rule 4c (docs/configurator.md): an A tile that reaches the MMA through registers (tf32, A
# not staged: M-major, or K-major and not rounded) costs its loads, rounding and register
# moves per K-step for BM x BK elements, against BM x BN x BK products: the penalty above,
# measured at BLOCK_N = TF32_REGISTER_A_BN, scales as TF32_REGISTER_A_BN / BN. Steps 4, 5
# and 5c weigh each tile's tau so: at 128x128 the A path costs twice its share at 128x256.
# Measured on an H100 (bench/results/runs/matmul_gpt2_all_search24_h100_c527b90.json,
# tf32 2304x768x8192 col/row, GPT-2's qkv weight gradient at batch 8): 128x128x32 unsplit,
# which step 4's halving chose, 0.196 ms; 128x256x32 split 7 (stream-K) 0.156; cuBLAS
# 0.156. Off: every tile's tau is its products' alone. In the step (GPT-2 124M tf32 batch 8,
# Nova alone, H100, 83712ff, bench/results/runs/ab_rule4c_*_h100_83712ff.json): 175,475 tok/s
# with it against 173,695 without (+1.0%)
TF32_REGISTER_A_BN = 256
TF32_REGISTER_A_BY_TILE = True
# Rule 9a: on Hopper every tf32 kernel reads both operands from shared memory. Off: the
# template settles register-A kernels instead (matmul.SETTLE_REGISTER_A), race-free in the
# GPU SASS test and faster (H100 at b02af12, against torch.compile in the same call: the
# 46M MLP 944,735 tok/s off, 840,058 on; GPT-2 tf32 b16 183,778 off, 181,956 on)
TF32_SHARED_OPERANDS = False
# Short K, one block per SM: the tile's prologue (filling stages - 1 ring slots) and
# epilogue (storing the C tile) leave the tensor cores idle, and no second block on the
# SM covers them. Both move at the SM's share of DRAM bandwidth, so
#     t_edge = (BM BN out_bytes + (stages - 1) stage_bytes) / (bw / S)
# against the K loop t_loop = 2 BM BN K / (peak / S). Where t_edge >= EDGE_RATIO x
# t_loop the tile is halved so that two blocks share the SM (one's edges under the
# other's loop). Calibrated on matmul_gpt2.json: bf16 K = 768 (ratio 0.79 at 128x256x64
# s4) ran 20-33% faster as 128x128x64 s3 (two blocks per SM); bf16 K = 2048 (0.30) and
# tf32 K = 768 (0.49, staged 128x256x32 s4) are fastest at one block per SM
EDGE_RATIO = 0.6
# one more kernel in a CUDA graph (a staging copy, the split-K reduction): measured, the
# 128^3 matmul replayed in a graph takes 1.9-2.3 us per launch (matmul.json)
LAUNCH_SECONDS = 2e-6
STATIC_SMEM = 1 * KiB
SYSTEM_SMEM_PER_BLOCK = 1 * KiB
BARRIER_SMEM = 128

PRECISIONS = ("ieee", "tf32", "tf32-rn", "tf32x3", "bf16")
# How a step's precision policy (nova.compile's "fp32" | "tf32" | "bf16") runs a matmul
# of fp32 operands: tf32 rounds to nearest, as cuBLAS does ("tf32-rn"); under bf16 the
# precision stage has already cast the operands, so fp32 ones stay exact
STEP_MATMUL_PRECISION = {"fp32": "ieee", "tf32": "tf32-rn", "bf16": "ieee"}
_ELT = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
_ALIASES = {
    "f64": "float64", "fp64": "float64", "double": "float64",
    "f32": "float32", "fp32": "float32", "float": "float32",
    "bf16": "bfloat16", "f16": "float16", "fp16": "float16", "half": "float16",
}  # fmt: skip


# --------------------------------------------------------------------------- small helpers


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2_ceil(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _pow2_floor(x: int) -> int:
    return 1 << (max(1, int(x)).bit_length() - 1)


def dtype_name(dtype) -> str:
    """Canonical name of a torch dtype or a string spelling of one."""
    name = str(dtype).removeprefix("torch.")
    name = _ALIASES.get(name, name)
    if name not in _ELT:
        raise ValueError(f"configurator: unsupported dtype {dtype!r}; supported: {sorted(_ELT)}")
    return name


def _device(device) -> DeviceSpec:
    if isinstance(device, DeviceSpec):
        return device
    if isinstance(device, str):
        spec = lookup(device)
        if spec is not None:
            return spec
        raise ValueError(f"configurator: unknown device {device!r}; known: {sorted(DEVICES)}")
    raise TypeError(f"configurator: device must be a DeviceSpec or a DEVICES key, got {type(device).__name__}")


def _positive(**dims: int) -> None:
    for k, v in dims.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"configurator: {k} must be a positive int, got {v!r}")


def arithmetic_path(dtype_a, dtype_b, precision: str) -> str:
    """Which peak the contraction runs at: "bf16" | "tf32" | "fp32" | "fp64".
    16-bit operands use the 16-bit tensor cores whatever ``precision`` says;
    fp32 operands follow ``precision``; any fp64 operand means fp64 FMA."""
    if precision not in PRECISIONS:
        raise ValueError(f"configurator: precision must be one of {PRECISIONS}, got {precision!r}")
    names = {dtype_name(dtype_a), dtype_name(dtype_b)}
    if "float64" in names:
        return "fp64"
    if names <= {"bfloat16", "float16"}:
        return "bf16"
    # tf32-rn / tf32x3 (the template's rounded and 3-pass tf32) run on the tf32 tensor cores
    return {"ieee": "fp32", "tf32": "tf32", "tf32-rn": "tf32", "tf32x3": "tf32", "bf16": "bf16"}[precision]


def _tensor_cores(dev: DeviceSpec, path: str) -> bool:
    # tf32 and bf16 mma exist from sm_80 (Ampere) on
    return path in ("bf16", "tf32") and dev.compute_capability >= (8, 0)


def _regs_per_thread(family: str, acc_regs: float) -> int:
    _, a, b = REG_MODEL[family]
    return min(255, math.ceil(a * acc_regs + b))


def _occupancy_without_smem(dev: DeviceSpec, warps: int, regs: int) -> int:
    """Blocks per SM the registers, the thread limit and the block limit allow."""
    per_warp = _cdiv(regs * dev.warp_size, REG_ALLOC_UNIT) * REG_ALLOC_UNIT
    by_regs = dev.regs_per_sm // (per_warp * warps)
    by_threads = dev.max_threads_per_sm // (warps * dev.warp_size)
    return max(1, min(by_regs, by_threads, dev.max_blocks_per_sm))


def _smem_limit(dev: DeviceSpec, blocks: int) -> int:
    """Dynamic shared memory one block may use when ``blocks`` share an SM."""
    share = dev.smem_per_sm // blocks - SYSTEM_SMEM_PER_BLOCK
    return min(dev.smem_per_block, share) - STATIC_SMEM - BARRIER_SMEM


def _blocks_by_smem(dev: DeviceSpec, smem: int) -> int:
    return max(1, dev.smem_per_sm // (smem + BARRIER_SMEM + STATIC_SMEM + SYSTEM_SMEM_PER_BLOCK))


# --------------------------------------------------------------------------- matmul


@dataclass(frozen=True)
class MatmulPlan:
    """The configurator's decision with the quantities it was derived from."""

    config: LoweringConfig
    path: str  # arithmetic path: bf16 | tf32 | fp32 | fp64
    flops: int  # 2 M N K batch
    bytes: int  # compulsory DRAM traffic: A, B, C (and bias) once
    ai_flop_per_byte: float
    ai_flop_per_element: float
    ridge: float  # device peak / bandwidth for this path, FLOP/byte
    tiles: int  # output tiles (x batch)
    work_items: int  # tiles x split_k
    blocks_per_sm: int  # occupancy of the chosen config
    waves: float  # work_items / (sm_count * blocks_per_sm)
    wave_efficiency: float  # waves / ceil(waves)
    smem_bytes: int  # dynamic shared memory: max(operand ring, epilogue tile)
    regs_per_thread: int  # estimate (REG_MODEL)


# Tile ladder, smallest to largest (long side, short side). Each step halves the
# area; the long side goes along N on the wgmma path (both sides >= 64), else along
# the longer of M and N.
_LADDER = ((16, 16), (32, 16), (32, 32), (64, 32), (64, 64), (128, 64), (128, 128), (256, 128))
_FLOOR = _LADDER.index((64, 64))  # see plan_matmul, step 4


# tf32 with an N-major B: BLOCK_N capped (TF32_NMAJOR_MAX_BN), the long side on M
_LADDER_TF32_NMAJOR = ((16, 16), (32, 16), (32, 32), (64, 32), (64, 64), (128, 64), (256, 64))


def _oriented_on(rung: int, M: int, N: int, ladder=_LADDER, wgmma: bool = False) -> tuple[int, int]:
    long, short = ladder[rung]
    if ladder is _LADDER_TF32_NMAJOR:
        bm, bn = long, short
    elif wgmma and short >= WGMMA_M:
        # one wgmma is 64 x BN x 16 (BN <= 256) per warpgroup: the long side along N
        # means fewer, wider instructions per K-step, each reusing its A rows more
        # (measured: every searched-best wgmma tile in matmul.json has BN >= BM)
        bm, bn = short, long
    else:
        bm, bn = (short, long) if N >= M else (long, short)
    # a tile wider than the matrix only computes padding
    return min(bm, max(MIN_DOT, _pow2_ceil(M))), min(bn, max(MIN_DOT, _pow2_ceil(N)))


def _warps(bm: int, bn: int, acc_words: int, family: str, per_rows: bool = True) -> int:
    """Fewest warps (>= 4: one per SM sub-partition) that keep the accumulator within
    the family's per-thread register budget; on the wgmma path also one warpgroup
    per 64 rows, up to two (not on the tf32 N-major path: there one warpgroup holds
    a 256x64 accumulator in its 128-register budget, and the search's best agrees)."""
    budget = REG_MODEL[family][0]
    warps = max(WARPGROUP, _pow2_ceil(_cdiv(bm * bn * acc_words, 32 * budget)))
    if family == "wgmma" and per_rows:
        warps = max(warps, WARPGROUP * min(2, bm // WGMMA_M))
    return min(MAX_WARPS, warps)


@dataclass(frozen=True)
class _Tile:
    """A tile shape with what follows from it on one device."""

    bm: int
    bn: int
    family: str  # instruction family: wgmma | mma | fma
    warps: int
    regs: int  # estimated registers per thread
    blocks: int  # blocks per SM the registers / threads / block limit allow
    stage_bytes: int  # one K-step of A and B in shared memory


# A matmul whose kernel runs a fuse-stage epilogue (``epilogue=True``) stores through
# pointers from its registers (several outputs, their own dtypes), not through C's
# descriptor, and keeps the one-program-per-tile grid (6c may give it two blocks per
# SM). Measured (scripts/epilogue_variants.py, bench/results/runs/epilogue_variants_d5443cd.json,
# GPT-2 2 layers, batch 32): persistent epilogue kernels 35.51 ms of kernels a step
# against 33.28 one program per tile; the bias + GELU forward epilogue 2.83 ms against
# 1.07 (at 128x256 in the flattened loop); losses bit-identical either way
PERSISTENT_EPILOGUES = False
# Rule 8d's persistent loop for the staged tf32 path's epilogue kernels only (the tf32 steps'
# forwards with bias + GELU or a residual, input gradients with a residual: both operands
# K-major in shared memory, the f32 C tile's store overlapped with the next tile's loads).
# Off until measured in a step. Offline sm_90a (scripts/epilogue_sm90_check.py --precision
# tf32 --batch 16 with it on): GPT-2's three epilogue kernels with both operands staged at
# 128x256x32 s3 persistent, 171-175 registers, no spills (the fourth, B alone staged, keeps its
# grid); bit for bit the tile grid (interpreter tests). Measured in the steps on an H100 at
# e1ea8b7 (README: the MLP 932,095 tok/s on against 962,397 off) and again at a555b0c (Nova
# alone, off / on / off / on, bench/results/runs/ab_pse_*_h100_a555b0c.json): the 46M MLP tf32
# b8 955,513 / 925,558 / 954,702 / 927,318 tok/s (3% slower on), GPT-2 124M tf32 b16 191,323 /
# 190,093 (0.6% slower): stays off
PERSISTENT_STAGED_EPILOGUES = False
# With PERSISTENT_STAGED_EPILOGUES, rule 8e's 128x128 tile for every staged tf32 epilogue launch
# whatever its wave fill (the 128x256 tile with an epilogue in the flattened loop is what lost
# above). Off until measured in a step: the matmul part alone, on an H100 at aa5c7ff
# (bench/results/runs/tf32_tiles_mlp46m_h100_aa5c7ff.json, both operands prerounded, no epilogue),
# the MLP's 8192x1536x384 0.0460 ms one program a tile (the step's 128x128x32 s3) against 0.0427
# at 128x128x32 s5 persistent (cuBLAS 0.0361); GPT-2 tf32 b8's forwards with epilogues run the
# former at 0.71-0.73x cuBLAS (runs/matmul_gpt2_b8_h100_aa5c7ff.md)
TF32_RETILE_EPILOGUES = False

# 8b. Warp specialization (docs/configurator.md, "Matmul", 9b): the tile of the
# warp-specialized persistent kernel (matmul.py's docstring) for an unsplit 2-D matmul on
# 16-bit operands with at least 2 tiles a program, per kind: "plain" (C stored) and
# "epilogue" (a fuse-stage epilogue, over the whole tile: the partitioner takes no slices).
# (BM, BN, warps a computing group). 128x256 for C: 0.95-0.97x cuBLAS on the GPT-2 step's
# shapes, 128x128 0.87-0.89x (scripts/matmul_ws.py, bench/results/runs/matmul_ws_49aaf89.json).
# None: that kind keeps step 8's kernel. Epilogues at 128x256 too: in the 12-layer GPT-2 124M
# bf16 step at batch 32, timed as nova bench gpt2 times it (CUDA graph; scripts/epilogue_variants.py
# --graph, bench/results/runs/epilogue_variants_graph_12l_a86b3ee.json, two runs each,
# interleaved) 66.33 / 66.45 ms against 66.62 / 66.74 with the epilogue kernels unpartitioned
# (their kernels alone 62.04 / 61.96 against 62.33 / 62.06 ms); per kernel at 2 layers the f32
# residual epilogue 0.246 against 0.264 ms, the 2304-column one 0.182 against 0.196, the GELU
# and bf16 ones 0.01-0.02 ms slower (epilogue_variants_ws_epi_a86b3ee.json). Offline the f32
# residual spills 1.9 KB at 128x256 (scripts/epilogue_sm90_check.py --ws), measured faster all the same
WS_TILES: dict[str, tuple[int, int, int] | None] = {"plain": (128, 256, 4), "epilogue": (128, 256, 4)}
# The least tiles (of the WS tile) a launch needs, in programs (SMs): 2, every program loops
# over at least two tiles, where the partitioned loop's overlap of one tile's store with the
# next's loads and MMAs is what it is for
WS_MIN_TILES_PER_SM = 2.0
# 8b for the staged tf32 path (both operands rounded and K-major in shared memory, C in fp32,
# no epilogue; WS_TF32): the warp-specialized kernel at WS_TF32_TILE (BM, BN, warps a computing
# group), its ring beside the fp32 tile's conversion (BM BN x 4 bytes), instead of step 8d's
# flattened loop. cuBLAS's tf32 kernel on these shapes has that structure (Nsight Compute on an
# H100 at 4e0b99b, `gpu_check.sh mm-stalls`: sm90_xmma_gemm_..._tf32f32_f32_..._tilesize128x128x32,
# 12 warps, 168 registers, one block an SM); so does Nova's offline sm_90a build of it (12 warps,
# 168 registers, no spills, 196,968 bytes of shared memory: scripts/offline_wgmma_census.py
# --launches bench/ws_tf32_launches.json). Timed off and on in one call on an H100 at 5aba26a
# (bash scripts/gpu_check.sh ws-tf32, bench/results/runs/*_wstf32_*_h100_5aba26a.json): the 46M
# MLP's 8192x1536x384 0.0445 -> 0.0450 ms (cuBLAS 0.0359), its logits 4096x50304x384 0.648 -> 0.650
# (0.512), the step 956,194 -> 946,966 tok/s (torch.compile 940,658 / 942,271): no gain. Off
WS_TF32 = False
WS_TF32_TILE = (128, 128, 4)
# 8b's half tile: a plain launch whose WS tile gives fewer than WS_MIN_TILES_PER_SM S tiles
# takes the tile halved along N (128x128) where that gives enough, rather than step 8's
# one-program-a-tile grid. GPT-2 124M bf16 at batch 8, its 768-wide outputs (M = 8192: 192
# tiles of 128x256, 1.45 waves rounded up to 2; 384 of 128x128 are 2.9 a program), off and on in
# one call on an H100 at 5aba26a (FEW_VARIANTS="default wsfull" bash scripts/gpu_check.sh few-tiles,
# bench/results/runs/matmul_gpt2_b8_bf16_halftile_{off,on}_h100_5aba26a.json), TFLOP/s: 8192x768x768
# 414 -> 455 (both layouts), 8192x768x2304 549 -> 593, 8192x768x3072 476 -> 605 (row/col) and
# 551 -> 612 (row/row); cuBLAS 547-562, 636, 680-694
WS_HALF_TILE = True
# The deepest ring the partitioned loop gets. The NaNs a partitioned bias + GELU epilogue wrote
# at 128x128 (bench/results/runs/ws_gpu_tests_epilogue_nan.log) were the ring's depth, not the
# epilogue: at 128x128x64 with 5 stages (what (smem - convert) / stage_bytes gave) column 0 of
# the first tile of every program came out NaN, with no epilogue too; 3 and 4 stages, with and
# without epilogues, at 128x128 and 128x256, were bit-identical to the unpartitioned kernel
# (scripts/matmul_ws.py --epilogues --tiles ..., bench/results/runs/matmul_ws_epilogues_probe_16a344e.json)
WS_MAX_STAGES = 4
# 8c. A split-K matmul (step 5's split) on the warp-specialized kernel: the split's own tile
# (at least 128 rows: two computing groups of 64-row wgmmas), every (split, tile) a work item
# of the persistent partitioned loop, the fp32 partials stored through pointers. The store's
# layout conversion takes the tile in fp32 (BM BN x 4 bytes) beside the ring: at 128x256 that
# leaves 2 stages. Bit for bit the unpartitioned split kernel (interpreter and H200 tests), but
# slower: the 2-layer GPT-2 bf16 step at batch 32, its 16 plain matmuls (8 split weight
# gradients) 2.982 ms against 2.880 (scripts/step_launches.py --set schedule.configurator.WS_SPLIT=True,
# bench/results/runs/step_launches_2l_bf16_b32_wss_9168703.json). Off.
WS_SPLIT = False
# 5c. Step 5 models a split that the launcher runs as stream-K (``matmul.STREAM_K_SPLIT``:
# a 2-D split without an epilogue, both operands through descriptors, more than one wave) by
# stream-K's own time, and takes it where that gains more than STREAM_K_MIN_GAIN over the
# tile grid or the one-wave split (docs/configurator.md, 5c). Measured on an H100 at 4911172
# (bench/results/runs/matmul_gpt2_all_search24_h100_4911172.json): the tf32 step's transposed
# qkv weight gradient 2304x768x32768 at 128x128 unsplit (step 4's halving) 0.764 ms, 128x256 as
# stream-K 0.525, cuBLAS 0.555. With the rule, on an H100 at 6a80632 (runs/*streamk*_h100_6a80632*,
# off and on in one call): that launch 0.757 -> 0.534 ms, at K = 16384 0.380 -> 0.283 (cuBLAS
# 0.272-0.279); the GPT-2 tf32 b16 step 185,988 -> 188,509 tok/s (torch.compile 165,559 /
# 165,857); bf16's 768x2304x32768, which it also changes (128x128 unsplit -> 128x256 stream-K),
# 0.1676 -> 0.1715 ms (cuBLAS 0.179-0.187), the bf16 b32 step 510,034 -> 511,122 tok/s. Off:
# the split model of step 5 alone, as before
STREAM_K_TILES = True
# The least model gain 5c takes stream-K for. The model charges stream-K its partial tiles and
# launches but not each segment's pipeline fill, and has no term for a tile's rate: the H100's
# 768x768x32768 bf16 weight gradient kept its one-wave split 7 (0.066 ms against 0.075 as
# stream-K, 63a1179), where the model puts the two within 3% of each other; the tf32 qkv weight
# gradient at K = 16384, 34% faster as stream-K on the H100 (above), is a 7.4% model gain, bf16's
# 768x2304x32768 (2.3% slower) a 7.1% one
STREAM_K_MIN_GAIN = 0.05
# 4: a compute-bound tile that step 5 fills the machine with by splitting K is not halved
# (docs/configurator.md, 4)
SPLIT_BEFORE_HALVING = True
# 4d: step 4 weighs the halved tile at its own split where step 4 would stop there, and only
# tiles of at least HALVED_SPLIT_MIN_TILE on a side (docs/configurator.md, 4d). Measured on an
# H100 (bench/results/runs/matmul_tail_h100_d218078.json): GPT-2 bf16 b8's 768x768x8192 weight
# gradient 25.3 us at 128x256 split 7, 22.3 at 128x128 split 3, 30.8 at 64-row tiles (cuBLAS 20.7)
HALVED_OWN_SPLIT = True
HALVED_SPLIT_MIN_TILE = 128
# Step 5's one-wave split (S/2 < tiles < S) is taken only where the model gains more than this
# share over the same tile unsplit: the model charges a split its partials and a launch but
# not each work item's pipeline fill and fp32 tile store, and there the gain it sees can be
# a few percent. Measured on the H200 (scripts/split_variants.py,
# bench/results/runs/split_variants_bf16_b32_edf14a3.json): GPT-2's 768x2304x32768 weight
# gradient, 108 tiles of 128x128, split 6 for a model gain of 4.4% ran 0.195 ms against 0.175
# unsplit (cuBLAS 0.168); the one-wave splits the model gains 20-34% on (768x3072, 3072x768,
# the LM head's dh) are faster split (0.230 against 0.297 unsplit). In the 12-layer bf16 b32
# step's CUDA graph (scripts/epilogue_variants.py "split-gain:0",
# bench/results/runs/epilogue_variants_graph_12l_split_gain_3758a41.json) the weight gradient
# took 0.170 ms a launch unsplit (128x128x64 s5) against 0.203 split 6, the step 65.46 ms
# against 66.16 (kernels 60.79 against 61.11). The same weight gradient of the tf32 step at
# batch 16 (768x2304x16384, 128x128x32 staged) runs unsplit too: not yet timed (split 6 it took
# 0.324 ms against cuBLAS's 0.276, bench/results/runs/tf32_variants_d7039cd.json)
ONE_WAVE_SPLIT_MIN_GAIN = 0.10
# 4b: the share of a tile grid's products past M and N (its edge tiles' padding) that makes
# the next smaller tile worth taking (docs/configurator.md, 4b)
PAD_WASTE = 0.125
# 8d's split form needs this deep a ring beside the fp32 tile's conversion (docs/configurator.md, 9d)
PERSISTENT_SPLIT_STAGES = 4
# 8e: on the staged tf32 path, an unsplit grid whose tiles fill less than this share of their
# waves (tiles / (waves x S)) takes the next smaller tile in 8d's persistent loop, where that
# gives every program at least two tiles (docs/configurator.md, 9e). Measured on an H100
# (scripts/matmul_wide.py, bench/results/runs/matmul_wide_h100_82788fb.json, both operands
# prerounded, K-major): 8192x768x768 (192 tiles of 128x256, 1.45 waves: 0.73 full) 47.4 us at
# 128x128x32 s3 two blocks an SM against 38.8 at 128x128x32 s4 persistent (cuBLAS 40.6);
# 8192x768x3072 143.6 at 128x256x32 s4 against 122.7 (127.6); 8192x2304x768 (576 tiles, 4.36
# waves: 0.87) 121.0 at 128x256x32 s3 persistent against 102.5 (83.0). Kept where the waves are
# full: 8192x3072x768 (768 tiles, 0.97) 125.5 at 128x256 against 138.1 at 128x128. 0 turns it off
TF32_RETILE_WAVE_FILL = 0.9


# 8f. The wave tail: a plain 16-bit launch (no epilogue, no batch, both operands through
# descriptors) whose grid ends in a partial wave runs as two launches in the same stream: the
# head, C's leading whole blocks of rows (or columns) whose tiles fill whole waves at the big
# tile, and the tail, the rest of C at TAIL_TILE, split along K where the tail's tiles leave
# SMs idle, so that the last wave's SMs share the tail instead of one tile of it each
# (docs/configurator.md, 9f). Two cases, each as measured on an H100 (scripts/matmul_tail.py,
# bench/results/runs/matmul_tail_h100_d218078.json; cuBLAS 52.4-53.5 us on the K >= 2304 rows):
# - a warp-specialized launch (8b) whose 128x256 grid has 1..TAIL_MAX_WAVES whole waves and
#   whose tail fits one wave at TAIL_TILE: the head at 128x256 warp-specialized, the tail
#   unsplit. GPT-2 bf16 batch 8: 8192x768x3072 63.7 -> 59.3 us (row/col) and 61.3 -> 57.4
#   (row/row), 8192x768x2304 49.5 -> 45.3, 8192x2304x768 51.8 -> 50.1. At 8192x768x768 (one
#   12-step tile a program in the head) it lost, 20.9 -> 23.7: the head's programs must walk at
#   least TAIL_MIN_HEAD_STEPS K-steps;
# - a 2-D split (step 5) whose TAIL_TILE grid has S..2S tiles: the head one wave of TAIL_TILE
#   unsplit, the tail split so that its (tile, split) items fill one wave. 3072x768x8192 (run
#   as stream-K at 128x256 split 3) 69.9 -> 60.0 us at tail split 11 (4: 66.7, 8: 63.4);
#   768x3072x8192 70.2 -> 61.2 at 8 (head along N). A tail split below TAIL_MIN_SPLIT was
#   not measured: such shapes keep step 5's split. So do heads longer than TAIL_SPLIT_MAX_K_STEPS
#   K-steps: at batch 32 (K = 32768, 512 steps) the same cut lost to stream-K, 207.5 -> 209.1 and
#   208.1 -> 211.4 us (`gpu_check.sh wave-tail`, bench/results/runs/matmul_gpt2_b32_wavetail_*_h100_5ab1025.json),
#   where stream-K's fix-up is a small share of the launch; between 128 and 512, unmeasured.
WAVE_TAIL = True
TAIL_TILE = (128, 128, 8, 5)  # BM, BN, warps, stages: 768x2304x8192's config (0.98x cuBLAS, H100)
TAIL_MAX_WAVES = 4
TAIL_MIN_HEAD_STEPS = 32
TAIL_MIN_SPLIT = 4
TAIL_SPLIT_MAX_K_STEPS = 128


def _group_m(dev: DeviceSpec, blocks: int, bm: int, bn: int, M: int, k_per_split: int, ea: int) -> int:
    """Step 7's GROUP_M for a bm x bn tile with ``blocks`` blocks an SM."""
    g_traffic = math.sqrt(dev.sm_count * blocks * bn / bm)
    g_l2 = dev.l2_bytes // 2 // (bm * k_per_split * ea)
    return _pow2_floor(max(1, min(g_traffic, g_l2, _cdiv(M, bm))))


def tail_config(cfg: LoweringConfig, K: int) -> LoweringConfig:
    """The tail's launch of a config with a wave tail (``cfg.tail_at`` > 0, rule 8f):
    TAIL_TILE split ``cfg.tail_split`` ways along K, on the one-program-a-tile kernel."""
    bm, bn, warps, stages = TAIL_TILE
    steps = _cdiv(_cdiv(K, cfg.tail_split), cfg.block_k)
    return LoweringConfig(kind="matmul", block_m=bm, block_n=bn, block_k=cfg.block_k, group_m=cfg.group_m,
                          split_k=cfg.tail_split, persistent=False, num_warps=warps,
                          num_stages=max(2, min(stages, steps)), instruction="wgmma+tma", regime=cfg.regime)


def head_config(cfg: LoweringConfig) -> LoweringConfig:
    """The head's launch of a config with a wave tail: the config without it."""
    return dataclasses.replace(cfg, tail_at=0, tail_axis="", tail_split=1)


def tail_parts(cfg: LoweringConfig, M: int, N: int, K: int):
    """A wave tail's two launches: ((head config, C's rows, C's columns), (tail config,
    rows, columns)), each a (start, stop) range of C. The launcher, the memory bound, the
    cost model and the plan's counts all cut C here."""
    at, whole_m, whole_n = cfg.tail_at, (0, M), (0, N)
    if cfg.tail_axis == "m":
        return (head_config(cfg), (0, at), whole_n), (tail_config(cfg, K), (at, M), whole_n)
    return (head_config(cfg), whole_m, (0, at)), (tail_config(cfg, K), whole_m, (at, N))


def part_items(part: LoweringConfig, rows: tuple[int, int], cols: tuple[int, int]) -> int:
    """The (tile, split) work items of one part of ``tail_parts``."""
    return _cdiv(rows[1] - rows[0], part.block_m) * _cdiv(cols[1] - cols[0], part.block_n) * part.split_k


def wave_tail(cfg: LoweringConfig, M: int, N: int, K: int, dev: DeviceSpec, smem_budget: int) -> LoweringConfig | None:
    """Rule 8f on a configured plain 16-bit launch (the caller checked the operands, the
    epilogue and the batch): the config with its head and tail, or None where neither case
    applies."""
    S, bk = dev.sm_count, cfg.block_k
    tokens = cfg.instruction.split("+")
    tbm, tbn, t_warps, t_stages = TAIL_TILE
    ws = WS_TILES.get("plain")
    if "ws" in tokens and ws is not None:  # the warp-specialized head, along M
        bm, bn, warps = ws
        if bn > _pow2_ceil(N) or bm > _pow2_ceil(M):
            return None  # a head tile wider than C (8b keeps its tile within C)
        per_block = _cdiv(N, bn)
        waves = _cdiv(M, bm) * per_block // S
        head = waves * S // per_block * bm
        if not (1 <= waves <= TAIL_MAX_WAVES and 0 < head < M and waves * _cdiv(K, bk) >= TAIL_MIN_HEAD_STEPS
                and _cdiv(M - head, tbm) * _cdiv(N, tbn) <= S):
            return None
        if max(2, min(t_stages, _cdiv(K, bk))) * (tbm + tbn) * 2 * bk > smem_budget:
            return None  # the tail's ring (tail_config's stages) does not fit: at BLOCK_K 128, 5 x 64 KiB
        stage = (bm + bn) * 2 * bk
        stages = min(WS_MAX_STAGES, (smem_budget - bm * bn // 2) // stage, _cdiv(K, bk))  # 8b's ring
        if stages < 2:
            return None
        return dataclasses.replace(cfg, block_m=bm, block_n=bn, num_warps=warps, num_stages=stages,
                                   group_m=_group_m(dev, 1, bm, bn, head, K, 2), tail_at=head, tail_axis="m",
                                   tail_split=1)
    if (cfg.split_k > 1 and not cfg.persistent and "ws" not in tokens and cfg.block_m * cfg.block_n >= tbm * tbn
            and min(M, N) >= min(tbm, tbn)):  # the split head, along M or N
        tiles = _cdiv(M, tbm) * _cdiv(N, tbn)
        if not S <= tiles < 2 * S or _cdiv(K, bk) > TAIL_SPLIT_MAX_K_STEPS:
            return None
        best = None
        for axis, extent, other, b_here, b_other in (("m", M, N, tbm, tbn), ("n", N, M, tbn, tbm)):
            per_block = _cdiv(other, b_other)
            head = S // per_block * b_here
            if 0 < head < extent and (best is None or head // b_here * per_block > best[2]):
                best = (axis, head, head // b_here * per_block)
        if best is None:
            return None
        axis, head, head_tiles = best
        split = min(S // (tiles - head_tiles), _cdiv(K, bk) // 2)
        if split < TAIL_MIN_SPLIT or t_stages * (tbm + tbn) * 2 * bk > smem_budget:
            return None
        rows = head if axis == "m" else M
        return dataclasses.replace(cfg, block_m=tbm, block_n=tbn, num_warps=t_warps,
                                   num_stages=max(2, min(t_stages, _cdiv(K, bk))), split_k=1,
                                   group_m=_group_m(dev, 1, tbm, tbn, rows, K, 2), tail_at=head, tail_axis=axis,
                                   tail_split=split)
    return None


def least_time_split(model_time, c: float, most: int) -> int:
    """The split in 2..``most`` with the least ``model_time`` (the first such, as
    ``min`` picks), where a split s > 1 costs at least ``c`` s + LAUNCH_SECONDS (its
    partials and the reduction's launch): once that alone reaches the best time found,
    no larger split can win, so the scan stops there (K = 50304 at BLOCK_K 32 has 785
    splits to try)."""
    best, best_t = 2, model_time(2)
    for s in range(3, most + 1):
        if c * s + LAUNCH_SECONDS >= best_t:
            break
        t = model_time(s)
        if t < best_t:
            best, best_t = s, t
    return best


def plan_matmul(
    M: int,
    N: int,
    K: int,
    batch: int,
    dtype_a,
    dtype_b,
    out_dtype,
    precision: str,
    a_layout: str = "row",
    b_layout: str = "row",
    has_bias: bool = False,
    device=None,
    epilogue: bool = False,
    epilogue_sums: bool = False,
    prerounded: tuple[str, ...] = (),
    allow_tail: bool = True,
) -> MatmulPlan:
    """``configure_matmul`` with its reasoning. Steps 1-9 are the sections of
    docs/configurator.md, "Matmul"."""
    _positive(M=M, N=N, K=K, batch=batch)
    dev = _device(device if device is not None else "H200")
    for name, lay in (("a_layout", a_layout), ("b_layout", b_layout)):
        if lay not in ("row", "col", "strided"):
            raise ValueError(f"configurator: {name} must be 'row', 'col' or 'strided', got {lay!r}")
    path = arithmetic_path(dtype_a, dtype_b, precision)
    ea, eb = _ELT[dtype_name(dtype_a)], _ELT[dtype_name(dtype_b)]
    eo = _ELT[dtype_name(out_dtype)]
    acc_words = 2 if path == "fp64" else 1  # 32-bit registers per accumulator element
    tensor = _tensor_cores(dev, path)
    S = dev.sm_count
    peak, bw = dev.flops(path), dev.mem_bandwidth

    # 1. roofline: arithmetic intensity against the ridge point
    flops = 2 * M * N * K * batch
    elements = batch * (M * K + K * N + M * N)
    nbytes = batch * (M * K * ea + K * N * eb + M * N * eo) + (N * eo if has_bias else 0)
    ai, ridge = flops / nbytes, peak / bw

    # 2. BLOCK_K: one 128-byte line of K per operand row, no longer than K itself
    # (the split-K and tile-size steps use this; step 6b may widen it)
    bk = min(max(MIN_DOT, LINE_BYTES // max(ea, eb)), max(MIN_DOT, _pow2_ceil(K)))
    k_steps = _cdiv(K, bk)
    smem_budget = _smem_limit(dev, 1)
    # 2b. tf32 operands (docs/configurator.md, "tf32 operands"): which to stage
    stage_a = stage_b = False
    if precision == "tf32-rn" and ea == eb == 4 and dev.has_wgmma and dev.has_tma:
        t_mma = flops / peak

        def stage_cost(elements: int) -> float:
            return 2 * elements * 4 / bw + LAUNCH_SECONDS

        b_penalty = (TF32_ROUND_B_PENALTY if b_layout == "col" else
                     TF32_REGISTER_BOTH_PENALTY if a_layout == "col" else TF32_REGISTER_B_PENALTY)
        stage_b = stage_cost(K * N * batch) < b_penalty * t_mma
        if stage_b:  # A is rounded in registers (any layout) unless staging it costs less
            stage_a = stage_cost(M * K * batch) < TF32_REGISTER_A_PENALTY * t_mma
        # an operand its producer stored rounded (``prerounded``) in the staged layout already
        # (K contiguous: A "row", B "col") is staged at no cost: the launcher reads it in place
        stage_b = stage_b or ("b" in prerounded and b_layout == "col")
        stage_a = stage_b and (stage_a or ("a" in prerounded and a_layout == "row"))
    tf32_nmajor = path == "tf32" and b_layout != "col" and not stage_b and dev.has_wgmma
    ladder = _LADDER_TF32_NMAJOR if tf32_nmajor else _LADDER

    def _oriented(rung, M, N):  # noqa: F811 - this plan's ladder
        return _oriented_on(rung, M, N, ladder, wgmma=tensor and dev.has_wgmma)

    def tile(rung: int) -> _Tile:
        bm, bn = _oriented(rung, M, N)
        family = "fma" if not tensor else "wgmma" if dev.has_wgmma and bm % WGMMA_M == 0 else "mma"
        warps = _warps(bm, bn, acc_words, family, per_rows=not tf32_nmajor)
        regs = _regs_per_thread(family, bm * bn * acc_words / (warps * 32))
        blocks = _occupancy_without_smem(dev, warps, regs)
        return _Tile(bm, bn, family, warps, regs, blocks, (bm * ea + bn * eb) * bk)

    def fits(t: _Tile) -> bool:
        # two stages (double buffering, the least a pipelined K loop needs) in one
        # block's shared memory; the epilogue may stage the fp32 output tile through
        # shared memory after the loop (measured on sm_90: shared = max(ring, tile)),
        # so it is bounded separately; the accumulator fits MAX_WARPS warps' budget
        return (
            2 * t.stage_bytes <= smem_budget
            and t.bm * t.bn * 4 <= smem_budget
            and t.bm * t.bn * acc_words <= MAX_WARPS * 32 * REG_MODEL[t.family][0]
        )

    def n_tiles(t: _Tile) -> int:
        return _cdiv(M, t.bm) * _cdiv(N, t.bn) * batch

    def stages(t: _Tile, steps: int, items: int) -> int:
        # fill the shared memory of the blocks that will share an SM (the bytes in
        # flight per SM, blocks x (stages - 1) x stage, hide the load latency: Little's
        # law), up to MAX_STAGES and no more than the K-steps; one stage when there is
        # a single K-step (nothing to overlap)
        # fill only as far as Little's law asks: (stages - 1) K-steps in flight cover
        # IN_FLIGHT_SECONDS of the SM's share of DRAM bandwidth (bw / S)
        if steps <= 1:
            return 1
        resident = min(t.blocks, _cdiv(items, S), _blocks_by_smem(dev, 2 * t.stage_bytes))
        fit = _smem_limit(dev, resident) // t.stage_bytes
        need = 1 + _cdiv(int(bw / S * IN_FLIGHT_SECONDS), resident * t.stage_bytes)
        if tf32_nmajor and t.bm * t.bn >= 256 * 64:
            need = 2  # B passes through registers anyway (measured: s2 best for 256x64)
        if path == "bf16" or stage_b:
            # operands straight from TMA into wgmma (16-bit, or tf32 staged K-major): fill
            # the ring (calibrated, docs "Calibration"; staged tf32 128x256x32: s4 beat s3
            # by 10-40% on every searched GPT-2 shape, matmul_gpt2.json)
            need = MAX_STAGES
        return max(2, min(fit, steps, MAX_STAGES, need))

    rungs = [r for r in range(len(ladder)) if fits(tile(r))]
    if not rungs:
        raise ValueError(f"configurator: no matmul tile fits {dev.name}'s {dev.smem_per_block} bytes of shared memory")

    def smaller(r: int) -> int | None:
        """The next smaller rung that is a different tile on this shape."""
        here = _oriented(r, M, N)
        return next((s for s in reversed(rungs) if s < r and _oriented(s, M, N) != here), None)

    # 3. the largest tile worth having: the smallest rung whose operand intensity
    # 2 BM BN / (BM ea + BN eb) reaches the ridge (its operands could then stream
    # from DRAM as fast as the SM computes on them), else the largest that fits
    rung = rungs[-1]
    for r in rungs:
        bm, bn = _oriented(r, M, N)
        if 2 * bm * bn / (bm * ea + bn * eb) >= ridge:
            rung = r
            break
    top = rung  # stream-K (5c) is weighed at this tile only: the model has no term for a
    # smaller tile's lower rate, which a halved stream-K tile would hide

    # step 5's wave model (there, with its reasons), which step 4 asks too: a tile's whole K
    # at one SM's share of the peak (tau), the fp32 partials per split (c), T(s) of s splits,
    # and the split of a wave at most half full
    c = 8 * M * N * batch / bw

    # 4c. the register path of A (above, TF32_REGISTER_A_BY_TILE): its cost per product
    # grows as BN shrinks. tf32 A goes through registers where it is not staged and is
    # rounded in the kernel ("tf32-rn") or is not K-major (wgmma reads tf32 from shared
    # memory K-major only)
    reg_a = (TF32_REGISTER_A_BY_TILE and path == "tf32" and tensor and dev.has_wgmma and not stage_a
             and (precision == "tf32-rn" or a_layout != "row"))

    def tau_of(t: _Tile) -> float:
        mma = 2 * t.bm * t.bn * K / (peak / S)
        return mma * (1 + TF32_REGISTER_A_PENALTY * TF32_REGISTER_A_BN / t.bn) if reg_a else mma

    def wave_time(t: _Tile, s: int) -> float:
        return math.ceil(n_tiles(t) * s / S) * tau_of(t) / s + (c * s + LAUNCH_SECONDS if s > 1 else 0.0)

    def underfilled_split(t: _Tile) -> int:
        return min(S // n_tiles(t), k_steps // 2, int(math.sqrt(tau_of(t) / c)))

    # 5c's stream-K (there, with its reasons): where the launcher runs a split of this shape
    # as stream-K (a 2-D launch without an epilogue, both operands through descriptors), S
    # programs share the tiles' K-steps evenly, with no wave to round up, and each segment
    # (a tile's K range inside one program's share: at most tiles + S of them) stores an
    # fp32 partial tile that the fix-up kernel reads back
    from nova.codegen.triton.matmul import stream_k_enabled  # the launcher's switches (late: codegen imports this)

    stream_k = (STREAM_K_TILES and stream_k_enabled(ea == 4) and tensor and dev.has_wgmma and dev.has_tma
                and batch == 1 and not epilogue and not tf32_nmajor
                and a_layout != "strided" and b_layout != "strided")

    def streamk_time(t: _Tile) -> float:
        return (n_tiles(t) * tau_of(t) / S + 8 * (n_tiles(t) + S) * t.bm * t.bn / bw
                + 2 * LAUNCH_SECONDS)

    # 4. fill the machine: a tile runs on one SM; while there are at most S/2 tiles,
    # halving the tile doubles them and they still run in one wave, so every SM
    # does half the work. Not below the 64x64 floor (one wgmma M=64 warpgroup, and
    # the 4 warps of a block each own a 32x32 accumulator): there split-K (5) is
    # preferred, as it keeps the tile's intensity
    # Nor, on a compute-bound shape, where step 5 would fill the wave at this tile instead
    # (``split_fills``: its under-filled split s = min(S // tiles, K_steps / 2, sqrt(tau / c))
    # >= 2) in less model time than the halved tile unsplit takes. There the tile's
    # intensity sets the speed, which split-K keeps and halving loses (measured on the H200,
    # bf16 768x768x32768, a GPT-2 weight gradient: 128x256x64 split 7, 126 work items,
    # 0.059 ms; halved to 64x128x64 split 7, 0.076; cuBLAS 0.064;
    # runs/split_variants_bf16_b32_edf14a3.json). On a memory-bound shape DRAM sets it and
    # the partials add to it: the grid's 128x8192x8192 halves to 64x128x128 unsplit, at
    # cuBLAS speed (bench/results/matmul.json)
    def split_fills(r: int) -> bool:
        nxt = smaller(r)
        if not SPLIT_BEFORE_HALVING or ai < ridge or nxt is None:
            return False
        halved = halved_time(nxt)
        if (stream_k and r == top and tile(r).family == "wgmma"
                and streamk_time(tile(r)) < (1 - STREAM_K_MIN_GAIN) * halved):
            return True
        s = underfilled_split(tile(r))
        return s >= 2 and wave_time(tile(r), s) < halved

    # 4d. the halved tile at its own split (HALVED_OWN_SPLIT, docs/configurator.md 4d): where
    # the halved tile is at least HALVED_SPLIT_MIN_TILE on both sides and step 4 would stop
    # there (its own under-filled split fills the wave, ``split_fills``), step 5 splits it,
    # so step 4 weighs it at that split. Not otherwise: a halved tile that step 4 would halve
    # again is weighed unsplit, as the model has no term for a smaller tile's lower rate
    def halved_time(nxt: int) -> float:
        h = tile(nxt)
        unsplit = wave_time(h, 1)
        if not HALVED_OWN_SPLIT or min(h.bm, h.bn) < HALVED_SPLIT_MIN_TILE or not split_fills(nxt):
            return unsplit
        return min(unsplit, wave_time(h, underfilled_split(h)))

    while n_tiles(tile(rung)) * 2 <= S and not split_fills(rung):
        nxt = smaller(rung)
        if nxt is None or nxt < _FLOOR:
            break
        rung = nxt

    # 4b. padding: a tile whose last row or column of tiles runs past M or N computes the
    # padded products too; past PAD_WASTE of the work, the next smaller rung that pads
    # less is taken (measured on the H200: the 46M MLP's LM head weight gradient,
    # 50304x384x4096 tf32, N = 384 on 256-wide tiles computes 512 columns: 0.76 ms at
    # 128x256x32 against 0.605 at 128x128x32, cuBLAS 0.645;
    # bench/results/runs/tf32_variants_lm_head_dw_c2b6e8c.json)
    def padded(r: int) -> float:
        bm, bn = _oriented(r, M, N)
        return _cdiv(M, bm) * bm * _cdiv(N, bn) * bn / (M * N)

    while padded(rung) > 1 + PAD_WASTE:
        nxt = smaller(rung)
        if nxt is None or nxt < _FLOOR or padded(nxt) >= padded(rung):
            break
        rung = nxt
    t = tile(rung)
    tiles = n_tiles(t)

    # 5. split-K. Model: a tile's whole K takes tau = 2 BM BN K / (peak / S) on one
    # SM; W = ceil(tiles s / S) waves of tau / s each; the fp32 partials cost
    # c = 8 M N batch / bw per split (4 bytes written, 4 read back per output element),
    # and the reduction is one more kernel (LAUNCH_SECONDS, L):
    #     T(s) = ceil(tiles s / S) tau / s + c s + L   (s > 1),   T(1) = ceil(tiles / S) tau.
    # Single wave with half the SMs idle (tiles <= S/2): T(s) = tau / s + c s is least at
    # s* = sqrt(tau / c); s is also bounded by one wave (tiles s <= S) and by >= 2
    # K-steps per split (so a load can overlap an MMA). Several waves whose last one
    # is at most half full: s = 2 halves that tail (ceil(2w) / 2 < ceil(w)). Either
    # way a split is taken only where the model says T(s) < T(1).
    def model_time(s: int) -> float:
        return wave_time(t, s)

    tail = tiles / S - tiles // S
    gain = 0.0  # the least share of T(1) a split must save, by the model
    if tiles * 2 <= S:
        s = underfilled_split(t)
    elif 0 < tail <= 0.5 and k_steps >= 4:
        s = 2
    elif tiles < S and k_steps >= 4:
        # one wave, more than half full (S/2 < tiles < S): the S - tiles idle SMs can only
        # get work from split K; the split with the least model time, >= 2 K-steps each
        # (e.g. a weight gradient 768 x 3072 x 32768: 72 tiles of 128x256 keep 60 of 132
        # SMs idle, T(7) = 0.66 T(1))
        s = least_time_split(model_time, c, k_steps // 2)
        gain = ONE_WAVE_SPLIT_MIN_GAIN
    else:
        s = 1
    split = 1
    if s >= 2 and model_time(s) < (1 - gain) * model_time(1):
        k_split = _cdiv(_cdiv(K, s), bk) * bk  # whole BLOCK_Ks per split, as the launcher does
        split = _cdiv(K, k_split)

    # 5c. stream-K: where the launcher would run a split of this tile as stream-K (above,
    # ``stream_k``) and that takes less model time than the choice so far by more than
    # STREAM_K_MIN_GAIN, the least split whose grid is more than one wave (the launcher's
    # test: the split count only selects stream-K, whose shares do not depend on it).
    # Wave quantization is what it removes: a weight gradient whose tiles fill part of one
    # wave (2304x768x32768 tf32, 54 tiles of 128x256; step 4 would halve the tile). A grid
    # whose last wave is part full gains less in the model (8192x768x3072 tf32, 192 tiles,
    # 1.45 waves: 4%, not taken; 10% on an H100 as searched, 4911172)
    streamk_chosen = False
    if (stream_k and rung == top and t.family == "wgmma" and k_steps >= 2 and not (split > 1 and split * tiles > S)
            and streamk_time(t) < (1 - STREAM_K_MIN_GAIN) * model_time(split)):
        k_split = _cdiv(_cdiv(K, max(2, S // tiles + 1)), bk) * bk
        if _cdiv(K, k_split) * tiles > S:
            split, streamk_chosen = _cdiv(K, k_split), True

    # 6. launch-bound: at most S/2 work items and K too short to split (fewer than 2
    # K-steps per split, step 5's bound); tiles smaller than the floor are then the only
    # way to reach more SMs. Not where K could be split but the model declined: there
    # the 64x64 wgmma floor's intensity wins (measured: bf16 128x2048x2048 32x64 ran
    # at 0.63 of 64x64). The tf32 N-major register path has no wgmma floor advantage
    # (its B tile passes through registers) and keeps shrinking (measured: 64x32 and
    # smaller are its best tiles at M or N = 128..512)
    launch_bound = False
    while split == 1 and n_tiles(tile(rung)) * 2 <= S and (k_steps // 2 < 2 or tf32_nmajor):
        nxt = smaller(rung)
        if nxt is None:
            break
        rung, launch_bound = nxt, True
    t = tile(rung)
    tiles = n_tiles(t)
    items = tiles * split

    # 6b. BLOCK_K, widened: without split-K, the largest power of two up to two
    # 128-byte lines per row whose K-step (BM + BN) BK elt stays within STAGE_BYTES_MAX
    # and K; fewer, longer K-steps halve the per-step barrier and issue overhead
    if split == 1:
        while (
            bk * 2 * max(ea, eb) <= 2 * LINE_BYTES
            and (t.bm * ea + t.bn * eb) * bk * 2 <= STAGE_BYTES_MAX
            and bk * 2 <= _pow2_ceil(K) // 2  # keep >= 2 K-steps for the ring to overlap
            and 2 * (t.bm * ea + t.bn * eb) * bk * 2 <= smem_budget
        ):
            bk *= 2
        t = dataclasses.replace(t, stage_bytes=(t.bm * ea + t.bn * eb) * bk)
    num_stages = stages(t, _cdiv(_cdiv(K, split), bk), items)

    # 6c. short K at one block per SM: halve the tile so two blocks share the SM when the
    # tile's edges (prologue + epilogue) take EDGE_RATIO of its K loop; the halved tile
    # must still give every SM two blocks' work (>= 2 S tiles) and fit two per SM
    def t_edge(t: _Tile, st: int) -> float:
        return (t.bm * t.bn * (4 if split > 1 else eo) + (st - 1) * t.stage_bytes) / (bw / S)

    # 8 (decided here, as it changes 6c). persistent grid: #SMs programs loop over the work
    # items in one flattened software pipeline (``tl.range(flatten=True)``): the ring of
    # loads runs on into the next tile while this one's epilogue stores, so a tile's edges
    # cost nothing and 6c's halving is not needed. Where the operands and C go through
    # TMA (C stored asynchronously in two column halves) and every program gets >= 2
    # tiles without a split. Measured (bench/results/runs/matmul_variants_3f4314c.json, bf16,
    # the GPT-2 124M step's shapes at batch 32): the configured 128x256x64 w8 s4 kernels at
    # 0.94-1.14x cuBLAS on the unsplit bf16-output shapes (0.89x on the f32-output LM head
    # dw), 3-16% faster than the same tiles one program per tile
    tma_path = t.family == "wgmma" and dev.has_tma and a_layout != "strided" and b_layout != "strided"
    persistent = (tma_path and split == 1 and n_tiles(t) >= 2 * S and not tf32_nmajor and not stage_b
                  and (PERSISTENT_EPILOGUES or not epilogue))
    # 8d. the staged tf32 path with both operands K-major in shared memory (stage_a and
    # stage_b: staged, or prerounded and read in place) takes the persistent loop too, its
    # ring as deep as fits beside C's staging half tile (up to MAX_STAGES): measured on the
    # H200 with both operands prerounded (scripts/tf32_variants.py --tile,
    # bench/results/runs/tf32_variants_lm_head_tiles_2db2bbf.json), the LM head's logits
    # 4096x50304x768 1.014 ms at 128x256x32 s3 against 1.224 one program a tile (s4), and
    # 4096x50304x384 0.647 at 128x256x32 s3 against 0.697 (128x128x32 s3, one program a
    # tile); bit for bit the same C (the same BLOCK_K: the same products in the same order).
    # The GPT-2 tf32 step's input gradients (both staged) take it too, measured in the step
    # only (nova bench gpt2 at cc5f6b0: 82.9 ms a step against 84.6 at 215611d)
    # A split one (its (split, tile) work items in the same loop, the fp32 partials stored
    # through pointers, their layout conversion taking the whole fp32 tile beside the ring)
    # where that leaves a ring of at least PERSISTENT_SPLIT_STAGES: the 46M MLP's LM head dh,
    # 4096x384x50304 split 4, 0.404 ms at 128x128x32 s5 against 0.614 one program a work item
    # (s3), bit for bit (runs/tf32_variants_lm_head_splits_bb200c1.json); GPT-2's dh keeps its
    # 128x256 tile one program a work item (2 stages would fit; its 128x128 persistent 0.778
    # against 0.744)
    tf32_staged = stage_a and stage_b and path == "tf32"

    # 8e. the staged tf32 path's part-full last wave, re-tiled (TF32_RETILE_WAVE_FILL, with its
    # measurements): the next smaller tile, every program looping over at least two of them in
    # 8d's persistent loop, in place of a grid whose waves the tiles fill less than the threshold.
    # From 128x256 to 128x128 only, as measured (not below: 128x128's own short grids, e.g.
    # 8192x384x1536, keep 6c's two blocks an SM)
    def wave_fill(t: _Tile) -> float:
        return n_tiles(t) / (_cdiv(n_tiles(t), S) * S)

    half = smaller(rung)
    if (tf32_staged and tma_path and split == 1 and not streamk_chosen and half is not None
            and (PERSISTENT_EPILOGUES or PERSISTENT_STAGED_EPILOGUES or not epilogue)
            and t.bm * t.bn > 128 * 128 and tile(half).bm * tile(half).bn >= 128 * 128
            and n_tiles(tile(half)) >= 2 * S
            and ((epilogue and TF32_RETILE_EPILOGUES)
                 or (wave_fill(t) < TF32_RETILE_WAVE_FILL and wave_fill(tile(half)) > wave_fill(t)))):
        rung, t = half, dataclasses.replace(tile(half), stage_bytes=(tile(half).bm * ea + tile(half).bn * eb) * bk)
        tiles = items = n_tiles(t)
    staged_persistent = (tf32_staged and tma_path and n_tiles(t) * split >= 2 * S and not streamk_chosen
                         and (PERSISTENT_EPILOGUES or PERSISTENT_STAGED_EPILOGUES or not epilogue))
    split_ring = (smem_budget - t.bm * t.bn * 4) // t.stage_bytes
    if staged_persistent and split > 1 and min(split_ring, _cdiv(_cdiv(K, split), bk)) < PERSISTENT_SPLIT_STAGES:
        staged_persistent = False
    if persistent:  # C's staging half tile beside the ring
        num_stages = max(2, min(num_stages, (smem_budget - t.bm * t.bn // 2 * eo) // t.stage_bytes))
    elif staged_persistent:
        persistent = True
        ring = split_ring if split > 1 else (smem_budget - t.bm * t.bn // 2 * eo) // t.stage_bytes
        num_stages = max(2, min(MAX_STAGES, _cdiv(_cdiv(K, split), bk), ring))

    # 8b. warp specialization: WS_TILES's tile for a 16-bit result, one program per SM, the
    # ring as deep as the shared memory allows beside the store's layout conversion (offline
    # sm_90a builds, past the ring: C BM BN / 2 bytes, an epilogue BM BN), at most MAX_STAGES;
    # BLOCK_K as above. Not for an f32 C: its conversion takes the whole tile, BM BN x 4 bytes
    # (a 4-stage 128x256 launch asked 320 KiB), leaving a 2-stage ring
    # An epilogue with column sums (``epilogue_sums``: a bias gradient summed from the tiles)
    # keeps step 8's kernel: Triton 3.6's partitioner fails on the tile's row reduction
    # inside the partitioned loop (bench/results/runs/step_launches_2l_564d08d.log)
    ws = WS_TILES.get("epilogue" if epilogue else "plain")

    def ws_tiles(w) -> int:
        return _cdiv(M, w[0]) * _cdiv(N, w[1])

    if ws is not None and WS_HALF_TILE and not epilogue and ws_tiles(ws) < WS_MIN_TILES_PER_SM * S and ws[1] > 128:
        ws = (ws[0], ws[1] // 2, ws[2])  # 8b's half tile (WS_HALF_TILE)
    if ws is not None and ws[1] > 128 and ws[1] > _pow2_ceil(N):
        ws = (ws[0], 128, ws[2])  # no wider than C (both WS tiles were measured; a 61-wide C took 128x256)
    if ws is not None and (ws[0] > _pow2_ceil(M) or ws[1] > _pow2_ceil(N)):
        ws = None  # C narrower than the smallest measured WS tile: step 8's kernel
    if not (ws is not None and not epilogue_sums and tma_path and split == 1 and batch == 1 and ea == eb == eo == 2
            and path == "bf16" and ws_tiles(ws) >= WS_MIN_TILES_PER_SM * S):
        ws = None
    f32_ws = (WS_TF32 and ws is None and not epilogue and tf32_staged and tma_path and split == 1
              and batch == 1 and eo == 4 and ws_tiles(WS_TF32_TILE) >= WS_MIN_TILES_PER_SM * S)
    if f32_ws:  # 8b on the staged tf32 path (WS_TF32_TILE)
        ws = WS_TF32_TILE
    split_ws = (WS_SPLIT and ws is None and split > 1 and not streamk_chosen and tma_path and batch == 1 and ea == eb == 2
                and path == "bf16" and t.bm >= 2 * WGMMA_M and not tf32_nmajor)
    if split_ws:  # 8c: the split's tile, 4 warps a computing group, the fp32 tile's conversion beside the ring
        ws = (t.bm, t.bn, 4)
    if ws is not None:
        w_bm, w_bn, w_warps = ws
        w_stage = (w_bm * ea + w_bn * eb) * bk
        convert = w_bm * w_bn * 4 if split_ws or f32_ws else w_bm * w_bn if epilogue else w_bm * w_bn // 2
        w_stages = min(WS_MAX_STAGES, (smem_budget - convert) // w_stage, _cdiv(_cdiv(K, split), bk))
        if w_stages < 2:
            ws = None
        else:
            t = dataclasses.replace(t, bm=w_bm, bn=w_bn, warps=w_warps, stage_bytes=w_stage,
                                    blocks=1, regs=_regs_per_thread(t.family, w_bm * w_bn / (2 * w_warps * 32)))
            tiles = n_tiles(t)
            items = tiles * split
            persistent, num_stages = True, w_stages

    two_block = False
    if split == 1 and t.family == "wgmma" and not tf32_nmajor and num_stages > 1 and not persistent:
        half = smaller(rung)
        one = min(t.blocks, _blocks_by_smem(dev, max(num_stages * t.stage_bytes, t.bm * t.bn * 4)))
        t_loop = 2 * t.bm * t.bn * K / (peak / S)
        if half is not None and one == 1 and t_edge(t, num_stages) >= EDGE_RATIO * t_loop:
            h = tile(half)
            h = dataclasses.replace(h, stage_bytes=(h.bm * ea + h.bn * eb) * bk)
            if h.family == "wgmma" and h.blocks >= 2 and n_tiles(h) >= 2 * S:
                h_stages = stages(h, _cdiv(K, bk), n_tiles(h))
                if min(h.blocks, _blocks_by_smem(dev, max(h_stages * h.stage_bytes, h.bm * h.bn * 4))) >= 2:
                    rung, t, num_stages, two_block = half, h, h_stages, True
                    tiles = items = n_tiles(h)
    # the one-program-per-tile kernel stages its C tile through the ring's memory after the
    # loop; the persistent one keeps C's staging half tile beside the ring (loads of the
    # next tile are in flight while it stores: measured sm_90 shared = ring + half tile)
    smem = (num_stages * t.stage_bytes + convert if ws else
            num_stages * t.stage_bytes + (t.bm * t.bn * 4 if split > 1 else t.bm * t.bn // 2 * eo) if persistent else
            max(num_stages * t.stage_bytes, t.bm * t.bn * 4))
    blocks = min(t.blocks, _blocks_by_smem(dev, smem))
    waves = items / (S * blocks)

    # 7. GROUP_M: consecutive tiles walk GROUP_M rows of tiles column by column, so
    # the W = S x blocks tiles in flight cover G rows x W/G columns and read
    # G BM + (W/G) BN operand rows: fewest at G = sqrt(W BN / BM). The group's G
    # A-panels (BM x K each) are reused along the whole group, so they must stay in
    # L2: at most half of it (the other half for the B panels streaming through and C).
    # Rounded down to a power of two: GROUP_M is part of the kernel text, and fewer
    # distinct values mean fewer compiled kernels across shapes
    group_m = _group_m(dev, blocks, t.bm, t.bn, M, _cdiv(K, split), ea)

    # 9. instruction path: TMA needs a contiguous dim in each operand. Layouts change
    # nothing else: a 16-element tile side is >= one 32-byte L2 sector in every dtype
    # 9a. tf32 on Hopper reads both operands from shared memory, never A from registers
    # (both staged, or read in place where stored rounded and K-major): Triton 3.6 pipelines
    # register-A wgmmas with three in flight across the K loop's back edge and ptxas gives
    # the next step's A the same registers, a race, except where ptxas serializes the wgmmas
    # itself. Measured on an H100 at e1ea8b7: the 46M MLP's 384x1536x8192 weight gradient at
    # 128x256 split 7 with B alone staged 2.5e-2 off and different launch to launch, GPT-2
    # tf32's 768x768 ones too; at b8a1515 (splits staged) unsplit epilogue kernels of the
    # tf32 steps still raced (nova.codegen.triton.wgmma_check refused them); every staged
    # kernel of the step shape files free of it (scripts/wgmma_census.py). A correctness
    # rule, not a cost: the tile and the split were chosen above for the path rule 2b
    # priced, and the copies are not in the model's time. Off (the default since b02af12's
    # measurements) rule 2b's choice stands and the template settles a register-A kernel's
    # wgmmas (matmul.SETTLE_REGISTER_A: every step launch's SASS clean and its result within
    # bounds on an H100, tests/gpu/test_step_matmuls_gpu.py; faster, see TF32_SHARED_OPERANDS)
    if TF32_SHARED_OPERANDS and t.family == "wgmma" and precision == "tf32-rn" and ea == eb == 4 and dev.has_tma:
        stage_a = stage_b = True
    instruction = t.family
    if t.family == "wgmma" and dev.has_tma and a_layout != "strided" and b_layout != "strided":
        instruction = "wgmma+tma"
    if stage_b and t.family == "wgmma":
        instruction = "wgmma+tma" + ("+stage_a" if stage_a else "") + "+stage_b"
    if ws:  # (the staged tf32 path keeps its staging: the kernel reads both operands rounded)
        instruction = "wgmma+tma+stage_a+stage_b+ws" if f32_ws else "wgmma+tma+ws"

    regime = "launch-bound" if launch_bound else "compute-bound" if ai >= ridge else "memory-bound"
    cfg = LoweringConfig(
        kind="matmul",
        block_m=t.bm,
        block_n=t.bn,
        block_k=bk,
        group_m=group_m,
        split_k=split,
        persistent=persistent,
        num_warps=t.warps,
        num_stages=num_stages,
        instruction=instruction,
        regime=regime,
    )
    # 8f. the wave tail (WAVE_TAIL): a grid whose last wave is partial runs as two launches
    cut = None
    if (WAVE_TAIL and allow_tail and batch == 1 and not epilogue and not epilogue_sums and path == "bf16"
            and ea == eb == eo == 2 and "tma" in instruction.split("+")):
        cut = wave_tail(cfg, M, N, K, dev, smem_budget)
    if cut is not None:  # the plan's counts over both launches (the head's items are whole waves)
        cfg = cut
        (h, *h_ext), (t_cfg, *t_ext) = tail_parts(cfg, M, N, K)
        head_items, tail_items = part_items(h, *h_ext), part_items(t_cfg, *t_ext)
        tiles, items, blocks = head_items + tail_items // t_cfg.split_k, head_items + tail_items, 1
        waves = head_items / S + tail_items / S
        smem = max(p.num_stages * (p.block_m * ea + p.block_n * eb) * bk for p in (h, t_cfg))
    return MatmulPlan(
        config=cfg,
        path=path,
        flops=flops,
        bytes=nbytes,
        ai_flop_per_byte=ai,
        ai_flop_per_element=flops / elements,
        ridge=ridge,
        tiles=tiles,
        work_items=items,
        blocks_per_sm=blocks,
        waves=waves,
        wave_efficiency=waves / math.ceil(waves),
        smem_bytes=smem,
        regs_per_thread=t.regs,
    )


def configure_matmul(
    M: int,
    N: int,
    K: int,
    batch: int,
    dtype_a,
    dtype_b,
    out_dtype,
    precision: str,
    a_layout: str = "row",
    b_layout: str = "row",
    has_bias: bool = False,
    device=None,
    epilogue: bool = False,
    epilogue_sums: bool = False,
    prerounded: tuple[str, ...] = (),
    tail: bool = True,
) -> LoweringConfig:
    """The LoweringConfig for C[batch, M, N] = A[batch, M, K] @ B[batch, K, N] (+ bias).

    ``precision`` ("ieee" | "tf32" | "bf16") says how fp32 operands enter the
    tensor cores; layouts are "row" (last dim contiguous), "col" (transposed) or
    "strided"; ``device`` is a DeviceSpec or a DEVICES key (default "H200"). ``prerounded``:
    the operands ("a", "b") the caller passes already rounded to nearest tf32 (as
    ``matmul(prerounded=)``), which count as staged where their layout is K-major. ``tail``:
    whether the launch may run as a head and a tail (rule 8f; not for a launch with an
    operand prologue, which the caller knows of and the arguments do not say)."""
    return plan_matmul(
        M, N, K, batch, dtype_a, dtype_b, out_dtype, precision, a_layout, b_layout, has_bias, device, epilogue,
        epilogue_sums, prerounded, tail,
    ).config


# --------------------------------------------------------------------------- streaming kernels
# Reductions and elementwise kernels do O(1) FLOP per byte, far below every ridge
# point: they are bound by DRAM bandwidth (or by launch latency when small), and
# the schedule's job is to keep enough bytes in flight with full-width loads.

MAX_REDUCTION_WARPS = 16  # 512 threads: 3 blocks fit sm_86's 1536 threads, 4 the 2048 of sm_80/90
VALUES_PER_THREAD = 2  # 16-byte vectors each thread loads before using any (a choice: two loads in flight)
# a row kept in registers (single pass) may use a quarter of the register file: 16K fp32
# values = 32 per thread at 16 warps, so four such blocks fill registers and threads alike
ROW_REGS_FRACTION = 4
# kinds whose result needs the whole row twice (normalise after reducing): single pass
# keeps the row in registers; longer rows loop over it again
ROW_KINDS = ("softmax", "log_softmax", "layernorm", "rmsnorm", "cross_entropy", "var")
SPLITTABLE_KINDS = ("sum", "mean", "max", "min", "amax", "amin", "sumsq", "norm")
REDUCTION_KINDS = ROW_KINDS + SPLITTABLE_KINDS


def _min_warps(dev: DeviceSpec) -> int:
    """Fewest warps per block that can still fill an SM's threads within its block
    limit: max_threads_per_sm / (max_blocks_per_sm x 32) = 2 on sm_80/90, 3 -> 4 on sm_86."""
    return _pow2_ceil(_cdiv(dev.max_threads_per_sm, dev.max_blocks_per_sm * dev.warp_size))


def configure_reduction(rows: int, cols: int, dtype, device, kind: str = "sum") -> LoweringConfig:
    """Reduce each of ``rows`` rows of ``cols`` contiguous elements (``kind``: one of
    REDUCTION_KINDS). ``block`` = columns per program step, ``block_m`` = rows per
    program, ``split_k`` = programs per row (a second pass combines them; only for
    SPLITTABLE_KINDS), ``num_stages`` 2 when the row is looped over (the next chunk's
    loads overlap the current chunk's arithmetic)."""
    _positive(rows=rows, cols=cols)
    if kind not in REDUCTION_KINDS:
        raise ValueError(f"configurator: unknown reduction kind {kind!r}; expected one of {REDUCTION_KINDS}")
    dev = _device(device)
    elt = _ELT[dtype_name(dtype)]
    acc_words = 2 if elt == 8 else 1  # fp64 accumulates in fp64, everything else in fp32
    S = dev.sm_count
    vec = VECTOR_BYTES // elt  # elements per 16-byte load
    per_thread = VALUES_PER_THREAD * vec
    single_max = dev.regs_per_sm // ROW_REGS_FRACTION // acc_words  # row elements held in registers

    width = max(vec, _pow2_ceil(cols))
    looped = width > single_max
    block = min(width, single_max)
    if looped:
        # chunks of one full block of 16-byte vectors: MAX warps x 32 x VALUES_PER_THREAD vectors
        block = MAX_REDUCTION_WARPS * 32 * per_thread
    # short rows: pack rows into a program until _min_warps warps each have one
    # 16-byte load, while keeping at least one program per SM
    lanes = _min_warps(dev) * 32 * vec
    rows_per_prog = 1
    if block < lanes:
        rows_per_prog = max(1, min(lanes // block, _pow2_floor(max(1, rows // S))))
    tile = block * rows_per_prog
    warps = max(1, min(MAX_REDUCTION_WARPS, tile // (32 * per_thread)))
    if tile >= lanes:
        warps = max(warps, _min_warps(dev))
    programs = _cdiv(rows, rows_per_prog)

    # few rows, long rows: split each row over programs (partials, then a second pass)
    split = 1
    if kind in SPLITTABLE_KINDS and programs * 2 <= S and cols > block:
        split = min(S // programs, _cdiv(cols, block))
    launch_bound = programs * split * 2 <= S and not looped
    return LoweringConfig(
        kind="reduction",
        block=block,
        block_m=rows_per_prog,
        split_k=split,
        num_warps=warps,
        num_stages=2 if looped or split > 1 else 1,
        instruction="simt",
        regime="launch-bound" if launch_bound else "memory-bound",
    )


# A column reduction (the kept axis is the contiguous one: a bias gradient summed over
# tokens) holds this many accumulators per program: 16 per thread at 4 warps
COLUMN_TILE = 2048
COLUMN_WARPS = 4
MIN_SPLIT_CHUNKS = 4  # a split walks at least this many chunks, so its partial row pays for itself
# Registers a column program is assumed to take when the split is sized to keep every
# program resident at once (one wave): the largest prologue the fuse stage puts in one,
# GPT-2's GELU backward in the c_fc bias gradient's program (8 ops), compiles to 72 a
# thread on sm_90a (64 at 6 ops, 40 for a bare cast and sum). The split sized by
# threads alone (10 programs an SM on the H200) gave that kernel 1320 programs where 7 an
# SM fit: 1.43 waves, 0.261 ms at 2.3 TB/s. At 72 (split 38, 912 programs) the 11 such
# kernels took 2.505 ms against 2.869 on the H200, the qkv bias gradient's 0.571 against
# 0.588, the 12-layer bf16 step's graph 63.93 against 64.28 ms (11b6733, epilogue_variants
# "colregs:72"). None: registers not modelled, the split by threads (as before).
COLUMN_PROGRAM_REGS: int | None = 72


def configure_column_reduction(kept: int, reduced: int, dtype, device, kind: str = "sum") -> LoweringConfig:
    """Reduce ``reduced`` rows of ``kept`` contiguous elements to one row of ``kept``
    (the layout of a bias gradient: [tokens, features] summed over tokens; ``kind``
    one of SPLITTABLE_KINDS). A program owns ``block`` contiguous kept elements and
    walks the reduced axis in chunks of COLUMN_TILE / block; ``split_k`` programs
    share each kept block (a second pass sums their partials). ``split_k`` follows
    from Little's law: enough programs that every SM keeps IN_FLIGHT_SECONDS of its
    DRAM share in flight, one COLUMN_TILE of loads per program, no more programs than
    the SMs hold at once (one wave, at COLUMN_PROGRAM_REGS registers a thread), and at
    least MIN_SPLIT_CHUNKS chunks per program."""
    _positive(kept=kept, reduced=reduced)
    if kind not in SPLITTABLE_KINDS:
        raise ValueError(f"configurator: a column reduction needs an associative kind {SPLITTABLE_KINDS}, got {kind!r}")
    dev = _device(device)
    elt = _ELT[dtype_name(dtype)]
    vec = VECTOR_BYTES // elt
    block = min(_pow2_ceil(kept), 32 * vec)  # a warp's row of 16-byte loads: 512 contiguous bytes
    block_c = max(1, COLUMN_TILE // block)
    chunks = _cdiv(reduced, block_c)
    kept_programs = _cdiv(kept, block)
    in_flight = dev.mem_bandwidth / dev.sm_count * IN_FLIGHT_SECONDS  # bytes one SM keeps in flight
    resident = (_occupancy_without_smem(dev, COLUMN_WARPS, COLUMN_PROGRAM_REGS) if COLUMN_PROGRAM_REGS
                else min(dev.max_threads_per_sm // (COLUMN_WARPS * dev.warp_size), dev.max_blocks_per_sm))
    per_sm = min(_cdiv(int(in_flight), COLUMN_TILE * elt), resident)
    want = dev.sm_count * per_sm
    # with registers modelled, no more programs than one wave holds (a second, partial
    # wave would stream at a fraction of the device's bandwidth)
    per_kept = want // kept_programs if COLUMN_PROGRAM_REGS else _cdiv(want, kept_programs)
    split = max(1, min(per_kept, chunks // MIN_SPLIT_CHUNKS))
    programs = kept_programs * split
    return LoweringConfig(
        kind="reduction",
        block=block,
        split_k=split,
        num_warps=COLUMN_WARPS,
        num_stages=1,
        instruction="simt",
        regime="launch-bound" if programs * 2 <= dev.sm_count else "memory-bound",
    )


def configure_elementwise(numel: int, dtype, n_inputs: int, device) -> LoweringConfig:
    """A pointwise kernel over ``numel`` elements reading ``n_inputs`` tensors and
    writing one: ``block`` = elements per program."""
    _positive(numel=numel, n_inputs=n_inputs)
    dev = _device(device)
    elt = _ELT[dtype_name(dtype)]
    words = 2 if elt == 8 else 1  # fp32 registers per value once loaded (fp64: 2)
    S = dev.sm_count
    vec = VECTOR_BYTES // elt
    # two 16-byte loads per input per thread when the values fit the registers a
    # thread has at full occupancy (regs_per_sm / max_threads_per_sm: 32 on sm_80/90),
    # else one
    budget = dev.regs_per_sm // dev.max_threads_per_sm
    per_thread = VALUES_PER_THREAD * vec if (n_inputs + 1) * VALUES_PER_THREAD * vec * words <= budget else vec
    warps = WARPGROUP  # one warp per SM sub-partition
    block = warps * 32 * per_thread
    # small tensors: halve the block while the grid leaves half the SMs idle, down
    # to one warp with one element per thread, not one 16-byte vector: in that regime
    # the bytes are few and a program's time is its threads' serial work (a multi-tensor
    # AdamW update of the biases and LayerNorm weights, fuse's batch_small, ~400 ops an
    # element over 12 tensors of 768, ran 43 us a launch on the H200 at one vector per
    # thread, 6 programs of one warp: explain_gpt2 at 623915d)
    launch_bound = False
    while _cdiv(numel, block) * 2 <= S and block > 32:
        block //= 2
        launch_bound = True
    warps = max(1, min(warps, block // (32 * vec)))
    launch_bound = launch_bound or _cdiv(numel, block) * 2 <= S
    return LoweringConfig(
        kind="elementwise",
        block=block,
        num_warps=warps,
        num_stages=1,
        instruction="simt",
        regime="launch-bound" if launch_bound else "memory-bound",
    )


# --------------------------------------------------------------------------- attention

# Attention with a small head (the fp32 output accumulator and score tile of a 64x64
# tile at D = 64 take 64 registers a thread in one warpgroup) is bound by how well the
# score tile's softmax (exp, max, sums on the CUDA cores: one exp per 4 D tensor FLOPs)
# overlaps the MMAs: with one warpgroup per program and four programs on an SM the
# schedulers run one program's softmax beside another's MMAs. WARPGROUP_TILE_REGS is
# half of the 128 registers a thread has when 4 x 128 threads share an SM's 65536 (the
# other half: operands, addresses, the softmax's row values). Measured on the H200
# (GPT-2: B 32, H 12, T 1024, D 64, bf16, causal; scripts/attention_variants.py,
# bench/results/runs/attention_variants_eb7626a.json, CUDA-graph timed): the forward at
# 64x64 w4 s3 0.164 ms (cuDNN's SDPA 0.154), against 0.252 at the previous rule's
# 128x128 w8 s5 and 0.177 at 128x64 w8 s3; 3 stages beat 2 (0.173) and 4 (0.181).
WARPGROUP_TILE_REGS = 64
ATTENTION_STAGES = 3


def configure_attention(
    B: int, H: int, T: int, D: int, causal: bool, dtype, device, precision: str | None = None
) -> LoweringConfig:
    """Flash-attention forward over [B, H, T, D]: ``block_m`` queries per program,
    ``block_n`` keys per inner step, ``block_k`` = D rounded up to a power of two.
    ``precision`` as for matmul (default: "ieee" for fp32/fp64, tensor cores for
    16-bit)."""
    _positive(B=B, H=H, T=T, D=D)
    dev = _device(device)
    name = dtype_name(dtype)
    elt = _ELT[name]
    if precision is None:
        precision = "ieee" if elt >= 4 else "bf16"
    path = arithmetic_path(name, name, precision)
    tensor = _tensor_cores(dev, path)
    acc_words = 2 if path == "fp64" else 1
    S = dev.sm_count
    d = max(MIN_DOT, _pow2_ceil(D))
    if d > MAX_BOX:
        raise ValueError(f"configurator: attention head dim {D} > {MAX_BOX} is not supported")
    t_pow2 = max(MIN_DOT, _pow2_ceil(T))
    smem_budget = _smem_limit(dev, 1)

    def family(bm: int) -> str:
        return "fma" if not tensor else "wgmma" if dev.has_wgmma and bm % WGMMA_M == 0 else "mma"

    def fits(bm: int, bn: int) -> bool:
        # registers: the output accumulator (BM x D) and the score tile (BM x BN) in
        # fp32 within MAX_WARPS warps' budget; shared memory: Q resident, K and V
        # double-buffered
        acc = (bm * d + bm * bn) * acc_words
        ring = bm * d * elt + 2 * (2 * bn * d * elt)
        return acc <= MAX_WARPS * 32 * REG_MODEL[family(bm)][0] and ring <= smem_budget

    # largest query block (one or two m64 warpgroups: 128), then the largest key
    # block that fits; then halve the query block while the grid leaves half the SMs idle
    options = [(bm, bn) for bm in (128, 64, 32, 16) for bn in (128, 64, 32, 16)
               if bm <= t_pow2 and bn <= t_pow2 and fits(bm, bn)]  # fmt: skip
    if not options:
        raise ValueError(f"configurator: no attention tile fits {dev.name} for head dim {D}")
    # small heads on wgmma: one warpgroup per program, the largest tile whose fp32 values fit
    # WARPGROUP_TILE_REGS registers a thread, so ATTENTION_PROGRAMS programs share an SM and one's
    # softmax runs while another's MMAs do (docs/configurator.md, "Attention")
    # (16-bit operands only: f32 ones on tf32 tensor cores ran 64x64 w4 s3 0.357 ms against 0.313
    # at the rule below's 128x128 w8 (GPT-2 at batch 16 on an H100, docs/configurator.md, "Attention")
    small = [(bm, bn) for bm, bn in options if bm >= WGMMA_M and family(bm) == "wgmma" and elt == 2
             and (bm * d + bm * bn) * acc_words <= WARPGROUP * 32 * WARPGROUP_TILE_REGS]  # fmt: skip
    if small:
        bm, bn = small[0]
        stages = 1 if _cdiv(T, bn) <= 1 else ATTENTION_STAGES
        return _attention_config(B, H, T, D, causal, dev, path, elt, bm, bn, d, WARPGROUP, stages)
    bm, bn = options[0]
    floor = WGMMA_M if family(bm) == "wgmma" else MIN_DOT
    while _cdiv(T, bm) * B * H * 2 <= S and bm // 2 >= floor:
        smaller = [o for o in options if o[0] == bm // 2]
        if not smaller:
            break
        bm, bn = smaller[0]
    fam = family(bm)
    acc_regs = (bm * d + bm * bn) * acc_words
    budget = REG_MODEL[fam][0]
    warps = max(WARPGROUP, _pow2_ceil(_cdiv(acc_regs, 32 * budget)))
    if fam == "wgmma":
        warps = max(warps, WARPGROUP * min(2, bm // WGMMA_M))
    warps = min(MAX_WARPS, warps)
    regs = _regs_per_thread(fam, acc_regs / (warps * 32))
    blocks = _occupancy_without_smem(dev, warps, regs)
    programs = _cdiv(T, bm) * B * H
    resident = max(1, min(blocks, _cdiv(programs, S)))
    stage = 2 * bn * d * elt  # one K tile and one V tile
    kv_steps = _cdiv(T, bn)
    fit = (_smem_limit(dev, resident) - bm * d * elt) // stage
    stages = 1 if kv_steps <= 1 else max(2, min(fit, kv_steps, MAX_STAGES))

    return _attention_config(B, H, T, D, causal, dev, path, elt, bm, bn, d, warps, stages)


def _attention_config(B, H, T, D, causal, dev, path, elt, bm, bn, d, warps, stages) -> LoweringConfig:
    """The attention LoweringConfig of a chosen tile: its instruction and regime."""
    fam = "fma" if not _tensor_cores(dev, path) else "wgmma" if dev.has_wgmma and bm % WGMMA_M == 0 else "mma"
    flops = 4 * B * H * T * T * D // (2 if causal else 1)
    nbytes = 4 * B * H * T * D * elt  # Q, K, V read, O written
    instruction = fam  # the attention kernels load q, k and v through pointers (cp.async), not TMA
    regime = "compute-bound" if flops / nbytes >= dev.ridge(path) else "memory-bound"
    if _cdiv(T, bm) * B * H * 2 <= dev.sm_count:
        regime = "launch-bound"
    return LoweringConfig(
        kind="attention",
        block_m=bm,
        block_n=bn,
        block_k=d,
        num_warps=warps,
        num_stages=stages,
        instruction=instruction,
        regime=regime,
    )


CONFIGURATORS = {
    "matmul": configure_matmul,
    "reduction": configure_reduction,
    "elementwise": configure_elementwise,
    "attention": configure_attention,
}

__all__ = [
    "configure_matmul", "plan_matmul", "MatmulPlan", "configure_reduction", "configure_column_reduction", "configure_elementwise",
    "configure_attention", "arithmetic_path", "dtype_name", "CONFIGURATORS", "REDUCTION_KINDS",
]  # fmt: skip
