"""Matmul template: C[b] = A[b] @ B[b] (+ bias over rows, or an epilogue), as generated Triton source.

``matmul_source`` writes the text of one kernel specialised to a ``LoweringConfig``
(tile sizes, group-M swizzle, split-K, persistence) and to the operation (dtypes,
precision, bias, batching). ``matmul`` validates torch tensors, asks the Analytic
Configurator for a config when none is given, and launches.

Design choices, and why:

* M, N, K and every stride are runtime arguments, never constexpr: one compiled
  config serves every shape, and any stride pattern (a transposed operand is just
  swapped strides, no copy). Triton still specialises integer arguments on
  ``== 1`` and ``% 16 == 0``, which is what vectorised loads need.
* Tile sizes and the swizzle are baked into the text as module-level constexprs;
  ``num_warps``/``num_stages`` are launch options. Configs that differ only in
  warps, stages or the split count share one source file (and one JITFunction).
* Ragged edges use masked loads/stores. ``EVEN`` (a constexpr chosen at launch:
  every tile full and every K chunk a whole number of BLOCK_K) drops the masks, so
  the aligned case compiles to the mask-free loop; at most two variants per config.
* Accumulation is always fp32. ``precision`` says how 32-bit operands enter the
  tensor cores: ``ieee`` (exact fp32 FMA path), ``tf32`` (``input_precision="tf32"``:
  the tensor core *truncates* the 13 low mantissa bits, ~2.6x cuBLAS's error),
  ``tf32-rn`` (the operand tiles are rounded to nearest-even tf32 in registers by
  integer arithmetic before the same tf32 dot, as cuBLAS does: same error as
  cuBLAS; costs a register round trip of both tiles, see ``TF32_RN``; a config
  whose instruction names ``stage_a`` / ``stage_b`` instead copies that operand,
  rounded, into a dense K-major buffer first, ``stage_tf32``, so its tiles reach
  wgmma straight from TMA: tf32 wgmma reads only K-major shared memory), ``tf32x3``
  (Triton's 3-pass split tf32, ~fp32 accuracy at ~3x the MMA work), ``bf16``
  (operands rounded to bf16). 16-bit operands go to ``tl.dot`` unchanged.
* Split-K is deterministic, in two passes: split ``s`` writes its fp32 partial tile to
  a workspace ``[S, B, M, N]``; a second kernel sums the S partials in a fixed order,
  adds the bias and casts. Atomic adds would save the workspace traffic but make the
  result depend on scheduling order (and need a zeroed fp32 output). With
  ``SERIAL_SPLIT`` (off: measured slower in the step) the splits add up in the kernel
  instead, in split order behind a lock a tile: the same sums, no second kernel. With
  ``LAST_SPLIT_SUMS`` (off: no faster in the step) the last split of a tile to finish sums its
  tile's S partials in split order: the same sums again, no second kernel, no waiting.
  With ``STREAM_K_SPLIT`` (on) a 2-D split without an epilogue whose operands take
  descriptors and whose grid is more than one wave runs as stream-K (``streamk_source``): one
  program an SM, each an equal share of the tiles' K-steps (``streamk_shares``: in bands
  the programs walk in step, ``STREAM_K_LOCKSTEP``), fp32 partial tiles where a share
  leaves a tile, and a fix-up kernel adding each tile's partials in K order (deterministic).
* Persistent: ``grid = min(#SMs, #work items)`` programs loop over work items; the
  work item order (tile fastest, then split, then batch) is the same as the
  one-program-per-tile grid, so both walk tiles in the same L2-friendly order.
* TMA (``"tma" in cfg.instruction``): A and B tiles come through host-built tensor
  descriptors (Hopper's Tensor Memory Accelerator; out-of-bounds boxes read as zeros,
  so no load masks). An operand needs one contiguous dim of its last two (a
  column-major operand is loaded as the transposed box and flipped in registers) and
  16-byte aligned base and strides; when either operand does not qualify, the
  pointer kernel runs instead (logged once), which takes any strides. C is always stored through
  pointers (any strides, masked edges).
* An ``Epilogue`` (the fuse stage's output fusion, composed by
  ``nova.codegen.triton.fused.epilogue_of`` from the same per-op expressions the
  fused elementwise kernels use) replaces the store: its body reads the fp32
  accumulator tile ``acc`` and its extra operands, each loaded at the tile's
  offsets through its own strides (a bias row, a saved pre-activation, a
  residual: any shape that broadcasts to the iteration shape), and it writes one
  or more contiguous outputs in their final dtypes. The iteration shape is static
  in the text (its last dim is N, its leading dims hold batch x M rows), so the
  row index of the tile is split into the leading dims' indices once per tile,
  not per element. Large tiles are worked through in column slices
  (``EPILOGUE_SLICE``: a whole tile's epilogue values beside the accumulator
  spill registers, or cost an SM its second block). Split-K runs it in the reduction kernel, on the summed tile.
  An epilogue's column sums (``ColumnSum``: a bias gradient, the sum of a body value
  over every row) are each tile's sums of its rows, stored to a partials buffer
  [P, N] (one row per tile's rows; split-K's reduction then works on 2-D tiles for
  it), and a second kernel adds the P partials of each column up in a fixed order:
  deterministic, no atomics (which would also need a zeroed output).
  Epilogue kernels launch with ``enable_fp_fusion=False``, as the fused
  elementwise kernels do: every op rounds as written (ptxas -v / PTX of offline
  sm_90a builds: GELU's backward has 1152 ``fma.rn.f32`` with contraction on, none
  off), and the K loop is unchanged: the tensor cores accumulate either way, and
  the fp32 FMA dot (precision "ieee") is Triton's explicit ``llvm.fmuladd``, which
  stays ``fma.rn.f32`` with contraction off (the same 1024 in a 64x64x32 tile).
* Warp specialization (``ws`` in the config's instruction, TmaLayout.ws): the
  persistent 2-D one-pass kernel on 16-bit operands as Triton 3.6 partitions it:
  the tile loop is ``tl.range(..., warp_specialize=True, num_stages=STAGES)``, a
  producer warp group issues the TMA loads into a ring of STAGES buffers while two
  consumer groups of ``num_warps`` each run the MMAs of half the tile's rows and
  its store, so one tile's epilogue overlaps the next tile's loads and MMAs. Triton
  partitions only what it can: A's and B's descriptors are built on the device
  (``tl.make_tensor_descriptor``, in a global scratch the launcher allocates), C
  and the epilogue's outputs go out through pointers, the epilogue works on the
  whole tile (the partitioner takes no reshape or split of the accumulator), and
  the grid size and stages are constants. Measured on the H200
  (scripts/matmul_ws.py, bench/results/runs/matmul_ws_49aaf89.json: the GPT-2
  124M step's bf16 shapes at batch 32): 128x256x64, 4 warps a group, 4 stages,
  0.95-0.97x cuBLAS; with host-built descriptors (the other kernels' way), or the
  grid size a runtime argument, the kernel did not finish in 45 s (a hang). A split
  config (configurator rule 8c, ``WS_SPLIT``, off: measured slower in the step) runs its
  (split, tile) work items in the same loop, every split ``K_SPLIT // BLOCK_K`` K steps
  (the last one's past K read zero boxes), its fp32 partials summed by the reduction.
* C may be a given ``out`` (a view into the step's arena beside the operands: only
  overlapping bytes are refused). What a launch allocates besides C (the split-K
  partials, the staged tf32 copies, column sums' partials) is bounded by ``scratch_bytes``, for the memory
  plan; nothing in a launch waits for the device, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

import dataclasses
import functools
import textwrap
from dataclasses import dataclass
import torch

from nova.codegen.triton.elementwise import Operand, convert, storage_view, tag, tf32_rn_bits
from nova.codegen.triton.source import interpreting, kernel_source, load_kernel
from nova.log import get_logger, once
from nova.schedule.config import LoweringConfig

PRECISIONS = ("ieee", "tf32", "tf32-rn", "tf32x3", "bf16")
_TL_DTYPE = {"float32": "tl.float32", "bfloat16": "tl.bfloat16", "float16": "tl.float16"}
_TORCH_TO_NAME = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_LOG = get_logger(__name__)
REDUCE_BLOCK = 1024  # elements per program of the split-K reduction (pure streaming)
# The split-K reduction of an epilogue with column sums works on [REDUCE_ROWS, REDUCE_COLS]
# tiles (the sums need whole columns of rows, not a flat block): 64 fp32 = one 256-byte run
# of a row per load, 2048 elements per program as the flat kernel's two blocks
REDUCE_ROWS, REDUCE_COLS = 32, 64
# The column sums' final pass: program j sums the [P, COLSUM_COLS] strip of the partials in
# COLSUM_ROWS-row chunks, in chunk order, then the chunk's rows by tl.sum's fixed tree. 16
# columns (64 bytes of fp32 per row) give N / 16 programs: 48 for GPT-2's N = 768, 192 for
# 3072, so the pass is spread over the SMs instead of a few programs walking all of P
COLSUM_ROWS, COLSUM_COLS = 64, 16
_INT32_MAX = 2**31 - 1
# Epilogues in the warp-specialized kernel: on. The NaNs a partitioned bias + GELU epilogue
# wrote on the H200 at 128x128 came from the 5-deep ring, epilogue or not
# (configurator.WS_MAX_STAGES); at 4 stages the epilogues are bit-identical to the
# unpartitioned kernel (bench/results/runs/matmul_ws_epilogues_s4_a86b3ee.json) and the
# 12-layer GPT-2 step's losses too (epilogue_variants_graph_12l_a86b3ee.json). Off, a config
# asking for it runs the unpartitioned kernel (logged once)
WS_EPILOGUES = True
# Split-K adding its splits up in the kernel, in split order (each split waits on its tile's
# lock for the one before, matmul_source's serial store): the two-pass reduction's sums bit for
# bit, without its second kernel (56 launches, 0.82 ms of the GPT-2 124M bf16 b32 step at
# db6f021) or its [S, M, N] fp32 partials in HBM. Off: measured slower. In the 12-layer step
# (scripts/epilogue_variants.py --graph, bench/results/runs/epilogue_variants_serial_split_2dfb675.json)
# the CUDA graph took 66.49 ms a step with it against 65.37 in two passes, its kernels timed
# one by one 67.53 against 61.67 ms (the splits' programs waiting on their locks). Bit-identical
# on the H200 at the step's split shapes (tests/gpu/test_matmul_split_gpu.py). It relies on a
# program of split s being dispatched after split s - 1's of its tile (a lower program id, as
# CUDA dispatches a grid); an epilogue keeps the two-pass form (the reduction runs it), and so
# does a persistent split config (a later work item could wait on a program not resident)
SERIAL_SPLIT = False
# Split-K adding its splits up in the last of them to finish: each split stores its fp32
# partial tile as in the two-pass form, then counts itself in on its tile's counter
# (tl.atomic_add, acq_rel); the split that finds the other S - 1 counted sums the S partials
# in split order, adds the bias and stores C (matmul_source's ``last`` store). The two-pass
# reduction's sums bit for bit, without its second kernel (56 launches, 0.85 ms of the GPT-2
# 124M bf16 b32 step at 459b619, bench/results/runs/dram_bytes_124m_bf16_b32_459b619.json) or
# its reading the partials back from DRAM (the last split reads them from L2 as a rule, the
# other splits of its tile having finished just before it); unlike SERIAL_SPLIT no split
# waits on another, so no chain of adds behind a lock. An epilogue or a persistent config
# keeps the two-pass form. Measured on the H200 and left off: bit-identical on the step's
# split shapes (tests/gpu/test_matmul_split_gpu.py), but in the 12-layer bf16 b32 step's CUDA
# graph 65.27 ms a step against 65.28 two-pass, and the four weight-gradient launches slower
# than matmul + reduction kernel were (a launch: 3072x768 0.239 -> 0.247 ms, 768x3072 0.237 ->
# 0.244, 768x2304 0.201 -> 0.207, 768x768 0.065 -> 0.074; 8.92 -> 9.25 ms a step): the last
# splits' sums, 7 partial tiles read by one SM each, stand at the grid's tail, where the
# reduction kernel spread them over every SM (scripts/epilogue_variants.py "last-split-sums",
# bench/results/runs/epilogue_variants_graph_12l_last_split_4a8fb19.json)
LAST_SPLIT_SUMS = False
# Columns of the last split's sum at a time: a partial tile loaded beside the running sum
# whole took 255 registers and spilled at 128x256 (offline sm_90a ptxas, 8 warps)
LAST_SUM_SLICE = 64
# Split-K as stream-K (on since 2026-12-05, eighth session, in its lockstep form; below): a 2-D
# split config without an epilogue, its operands through host-built descriptors, its split
# grid more than one wave (``stream_k_applies``), runs as one
# program an SM, each taking an equal share of the tiles x K-steps iterations as segments
# (a tile and a K range; a share may end inside a tile and the next begin there), storing
# an fp32 partial tile a segment; a fix-up kernel adds each tile's partials up in K order
# (deterministic, no atomics), adds the bias and casts. Against S splits it has no wave
# quantization (the H200's 768x3072x32768 weight gradient: 72 tiles x 7 splits = 504
# programs, 3.8 waves) and writes fewer partial tiles (192 against 504 there). The shares
# are a host-built table (``streamk_shares``), read by both kernels; the sums' order is not
# the split's (other chunk boundaries): the result differs from the split kernel's by fp32
# rounding. The first form (contiguous shares of the tile-major iterations,
# ``STREAM_K_LOCKSTEP`` off) measured on an H100 (scripts/epilogue_variants.py "stream-k" /
# "stream-k-all", 4c64f5c, bench/results/runs/epilogue_variants_graph_12l_h100_4c64f5c.json):
# the step's graph 66.34 -> 71.42 ms; a launch 768x3072 0.246 -> 0.437 ms, 3072x768 0.243 ->
# 0.378, 768x768 0.066 -> 0.147 (tests/gpu/test_matmul_split_gpu.py -k stream_k: 4 passed,
# the results right). Our reading: L2 reuse. A split grid's first wave is every tile at the
# same K range, its programs walking K in step, so the 72 tiles share A's and B's K slices in
# L2; contiguous shares start spread over every tile and K offset at once, so each program
# streams its own operand slabs (a 128x256 tile's 24 MB at K 32768, 1.7 GB over 72 tiles
# against 252 MB of operands). Hence the lockstep form: the shares are bands of K that whole
# groups of programs walk in step, as the split's waves do. Measured on an H100 at 63a1179
# (scripts/epilogue_variants.py --graph --layers 12, tile-grid / stream-k / stream-k-contiguous,
# bench/results/runs/epilogue_variants_graph_12l_h100_streamk_63a1179.json): the step's graph
# 64.84 / 64.08 / 70.28 ms; a launch 768x3072 0.248 / 0.213 / 0.434 ms, 3072x768 0.244 / 0.211 /
# 0.372, the LM head (its dh split 4) 14.54 / 14.37 / 15.96 ms a step; 768x768 (one wave split,
# 126 programs) 0.066 / 0.075 / 0.139: one-wave grids keep the split (``stream_k_applies``).
STREAM_K_SPLIT = True
# Stream-K's shares in lockstep bands (``streamk_shares``; off: contiguous shares of the
# tile-major iterations, the first form)
STREAM_K_LOCKSTEP = True
# stream-K for fp32 operands too (the tf32 step's weight gradients and LM head dh, 32-wide K-steps,
# staged rounded operands): on with linear_ce.ROW_STATS_F32 since 1b29c22's H100 run (GPT-2 tf32
# b16 88.1 -> 86.5 ms a step, MLP LM 46M tf32 b8 9.3 -> 9.0 ms; runs/*_h100_*_1b29c22*.json)
STREAM_K_F32 = True
# columns of a tile the fix-up adds up a program (a 128x256 fp32 tile whole is 256 registers
# a thread at 4 warps)
STREAM_K_FIXUP_COLS = 64
# C stored through a TMA descriptor (the one-pass kernel, no epilogue). Triton 3.6 stages the
# two column halves in one shared buffer: the second half waits until the first has left
# shared memory (DEPBAR SB0 between the two UTMASTG in the SASS, offline sm_90a), which a
# pointer store (registers to global, no wait) does not; off: C through pointers
C_TMA = True
# The warp-specialized kernel's global scratch a program: its two device-built
# descriptors, 128 bytes each (a CUtensorMap), with room for Triton's alignment
WS_SCRATCH_PER_PROGRAM = 512


def _dtype_name(dtype) -> str:
    if isinstance(dtype, torch.dtype):
        if dtype not in _TORCH_TO_NAME:
            raise ValueError(f"matmul: unsupported dtype {dtype}; supported: float32, bfloat16, float16")
        return _TORCH_TO_NAME[dtype]
    name = str(dtype).removeprefix("torch.")
    if name not in _TL_DTYPE:
        raise ValueError(f"matmul: unsupported dtype {dtype!r}; supported: float32, bfloat16, float16")
    return name


# Round-to-nearest-even of an fp32 tile to tf32 (10 mantissa bits), in integer
# arithmetic on the bits: add half an ulp of tf32 (0xFFF) plus the lowest kept bit
# (ties go to even), clear the 13 dropped bits. A carry out of the mantissa bumps the
# exponent, which is the correctly rounded result (the largest finite values round to
# inf, as IEEE rounding does); inf stays inf; NaNs stay NaN (their payload is in the
# high mantissa bits for every NaN Triton or torch produces). The tensor core's own
# conversion truncates, so after this it sees values it represents exactly.
TF32_RN = ("{x}_bits = {x}.to(tl.uint32, bitcast=True)\n"
           f"{{x}}_bits = {tf32_rn_bits('{x}_bits')}\n"
           "{x} = {x}_bits.to(tl.float32, bitcast=True)")


# The same rounding as one instruction, ``cvt.rn.tf32.f32`` (round to nearest even; sm_90 and
# newer, PTX 7.8), in place of the four integer operations: the kernels that round in registers
# (a matmul's register-path operands, the attention kernels' dot operands, the LM head's d) spend
# CUDA-core issue slots beside the tensor cores on it. Where the kernels are built for a target
# without it (the interpreter, which runs no inline assembly; a CUDA device before sm_90) the
# integer form is written instead: the same bits (tests/gpu/test_tf32_cvt_gpu.py checks that on
# a Hopper GPU), so the switch chooses an instruction, never a result. On since 2026-12-07
# (twenty-fourth session): on an H100 at a4d16f9, Nova alone, off then on, the 46M MLP tf32 b8
# 953,317 -> 981,290 tok/s (+2.9%) and GPT-2 124M tf32 b16 224,447 -> 233,550 (+4.1%)
# (bench/results/runs/ab_cvt_*_h100_a4d16f9.json).
TF32_RN_CVT = True


def cvt_target() -> bool:
    """Whether the kernels being built can use ``cvt.rn.tf32.f32``: not under the interpreter,
    not for a CUDA device older than sm_90; with no CUDA device (an offline sm_90a build) yes.
    Asked at every matmul launch (``rn_cvt`` keys the kernel caches): the device's answer is
    cached."""
    from nova.codegen.triton.source import interpreting

    if interpreting():
        return False
    return not torch.cuda.is_available() or _sm90_or_newer(torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _sm90_or_newer(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def rn_cvt() -> bool:
    """Whether ``tf32_rn_text`` writes the instruction now: ``TF32_RN_CVT`` and a target that has
    it. Part of the key of every cache of generated kernels (``matmul_kernels``,
    ``streamk_kernels``), so that a process that changes the switch never launches a kernel
    generated under the other value."""
    return TF32_RN_CVT and cvt_target()


def tf32_rn_text(x: str) -> str:
    """Lines rounding the fp32 tile ``x`` to tf32 in place: ``TF32_RN``'s integer arithmetic, or
    the instruction under ``TF32_RN_CVT`` where the target has it (``rn_cvt``)."""
    if not rn_cvt():
        return TF32_RN.format(x=x)
    return (f'{x} = tl.inline_asm_elementwise("cvt.rn.tf32.f32 $0, $1;", "=r,f", [{x}], dtype=tl.uint32, '
            f"is_pure=True, pack=1).to(tl.float32, bitcast=True)")


def tf32_rn_fn() -> str:
    """``tf32_rn_text`` as a device function, for generated kernels that round dot operands of
    their own (attention's dots, the LM head's logits gradient): ``tf32_rn(x)``."""
    return "\n\n@triton.jit\ndef tf32_rn(x):\n" + textwrap.indent(tf32_rn_text("x"), "    ") + "\n    return x\n"


def round_to_tf32(x: torch.Tensor) -> torch.Tensor:
    """``TF32_RN`` on the host: fp32 ``x`` rounded to nearest-even tf32 (for tests and
    for reference results)."""
    bits = x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    bits = (bits + 0xFFF + ((bits >> 13) & 1)) & 0xFFFFE000
    bits = torch.where(bits >= 2**31, bits - 2**32, bits)
    return bits.to(torch.int32).view(torch.float32).view_as(x)


def _check_config(cfg: LoweringConfig) -> None:
    for field in ("block_m", "block_n", "block_k"):
        v = getattr(cfg, field)
        if v < 16 or v & (v - 1):
            raise ValueError(f"matmul: {field}={v} must be a power of two >= 16 (tl.dot tile constraint)")
    if cfg.group_m < 1:
        raise ValueError(f"matmul: group_m={cfg.group_m} must be >= 1")
    if cfg.split_k < 1:
        raise ValueError(f"matmul: split_k={cfg.split_k} must be >= 1")


# --------------------------------------------------------------------------- source


@dataclass(frozen=True)
class ColumnSum:
    """One column sum of an epilogue: the body variable ``var`` (register type
    ``vtag``, a value of ``dtype``), summed over the iteration shape's rows into an
    [N] result of ``dtype``, accumulated in fp32 (fp64 for f64: ``acc``). Each tile's
    program adds up its rows (masked rows 0) and stores the [N] slice of its row of
    the partials [P, N] (``acc``); a second pass (``colsum_source``) adds up the P
    partials of each column in a fixed order: deterministic, no atomics."""

    var: str
    vtag: str
    dtype: torch.dtype
    slot: int

    @property
    def acc(self) -> str:
        return tag(self.acc_dtype)

    @property
    def acc_dtype(self) -> torch.dtype:
        return sum_accumulator(self.dtype)


def sum_accumulator(dtype: torch.dtype) -> torch.dtype:
    """The partials' dtype of a column sum of ``dtype`` values: fp64 for f64, else
    fp32 (the reduce template's accumulators)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class Epilogue:
    """What a matmul kernel does with its fp32 accumulator instead of storing it.

    ``shape``: the iteration shape (static; its last dim is N, the product of the
    others batch x M: the tile's rows). ``operands``: the extra inputs, operand k
    loaded (in its stored type, bools as 0/1 bytes) into ``ex<k>`` at the tile's
    elements, through its own strides (shape right-aligned against ``shape``, as
    pointwise operands are). ``body``: statements reading ``e_tile`` (the fp32
    accumulator: the tile or a column slice of it, or the summed split-K partials)
    and the ``ex<k>`` (and ``offs``, the flat index of ``shape``, where
    ``flat_index``), assigning the stored variables; ``stores``:
    (variable, register type, dtype) per output, each written contiguously, of
    shape ``out_shapes[j]`` (the iteration shape, or the matmul's result shape:
    the same elements in the same order). ``helpers``: functions the body calls.
    ``sums``: column sums (``ColumnSum``) of body values over every row of the
    iteration shape, [N] outputs each; ``sums[i].slot`` places it among the
    launch's outputs, the stores filling the other slots in order.
    ``row_stats``: a body variable (fp32) whose log-sum-exp statistics over each
    tile's columns are stored, per row of the iteration shape and column tile: its
    maximum and the sum of exp(value - maximum) (columns past N left out), two f32
    outputs [rows, cdiv(N, row_stats_cols)] after the others; ``row_stats_cols`` is
    the tile's BLOCK_N, which the launch's config must have (a row's statistics are
    then combined from its tiles': ``nova.codegen.triton.linear_ce``). The two-D,
    unsplit kernel only."""

    shape: tuple[int, ...]
    operands: tuple[Operand, ...]
    body: str
    stores: tuple[tuple[str, str, torch.dtype], ...]
    out_shapes: tuple[tuple[int, ...], ...]
    helpers: str = ""
    flat_index: bool = False
    sums: tuple[ColumnSum, ...] = ()
    row_stats: str = ""
    row_stats_cols: int = 0

    def slots(self) -> tuple[list[int], list[int]]:
        """(the output slots of the stores, of the sums), in their orders."""
        taken = [c.slot for c in self.sums]
        n = len(self.stores) + len(self.sums)
        if sorted(taken) != sorted(set(taken)) or any(not 0 <= t < n for t in taken):
            raise ValueError(f"matmul: column sum slots {taken} do not fit {n} outputs")
        return [j for j in range(n) if j not in taken], taken

    def check(self, N: int, rows: int) -> None:
        shape = self.shape
        if not shape or shape[-1] != N or _prod(shape[:-1]) != rows:
            raise ValueError(f"matmul: epilogue iteration shape {shape} does not hold a [{rows}, {N}] result "
                             "(its last dim must be N, its others batch x M)")
        for s in self.out_shapes:
            if _prod(s) != rows * N or not s or s[-1] != N:
                raise ValueError(f"matmul: epilogue output shape {s} does not hold a [{rows}, {N}] result")


@dataclass(frozen=True)
class Prologue:
    """A's tile computed in registers from the tile as loaded, before the dot: an operand
    prologue (the LM head's backward computes its logits' gradient so from the logits,
    ``nova.codegen.triton.linear_ce.D_PROLOGUE``). ``vectors``: (name, axis) of vector
    operands, pointer arguments ``pv_<name>`` read with unit stride along A's rows (axis
    "m": once a tile, at the tile's rows) or along K ("k": each K step, at its indices);
    elements past M or K read 0. ``body``: lines computing ``a`` (the dot's operand, in the
    kernel's operand type) from ``a`` (the tile as loaded, [BLOCK_M, BLOCK_K], zeros past M
    and K), the vectors by name, ``p_m`` and ``p_k`` (the tile's row and K indices).
    ``rounded``: the body rounds ``a`` to nearest tf32 itself (``tf32_rn`` is in the source),
    so a tf32-rn dot takes it as prerounded; A is never staged (the staging pass would round
    the loaded values instead). The kernel without warp specialization or stream-K."""

    vectors: tuple[tuple[str, str], ...]
    body: str
    rounded: bool = False

    def __post_init__(self) -> None:
        for name, axis in self.vectors:
            if axis not in ("m", "k") or not name.isidentifier():
                raise ValueError(f"matmul: prologue vector {name!r} on axis {axis!r} (axes: 'm', 'k')")


def _prologue_lines(pro: Prologue, where: str) -> str:
    """The prologue's vector loads along ``where`` ("m": before the K loop, "k": in it, with
    the step's ``p_k``), and in the K loop its body, at the kernel body's indentations."""
    if where == "m":
        loads = [f"{n} = tl.load(pv_{n} + p_m, mask=p_m < M, other=0)" for n, ax in pro.vectors if ax == "m"]
        return "".join(f"\n        {ln}" for ln in ["p_m = offs_m", *loads])
    loads = [f"{n} = tl.load(pv_{n} + p_k, mask=p_k < K, other=0)" for n, ax in pro.vectors if ax == "k"]
    lines = ["# the operand prologue: A computed from the tile as loaded", "p_k = k0 + k + tl.arange(0, BLOCK_K)",
             *loads, *textwrap.dedent(pro.body).strip("\n").splitlines()]
    return "".join(f"\n            {ln}" for ln in lines)


def _prod(dims) -> int:
    n = 1
    for d in dims:
        n *= int(d)
    return n


def _epilogue_params(ep: Epilogue) -> tuple[list[str], list[str]]:
    """(pointer parameters, stride parameters) of an epilogue: ``e<k>`` per operand,
    ``o<j>`` per output, then ``es<k>_<d>`` per moving dim of each operand."""
    rank = len(ep.shape)
    ptrs = [f"e{k}" for k in range(len(ep.operands))] + [f"o{j}" for j in range(len(ep.stores))]
    ptrs += [f"cs{j}" for j in range(len(ep.sums))]  # the column sums' partials
    ptrs += ["rm", "rs"] if ep.row_stats else []  # the row statistics: maxima, sums of exponentials
    strides = [f"es{k}_{kd}" for k, op in enumerate(ep.operands) for kd, _, _ in op.terms(rank)]
    return ptrs, strides


def epilogue_lines(ep: Epilogue, two_d: bool, masked: bool, cols: str = "offs_n", mask_n: str = "mask_n",
                   tile: str = "acc", box: tuple[str, str] | None = None) -> list[str]:
    """The epilogue's statements. ``two_d``: in the main kernel, over the
    [BLOCK_M, BLOCK_N] tile or a column slice of it (``e_rows`` [BLOCK_M] and
    ``mask_m`` are defined; ``cols``, ``mask_n`` and ``tile`` name the slice's
    columns, their mask and its accumulator); else in the split-K reduction, over a
    flat block of the result (``offs``, ``mask``, the sum ``acc``). ``masked``:
    ragged edges (EVEN is false). ``box``: (first row, first column) of the slice's
    box when the outputs are tensor descriptors (``TmaLayout.e``; the copy engine
    clips the edges, so the stores take no mask). Column sums (``ep.sums``, the
    two-D form only: ``e_prow`` is the tile's row of the partials) store the tile's
    sums of its rows, masked rows 0, at the partials' row ``e_prow``, through
    pointers."""
    if (ep.sums or ep.row_stats) and not two_d:
        raise ValueError("matmul: column sums and row statistics need the epilogue over 2-D tiles (the flat split-K "
                         "reduction has none)")
    rank = len(ep.shape)
    last = rank - 1
    lines = [f"e_tile = {tile}", f"e_cols = {cols}" if two_d else f"e_cols = offs % {ep.shape[-1]}"]
    if not two_d:
        lines.append(f"e_rows = offs // {ep.shape[-1]}")
    lead = sorted({d for op in ep.operands for _, d, _ in op.terms(rank) if d < last})
    if lead:  # the leading dims' indices of each row, once per row
        lines.append("e_rem = e_rows")
        for d in range(last - 1, lead[0] - 1, -1):
            if d == lead[0] and _prod(ep.shape[:d]) == 1:  # the outermost dim that moves: no modulo
                lines.append(f"e_i{d} = e_rem")
            else:
                lines += [f"e_i{d} = e_rem % {ep.shape[d]}", f"e_rem = e_rem // {ep.shape[d]}"]
    if ep.flat_index:
        lines.append(f"offs = e_rows[:, None] * {ep.shape[-1]} + e_cols[None, :]" if two_d else "")

    def index(d: int) -> str:
        name = "e_cols" if d == last else f"e_i{d}"
        if not two_d:
            return name
        return f"{name}[None, :]" if d == last else f"{name}[:, None]"

    def mask_of(dims: set[int]) -> str:
        if not masked:
            return ""
        if not two_d:
            return ", mask=mask"
        parts = (["mask_m[:, None]"] if any(d < last for d in dims) else []) + ([f"{mask_n}[None, :]"] if last in dims else [])
        return ", mask=" + " & ".join(parts)

    for k, op in enumerate(ep.operands):
        terms = op.terms(rank)
        if not terms:
            lines.append(f"ex{k} = tl.load(e{k})")  # one element for every lane
            continue
        off = " + ".join(f"{index(d)} * es{k}_{kd}" for kd, d, _ in terms)
        lines.append(f"ex{k} = tl.load(e{k} + {off}{mask_of({d for _, d, _ in terms})})")
    lines += [ln for ln in ep.body.strip("\n").splitlines()]
    out = "e_rows[:, None] * " + str(ep.shape[-1]) + " + e_cols[None, :]" if two_d else "offs"
    if box is not None:
        for j, (var, vtag, dtype) in enumerate(ep.stores):
            lines.append(f"o{j}.store([{box[0]}, {box[1]}], {convert(var, vtag, tag(dtype))})")
    else:
        lines.append(f"e_out = {out}")
        full = mask_of({0, last}) if rank > 1 else mask_of({last})
        for j, (var, vtag, dtype) in enumerate(ep.stores):
            lines.append(f"tl.store(o{j} + e_out, {convert(var, vtag, tag(dtype))}{full})")
    for j, c in enumerate(ep.sums):
        value = convert(c.var, c.vtag, c.acc)
        if masked:  # rows past the edge hold values of masked loads: they add 0
            zero = "tl.zeros_like(e_cs)" if c.acc == "f64" else "0.0"
            lines += [f"e_cs = {value}", f"e_cs = tl.where(mask_m[:, None], e_cs, {zero})"]
            value = "e_cs"
        mask = f", mask={mask_n}" if masked else ""
        lines.append(f"tl.store(cs{j} + e_prow * {ep.shape[-1]} + e_cols, tl.sum({value}, axis=0){mask})")
    if ep.row_stats:  # this slice's columns into the tile's running maximum e_rm and sum e_rs (_sliced_epilogue)
        v = ep.row_stats
        if masked:  # columns past N take no part
            lines.append(f"e_sv = tl.where({mask_n}[None, :], {v}, float('-inf'))")
            v = "e_sv"
        lines += [f"e_sm = tl.maximum(e_rm, tl.max({v}, axis=1))",
                  "e_ss = tl.where(e_sm == float('-inf'), 0.0, e_sm)",
                  f"e_rs = e_rs * tl.exp(e_rm - e_ss) + tl.sum(tl.exp({v} - e_ss[:, None]), axis=1)",
                  "e_rm = e_sm"]  # fmt: skip
    return [ln for ln in lines if ln]


@dataclass(frozen=True)
class TmaLayout:
    """How the TMA variant addresses A and B: ``row`` = the last dim is contiguous
    (A: K, B: N), ``col`` = the second-to-last is (the tile is loaded transposed
    and flipped in registers); ``*_batched`` = the operand has its own batch dim
    (otherwise one matrix serves every batch). ``c``: C is stored through a
    descriptor too (rows contiguous, 16-byte aligned; the one-pass kernel without an
    epilogue), in two column halves (half the staging buffer in shared memory), so
    the store is asynchronous and clipped at the edges by the copy engine. ``e``: the
    one-pass kernel's epilogue outputs, of two element sizes, are stored through
    descriptors (each output read as [rows, N], rows contiguous, 16-byte aligned:
    ``_tma_e``), a [BLOCK_M, slice] box per column slice: the values go out from the accumulator's own
    register layout through shared memory, so outputs of different dtypes do not
    each ask for a store layout of their own (with pointer stores Triton computes
    the chain they share once per layout: GELU's backward twice, for its f32 and
    its bf16 result)."""

    a: str = "row"
    b: str = "row"
    a_batched: bool = False
    b_batched: bool = False
    c: bool = False
    c_batched: bool = False
    e: bool = False  # the epilogue's outputs through descriptors, one box per column slice
    # warp-specialized (the module docstring): A's and B's descriptors built on the device, 2-D only,
    # the persistent loop partitioned into a loading warp group and two computing ones
    ws: bool = False


def _dot_text(in_name: str, precision: str, prerounded: tuple[str, ...], settle: bool = False) -> tuple[str, str]:
    """(the lines that prepare the loaded ``a`` and ``b`` for the dot, at a K loop's
    indentation; the dot adding ``a @ b`` into ``acc``) for operands of ``in_name`` under
    ``precision`` (``prerounded``: the operands already rounded to tf32). ``settle``
    (``_register_a``): the dot's sum is used at once (``+ 0.0``, the same value), so
    Triton waits for each wgmma before the next K-step instead of keeping three in flight
    while ptxas reuses their A registers (``wgmma_check``)."""
    if in_name == "float32" and precision == "bf16":
        cast, dot = "\n            a = a.to(tl.bfloat16)\n            b = b.to(tl.bfloat16)", "tl.dot(a, b, acc)"
    elif in_name == "float32" and precision == "tf32-rn":
        todo = [x for x in ("a", "b") if x not in prerounded]
        cast = "".join("\n" + textwrap.indent(tf32_rn_text(x), " " * 12) for x in todo)
        dot = 'tl.dot(a, b, acc, input_precision="tf32")'
    elif in_name == "float32":
        cast, dot = "", f'tl.dot(a, b, acc, input_precision="{precision}")'
    else:
        cast, dot = "", "tl.dot(a, b, acc)"
    return cast, (f"({dot}) + 0.0" if settle else dot)


# Register-A wgmma kernels wait for each K-step's wgmmas (``_dot_text``'s ``settle``). Triton 3.6
# keeps a register-A dot's wgmmas in flight across the K loop's back edge and ptxas may give the
# next step's A the same registers: the race found on an H100 at e1ea8b7 (``wgmma_check``).
SETTLE_REGISTER_A = True


def _register_a(cfg: LoweringConfig, tma: "TmaLayout | None", in_name: str, precision: str,
                dot_pre: tuple[str, ...], prologue: bool = False) -> bool:
    """Whether a wgmma kernel's A reaches the MMA through registers: computed by a prologue, or
    fp32 A rounded or transposed in the kernel (not K-major in shared memory as stored), or
    loaded through pointers (Triton decides)."""
    if not (SETTLE_REGISTER_A and cfg.instruction.startswith("wgmma")):
        return False
    if prologue:
        return True
    if in_name != "float32" or precision == "bf16":
        return False
    return "a" not in dot_pre or tma is None or tma.a != "row"


def _place_lines(p: str, tile: str) -> list[str]:
    """Tile index ``tile`` -> its (pid_m, pid_n) under the group-M swizzle, as variables
    prefixed ``p`` (the kernel's num_pid_m, tiles_per_group in scope)."""
    return [
        f"{p}group = {tile} // tiles_per_group",
        f"{p}first_m = {p}group * GROUP_M",
        f"{p}group_rows = tl.minimum(num_pid_m - {p}first_m, GROUP_M)",
        f"{p}pid_m = {p}first_m + ({tile} % tiles_per_group) % {p}group_rows",
        f"{p}pid_n = ({tile} % tiles_per_group) // {p}group_rows",
    ]


def streamk_shares(tiles: int, k_steps: int, programs: int, lockstep: bool = True) -> list[list[tuple[int, int, int]]]:
    """Each program's share of the ``tiles`` x ``k_steps`` iterations as segments
    (tile, k_lo, k_hi), in the order it walks them; every iteration in exactly one
    segment, the shares' sizes within a few K-steps of tiles x k_steps / programs.

    ``lockstep`` (``STREAM_K_LOCKSTEP``): in bands that groups of programs walk in step.
    With P programs for T tiles of L K-steps: P >= T gives the P // T bands of width
    ceil(T L / P) to T programs each (every tile, the same K range: the split's waves'
    L2 reuse), P a multiple of T the L K-steps in P / T equal bands; the K-steps past the
    bands go to the programs left over, P < T of them: each takes one tile's whole range
    (again in step), and the tiles left over are shared out to the same programs the same
    way. At the H200's 768x3072x32768 weight gradient (72 tiles of 512 K-steps, 132 SMs):
    72 programs take K-steps 0..280 of every tile; 60 take 280..512 of tiles 0..59 and then
    one of 5 bands of tiles 60..71's 280..512 (46-47 K-steps): two groups walking in step,
    192 partial tiles. Without it: contiguous shares of the tile-major iterations, program
    p the iterations [p T L // P, (p + 1) T L // P) (the first form)."""
    shares: list[list[tuple[int, int, int]]] = [[] for _ in range(programs)]
    if not lockstep:
        total = tiles * k_steps
        for p in range(programs):
            it, end = p * total // programs, (p + 1) * total // programs
            while it < end:
                t, lo = divmod(it, k_steps)
                hi = min(k_steps, lo + end - it)
                shares[p].append((t, lo, hi))
                it = t * k_steps + hi
        return shares
    ts, ps, k0 = list(range(tiles)), list(range(programs)), 0
    while ts and ps and k0 < k_steps:
        T, P, L = len(ts), len(ps), k_steps - k0
        if P < T:  # a whole range a program, the tiles left over shared out again
            for t, p in zip(ts, ps):
                shares[p].append((t, k0, k_steps))
            ts = ts[P:]
            continue
        if P % T == 0:  # equal bands, nothing left over
            nb = P // T
            for b in range(nb):
                lo, hi = k0 + b * L // nb, k0 + (b + 1) * L // nb
                if hi > lo:
                    for i, t in enumerate(ts):
                        shares[ps[b * T + i]].append((t, lo, hi))
            break
        width = -(-T * L // P)
        nb = min(P // T, L // width)
        for b in range(nb):
            for i, t in enumerate(ts):
                shares[ps[b * T + i]].append((t, k0 + b * width, k0 + (b + 1) * width))
        k0 += nb * width
        ps = ps[T * nb:]
    return shares


def streamk_tables(tiles: int, k_steps: int, programs: int, lockstep: bool = True) -> tuple[list[int], list[int], list[int], list[int]]:
    """``streamk_shares`` as the kernels read it: (seg_off, segs, fix_off, fix_slot).
    Program p's segments are seg_off[p]..seg_off[p + 1] (segment s: tile, k_lo, k_hi at
    segs[3 s..3 s + 2], its partial tile at the workspace's slot s); tile t's partials are
    at the slots fix_slot[fix_off[t]..fix_off[t + 1]], in K order."""
    seg_off, segs, by_tile = [0], [], [[] for _ in range(tiles)]
    for share in streamk_shares(tiles, k_steps, programs, lockstep):
        for t, lo, hi in share:
            by_tile[t].append((lo, len(segs) // 3))
            segs += [t, lo, hi]
        seg_off.append(len(segs) // 3)
    fix_off, fix_slot = [0], []
    for parts in by_tile:
        fix_slot += [slot for _, slot in sorted(parts)]
        fix_off.append(len(fix_slot))
    return seg_off, segs, fix_off, fix_slot


def streamk_source(cfg: LoweringConfig, tma: TmaLayout, *, has_bias: bool, precision: str, in_dtype: str,
                   out_dtype: str, prerounded: tuple[str, ...] = ()) -> str:
    """Stream-K (``STREAM_K_SPLIT``) for a 2-D C[M, N] = A @ B (+ bias) with A and B
    through host-built descriptors: ``matmul_streamk`` and ``matmul_streamk_fixup``.

    The shares are a table (``streamk_tables``): program p walks its segments (a tile,
    in the group-M order of the tile grid, and a K range), accumulates each in fp32 and
    stores it whole to the workspace's slot of the segment [S, BLOCK_M, BLOCK_N]. The
    fix-up program of tile t (and STREAM_K_FIXUP_COLS of its columns) adds the tile's
    partials in K order; then the bias, the cast and C's store (masked at the edges: the
    workspace holds whole tiles, zeros past M, N and K from the descriptors'
    out-of-bounds boxes)."""
    in_name, out_name = _dtype_name(in_dtype), _dtype_name(out_dtype)
    cast, dot = _dot_text(in_name, precision, prerounded, _register_a(cfg, tma, in_name, precision, prerounded))
    a_load = _tma_load("a_desc", tma.a == "row", False, "pid_m * BLOCK_M", "BLOCK_M", k_last=True, k="ki * BLOCK_K")
    b_load = _tma_load("b_desc", tma.b == "col", False, "pid_n * BLOCK_N", "BLOCK_N", k_last=False, k="ki * BLOCK_K")
    place, place4 = (("\n" + " " * n).join(_place_lines("", "tile")) for n in (8, 4))
    cols = min(cfg.block_n, STREAM_K_FIXUP_COLS)
    bias_param = ["bias_ptr"] if has_bias else []
    bias_stride = ["stride_bias"] if has_bias else []
    bias = ("\n    acc += tl.load(bias_ptr + offs_n * stride_bias, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]"
            if has_bias else "")
    header = textwrap.dedent(f"""\
        # Generated by nova.codegen.triton.matmul (stream-K); do not edit.
        # block {cfg.block_m}x{cfg.block_n}x{cfg.block_k}, group_m {cfg.group_m}
        # in {in_name}, out {out_name}, precision {precision}, bias {'yes' if has_bias else 'no'}
        # operands through tensor descriptors (TMA): {tma!r}\
{', rounded to tf32 before the kernel: ' + ' '.join(prerounded) if prerounded else ''}
        import triton
        import triton.language as tl

        BLOCK_M = tl.constexpr({cfg.block_m})
        BLOCK_N = tl.constexpr({cfg.block_n})
        BLOCK_K = tl.constexpr({cfg.block_k})
        GROUP_M = tl.constexpr({cfg.group_m})
        FIX_COLS = tl.constexpr({cols})
        """)
    grid_lines = textwrap.indent(textwrap.dedent("""\
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        tiles_per_group = GROUP_M * num_pid_n
        """), "    ")
    main = f"""
@triton.jit
def matmul_streamk(
    a_desc,
    b_desc,
    ws_ptr,
    seg_off_ptr,
    segs_ptr,
    M,
    N,
    K,
):
{grid_lines}    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    for s in range(tl.load(seg_off_ptr + pid), tl.load(seg_off_ptr + pid + 1)):
        tile = tl.load(segs_ptr + 3 * s)
        k_lo = tl.load(segs_ptr + 3 * s + 1)
        k_hi = tl.load(segs_ptr + 3 * s + 2)
        {place}
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_lo, k_hi):
            a = {a_load}
            b = {b_load}{cast}
            acc = {dot}
        slot = tl.cast(s, tl.int64) * (BLOCK_M * BLOCK_N)
        tl.store(ws_ptr + slot + rows[:, None] * BLOCK_N + cols[None, :], acc)
"""
    fixup = f"""
@triton.jit
def matmul_streamk_fixup(
    ws_ptr,
    fix_off_ptr,
    fix_slot_ptr,
    c_ptr,
    {''.join(x + ', ' for x in bias_param)}M,
    N,
    K,
    stride_cm,
    stride_cn,
    {''.join(x + ', ' for x in bias_stride)}
):
{grid_lines}    tile = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * FIX_COLS + tl.arange(0, FIX_COLS)
    acc = tl.zeros((BLOCK_M, FIX_COLS), dtype=tl.float32)
    for j in range(tl.load(fix_off_ptr + tile), tl.load(fix_off_ptr + tile + 1)):
        slot = tl.load(fix_slot_ptr + j).to(tl.int64) * (BLOCK_M * BLOCK_N)
        acc += tl.load(ws_ptr + slot + rows[:, None] * BLOCK_N + cols[None, :])
    {place4}
    offs_m = (pid_m * BLOCK_M + rows).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + cols).to(tl.int64){bias}
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn, acc.to({_TL_DTYPE[out_name]}), mask=mask)
"""
    return header + "\n" + main + "\n" + fixup


def stream_k_enabled(f32: bool) -> bool:
    """Whether a split may run as stream-K at all: ``STREAM_K_SPLIT`` on, and for fp32
    operands (``f32``) ``STREAM_K_F32`` too (the configurator's rule 5c asks the same)."""
    return STREAM_K_SPLIT and (STREAM_K_F32 or not f32)


def stream_k_applies(M: int, N: int, splits: int, cfg: LoweringConfig, sms: int, f32: bool) -> bool:
    """Whether a 2-D split without an epilogue (operands through descriptors) runs as
    stream-K: ``STREAM_K_SPLIT`` on, 16-bit operands (``f32``: fp32 ones, the tf32 and fp32
    steps', only with ``STREAM_K_F32``) and the split grid more than one wave of ``sms``
    programs. A grid of one wave has no wave to even out, and there stream-K lost
    (768x768x32768 at 128x256, 18 tiles x 7 splits = 126 programs on 132 SMs: 0.066 ->
    0.075 ms a launch, H100, 63a1179)."""
    return stream_k_enabled(f32) and cdiv(M, cfg.block_m) * cdiv(N, cfg.block_n) * splits > sms


def runs_stream_k(M: int, N: int, K: int, batch: int, cfg: LoweringConfig, sms: int, f32: bool,
                  epilogue: bool = False) -> bool:
    """Whether a launch of ``cfg`` at this shape runs as stream-K, as far as the config says
    before the operands' strides are known: split (``split_k_plan``), 2-D, no epilogue, one
    program a work item, TMA in its instruction path and ``stream_k_applies``. At launch the
    operands must also take descriptors (``_tma_plan``) and no prologue ride on A. The memory
    plan's bound (``scratch_bytes``), ``explain()``'s schedule column and the launch (``_run``,
    which adds those two) ask this."""
    splits = split_k_plan(K, cfg)[1]
    return (splits > 1 and not epilogue and not cfg.persistent and batch == 1
            and "tma" in cfg.instruction.split("+") and stream_k_applies(M, N, splits, cfg, sms, f32))


def streamk_plan(M: int, N: int, K: int, cfg: LoweringConfig, programs: int) -> tuple[int, int]:
    """(programs, partial tiles) of a stream-K launch on ``programs`` SMs: at most one
    program an iteration; a partial tile a segment of ``streamk_shares``."""
    k = cdiv(K, cfg.block_k)
    tiles = cdiv(M, cfg.block_m) * cdiv(N, cfg.block_n)
    p = max(1, min(programs, tiles * k))
    return p, _streamk_host_tables(tiles, k, p, STREAM_K_LOCKSTEP)[0][-1]


@functools.lru_cache(maxsize=256)
def _streamk_host_tables(tiles: int, k_steps: int, programs: int, lockstep: bool) -> tuple[list[int], ...]:
    """``streamk_tables``, once a shape (the scratch count and the launch read it)."""
    return streamk_tables(tiles, k_steps, programs, lockstep)


# (device, tiles, K-steps, programs, lockstep) -> the tables on the device: built at a shape's
# first launch (a step runs its launch list once before its CUDA graph is captured, and a
# graph cannot capture the host-to-device copy), read by every launch after it
_STREAMK_TABLES: dict[tuple, tuple[torch.Tensor, ...]] = {}


def _streamk_device_tables(device: torch.device, tiles: int, k_steps: int, programs: int) -> tuple[torch.Tensor, ...]:
    key = (str(device), tiles, k_steps, programs, STREAM_K_LOCKSTEP)
    if key not in _STREAMK_TABLES:
        _STREAMK_TABLES[key] = tuple(torch.tensor(t, dtype=torch.int32, device=device)
                                     for t in _streamk_host_tables(tiles, k_steps, programs, STREAM_K_LOCKSTEP))
    return _STREAMK_TABLES[key]


@functools.lru_cache(maxsize=None)
def streamk_kernels(cfg: LoweringConfig, tma: TmaLayout, has_bias: bool, precision: str, in_dtype: str,
                    out_dtype: str, prerounded: tuple[str, ...], interpreted: bool = False, cvt: bool = False):
    """(main, fix-up, source path) of ``streamk_source`` (``interpreted`` and ``cvt``, ``rn_cvt()``'s
    value, key the cache)."""
    key_cfg = LoweringConfig(kind="matmul", block_m=cfg.block_m, block_n=cfg.block_n, block_k=cfg.block_k,
                             group_m=cfg.group_m, instruction=cfg.instruction)  # (the path: _register_a)
    src = streamk_source(key_cfg, tma, has_bias=has_bias, precision=precision, in_dtype=in_dtype,
                         out_dtype=out_dtype, prerounded=prerounded)
    main, path = load_kernel(src, "matmul_streamk")
    return main, load_kernel(src, "matmul_streamk_fixup")[0], str(path)


def matmul_source(
    cfg: LoweringConfig,
    *,
    has_bias: bool,
    precision: str,
    out_dtype="float32",
    in_dtype="float32",
    batched: bool = False,
    index_64: bool = False,
    tma: TmaLayout | None = None,
    prerounded: tuple[str, ...] = (),
    name: str = "matmul_kernel",
    epilogue: Epilogue | None = None,
    serial: bool = False,
    last: bool = False,
    prologue: Prologue | None = None,
) -> str:
    """Triton source for one matmul kernel (plus the split-K reduction when
    ``cfg.split_k > 1``, named ``<name>_reduce``; with ``serial``, no epilogue, the
    splits add up in the kernel instead: ``SERIAL_SPLIT``; with ``last``, no epilogue,
    the last split of a tile to finish adds them up: ``LAST_SPLIT_SUMS``). With ``tma`` the operand tiles are
    fetched through host-built tensor descriptors (Hopper TMA; out-of-bounds boxes
    read as zeros, so the loads need no masks); otherwise through pointers.
    ``prerounded`` names the operands ("a", "b") a staging pass already rounded to
    tf32: ``tf32-rn`` rounds only the others in the kernel. ``epilogue`` replaces C's
    store (in the reduction kernel when split): its operands and outputs are
    pointer arguments after A, B (and C, the partials, when split), their strides
    after every other stride. ``prologue`` computes A from its tile as loaded
    (``Prologue``): its vectors are pointer arguments after the epilogue's."""
    _check_config(cfg)
    if epilogue is not None and has_bias:
        raise ValueError("matmul: a bias and an epilogue (the epilogue holds the bias add)")
    if precision not in PRECISIONS:
        raise ValueError(f"matmul: precision must be one of {PRECISIONS}, got {precision!r}")
    in_name, out_name = _dtype_name(in_dtype), _dtype_name(out_dtype)
    split = cfg.split_k > 1
    persistent = bool(cfg.persistent)
    if serial and (not split or epilogue is not None or persistent):
        raise ValueError("matmul: the serial split-K kernel is a split, one-program-per-work-item kernel storing C "
                         "(no epilogue)")
    if last and (serial or not split or epilogue is not None or persistent):
        raise ValueError("matmul: the last-split sums are a split, one-program-per-work-item kernel storing C "
                         "(no epilogue, not serial)")
    split_partials = split and not serial  # each split writes an fp32 partial tile, [S, B, M, N]
    kernel_bias = has_bias and (not split or serial or last)  # added here, not by the reduction kernel

    if prologue is not None and tma is not None and tma.ws:
        raise ValueError("matmul: an operand prologue runs in the kernel without warp specialization")
    # (a rounding prologue's A is the dot's as it is: not rounded again)
    dot_pre = tuple(sorted({*prerounded, "a"})) if prologue is not None and prologue.rounded else prerounded
    cast, dot = _dot_text(in_name, precision, dot_pre,
                          _register_a(cfg, tma, in_name, precision, dot_pre, prologue is not None))

    idx = ".to(tl.int64)" if index_64 else ""
    fused = epilogue is not None and not split  # this kernel runs the epilogue
    c_tma = tma is not None and tma.c
    if c_tma and (fused or split):
        raise ValueError("matmul: C through a descriptor is the one-pass kernel's store (no split, no epilogue)")
    e_tma = tma is not None and tma.e
    if e_tma and not fused:
        raise ValueError("matmul: epilogue outputs through descriptors are the one-pass kernel's (an epilogue, no split)")
    ws = tma is not None and tma.ws
    if ws and (serial or batched or not persistent or c_tma or e_tma or (in_name == "float32" and not ws_f32_reads(
            precision, prerounded, tma))):
        raise ValueError("matmul: the warp-specialized kernel is the persistent 2-D kernel on 16-bit operands (or fp32 "
                         "ones rounded to tf32 before it, both K-major), storing through pointers (no batch, no C or "
                         "epilogue descriptors, split-K in two passes)")
    params = ["a_ptr", "b_ptr"] if ws or not tma else ["a_desc", "b_desc"]
    if not fused:
        params.append("c_desc" if c_tma else "c_ptr")
    if kernel_bias:
        params.append("bias_ptr")
    if serial:  # the running sums' workspace [B, M, N] f32 and a lock a tile (zeros at launch)
        params += ["ws_ptr", "lock_ptr"]
    if last:  # C (c_ptr is the partials' workspace) and a count a tile (zeros at launch)
        params += ["out_ptr", "count_ptr"]
    ep_ptrs, ep_strides = _epilogue_params(epilogue) if fused else ([], [])
    params += ep_ptrs
    params += [f"pv_{n}" for n, _ in prologue.vectors] if prologue is not None else []
    params += ["M", "N", "K"]
    if split:
        params += ["K_SPLIT", "SPLITS"]
    if batched:
        params.append("BATCH")
    if ws:  # each operand's one stride that is not 1 (its descriptor is built in the kernel)
        params += ["stride_a", "stride_b"]
    if not tma:
        params += ["stride_am", "stride_ak", "stride_bk", "stride_bn"]
    if not fused and not c_tma:
        params += ["stride_cm", "stride_cn"]
    if batched:
        params += [] if tma else ["stride_ab", "stride_bb"]
        params += [] if fused or c_tma else ["stride_cb"]
    if split_partials:
        params.append("stride_cs")
    if kernel_bias:
        params.append("stride_bias")
    if last:
        params += ["stride_om", "stride_on"] + (["stride_ob"] if batched else [])
    params += ep_strides
    if ws:  # constants of the partitioned loop (a runtime grid size did not finish on the H200)
        params += ["NUM_PROGS: tl.constexpr", "STAGES: tl.constexpr"]
    elif persistent:
        params.append("NUM_PROGS")
    params.append("EVEN: tl.constexpr")

    def place(work: str, p: str) -> str:
        """Work item ``work`` -> (batch, split, tile) -> the tile's (pid_m, pid_n) under the
        group-M swizzle, as variables prefixed ``p``; the tile index is fastest."""
        lines = [f"{p}tile = {work} % tiles"]
        rest = f"{work} // tiles"
        if split:
            lines.append(f"{p}pid_s = ({rest}) % SPLITS")
            rest = f"{work} // (tiles * SPLITS)"
        if batched:
            lines.append(f"{p}pid_b = {rest}")
        lines += _place_lines(p, f"{p}tile")
        return "\n        ".join(lines)

    a_base, b_base, c_base = "a_ptr", "b_ptr", "c_ptr"
    if batched:
        a_base = "a_ptr + pid_b.to(tl.int64) * stride_ab"
        b_base = "b_ptr + pid_b.to(tl.int64) * stride_bb"
        c_base = "c_ptr + pid_b.to(tl.int64) * stride_cb"
    if split_partials:
        c_base += " + pid_s.to(tl.int64) * stride_cs"
    if split:
        k_range = "k0 = pid_s * K_SPLIT\n        k_len = tl.minimum(K - k0, K_SPLIT)"
    else:
        k_range = "k0 = 0\n        k_len = K"

    if tma:
        a_load = _tma_load("a_desc", tma.a == "row", tma.a_batched, "pid_m * BLOCK_M", "BLOCK_M", k_last=True)
        b_load = _tma_load("b_desc", tma.b == "col", tma.b_batched, "pid_n * BLOCK_N", "BLOCK_N", k_last=False)
        operands = ""
        loads = f"""\
            # tensor-descriptor (TMA) loads: boxes past M, N or K read as zeros
            a = {a_load}
            b = {b_load}"""
        advance = ""
    else:
        operands = f"""
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = {a_base} + offs_m[:, None] * stride_am + (k0 + offs_k)[None, :] * stride_ak
        b_ptrs = {b_base} + (k0 + offs_k)[:, None] * stride_bk + offs_n[None, :] * stride_bn"""
        loads = """\
            if EVEN:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                a = tl.load(a_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_len - k), other=0.0)
                b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_len - k) & mask_n[None, :], other=0.0)"""
        advance = """
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk"""

    bias = ""
    if has_bias and not split:
        bias = (
            "\n        bias = tl.load(bias_ptr + offs_n * stride_bias, mask=offs_n < N, other=0.0)"
            "\n        acc += bias.to(tl.float32)[None, :]"
        )
    store_ty = "tl.float32" if split_partials else _TL_DTYPE[out_name]
    if c_tma:
        # the tile's place again, from a second counter: in the flattened persistent loop the
        # next tile's loads are issued before this store, and its indices need not stay live
        again = f"work_c += NUM_PROGS\n        {place('work_c', 'c_')}\n        " if persistent else ""
        pm, pn, pb = ("c_pid_m", "c_pid_n", "c_pid_b") if persistent else ("pid_m", "pid_n", "pid_b")
        lead = f"{pb}, " if tma.c_batched else ""
        halves = [(f"{pm} * BLOCK_M", f"{pn} * BLOCK_N"), (f"{pm} * BLOCK_M", f"{pn} * BLOCK_N + BLOCK_N // 2")]
        shape = "(1, BLOCK_M, BLOCK_N // 2)" if tma.c_batched else None
        puts = "\n        ".join(
            f"c_desc.store([{lead}{r}, {c}], {'tl.reshape(' + h + ', ' + shape + ')' if shape else h})"
            for (r, c), h in zip(halves, ("c_lo", "c_hi")))
        store = f"""\
        {again}# C through its descriptor, in two column halves
        c = tl.permute(tl.reshape(acc.to({store_ty}), (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
        c_lo, c_hi = tl.split(c)
        {puts}
"""
    elif fused:
        rows = ("pid_b.to(tl.int64) * M + offs_m" if index_64 else "pid_b * M + offs_m") if batched else "offs_m"
        # a descriptor's box starts at the tile's first row of [BATCH * M, N] (M a multiple of BLOCK_M when batched)
        box_row = ("pid_b * M + pid_m * BLOCK_M" if batched else "pid_m * BLOCK_M") if e_tma else None
        # (the partitioned loop takes no reshape or split of the accumulator: one slice)
        lines = _sliced_epilogue(epilogue, cfg.block_m, cfg.block_n, rows, idx, box_row, slices=1 if ws else None)
        store = "\n".join("        " + ln for ln in lines) + "\n"
    else:
        store = f"""\
        c_ptrs = {c_base} + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
        c = acc.to({store_ty})
        if EVEN:
            tl.store(c_ptrs, c)
        else:
            tl.store(c_ptrs, c, mask=mask_m[:, None] & mask_n[None, :])
"""
    if serial:
        w_base = "ws_ptr + pid_b.to(tl.int64) * M * N" if batched else "ws_ptr"
        lock = "lock_ptr + pid_b * tiles + tile" if batched else "lock_ptr + tile"
        final_bias = ("\n            bias = tl.load(bias_ptr + offs_n * stride_bias, mask=offs_n < N, other=0.0)"
                      "\n            acc += bias.to(tl.float32)[None, :]") if has_bias else ""
        store = f"""\
        # the splits in split order: split s waits until split s - 1 has left the sum of splits
        # 0..s-1 in the workspace tile (its lock reads s), adds its own partial to it, and
        # hands it on; the last split adds the bias and stores C. The two-pass reduction's
        # sums, element for element, with no second kernel and the running tile in L2
        w_ptrs = {w_base} + offs_m[:, None] * N + offs_n[None, :]
        w_mask = mask_m[:, None] & mask_n[None, :]
        lock = {lock}
        if pid_s > 0:
            while tl.atomic_cas(lock, pid_s, pid_s, sem="acquire") != pid_s:
                pass
            acc = tl.load(w_ptrs, mask=w_mask, other=0.0, cache_modifier=".cg") + acc
        if pid_s == SPLITS - 1:{final_bias}
{textwrap.indent(store, "    ")}        else:
            tl.store(w_ptrs, acc, mask=w_mask, cache_modifier=".cg")
            tl.debug_barrier()  # every thread's part of the tile stored before the lock moves on
            tl.atomic_xchg(lock, pid_s + 1, sem="release")
"""

    if last:
        p_base = "c_ptr + pid_b.to(tl.int64) * stride_cb" if batched else "c_ptr"
        o_base = "out_ptr + pid_b.to(tl.int64) * stride_ob" if batched else "out_ptr"
        count = "count_ptr + pid_b * tiles + tile" if batched else "count_ptr + tile"
        last_bias = ("\n                sum_n += tl.load(bias_ptr + cols_n * stride_bias, mask=cols_n < N, other=0.0)"
                     ".to(tl.float32)[None, :]") if has_bias else ""
        slice_n = min(cfg.block_n, LAST_SUM_SLICE)
        store += f"""\
        # the last split of the tile to finish adds the partials up: each split stores its
        # partial, then counts itself in on the tile's counter; the one that finds SPLITS - 1
        # splits counted before it sums the S partials in split order, as the two-pass
        # reduction kernel does (the same sums, bit for bit), adds the bias and stores C.
        # No split waits on another, and no second kernel
        tl.debug_barrier()  # every thread's part of the partial stored before the count moves
        arrived = tl.atomic_add({count}, 1, sem="acq_rel")
        if arrived == SPLITS - 1:  # (in column slices: a whole f32 tile loaded beside the sum spills)
            for j in tl.static_range(0, BLOCK_N, {slice_n}):
                cols_n = pid_n * BLOCK_N + j + tl.arange(0, {slice_n}){idx}
                p_mask = mask_m[:, None] & (cols_n < N)[None, :]
                p_ptrs = {p_base} + offs_m[:, None] * stride_cm + cols_n[None, :] * stride_cn
                sum_n = tl.zeros((BLOCK_M, {slice_n}), dtype=tl.float32)
                for s in range(0, SPLITS):
                    sum_n += tl.load(p_ptrs, mask=p_mask, other=0.0, cache_modifier=".cg")
                    p_ptrs += stride_cs
{last_bias}
                o_ptrs = {o_base} + offs_m[:, None] * stride_om + cols_n[None, :] * stride_on
                tl.store(o_ptrs, sum_n.to({_TL_DTYPE[out_name]}), mask=p_mask)
"""

    pro_m = _prologue_lines(prologue, "m") if prologue is not None else ""
    pro_k = _prologue_lines(prologue, "k") if prologue is not None else ""
    body = f"""\
        # group-M swizzle: GROUP_M rows of tiles are walked column by column so
        # the A rows and B columns they share stay resident in L2
        {place("work", "")}
        offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)){idx}
        offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)){idx}
        {k_range}{operands}
        mask_m = offs_m < M
        mask_n = offs_n < N{pro_m}
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, k_len, BLOCK_K):
{loads}{pro_k}{cast}
            acc = {dot}{advance}{bias}
{store}"""
    if ws:
        # the form measured to run partitioned on the H200 (scripts/matmul_ws.py): the tile's
        # place, its K loop over whole BLOCK_Ks, then its indices and masks for the store
        # only, and the store always masked (the launch passes EVEN false). A first form, the
        # body above with its indices and masks before the K loop, the K loop from k0 and
        # unmasked stores, made an illegal memory access there (not narrowed down further)
        # a split's K loop: K_SPLIT // BLOCK_K whole steps from its first K (K_SPLIT is whole
        # BLOCK_Ks, split_k_plan), the same count for every split: the last split's steps past K
        # read zero boxes (both operands' boxes lie past K there, so they add 0 x 0)
        kk = "k0 + ki * BLOCK_K" if split else "ki * BLOCK_K"
        k_first = "\n        k0 = pid_s * K_SPLIT" if split else ""
        a_load = _tma_load("a_desc", tma.a == "row", False, "pid_m * BLOCK_M", "BLOCK_M", k_last=True, k=kk)
        b_load = _tma_load("b_desc", tma.b == "col", False, "pid_n * BLOCK_N", "BLOCK_N", k_last=False, k=kk)
        body = f"""\
        # group-M swizzle: GROUP_M rows of tiles are walked column by column so
        # the A rows and B columns they share stay resident in L2
        {place("work", "")}{k_first}
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            a = {a_load}
            b = {b_load}
            acc = {dot}
        offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)){idx}
        offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)){idx}
        mask_m = offs_m < M
        mask_n = offs_n < N{bias}
{store}"""
    if persistent:
        total = "tiles" + (" * SPLITS" if split else "") + (" * BATCH" if batched else "")
        # flatten: one software pipeline over the work items and their K loops, so the ring of
        # loads runs on into the next item while this one's epilogue stores (measured:
        # bench/results/runs/matmul_variants_3f4314c.json)
        first = "    work_c = tl.program_id(0) - NUM_PROGS\n" if c_tma else ""
        loop = (f"    total = {total}\n{first}"
                "    for work in tl.range(tl.program_id(0), total, NUM_PROGS, flatten=True):\n")
        if ws:
            steps = "K_SPLIT // BLOCK_K" if split else "tl.cdiv(K, BLOCK_K)"
            loop = f"    total = {total}\n    k_tiles = {steps}\n" + _ws_descriptors(tma) + (
                "    # warp-specialized: Triton splits this loop into a warp group issuing the loads\n"
                "    # and two computing ones (each half of the tile's rows), ring of STAGES buffers\n"
                "    for work in tl.range(tl.program_id(0), total, NUM_PROGS, warp_specialize=True,"
                " num_stages=STAGES):\n")
    else:
        loop = "    work = tl.program_id(0)\n"
        body = textwrap.indent(textwrap.dedent(body), "    ")
    # the split count and the persistent grid size vary from shape to shape: keep
    # them out of Triton's integer specialisation (== 1, % 16) so they share a binary
    dns = [p for p in ("SPLITS", "NUM_PROGS") if p in params]
    decorator = f"@triton.jit(do_not_specialize={dns})\n" if dns else "@triton.jit\n"
    kernel = (
        decorator
        + f"def {name}(\n    " + ",\n    ".join(params) + ",\n):\n"
        "    num_pid_m = tl.cdiv(M, BLOCK_M)\n"
        "    num_pid_n = tl.cdiv(N, BLOCK_N)\n"
        "    tiles = num_pid_m * num_pid_n\n"
        "    tiles_per_group = GROUP_M * num_pid_n\n" + loop + body
    )

    header = textwrap.dedent(f"""\
        # Generated by nova.codegen.triton.matmul; do not edit.
        # block {cfg.block_m}x{cfg.block_n}x{cfg.block_k}, group_m {cfg.group_m}, split_k {'yes' if split else 'no'}, \
persistent {'yes' if persistent else 'no'}{', warp-specialized' if ws else ''}
        # in {in_name}, out {out_name}, precision {precision}, bias {'yes' if has_bias else 'no'}, \
batched {'yes' if batched else 'no'}, index {'int64' if index_64 else 'int32'}
        # epilogue {_describe(epilogue)}{'; A from a prologue: ' + ', '.join(n + ' by ' + ax for n, ax in prologue.vectors) + (', rounded to tf32 there' if prologue.rounded else '') if prologue is not None else ''}
        # operands {'through tensor descriptors (TMA): ' + repr(tma) if tma else 'through pointers'}\
{', rounded to tf32 before the kernel (staged, or by the caller): ' + ' '.join(prerounded) if prerounded else ''}
        import triton
        import triton.language as tl

        BLOCK_M = tl.constexpr({cfg.block_m})
        BLOCK_N = tl.constexpr({cfg.block_n})
        BLOCK_K = tl.constexpr({cfg.block_k})
        GROUP_M = tl.constexpr({cfg.group_m})
        """)
    helpers = epilogue.helpers.strip("\n") + "\n\n\n" if epilogue is not None and epilogue.helpers else ""
    if prologue is not None and prologue.rounded:
        helpers += tf32_rn_fn().strip("\n") + "\n\n\n"
    text = header + "\n\n" + helpers + kernel
    if split_partials and not last:
        text += "\n\n" + _reduce_source(name + "_reduce", has_bias, _TL_DTYPE[out_name], epilogue)
    for j, c in enumerate(epilogue.sums if epilogue is not None else ()):
        text += "\n\n" + colsum_source(f"{name}_colsum{j}", c.acc, tag(c.dtype))
    return text


# The epilogue works through the accumulator in column slices, one at a time, so
# that its values of a whole tile are never live beside the accumulator at once: a
# slice holds at most EPILOGUE_SLICE / epilogue_streams accumulator elements (the
# tile-sized values it moves, in 16-bit halves of a register per element). sm_90
# gives a thread at most 255 registers, and 65536 / (2 x 256) = 128 when two 8-warp
# blocks share an SM (the configurator's short-K rule, 6c); the accumulator alone
# takes 64 (128x128, 8 warps) or 128 (128x256). ptxas -v of offline sm_90a builds of
# the GPT-2 124M bf16 step's epilogues at its configs (TMA; scripts/epilogue_sm90_check.py),
# registers (+ spill bytes) for 1 / 2 / 4 / 8 / 16 slices, [streams]:
#   128x128x64 w8 s3 (plain 90):
#     bias, cast [1]                       92   90   94   90
#     bias, GELU, cast [2]                 96   94   97   90
#     bias, GELU, cast, f32 kept [3]      145  150  137  119
#     bias, residual, f32 out [5]         188  183  110   92
#     GELU backward [5]                   255  130  116  104
#     GELU recomputed + backward [5]      255+3988  255+1244  255  207
#   128x256x64 w8 s4 (plain 158):
#     cast to f32 [2]                     154  158  154  154  154
#     bias, residual, f32 out [4]         255+236  255+24  222  191  164
# Slicing never cost registers; this constant is the largest that keeps every one of
# these at 128x128 within two blocks per SM (but the recompute, whose 207 no slicing
# lowers) and spills nothing. More slices only unroll the epilogue further: compile
# time of the recompute 2.1 s in 4 slices, 3.1 s in 8.
EPILOGUE_SLICE = 8192


def epilogue_streams(ep: Epilogue) -> int:
    """The registers an epilogue's tile-sized values take per element, in 16-bit
    halves of a register: each output and each operand read at every element (one
    with a leading and the last dim; a bias row or a scalar is not), by its size
    (bf16 1, f32 2), and each column sum's value in its accumulator type (f32 2:
    so GELU's backward with its bias gradient's sum slices as it did with the f32
    output it replaces)."""
    rank = len(ep.shape)

    def full(op) -> bool:
        dims = {d for _, d, _ in op.terms(rank)}
        return rank - 1 in dims and any(d < rank - 1 for d in dims)

    halves = [op.dtype.itemsize // 2 or 1 for op in ep.operands if full(op)]
    halves += [d.itemsize // 2 or 1 for _, _, d in ep.stores]
    halves += [c.acc_dtype.itemsize // 2 for c in ep.sums]  # the value widened to its accumulator
    return max(1, sum(halves))


def epilogue_slices(ep: Epilogue, block_m: int, block_n: int) -> int:
    """How many column slices the main kernel's epilogue takes (a power of two;
    slices of at least 16 columns): slices of at most ``EPILOGUE_SLICE /
    epilogue_streams`` elements."""
    limit = EPILOGUE_SLICE // epilogue_streams(ep)
    n = 1
    while block_m * block_n // n > limit and block_n // (2 * n) >= 16:
        n *= 2
    return n


def _sliced_epilogue(ep: Epilogue, block_m: int, block_n: int, rows: str, idx: str,
                     box_row: str | None = None, slices: int | None = None) -> list[str]:
    """The main kernel's epilogue, over ``epilogue_slices`` column slices of the
    accumulator in turn (one slice: the whole tile), or ``slices``. ``box_row``: the
    tile's first row when the outputs are descriptors."""
    n = epilogue_slices(ep, block_m, block_n) if slices is None else slices
    lines = ["e_rows = " + rows]
    boxes = [(box_row, f"pid_n * BLOCK_N + {h * (block_n // n)}") if box_row else None for h in range(n)]
    if ep.sums:  # the tile's row of the column sums' partials: batch-major, as the tiles' rows
        lines.append("e_prow = (" + ("pid_b * num_pid_m + pid_m" if "pid_b" in rows else "pid_m") + ")" + idx)
    if n == 1:
        parts = [("offs_n", "mask_n", "acc")]
    else:  # acc[:, h * w : (h + 1) * w] for each h: split the column index into (h, j), h last
        w = block_n // n
        bits = n.bit_length() - 1
        # [BM, BN] as [BM, 2, .., 2, w] (the bits of h, highest first), then [BM, w, bits...]:
        # tl.split halves the last dim (size 2), so the lowest bit of h is split off first
        lines.append(f"e_split = tl.reshape(acc, (BLOCK_M{', 2' * bits}, {w}))")
        lines.append(f"e_split = tl.permute(e_split, (0, {bits + 1}, {', '.join(str(d) for d in range(1, bits + 1))}))")
        names = ["e_split"]
        for _ in range(bits):
            new = []
            for x in names:
                lines.append(f"{x}_0, {x}_1 = tl.split({x})")
                new += [f"{x}_0", f"{x}_1"]
            names = new
        # a name's i-th suffix is bit i of h
        order = sorted(names, key=lambda x: sum(int(b) << i for i, b in enumerate(x.split("_")[2:])))
        parts = []
        for h, name in enumerate(order):
            lines.append(f"e_n{h} = (pid_n * BLOCK_N + {h * w} + tl.arange(0, {w})){idx}")
            lines.append(f"e_mask_n{h} = e_n{h} < N")
            parts.append((f"e_n{h}", f"e_mask_n{h}", name))
    for even in (True, False):
        lines.append("if EVEN:" if even else "else:")
        if ep.row_stats:
            lines += ["    e_rm = tl.full((BLOCK_M,), float('-inf'), tl.float32)", "    e_rs = tl.zeros((BLOCK_M,), tl.float32)"]
        for (cols, mask, tile), box in zip(parts, boxes, strict=True):
            lines += ["    " + ln for ln in epilogue_lines(ep, True, not even, cols, mask, tile, box)]
        if ep.row_stats:  # the tile's column of the statistics [rows, cdiv(N, BLOCK_N)]
            at = "e_rows * tl.cdiv(N, BLOCK_N) + pid_n"
            mask = "" if even else ", mask=mask_m"
            lines += [f"    tl.store(rm + {at}, e_rm{mask})", f"    tl.store(rs + {at}, e_rs{mask})"]
    return lines


def _ws_descriptors(tma: TmaLayout) -> str:
    """The warp-specialized kernel's descriptors of A and B, built on the device (in the
    global scratch Triton's launcher allocates: ``_ws_allocator``), laid out like the
    operand in memory as ``_tma_load`` reads them."""
    a = ("[M, K]", "[BLOCK_M, BLOCK_K]") if tma.a == "row" else ("[K, M]", "[BLOCK_K, BLOCK_M]")
    b = ("[N, K]", "[BLOCK_N, BLOCK_K]") if tma.b == "col" else ("[K, N]", "[BLOCK_K, BLOCK_N]")
    return "".join(f"    {x}_desc = tl.make_tensor_descriptor({x}_ptr, shape={shape}, strides=[stride_{x}, 1], "
                   f"block_shape={box})\n" for x, (shape, box) in (("a", a), ("b", b)))


def _describe(ep: Epilogue | None) -> str:
    if ep is None:
        return "none (C stored)"
    sums = f", column sums {', '.join(str(c.dtype).removeprefix('torch.') for c in ep.sums)}" if ep.sums else ""
    return (f"over {list(ep.shape)}: {len(ep.operands)} operands, "
            f"outputs {', '.join(str(d).removeprefix('torch.') for _, _, d in ep.stores)}{sums}")


def _tma_load(desc: str, k_contiguous: bool, batched: bool, offset: str, size: str, k_last: bool,
              k: str = "k0 + k") -> str:
    """One operand tile through a descriptor. The box is laid out like the operand in
    memory ([size, BLOCK_K] when K is the contiguous dim, else [BLOCK_K, size]);
    ``k_last`` says which way round the dot wants it (A: [BLOCK_M, BLOCK_K], B:
    [BLOCK_K, BLOCK_N]), and a box the other way round is transposed after loading.
    ``k``: the K coordinate of the box."""
    coords, box = ([offset, k], [size, "BLOCK_K"]) if k_contiguous else ([k, offset], ["BLOCK_K", size])
    if batched:
        text = f"{desc}.load([pid_b, {coords[0]}, {coords[1]}]).reshape({box[0]}, {box[1]})"
    else:
        text = f"{desc}.load([{coords[0]}, {coords[1]}])"
    return text if k_contiguous == k_last else f"tl.trans({text})"


def _reduce_kernel(name: str, params: str, body: str) -> str:
    """A split-K reduction kernel: ``body`` under its signature (SPLITS unspecialized)."""
    return f"""\
@triton.jit(do_not_specialize=["SPLITS"])
def {name}(
    {params}
):
{body}"""


# the flat reduction's sum: element offs of the [B, M, N] result, the partials added in split order
_FLAT_SUM = f"""\
    offs = tl.program_id(0).to(tl.int64) * {REDUCE_BLOCK} + tl.arange(0, {REDUCE_BLOCK})
    mask = offs < TOTAL
    acc = tl.zeros(({REDUCE_BLOCK},), dtype=tl.float32)
    for s in range(0, SPLITS):
        acc += tl.load(ws_ptr + s * stride_ws + offs, mask=mask, other=0.0)
"""


def _reduce_source(name: str, has_bias: bool, out_ty: str, epilogue: Epilogue | None = None) -> str:
    """Second split-K pass: sum the partials in split order (deterministic), add the
    bias, cast, store through C's strides (or run the epilogue on the sum). The
    workspace is contiguous [S, B, M, N]."""
    if epilogue is not None and epilogue.sums:
        return _reduce_tiles_source(name, epilogue)
    if epilogue is not None:
        ptrs, strides = _epilogue_params(epilogue)
        lines = "\n".join("    " + ln for ln in epilogue_lines(epilogue, False, True))
        params = f"ws_ptr, {', '.join(ptrs)}, M, N, TOTAL, SPLITS, stride_ws, {''.join(st + ', ' for st in strides)}"
        return _reduce_kernel(name, params, _FLAT_SUM + lines + "\n")
    bias_param = "bias_ptr, stride_bias, " if has_bias else ""
    bias = (
        "\n    acc += tl.load(bias_ptr + n * stride_bias, mask=mask, other=0.0).to(tl.float32)" if has_bias else ""
    )
    params = f"ws_ptr, c_ptr, {bias_param}M, N, TOTAL, SPLITS, stride_ws, stride_cb, stride_cm, stride_cn,"
    return _reduce_kernel(name, params, _FLAT_SUM + f"""\
    n = offs % N
    m = (offs // N) % M
    b = offs // (M * N){bias}
    tl.store(c_ptr + b * stride_cb + m * stride_cm + n * stride_cn, acc.to({out_ty}), mask=mask)
""")


def _reduce_tiles_source(name: str, ep: Epilogue) -> str:
    """The split-K reduction of an epilogue with column sums: the same sums of the
    partials in split order (each element as the flat kernel adds it), over
    [REDUCE_ROWS, REDUCE_COLS] tiles of the [batch x M, N] result (program (r, n)),
    so the epilogue runs as in the main kernel's two-D form and each tile stores
    its row ``r`` of the column sums' partials [cdiv(batch x M, REDUCE_ROWS), N]."""
    ptrs, strides = _epilogue_params(ep)
    lines = "\n".join("    " + ln for ln in epilogue_lines(ep, True, True))
    params = f"ws_ptr, {', '.join(ptrs)}, M, N, ROWS, SPLITS, stride_ws, {''.join(st + ', ' for st in strides)}"
    return _reduce_kernel(name, params, f"""\
    pid_r = tl.program_id(0)
    offs_m = pid_r.to(tl.int64) * {REDUCE_ROWS} + tl.arange(0, {REDUCE_ROWS})
    offs_n = tl.program_id(1).to(tl.int64) * {REDUCE_COLS} + tl.arange(0, {REDUCE_COLS})
    mask_m = offs_m < ROWS
    mask_n = offs_n < N
    offs = offs_m[:, None] * N + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    acc = tl.zeros(({REDUCE_ROWS}, {REDUCE_COLS}), dtype=tl.float32)
    for s in range(0, SPLITS):
        acc += tl.load(ws_ptr + s * stride_ws + offs, mask=mask, other=0.0)
    e_rows = offs_m
    e_prow = pid_r.to(tl.int64)
{lines}
""")


def colsum_source(name: str, acc: str, out: str) -> str:
    """The column sums' final pass: ``out[n] = sum over p of partials[p, n]``, the
    partials [P, N] (register type ``acc``: fp32, fp64 for f64) added in
    COLSUM_ROWS-row chunks in chunk order into a [COLSUM_ROWS, COLSUM_COLS]
    accumulator, then its rows by ``tl.sum`` (a fixed tree), rounded once to
    ``out``: the same order every run (no atomics). Program j owns COLSUM_COLS
    columns."""
    ty = {"f32": "tl.float32", "f64": "tl.float64"}[acc]
    return f"""\
@triton.jit
def {name}(part_ptr, out_ptr, P, N):
    cols = tl.program_id(0).to(tl.int64) * {COLSUM_COLS} + tl.arange(0, {COLSUM_COLS})
    cmask = cols < N
    acc = tl.zeros(({COLSUM_ROWS}, {COLSUM_COLS}), dtype={ty})
    for p0 in range(0, P, {COLSUM_ROWS}):
        rows = p0 + tl.arange(0, {COLSUM_ROWS}).to(tl.int64)
        m = (rows < P)[:, None] & cmask[None, :]
        acc += tl.load(part_ptr + rows[:, None] * N + cols[None, :], mask=m, other=0.0)
    total = tl.sum(acc, axis=0)
    tl.store(out_ptr + cols, {convert("total", acc, out)}, mask=cmask)
"""


def column_sum_rows(M: int, batch: int, cfg: LoweringConfig | None, splits: int | None = None) -> int:
    """P, the rows of a column sum's partials [P, N] for C[batch, M, N] under
    ``cfg``: one per output tile's rows, batch x cdiv(M, BLOCK_M) (the tile grid
    and the persistent kernel), or cdiv(batch x M, REDUCE_ROWS) where split-K's
    reduction runs the epilogue (``splits``: the launch's split count, else the
    config's plan without K); ``cfg=None`` (the configurator picks at launch):
    the most of both, BLOCK_M >= 16."""
    if cfg is None:
        return max(batch * cdiv(M, 16), cdiv(batch * M, REDUCE_ROWS))
    split = cfg.split_k > 1 if splits is None else splits > 1
    return cdiv(batch * M, REDUCE_ROWS) if split else batch * cdiv(M, cfg.block_m)


STAGE_BLOCK = 64  # square tile of the staging copy: 64 fp32 = two 128-byte lines per row


def stage_source(name: str = "stage_kernel") -> str:
    """Staging pass of the tf32 path: copy a [batch, R, C] fp32 operand through any
    strides into a dense buffer of any strides, rounding every element to nearest
    tf32 (``TF32_RN``). A transposing copy (K-major destination of an N-major B) is
    the same text with the strides swapped: Triton's coalescing pass gives the load
    and the store each their own contiguous layout and converts between them
    through shared memory."""
    rn = textwrap.indent(TF32_RN.format(x="x"), " " * 4)
    return f"""\
# Generated by nova.codegen.triton.matmul; do not edit.
# tf32 staging copy: round to nearest tf32, any strides in and out
import triton
import triton.language as tl


@triton.jit
def {name}(
    src_ptr, dst_ptr, R, C, TILES_C, stride_sb, stride_sr, stride_sc, stride_db, stride_dr, stride_dc,
):
    tile = tl.program_id(0)
    pid_b = tl.program_id(1).to(tl.int64)
    offs_r = (tile // TILES_C) * {STAGE_BLOCK} + tl.arange(0, {STAGE_BLOCK})
    offs_c = (tile % TILES_C) * {STAGE_BLOCK} + tl.arange(0, {STAGE_BLOCK})
    mask = (offs_r < R)[:, None] & (offs_c < C)[None, :]
    r64 = offs_r.to(tl.int64)[:, None]
    c64 = offs_c.to(tl.int64)[None, :]
    x = tl.load(src_ptr + pid_b * stride_sb + r64 * stride_sr + c64 * stride_sc, mask=mask, other=0.0)
{rn}
    tl.store(dst_ptr + pid_b * stride_db + r64 * stride_dr + c64 * stride_dc, x, mask=mask)
"""


@functools.lru_cache(maxsize=None)
def _stage_kernel(interpreted: bool):  # the flag keys the cache: @triton.jit builds another object
    return load_kernel(stage_source(), "stage_kernel")[0]


def _record_stage(record: dict | None) -> None:
    """``record`` (``matmul``'s) receives the staging kernel's source as "tf32_stage"."""
    if record is not None and "tf32_stage" not in record:
        record["tf32_stage"] = kernel_source(_stage_kernel(interpreting()))


def stage_tf32(src: torch.Tensor, dst: torch.Tensor, record: dict | None = None) -> torch.Tensor:
    """``dst[...] = round_to_tf32(src)`` for 3-D fp32 tensors of one shape (any strides);
    ``record`` (``matmul``'s) receives the staging kernel's source as "tf32_stage"."""
    if src.shape != dst.shape or src.dim() != 3 or src.dtype != torch.float32 or dst.dtype != torch.float32:
        raise ValueError(f"stage_tf32: needs two 3-D float32 tensors of one shape, got {src.shape} and {dst.shape}")
    kern = _stage_kernel(interpreting())
    _record_stage(record)
    B, R, C = src.shape
    tiles_c = cdiv(C, STAGE_BLOCK)
    grid = (cdiv(R, STAGE_BLOCK) * tiles_c, B)
    kern[grid](src, dst, R, C, tiles_c, *src.stride(), *dst.stride(), num_warps=4)
    return dst


def _stage_operands(a3: torch.Tensor, b3: torch.Tensor, stage_a: bool, stage_b: bool, launch: bool = True):
    """The staged tf32 path's operands: ``stage_a`` copies A into a dense [Ba, M, K]
    (K contiguous), ``stage_b`` copies B into a dense [Bb, N, K] seen as [Bb, K, N]
    (K contiguous: what tf32 wgmma reads from shared memory), both rounded to nearest
    tf32 on the way. An expanded (stride-0) batch is staged once. ``launch=False``
    only shapes the buffers (``precompile`` on meta tensors). Returns (a3, b3, names
    of the staged operands); the kernel rounds the others itself."""
    staged = []

    def matrices(t3):
        return 1 if t3.shape[0] == 1 or t3.stride(0) == 0 else t3.shape[0]

    if stage_a:
        n = matrices(a3)
        dense = torch.empty((n, a3.shape[1], a3.shape[2]), dtype=torch.float32, device=a3.device)
        a3 = stage_tf32(a3[:n], dense) if launch else dense
        staged.append("a")
    if stage_b:
        n = matrices(b3)
        dense = torch.empty((n, b3.shape[2], b3.shape[1]), dtype=torch.float32, device=b3.device)
        b3 = stage_tf32(b3[:n], dense.transpose(1, 2)) if launch else dense.transpose(1, 2)
        staged.append("b")
    return a3, b3, tuple(staged)


@dataclass(frozen=True)
class MatmulKernels:
    main: object  # triton JITFunction
    reduce: object | None  # split-K second pass
    path: str  # the generated source file
    colsums: tuple = ()  # the final pass of each column sum of the epilogue (colsum_source)


@functools.lru_cache(maxsize=None)
def matmul_kernels(
    cfg: LoweringConfig,
    has_bias: bool,
    precision: str,
    out_dtype: str,
    in_dtype: str,
    batched: bool,
    index_64: bool,
    interpreted: bool = False,  # part of the key: @triton.jit builds a different object
    tma: TmaLayout | None = None,
    cvt: bool = False,  # part of the key: rn_cvt(), the tf32 rounding's form in the text
    prerounded: tuple[str, ...] = (),
    epilogue: Epilogue | None = None,
    serial: bool = False,
    last: bool = False,
    prologue: Prologue | None = None,
) -> MatmulKernels:
    # num_warps / num_stages / the split count are launch-time: keep them out of the text
    key_cfg = LoweringConfig(
        kind="matmul",
        block_m=cfg.block_m,
        block_n=cfg.block_n,
        block_k=cfg.block_k,
        group_m=cfg.group_m,
        split_k=2 if cfg.split_k > 1 else 1,
        persistent=cfg.persistent,
        instruction=cfg.instruction,  # the path (_register_a: a wgmma kernel's A through registers)
    )
    src = matmul_source(
        key_cfg,
        has_bias=has_bias,
        precision=precision,
        out_dtype=out_dtype,
        in_dtype=in_dtype,
        batched=batched,
        index_64=index_64,
        tma=tma,
        prerounded=prerounded,
        epilogue=epilogue,
        serial=serial,
        last=last,
        prologue=prologue,
    )
    main, path = load_kernel(src, "matmul_kernel")
    reduce = load_kernel(src, "matmul_kernel_reduce")[0] if cfg.split_k > 1 and not serial and not last else None
    sums = tuple(load_kernel(src, f"matmul_kernel_colsum{j}")[0] for j in range(len(epilogue.sums if epilogue else ())))
    return MatmulKernels(main, reduce, str(path), sums)


# --------------------------------------------------------------------------- launcher


def cdiv(x: int, y: int) -> int:
    return -(-x // y)


def split_k_plan(K: int, cfg: LoweringConfig) -> tuple[int, int]:
    """(K elements per split, number of splits): chunks are whole BLOCK_Ks, and
    splits that would get no K at all are dropped."""
    k_split = cdiv(cdiv(K, cfg.split_k), cfg.block_k) * cfg.block_k
    return k_split, cdiv(K, k_split)


def scratch_bytes(
    M: int, N: int, K: int, batch: int, a_dtype, b_dtype, out_dtype, cfg: LoweringConfig | None,
    *, precision: str | None = None, device: torch.device | None = None, column_sums: tuple = (),
    epilogue: bool = False,
) -> int:  # fmt: skip
    """The most device memory one ``matmul`` launch of C[batch, M, N] = A @ B with
    ``cfg`` allocates besides C (an upper bound, for the memory plan; ``batch`` is 1
    for a 2-D matmul). The launch picks its path from the operands' strides, so the
    bound counts every buffer the config can lead to:

    * split-K (``split_k_plan`` gives more than one split): the running sums
      [batch, M, N] fp32 and an int32 lock a tile (``SERIAL_SPLIT``), or, with an
      ``epilogue`` (the two-pass reduction runs it) or a persistent config, the fp32
      partials [S, batch, M, N];
    * a staged tf32 config (``stage_a`` / ``stage_b`` in ``cfg.instruction``, fp32
      operands): the dense fp32 copy of A [batch, M, K] and / or of B [batch, K, N]
      (an operand shared by the batch is staged once: at most this);
    * an epilogue's column sums (``column_sums``: their accumulation dtypes,
      ``ColumnSum.acc_dtype``): each one's partials [P, N] (``column_sum_rows``).

    Host-built TMA descriptors are passed by value: no device memory. A
    warp-specialized config's device-built ones take ``WS_SCRATCH_PER_PROGRAM`` bytes
    of global scratch a program (at most one program a tile). The
    partials are fp32 whatever ``out_dtype`` is, and ``a_dtype`` is ``b_dtype`` (the
    launch refuses others). ``cfg=None`` means the launch asks the configurator,
    which also sees the operands' layouts, the bias and ``precision`` (None: any):
    the bound is then the largest over all of those, configured for ``device``
    (None: the CPU, which stands in for the H200)."""
    if M * N * batch == 0 or K == 0:
        return 0  # nothing is launched
    sums = 0
    if column_sums:
        splits = split_k_plan(K, cfg)[1] if cfg is not None else None
        sums = sum(column_sum_rows(M, batch, cfg, splits) * N * d.itemsize for d in column_sums)
    if cfg is None:
        return _configured_scratch_bytes(M, N, K, batch, a_dtype, out_dtype, precision, device, epilogue) + sums
    if cfg.tail_at:  # a wave tail: the head's launch and the tail's, both counted (rule 8f)
        from nova.schedule.configurator import tail_parts

        return sums + sum(scratch_bytes(r1 - r0, c1 - c0, K, batch, a_dtype, b_dtype, out_dtype, part, device=device,
                                        epilogue=epilogue) for part, (r0, r1), (c0, c1) in tail_parts(cfg, M, N, K))
    f32 = torch.float32.itemsize
    total = sums
    splits = split_k_plan(K, cfg)[1]
    tiles = batch * cdiv(M, cfg.block_m) * cdiv(N, cfg.block_n)
    tokens = cfg.instruction.split("+")
    split_bytes = 0
    if splits > 1 and SERIAL_SPLIT and not epilogue and not cfg.persistent:  # the running sums, a lock a tile
        split_bytes = batch * M * N * f32 + tiles * 4
    elif splits > 1:
        split_bytes = splits * batch * M * N * f32
        if LAST_SPLIT_SUMS and not epilogue and not cfg.persistent:  # and a count a tile
            split_bytes += tiles * 4
    sms = device_spec(device or torch.device("cpu")).num_sms
    if runs_stream_k(M, N, K, batch, cfg, sms, _dtype_name(a_dtype) == "float32", epilogue):
        # stream-K's partial tiles, or the split's where the operands take no descriptor
        _, segments = streamk_plan(M, N, K, cfg, sms)
        split_bytes = max(split_bytes, segments * cfg.block_m * cfg.block_n * f32)
    total += split_bytes
    if "ws" in tokens:
        total += cdiv(M, cfg.block_m) * cdiv(N, cfg.block_n) * WS_SCRATCH_PER_PROGRAM
    if _dtype_name(a_dtype) == "float32":
        if "stage_a" in tokens:
            total += batch * M * K * f32
        if "stage_b" in tokens:
            total += batch * K * N * f32
    return total


def _configured_scratch_bytes(M, N, K, batch, dtype, out_dtype, precision, device, epilogue) -> int:
    """``scratch_bytes`` over every config the configurator may pick at launch."""
    spec = device_spec(device or torch.device("cpu"))
    if _dtype_name(dtype) != "float32":
        precisions = ("bf16",)  # 16-bit operands: the launch ignores the precision
    else:
        precisions = PRECISIONS if precision is None else (precision,)
    layouts = ("row", "col", "strided")
    configs = (
        configure(M, N, K, batch, dtype, out_dtype, p, la, lb, bias, spec)
        for p in precisions for la in layouts for lb in layouts for bias in (False, True)
    )  # fmt: skip
    return max(scratch_bytes(M, N, K, batch, dtype, dtype, out_dtype, cfg, epilogue=epilogue) for cfg in configs)


@functools.lru_cache(maxsize=None)
def device_spec(device: torch.device):
    """The configurator's description of ``device``; the H200 for CPU tensors (the
    interpreter stands in for the GPU the kernels are tuned for). Cached: it reads
    the driver's device properties."""
    from nova.schedule.devices import DEVICES, from_torch_device

    return from_torch_device(device) if device.type == "cuda" else DEVICES["H200"]


def layout(t: torch.Tensor) -> str:
    """"row" when the last dim is contiguous, "col" when the second-to-last is, else "strided"."""
    if t.stride(-1) == 1:
        return "row"
    if t.stride(-2) == 1:
        return "col"
    return "strided"


def configure(M, N, K, batch, dtype, out_dtype, precision, a_layout, b_layout, has_bias, device,
              prerounded: tuple[str, ...] = (), tail: bool = True) -> LoweringConfig:
    """The Analytic Configurator's schedule for one matmul (``device``: a DeviceSpec;
    ``prerounded`` as ``matmul``'s; ``tail``: whether rule 8f may cut it, not where an
    epilogue or a prologue rides on the launch)."""
    from nova.schedule.configurator import configure_matmul

    return configure_matmul(M, N, K, batch, dtype, dtype, out_dtype, precision, a_layout, b_layout, has_bias, device,
                            prerounded=prerounded, tail=tail)


def _span(t: torch.Tensor, margin: int) -> int:
    """Upper bound on the element offsets a kernel may form for ``t`` (including
    masked-off lanes up to ``margin`` past each edge)."""
    return sum((size + margin) * abs(stride) for size, stride in zip(t.shape, t.stride()))


def _tma_operand(t3: torch.Tensor, k_dim: int, box: tuple[int, int]):
    """How one operand ([batch, rows, cols], K at ``k_dim`` of the last two) is read
    through a tensor descriptor, or None when TMA cannot address it: one of the last
    two dims must be contiguous, the other strides and the base 16-byte aligned."""
    elt = t3.element_size()
    if t3.stride(2) == 1:
        layout, lead = "row", 1
    elif t3.stride(1) == 1:
        layout, lead = "col", 2
    else:
        return None
    batched = t3.shape[0] > 1 and t3.stride(0) != 0  # an expanded batch is one matrix
    strides = ([t3.stride(0)] if batched else []) + [t3.stride(lead)]
    if t3.data_ptr() % 16 or any(st * elt % 16 for st in strides):
        return None
    contiguous = 2 if layout == "row" else 1
    dims = [t3.shape[lead], t3.shape[contiguous]]  # memory order: outer, contiguous
    # the box follows the memory order too: (size along rows/cols of the stored matrix)
    box_rows, box_cols = box
    blocks = [box_rows, box_cols] if layout == "row" else [box_cols, box_rows]
    if batched:
        dims, strides, blocks = [t3.shape[0], *dims], [*strides, 1], [1, *blocks]
    else:
        strides = [*strides, 1]
    return layout, batched, (dims, strides, blocks)


def _tma_plan(cfg: LoweringConfig, a3, b3):
    """Descriptors for A and B when the config asks for TMA and both operands allow it
    (else None: the pointer kernel runs, which handles every stride)."""
    if "tma" not in cfg.instruction:
        return None
    a = _tma_operand(a3, 2, (cfg.block_m, cfg.block_k))
    b = _tma_operand(b3, 1, (cfg.block_k, cfg.block_n))
    if a is None or b is None:
        which = " and ".join(n for n, x in (("A", a), ("B", b)) if x is None)
        strides = f"A strides {tuple(a3.stride())}, B strides {tuple(b3.stride())}"
        once(_LOG, f"tma:{which}:{strides}",
             "matmul: %s cannot be read through a TMA descriptor (needs one contiguous dim of the last two, "
             "16-byte aligned base and strides; %s): the pointer-load kernel runs instead", which, strides)
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor

    layout = TmaLayout(a=a[0], b=b[0], a_batched=a[1], b_batched=b[1])
    descs = [TensorDescriptor(t, *spec) for t, (_, _, spec) in ((a3, a), (b3, b))]
    return layout, descs


def _tma_c(cfg: LoweringConfig, c3: torch.Tensor):
    """C's descriptor (boxes of BLOCK_M x BLOCK_N / 2) when C can be stored through one:
    rows contiguous, base and row (and batch) strides 16-byte aligned; else None (the
    pointer store, any strides)."""
    elt = c3.element_size()
    strides = [c3.stride(0), c3.stride(1)] if c3.shape[0] > 1 else [c3.stride(1)]
    if c3.stride(2) != 1 or c3.data_ptr() % 16 or any(st * elt % 16 for st in strides) or cfg.block_n // 2 * elt < 16:
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor

    box = [cfg.block_m, cfg.block_n // 2]
    if c3.shape[0] > 1:
        return TensorDescriptor(c3, list(c3.shape), [*strides, 1], [1, *box])
    return TensorDescriptor(c3[0], [c3.shape[1], c3.shape[2]], [*strides, 1], box)


def _tma_e(cfg: LoweringConfig, ep: Epilogue, outs, batched: bool, M: int):
    """Descriptors of the epilogue's outputs, each read as [rows, N] with a [BLOCK_M,
    slice] box, when the outputs differ in element size (pointer stores would each
    want a layout of their own: ``TmaLayout.e``) and every output allows one: the
    last dim contiguous, the leading dims one row stride (``view``), base and row
    stride 16-byte aligned, and (batched) M a multiple of BLOCK_M, so that no box
    reaches into the next matrix's rows (the copy engine clips only at the tensor's
    edge). Else None: the pointer stores, any strides. Measured on the H200 (GPT-2
    124M bf16 batch 32, scripts/explain_gpt2.py at b4dba8f against f1ed414, each
    launch timed): GELU's backward (f32 and bf16 out) 0.689 -> 0.578 ms a launch
    through descriptors, the attention projection (bf16 and f32) 0.142 either way;
    one element size, descriptors cost: the fc layer's two bf16 outputs 0.394 ->
    0.418, the output projection's f32 residual 0.263 -> 0.287 (each slice's box
    waits for the staging buffer the previous slice's store still reads)."""
    if len({d.itemsize for _, _, d in ep.stores}) < 2 or batched and M % cfg.block_m:
        return None
    w = cfg.block_n // epilogue_slices(ep, cfg.block_m, cfg.block_n)
    descs = []
    from triton.tools.tensor_descriptor import TensorDescriptor

    for x in outs:
        n, elt = x.shape[-1], x.element_size()
        if x.stride(-1) != 1 or x.data_ptr() % 16 or w * elt < 16:
            return None
        try:
            x2 = x.view(-1, n)
        except RuntimeError:  # leading dims of more than one stride
            return None
        if x2.stride(0) * elt % 16:
            return None
        descs.append(TensorDescriptor(x2, list(x2.shape), [x2.stride(0), 1], [cfg.block_m, w]))
    return descs


def ws_f32_reads(precision: str, rounded: tuple[str, ...], tma: "TmaLayout | None") -> bool:
    """Whether the warp-specialized kernel takes fp32 operands: under tf32-rn, both already
    rounded (``rounded``: staged, or prerounded and read in place) and both K-major (A "row", B
    "col": wgmma reads tf32 from shared memory K-major only), so the partitioned loop's dot is a
    plain tf32 one, no rounding or transposition in registers (configurator rule 8b's
    ``WS_TF32``, off: measured no faster than the flattened loop)."""
    return (precision == "tf32-rn" and {"a", "b"} <= set(rounded) and tma is not None
            and tma.a == "row" and tma.b == "col")


def _ws_plan(cfg: LoweringConfig, tma, a3, b3, batched: bool, in_name: str,
             epilogue: Epilogue | None, prologue: Prologue | None = None, precision: str = "ieee",
             rounded: tuple[str, ...] = ()) -> list[int] | None:
    """The operands' strides for the warp-specialized kernel (``ws`` in the config's
    instruction), or None where it cannot run: the operands not both TMA-addressable
    (``tma`` None: the pointer kernel), a batch, 32-bit operands, an epilogue
    (``WS_EPILOGUES``), an epilogue with column sums (Triton 3.6's partitioner fails on
    the tile's row reduction inside the loop: "NVGPUWarpSpecialization" on the H200,
    bench/results/runs/step_launches_2l_564d08d.log; the configurator does not ask
    for it, rule 8b; row statistics, reductions along the tile's rows, partition: the
    offline sm_90a build of the LM head's logits with them, 168 registers, no spills,
    ``scripts/epilogue_sm90_check.py --lm-head-stats``). Then the config's tile runs in the kernel without partitioning
    (logged once): the same result, at that kernel's speed."""
    if "ws" not in cfg.instruction.split("+"):
        return None
    why = ("operands not TMA-addressable" if tma is None else "batched" if batched or tma[0].a_batched
           or tma[0].b_batched else "32-bit operands not both rounded and K-major" if in_name == "float32"
           and not ws_f32_reads(precision, rounded, tma[0])
           else "not persistent" if not cfg.persistent else "an epilogue (WS_EPILOGUES off)"
           if epilogue is not None and not WS_EPILOGUES else "column sums in the epilogue"
           if epilogue is not None and epilogue.sums else "an operand prologue" if prologue is not None else None)
    if why is not None:
        once(_LOG, f"ws:{why}", "matmul: the warp-specialized kernel does not run here (%s): the %s kernel does",
             why, "persistent TMA" if tma is not None else "pointer-load")
        return None
    # the one stride that is not 1: the row stride of the stored matrix (_tma_operand's order)
    return [a3.stride(1) if tma[0].a == "row" else a3.stride(2), b3.stride(2) if tma[0].b == "col" else b3.stride(1)]


class _ws_allocator:
    """Within it, the global scratch Triton's launcher asks for (the device-built
    descriptors: ``WS_SCRATCH_PER_PROGRAM`` bytes a program at most) comes from
    torch's caching allocator on ``device``: inside a CUDA graph capture that is the
    graph's pool, stream-ordered like every other buffer of the step. The caller's
    own allocator (``triton.set_allocator``) is set back after the launch."""

    def __init__(self, device: torch.device):
        self.device = device

    def __call__(self, size: int, alignment: int, stream):
        return torch.empty(size, dtype=torch.int8, device=self.device)

    def __enter__(self):
        from triton.runtime import _allocation

        self._token = _allocation._allocator.set(self)
        return self

    def __exit__(self, *exc):
        from triton.runtime import _allocation

        _allocation._allocator.reset(self._token)
        return False


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return device_spec(device).num_sms


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """The byte range [first, last + 1) the elements of ``t`` lie in."""
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def _overlaps(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether ``x`` and ``y`` may share bytes: their extents intersect (views into
    one arena do not overlap when their ranges are disjoint)."""
    if not x.numel() or not y.numel():
        return False
    (x0, x1), (y0, y1) = _extent(x), _extent(y)
    return x0 < y1 and y0 < x1


def _validate(a, b, bias, out, out_dtype, precision, allow_meta=False):
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise ValueError("matmul: a and b must be torch tensors")
    if a.dim() not in (2, 3) or b.dim() not in (2, 3):
        raise ValueError(f"matmul: a and b must be 2-D or 3-D (batched), got shapes {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise ValueError(f"matmul: dtype mismatch, a is {a.dtype} and b is {b.dtype}")
    in_name = _dtype_name(a.dtype)
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(
            f"matmul: shapes {tuple(a.shape)} and {tuple(b.shape)} do not contract "
            f"(a has K={a.shape[-1]}, b has K={b.shape[-2]})"
        )
    ba = a.shape[0] if a.dim() == 3 else None
    bb = b.shape[0] if b.dim() == 3 else None
    if ba is not None and bb is not None and ba != bb and 1 not in (ba, bb):
        raise ValueError(f"matmul: batch sizes differ, a has {ba} and b has {bb}")
    batched = ba is not None or bb is not None
    batch = max(ba or 1, bb or 1)
    if a.device != b.device:
        raise ValueError(f"matmul: a is on {a.device} and b on {b.device}")
    if a.device.type != "cuda" and not (allow_meta and a.device.type == "meta") and not interpreting():
        raise ValueError(f"matmul: tensors on {a.device} need a CUDA device or the Triton interpreter (TRITON_INTERPRET=1)")
    if precision is None:
        precision = "ieee" if in_name == "float32" else "bf16"
    if precision not in PRECISIONS:
        raise ValueError(f"matmul: precision must be one of {PRECISIONS}, got {precision!r}")
    M, K, N = a.shape[-2], a.shape[-1], b.shape[-1]
    shape = (batch, M, N) if batched else (M, N)
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise ValueError("matmul: out must be a torch tensor")
        if out_dtype is not None and out.dtype != out_dtype:
            raise ValueError(f"matmul: out has dtype {out.dtype} but out_dtype={out_dtype}")
        out_dtype = out.dtype
        if tuple(out.shape) != shape:
            raise ValueError(f"matmul: out has shape {tuple(out.shape)}, expected {shape}")
        if out.device != a.device:
            raise ValueError(f"matmul: out is on {out.device}, inputs on {a.device}")
        if any(st == 0 and sz > 1 for sz, st in zip(out.shape, out.stride())):
            raise ValueError("matmul: out has a zero stride (its elements overlap)")
        if a.device.type != "meta" and any(_overlaps(out, t) for t in (a, b, bias) if t is not None):
            raise ValueError("matmul: out overlaps an input (the kernel would read what it has written)")
    out_dtype = a.dtype if out_dtype is None else out_dtype
    out_name = _dtype_name(out_dtype)
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.dim() != 1 or bias.shape[0] != N:
            got = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
            raise ValueError(f"matmul: bias must be a 1-D tensor of length N={N}, got {got}")
        _dtype_name(bias.dtype)
        if bias.device != a.device:
            raise ValueError(f"matmul: bias is on {bias.device}, inputs on {a.device}")
    return batched, batch, M, N, K, shape, in_name, out_name, out_dtype, precision


def matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None = None,
    cfg: LoweringConfig | None = None,
    precision: str | None = None,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    *,
    num_programs: int | None = None,
    record: dict[str, str] | None = None,
    prerounded: tuple[str, ...] = (),
    prologue: tuple[Prologue, list[torch.Tensor]] | None = None,
) -> torch.Tensor:
    """``a @ b (+ bias)`` for 2-D or 3-D (batched; a batch of 1 or a 2-D operand
    broadcasts) float32 / bfloat16 / float16 tensors with any strides.

    ``precision``: "ieee" | "tf32" | "tf32-rn" | "tf32x3" | "bf16" for float32
    operands (default "ieee", like torch without allow_tf32); 16-bit operands are
    used as they are.
    ``out``: where C is written (and returned), e.g. a contiguous [M, N] or
    [batch, M, N] view into an arena; it may not overlap an operand.
    ``out_dtype`` defaults to the input dtype. ``cfg`` defaults to the Analytic
    Configurator's choice. ``num_programs`` caps a persistent grid (default: #SMs).
    ``record`` (a dict) receives {generated file path, or "tf32_stage": source text}
    of every kernel launched.
    ``prerounded``: the operands ("a", "b") whose values the caller already rounded to
    nearest tf32 (``round_to_tf32``'s bits); under "tf32-rn" the kernel does not round
    them again, and a staged config does not copy a 2-D A whose K is contiguous, or a
    2-D B whose K is contiguous (a [K, N] view of a dense [N, K]: the staged layouts
    already): the same bits, rounding being idempotent.
    ``prologue``: (``Prologue``, its vectors in order) computing A from its tile as
    loaded: 2-D operands, the vectors 1-D with unit stride, of A's rows (axis "m") or
    of K (axis "k").
    """
    return _run(a, b, bias, cfg, precision, out, out_dtype, num_programs, warmup=False, record=record,
                prerounded=prerounded, prologue=prologue)


def matmul_epilogue(
    a: torch.Tensor,
    b: torch.Tensor,
    epilogue: Epilogue,
    inputs: list[torch.Tensor],
    out_dtype: torch.dtype,
    cfg: LoweringConfig | None = None,
    precision: str | None = None,
    outs: list[torch.Tensor] | None = None,
    *,
    num_programs: int | None = None,
    record: dict[str, str] | None = None,
    prerounded: tuple[str, ...] = (),
    prologue: tuple[Prologue, list[torch.Tensor]] | None = None,
) -> list[torch.Tensor]:
    """``a @ b`` (as ``matmul``, its fp32 accumulator then rounded as a C of
    ``out_dtype`` would be only where the epilogue says so) with ``epilogue``
    applied to the accumulator instead of storing C: ``inputs`` are its operands
    (any strides), ``outs`` its outputs (contiguous, one per store; new tensors
    when None). An output may be an input itself (same storage, the iteration
    shape, contiguous: each element is read by the lane that writes it, before it
    writes it); it may not overlap ``a`` or ``b`` or another output. ``out_dtype``
    is the matmul's result dtype (what the configurator plans the tile for).
    ``prerounded`` and ``prologue`` as for ``matmul``. Returns the outputs."""
    return _run(a, b, None, cfg, precision, None, out_dtype, num_programs, warmup=False, record=record,
                epilogue=(epilogue, list(inputs), outs), prerounded=prerounded, prologue=prologue)


def precompile(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None = None,
    cfg: LoweringConfig | None = None,
    precision: str | None = None,
    out_dtype: torch.dtype | None = None,
    prerounded: tuple[str, ...] = (),
) -> list:
    """Compile (do not run) the kernels ``matmul`` would launch for these arguments.
    ``a``, ``b`` and ``bias`` may be ``meta`` tensors: only dtypes, shapes and strides
    matter. Triton specialises on integer arguments being 1 or multiples of 16 and
    on 16-byte alignment, so one call serves every shape of the same classes.
    The grid is the device's (meta tensors: the H200's), as a launch's: a split compiles
    as stream-K only where a launch would run it so.
    Returns the compiled kernels (their ``metadata`` has e.g. the shared memory)."""
    return _run(a, b, bias, cfg, precision, None, out_dtype, None, warmup=True, prerounded=prerounded)


def precompile_specs(specs: list[tuple]) -> list[tuple]:
    """``precompile`` from plain data, for worker processes (picklable in and out).
    Each spec is (key, config dict, M, N, K, dtype name, precision) for a row-major
    A[M, K] @ B[K, N]; returns (key, max shared memory in bytes or None, error or None)."""
    done = []
    for key, cfg_dict, M, N, K, dtype_name, precision in specs:
        dtype = getattr(torch, dtype_name)
        a = torch.empty((M, K), dtype=dtype, device="meta")
        b = torch.empty((K, N), dtype=dtype, device="meta")
        try:
            kernels = precompile(a, b, cfg=LoweringConfig.from_dict(cfg_dict), precision=precision)
            done.append((key, max((k.metadata.shared for k in kernels), default=0), None))
        except Exception as e:  # reported to the caller: a config the compiler rejects
            done.append((key, None, f"{type(e).__name__}: {str(e)[:300]}"))
    return done


def _epilogue_tensors(ep: Epilogue, inputs, outs, a, b, batch, M, N):
    """The checked operands and outputs of an epilogue launch (outputs made when None)."""
    ep.check(N, batch * M)
    if len(inputs) != len(ep.operands):
        raise ValueError(f"matmul: the epilogue takes {len(ep.operands)} operands, got {len(inputs)}")
    for k, (x, op) in enumerate(zip(inputs, ep.operands)):
        if tuple(x.shape) != tuple(op.shape) or x.dtype != op.dtype or x.device != a.device:
            raise ValueError(f"matmul: epilogue operand {k} is {tuple(x.shape)} {x.dtype} on {x.device}, expected "
                             f"{tuple(op.shape)} {op.dtype} on {a.device}")
    store_slots, sum_slots = ep.slots()
    shapes = [None] * (len(store_slots) + len(sum_slots))
    for j, s, (_, _, d) in zip(store_slots, ep.out_shapes, ep.stores):
        shapes[j] = (tuple(s), d)
    for j, c in zip(sum_slots, ep.sums):
        shapes[j] = ((N,), c.dtype)
    if ep.row_stats:  # the maxima and the sums of exponentials, a column per column tile
        shapes += [((batch * M, cdiv(N, ep.row_stats_cols)), torch.float32)] * 2
    if outs is None:
        outs = [torch.empty(s, dtype=d, device=a.device) for s, d in shapes]
    if len(outs) != len(shapes):
        raise ValueError(f"matmul: the epilogue writes {len(shapes)} outputs, got {len(outs)}")
    for j, (o, (s, d)) in enumerate(zip(outs, shapes)):
        if tuple(o.shape) != tuple(s) or o.dtype != d or not o.is_contiguous() or o.device != a.device:
            raise ValueError(f"matmul: epilogue output {j} is {tuple(o.shape)} {o.dtype} with strides "
                             f"{tuple(o.stride())} on {o.device}, expected a contiguous {tuple(s)} {d} on {a.device}")
        if a.device.type == "meta":
            continue
        others = [a, b, *outs[:j]]
        if any(_overlaps(o, t) for t in others):
            raise ValueError(f"matmul: epilogue output {j} overlaps an operand or another output")
        for x in inputs:  # in place only element for element: the same bytes, read at the same index
            if _overlaps(o, x) and (j in sum_slots or not (x.data_ptr() == o.data_ptr() and x.is_contiguous()
                                                           and tuple(x.shape) == tuple(ep.shape) and x.dtype == o.dtype)):
                raise ValueError(f"matmul: epilogue output {j} overlaps an operand it does not replace element "
                                 "for element")
    return outs


def _run_streamk(a3, b3, bias, cfg, precision, out, c3, tma, in_name, out_name, staged, num_programs, warmup, record):
    """A 2-D split config without an epilogue as stream-K (``STREAM_K_SPLIT``,
    ``streamk_source``): the main kernel on one program an SM, then the fix-up."""
    M, K, N = a3.shape[1], a3.shape[2], b3.shape[2]
    main, fixup, path = streamk_kernels(cfg, tma[0], bias is not None, precision, in_name, out_name, staged,
                                        interpreting(), rn_cvt())
    if record is not None and path not in record:
        record[path] = kernel_source(main)
    programs, segments = streamk_plan(M, N, K, cfg, num_programs or _num_sms(a3.device))
    tiles = cdiv(M, cfg.block_m) * cdiv(N, cfg.block_n)
    seg_off, segs, fix_off, fix_slot = _streamk_device_tables(a3.device, tiles, cdiv(K, cfg.block_k), programs)
    ws = torch.empty((segments, cfg.block_m, cfg.block_n), dtype=torch.float32, device=a3.device)
    args = [*tma[1], ws, seg_off, segs, M, N, K]
    fargs = [ws, fix_off, fix_slot, c3] + ([bias] if bias is not None else []) + [M, N, K, c3.stride(1), c3.stride(2)]
    fargs += [bias.stride(0)] if bias is not None else []
    grid = (programs,)
    fgrid = (tiles, cdiv(cfg.block_n, min(cfg.block_n, STREAM_K_FIXUP_COLS)))
    options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if warmup:
        return [main.warmup(*args, grid=grid, **options), fixup.warmup(*fargs, grid=fgrid, num_warps=4)]
    main[grid](*args, **options)
    fixup[fgrid](*fargs, num_warps=4)
    return out


def _check_prologue(pro: Prologue, vectors, a, b, bias, M: int, K: int) -> None:
    """A prologue's launch: 2-D operands without a bias (the LM head's), one vector of A's
    rows or of K for each of its vectors, 1-D with unit stride on A's device."""
    if a.dim() != 2 or b.dim() != 2 or bias is not None:
        raise ValueError("matmul: an operand prologue takes 2-D operands and no bias")
    if len(vectors) != len(pro.vectors):
        raise ValueError(f"matmul: the prologue has {len(pro.vectors)} vectors, the launch gives {len(vectors)}")
    for (name, axis), v in zip(pro.vectors, vectors):
        n = M if axis == "m" else K
        if v.dim() != 1 or v.shape[0] != n or (n > 1 and v.stride(0) != 1) or v.device != a.device:
            raise ValueError(f"matmul: prologue vector {name} must be 1-D of {n} elements ({'M' if axis == 'm' else 'K'}) "
                             f"with unit stride on {a.device}, got {tuple(v.shape)} stride {v.stride()} on {v.device}")


def _run_tail(a, b, bias, cfg, precision, out, out_dtype, num_programs, warmup, record, prerounded, M, N, K,
              fused: bool):
    """A config with a wave tail: the head and the tail as two launches of ``_run`` on views
    of A (or B), the bias and C, one after the other in the stream (``tail_parts``)."""
    extent = M if cfg.tail_axis == "m" else N
    block = cfg.block_m if cfg.tail_axis == "m" else cfg.block_n
    if cfg.tail_axis not in ("m", "n") or not 0 < cfg.tail_at < extent or cfg.tail_at % block:
        raise ValueError(f"matmul: tail_at={cfg.tail_at} along {cfg.tail_axis!r} must be a multiple of the "
                         f"block ({block}) inside C's {extent} {'rows' if cfg.tail_axis == 'm' else 'columns'}")
    if fused:
        raise ValueError("matmul: a config with a wave tail (tail_at) is for a plain 2-D launch; this one has a "
                         "batch, an epilogue or an operand prologue (the configurator gives those none)")
    from nova.schedule.configurator import tail_parts

    compiled = []
    for part, (r0, r1), (c0, c1) in tail_parts(cfg, M, N, K):
        c = out[r0:r1, c0:c1]
        r = _run(a[r0:r1], b[:, c0:c1], bias[c0:c1] if bias is not None else None, part, precision, c, out_dtype,
                 num_programs, warmup, record=record, prerounded=prerounded)
        if warmup:
            compiled += r
    return compiled if warmup else out


def _run(a, b, bias, cfg, precision, out, out_dtype, num_programs, warmup, record=None, epilogue=None, prerounded=(),
         prologue=None):
    batched, batch, M, N, K, shape, in_name, out_name, out_dtype, precision = _validate(
        a, b, bias, out, out_dtype, precision, allow_meta=warmup
    )
    ep, ep_inputs, ep_outs = epilogue if epilogue is not None else (None, [], [])
    if ep is not None:
        ep_outs = _epilogue_tensors(ep, ep_inputs, ep_outs, a, b, batch, M, N)
        if K == 0 or M * N * batch == 0:
            raise ValueError(f"matmul: an epilogue needs a non-empty contraction, got M={M} N={N} K={K} "
                             f"batch={batch}")
        out = torch.empty((1, 0, 0), dtype=out_dtype, device=a.device)  # C is never written
    if out is None:
        out = torch.empty(shape, dtype=out_dtype, device=a.device)
    if ep is None and (out.numel() == 0 or K == 0):
        if warmup:
            return []
        if K == 0 and out.numel():  # empty contraction: the sum over nothing, plus the bias
            if bias is None:
                out.zero_()
            else:
                out.copy_(bias.expand(out.shape))  # converts in place: no temporary
        return out
    if cfg is None:
        cfg = configure(
            M, N, K, batch, a.dtype, out_dtype, precision, layout(a), layout(b), bias is not None, device_spec(a.device),
            tail=ep is None and prologue is None,
        )
    elif cfg.kind != "matmul":
        raise ValueError(f"matmul: config is for a {cfg.kind!r} kernel")
    _check_config(cfg)
    if in_name != "float32":
        precision = "bf16"  # 16-bit operands: nothing to round; one kernel for every spelling
    pro, pro_vectors = prologue if prologue is not None else (None, [])
    if cfg.tail_at:
        return _run_tail(a, b, bias, cfg, precision, out, out_dtype, num_programs, warmup, record, prerounded,
                         M, N, K, batched or ep is not None or pro is not None or a.dim() + b.dim() + out.dim() != 6)
    if pro is not None:
        _check_prologue(pro, pro_vectors, a, b, bias, M, K)

    a3 = a if a.dim() == 3 else a.unsqueeze(0)
    b3 = b if b.dim() == 3 else b.unsqueeze(0)
    c3 = out if out.dim() == 3 else out.unsqueeze(0)
    staged = ()
    tokens = cfg.instruction.split("+")
    # a prerounded operand is taken as it is only K-contiguous (wgmma reads tf32 from shared memory
    # K-major only): an M-major A goes through registers anyway, where its rounding stays (the 46M
    # step's weight gradients, A = dY^T, ran 0.062 -> 0.107 ms with it skipped: tf32_stage_ab.py)
    k_major = {"a": a3.stride(2) == 1, "b": b3.stride(1) == 1}
    rounded = (tuple(x for x in ("a", "b") if x in prerounded and k_major[x])
               if in_name == "float32" and precision == "tf32-rn" else ())
    # a prerounded operand already in the staged layout (one matrix, K contiguous) is read in place
    # (A with a prologue is read as it is: the prologue computes the operand, and rounds it)
    stage_a = "stage_a" in tokens and not ("a" in rounded and a3.shape[0] == 1) and pro is None
    stage_b = "stage_b" in tokens and not ("b" in rounded and b3.shape[0] == 1)
    if "stage_a" in tokens or "stage_b" in tokens:
        if in_name != "float32" or precision != "tf32-rn":
            raise ValueError(
                f"matmul: a staged config ({cfg.instruction}) is the rounded tf32 path: it needs float32 "
                f"operands and precision 'tf32-rn', got {in_name} and {precision!r}"
            )
        a3, b3, staged = _stage_operands(a3, b3, stage_a, stage_b, launch=not warmup)
        if staged:
            _record_stage(record)
    staged = tuple(x for x in ("a", "b") if x in staged or x in rounded)  # what the kernel does not round
    k_split, splits = split_k_plan(K, cfg)
    split = splits > 1
    if not split and cfg.split_k > 1:  # K too short to split: the one-pass kernel
        once(_LOG, f"split:{K}:{cfg.split_k}:{cfg.block_k}",
             "matmul: K=%d is one BLOCK_K=%d chunk, too short for split_k=%d: the one-pass kernel runs",
             K, cfg.block_k, cfg.split_k)
        cfg = dataclasses.replace(cfg, split_k=1)
    margin = max(cfg.block_m, cfg.block_n, cfg.block_k)
    c_span = _span(c3[0], margin) if ep is None else 0
    spans = [_span(a3[0], margin), _span(b3[0], margin), c_span, (M + margin) * (N + margin)]
    if ep is not None:  # the epilogue's flat offsets run over every batch's rows
        spans += [(batch * M + margin) * (N + margin)] + [_span(x, margin) for x in ep_inputs]
    index_64 = max(spans) > _INT32_MAX
    tma = _tma_plan(cfg, a3, b3)
    if (tma and pro is None and not batched
            and runs_stream_k(M, N, K, batch, cfg, num_programs or _num_sms(a3.device), in_name == "float32",
                              epilogue=ep is not None)):
        return _run_streamk(a3, b3, bias, cfg, precision, out, c3, tma, in_name, out_name, staged, num_programs,
                            warmup, record)
    fused = ep is not None and not split
    serial = split and ep is None and not cfg.persistent and SERIAL_SPLIT
    last = split and ep is None and not cfg.persistent and not serial and LAST_SPLIT_SUMS
    split_partials = split and not serial  # each split writes an fp32 partial tile, [S, B, M, N]
    kernel_bias = bias is not None and (not split or serial or last)  # added in the main kernel
    ws_strides = _ws_plan(cfg, tma, a3, b3, batched, in_name, ep, pro, precision, staged)
    if ws_strides is not None:
        tma = (dataclasses.replace(tma[0], ws=True), None)
    c_desc = _tma_c(cfg, c3) if C_TMA and tma and ws_strides is None and not split and ep is None else None
    if c_desc is not None:
        tma = (dataclasses.replace(tma[0], c=True, c_batched=c3.shape[0] > 1), tma[1])
    e_descs = (_tma_e(cfg, ep, [ep_outs[j] for j in ep.slots()[0]], batched, M)
               if tma and fused and ws_strides is None else None)
    if e_descs is not None:
        tma = (dataclasses.replace(tma[0], e=True), tma[1])
    kern = matmul_kernels(
        cfg, bias is not None, precision, out_name, in_name, batched, index_64, interpreting(), tma and tma[0], rn_cvt(),
        staged, ep, serial, last, pro,
    )

    if record is not None and kern.path not in record:  # once per kernel: this runs every step
        record[kern.path] = kernel_source(kern.main)
    # (the warp-specialized kernel runs its masked form: the body's comment in matmul_source)
    even = M % cfg.block_m == 0 and N % cfg.block_n == 0 and K % k_split == 0 and ws_strides is None
    tiles = cdiv(M, cfg.block_m) * cdiv(N, cfg.block_n)
    total = tiles * splits * batch

    rank = len(ep.shape) if ep is not None else 0
    store_slots, sum_slots = ep.slots() if ep is not None else ([], [])
    sums = ep.sums if ep is not None else ()
    rows = column_sum_rows(M, batch, cfg, splits)
    partials = [torch.empty((rows, N), dtype=c.acc_dtype, device=a.device) for c in sums]
    stored = [storage_view(ep_outs[j]) for j in store_slots]
    ep_ptrs = [storage_view(x) for x in ep_inputs] + (e_descs if e_descs is not None else stored) + partials
    if ep is not None and ep.row_stats:
        if split or cfg.block_n != ep.row_stats_cols:
            raise ValueError(f"matmul: the epilogue's row statistics are per {ep.row_stats_cols}-column tile of an "
                             f"unsplit kernel; the config is {cfg.block_m}x{cfg.block_n} split {cfg.split_k}")
        ep_ptrs += ep_outs[len(store_slots) + len(sum_slots):]
    ep_strides = [x.stride(kd) for op, x in zip(ep.operands, ep_inputs) for kd, _, _ in op.terms(rank)] if ep else []
    if serial:  # the running sums and the tiles' locks (each split s waits for s)
        ws = torch.empty((batch, M, N), dtype=torch.float32, device=a.device)
        locks = torch.zeros((batch * tiles,), dtype=torch.int32, device=a.device)
    if split_partials:
        ws = torch.empty((splits, batch, M, N), dtype=torch.float32, device=a.device)
        dst, dst_strides = ws, (N, 1)
    else:
        dst, dst_strides = c3, (c3.stride(1), c3.stride(2))
    if last:  # a count a tile of the splits that have stored their partials
        counts = torch.zeros((batch * tiles,), dtype=torch.int32, device=a.device)
    args = list(tma[1]) if tma and ws_strides is None else [a3, b3]
    if not fused:
        args.append(c_desc if c_desc is not None else dst)
    if kernel_bias:
        args.append(bias)
    if serial:
        args += [ws, locks]
    if last:
        args += [c3, counts]
    if fused:
        args += ep_ptrs
    args += pro_vectors
    args += [M, N, K]
    if split:
        args += [k_split, splits]
    if batched:
        args.append(batch)
    if ws_strides is not None:
        args += ws_strides
    if not tma:
        args += [a3.stride(1), a3.stride(2), b3.stride(1), b3.stride(2)]
    if not fused and c_desc is None:
        args += dst_strides
    if batched:
        if not tma:
            args += [a3.stride(0) if a3.shape[0] > 1 else 0, b3.stride(0) if b3.shape[0] > 1 else 0]
        if not fused and c_desc is None:
            args.append(M * N if split_partials else c3.stride(0))
    if split_partials:
        args.append(batch * M * N)
    if kernel_bias:
        args.append(bias.stride(0))
    if last:
        args += [c3.stride(1), c3.stride(2)] + ([c3.stride(0)] if batched else [])
    if fused:
        args += ep_strides
    if cfg.persistent:
        nprog = min(total, num_programs or _num_sms(a.device))
        args.append(nprog)
        if ws_strides is not None:
            args.append(cfg.num_stages)
        grid = (nprog,)
    else:
        grid = (total,)
    options = dict(EVEN=even, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if fused:
        options["enable_fp_fusion"] = False  # each epilogue op rounds as written (the module docstring)
    if warmup:
        compiled = [kern.main.warmup(*args, grid=grid, **options)]
    elif ws_strides is not None:
        with _ws_allocator(a.device):
            kern.main[grid](*args, **options)
    else:
        kern.main[grid](*args, **options)

    if split_partials and not last:
        n_out = batch * M * N
        rgrid = (cdiv(n_out, REDUCE_BLOCK),)
        if sums:  # over [REDUCE_ROWS, REDUCE_COLS] tiles (_reduce_tiles_source)
            rgrid = (cdiv(batch * M, REDUCE_ROWS), cdiv(N, REDUCE_COLS))
            rargs = [ws, *ep_ptrs, M, N, batch * M, splits, n_out, *ep_strides]
            roptions = dict(num_warps=4, enable_fp_fusion=False)
        elif ep is not None:
            rargs = [ws, *ep_ptrs, M, N, n_out, splits, n_out, *ep_strides]
            roptions = dict(num_warps=4, enable_fp_fusion=False)
        else:
            rargs = [ws, c3]
            if bias is not None:
                rargs += [bias, bias.stride(0)]
            rargs += [M, N, n_out, splits, n_out, c3.stride(0), c3.stride(1), c3.stride(2)]
            roptions = dict(num_warps=4)
        if warmup:
            compiled.append(kern.reduce.warmup(*rargs, grid=rgrid, **roptions))
        else:
            kern.reduce[rgrid](*rargs, **roptions)
    for fn, part, j in zip(kern.colsums, partials, sum_slots, strict=True):  # the partials' ordered sums
        cargs, cgrid = (part, ep_outs[j], rows, N), (cdiv(N, COLSUM_COLS),)
        if warmup:
            compiled.append(fn.warmup(*cargs, grid=cgrid, num_warps=4))
        else:
            fn[cgrid](*cargs, num_warps=4)
    if warmup:
        return compiled
    return ep_outs if ep is not None else out


__all__ = [
    "matmul", "precompile", "precompile_specs", "matmul_source", "matmul_kernels", "configure", "device_spec", "layout",
    "split_k_plan", "scratch_bytes", "PRECISIONS", "MatmulKernels", "TmaLayout", "round_to_tf32", "TF32_RN",
    "stage_source", "stage_tf32", "Epilogue", "ColumnSum", "sum_accumulator", "column_sum_rows", "colsum_source", "matmul_epilogue", "epilogue_lines", "epilogue_slices", "epilogue_streams", "EPILOGUE_SLICE",
]
