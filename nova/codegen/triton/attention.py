"""Attention lowerings: FlashAttention-2 forward and backward as generated Triton source.

q is [B, H, Tq, D], k and v are [B, H, Tk, D]; ``causal`` is top-left aligned (query
i sees keys j <= i, as torch SDPA's is_causal); ``scale`` multiplies q k^T.

Design choices, and why:

* Static shapes (B, H, Tq, Tk, D), the scale and causality are baked into the text;
  every operand's four strides are launch arguments, so q/k/v views split from a
  packed qkv projection or transposed from [B, T, H, D] are read in place
  (``needs_contiguous`` is empty). The (batch, head) base offset is int64; offsets
  inside one head are int32 and the launcher checks that they fit.
* D is padded to a power of two >= 16 (the tl.dot minimum) with masked loads, so
  D = 96 works; D > 256 is refused (the q/acc tiles would not fit in registers).
* Forward: one program per (query block, batch*head), online softmax in fp32
  (fp64 for f64) in the base-2 domain (the scale folded with log2(e), one exp2 per
  score). Key blocks are walked in two loops: whole blocks that need no mask, then
  the blocks that straddle the causal diagonal or the key tail, with the mask.
  Causal programs never visit key blocks above the diagonal.
* Backward (FlashAttention-2): ``delta = rowsum(dO * O)``; a dK/dV kernel walks
  query blocks for its key block and a dQ kernel walks key blocks for its query
  block, both recomputing P = exp(q k^T * scale - lse). No atomics: every output
  element is written by exactly one program, so gradients are deterministic.
* An optional additive ``bias`` (rank 4, broadcasting to the scores [B, H, Tq, Tk]:
  a boolean mask arrives as 0 / -inf) is loaded tile by tile through its own four
  strides (0 on broadcast dims: a [B, 1, 1, Tk] padding mask is never expanded in
  memory) in the forward and in both backward walks, added to q k^T * scale before
  the causal mask. With a bias a row can be all -inf: the forward's online softmax
  then takes exp relative to 0 (no inf - inf), a row that masks every key gives 0
  and lse -inf, and the backward's P is 0 there (as torch's SDPA). The bias's own
  gradient is not computed here (autodiff builds it from plain ops).
* Contractions use tl.dot with fp32 accumulation. 16-bit operands go in as they
  are (P and dS are rounded to the operand dtype before their dots, as FA2 does);
  fp32 operands use ``input_precision="ieee"`` unless the module's precision
  policy is "tf32": then every dot operand (q, k, v, do and the P / dS tiles) is
  first rounded to nearest-even tf32 in registers (``tf32_rn``: the matmul
  template's ``TF32_RN``), as the step's tf32 matmuls round theirs ("tf32-rn"),
  since the tensor cores alone truncate; f64 operands use an f64 dot with f64
  accumulation.
* With the op's ``sums`` (the attention_sums stage: a packed qkv projection's bias
  gradient) each dK/dV and dQ program also adds up the rows of the tiles it stores
  (as stored, masked rows 0) into a row of partials in launch scratch, and a fourth
  kernel (``attention_bwd_sums``) adds those up in row order into the [3, H, D] sums:
  no atomics, the same bits every run.
* With the op's ``rounded`` (the tf32_operands stage, where only tf32 matmuls read the
  gradients: the qkv projection's input and weight gradients) dq, dk and dv are
  stored rounded to nearest-even tf32 (``tf32_rn``), so those matmuls read them as
  ``prerounded``, from shared memory and without rounding in their K loops; the
  column sums add up the tiles before that rounding.
* With the op's ``dropout`` p (SDPA's dropout_p) each program loads the step's seed
  once and every score tile gets its keep mask from ``nova.rng``'s hash of the score's
  flat index ((b H + h) Tq + i) Tk + j in uint32 (``dropout_keep``, the arithmetic of
  ``nova.dropout_mask``'s lowering): the forward multiplies the probabilities it
  multiplies v by (not those of the row sum, so lse is the scores' own), the dK/dV
  walk P^T before dV += (P Z)^T dO and dP = (dO v^T) Z, the dQ walk dP likewise; the
  masks are recomputed, never stored, and equal the reference's bit for bit.
* ``SOURCE_FLAGS`` name optional variants of the text (fma_scale: the forward's scale
  inside one FMA; fused_bwd: dK/dV and dQ in one kernel; tma_kv, tma_bwd: the tiles the
  key and query walks load through host-built TMA descriptors), off unless a lowering is
  given ``source_flags``: candidates that ``scripts/attention_variants.py`` measures
  before a default changes. ``lower_attention_backward(tiles=)`` sets either backward
  kernel's schedule on its own, for the same script.
* ``launch(inputs, outs)`` writes into ``outs`` when given; the forward needs no
  scratch, the backward exactly its delta [B*H, Tq] and, with sums, their partials
  (``Kernel.scratch_bytes``).
  The forward's o and the backward's dq, dk, dv are stored through their own four
  strides, so an ``out`` may be any non-overlapping view of [B, H, T, D] (the
  [B, T, H, D] layout that the output projection's [B, T, C] reshape reads as a
  view, or a gradient's window of the split backward's cat buffer); lse and the gradients' rounding are as before (bf16 dq, dk, dv are the
  fp32 accumulators rounded once to bf16, as eager's SDPA backward returns them).
"""

from __future__ import annotations

import dataclasses
import math
import re
import textwrap

import torch

from nova import rng
from nova.codegen.triton.lowering import Kernel, lowers
from nova.codegen.triton.matmul import tf32_rn_fn
from nova.codegen.triton.rowwise import nbytes, next_pow2, result_specs, results
from nova.codegen.triton.source import load_kernel
from nova.ir import dialect as nv
from nova.ir.types import elem_of, shape_of, to_torch_dtype
from nova.schedule.config import LoweringConfig

MAX_HEAD_DIM = 256
PRECISIONS = ("fp32", "tf32", "bf16")  # the module's precision policy (nova.precision)
_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453
_INT32_MAX = 2**31 - 1
_DELTA_ELEMS = 4096  # dO and O elements per program of the delta = rowsum(dO * O) pass
# Optional variants of the generated source, default off (the shipped kernels are the
# text without them) until scripts/attention_variants.py measures them on the device;
# flag -> what it changes. ``lower_attention(..., source_flags=)`` and
# ``lower_attention_backward(..., source_flags=)`` take a set of them.
SOURCE_FLAGS: dict[str, str] = {
    # the forward's score scale applied inside the exponent's argument, one FMA per score
    # (s * c - m) instead of a multiply then a subtract, the row max scaled per row (the
    # Triton tutorial 06-fused-attention's form); needs scale > 0 and no bias
    "fma_scale": "forward: exp2(s * scale - m) as one FMA, m = rowmax(s) * scale",
    # the dK/dV walk of key block i and the dQ walk of query block i in one program
    # (the tutorial's _attn_bwd): one launch instead of two, and under a causal mask each
    # program's total work is about constant (key block i walks T - i query blocks,
    # query block i walks i key blocks) where each kernel alone has a triangle of
    # program lengths; the dK/dV kernel's warps and stages
    "fused_bwd": "backward: dK/dV and dQ in one kernel, program i does key block i and query block i",
    # the forward's k and v tiles through TMA descriptors of [B, H, Tk, D] (host-built, a
    # [1, 1, BLOCK_N, BLOCK_D] box; out-of-range keys and the padded head dim come back 0,
    # as the masked loads give) instead of pointer loads: one copy instruction a tile in
    # place of a 16-byte cp.async and its address arithmetic per thread and vector. Needs
    # k and v with a unit last stride and 16-byte aligned base and strides
    "tma_kv": "forward: k and v tiles loaded through TMA descriptors, not pointers",
    # the same for the tiles the backward's walks load each step: q and dO in the dK/dV
    # kernel, k and v in the dQ kernel (each kernel's own box; not with fused_bwd)
    "tma_bwd": "backward: the walked tiles (q, dO for dK/dV; k, v for dQ) through TMA descriptors",
}
ROUNDABLE_INPUTS = ("q", "k", "v", "do")
_TL = {torch.float32: "tl.float32", torch.bfloat16: "tl.bfloat16", torch.float16: "tl.float16", torch.float64: "tl.float64"}


# --------------------------------------------------------------------------- plan


# Default tiles per kernel and dtype class, (BLOCK_M queries, BLOCK_N keys, warps),
# for padded head dims <= 64, <= 128 and <= 256. Chosen from ptxas -v on sm_90a
# builds (B=4, H=12, T=1024, causal and not): the largest tiles that keep the
# tensor-core (wgmma / mma) path without register spills. The backward kernels
# hold two [BLOCK_N, D] (dK/dV) or one [BLOCK_M, D] (dQ) fp32 accumulators across
# their walk, so they take narrow tiles along the walked dim (16-bit, D=128: dK/dV
# at 64x64 spills 144 bytes, at 32x128 up to 504, at 64x32 none). 16-bit at D <= 64:
# one warpgroup, 64 along the kept dim, as the configurator's small-head forward rule
# (configurator.WARPGROUP_TILE_REGS) and for the same reason; measured on the H200
# (GPT-2, B 32, H 12, T 1024, D 64, causal; bench/results/runs/
# attention_variants_eb7626a.json): dK/dV 32x64 w4 s3 0.271 ms (the table's 32x128 w8
# s2 before: 0.491; 64x64 w4 s3 0.287), dQ 64x64 w4 s3 0.175 (128x32 w8 s2: 0.268);
# the whole backward with the delta pass 0.47 ms against cuDNN's 0.51. "tf32": f32
# operands on tf32 tensor cores (the "32" row is f32 on the FMA path). At D <= 64,
# measured on an H100 (GPT-2 at batch 16: B 16, H 12, T 1024, D 64, causal;
# ``gpu_check.sh attn-tf32``, bench/results/runs/attention_variants_tf32_h100_21454d7.json):
# dK/dV 64x128 w8 s2 0.592 ms (the "32" row's 64x32 w8 s2, which compiles to mma.sync,
# not wgmma: 1.041; 32x64 w4 s3 0.679; 64x64 spills), dQ 128x32 w4 s3 0.366 (64x32 w8
# s2: 0.938); the whole backward 2.05 ms before, SDPA's memory-efficient backend 2.23.
_TILES = {
    "fwd": {
        "16": ((128, 64, 8), (128, 64, 8), (64, 32, 8)),
        "32": ((64, 32, 4), (64, 32, 4), (32, 32, 4)),
        "tf32": ((128, 64, 8), (64, 32, 4), (32, 32, 4)),
        "64": ((32, 16, 4), (32, 16, 4), (16, 16, 4)),
    },
    "dkdv": {
        "16": ((32, 64, 4), (64, 32, 8), (32, 32, 8)),
        "32": ((64, 32, 8), (64, 32, 8), (32, 32, 8)),
        "tf32": ((64, 128, 8), (64, 32, 8), (32, 32, 8)),
        "64": ((64, 32, 8), (32, 16, 8), (16, 16, 8)),
    },
    "dq": {
        "16": ((64, 64, 4), (128, 32, 8), (32, 32, 8)),
        "32": ((64, 32, 8), (64, 32, 8), (32, 32, 8)),
        "tf32": ((128, 32, 4), (64, 32, 8), (32, 32, 8)),
        "64": ((32, 64, 8), (16, 32, 8), (16, 16, 8)),
    },
}
# Stages of the backward kernels: 16-bit at D <= 64 three (measured above: dK/dV 0.271
# ms against 0.302 at two), tf32 at D <= 64 (dK/dV, dQ) two and three (as measured
# above), else two.
_BWD_STAGES_SMALL_HEAD = 3
_BWD_STAGES_TF32 = {"dkdv": 2, "dq": 3}


def attention_plan(tq: int, tk: int, d: int, dtype: torch.dtype, cfg: LoweringConfig | None, kernel: str = "fwd",
                   exact: bool = False, ip: str = "ieee"):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of ``kernel`` ("fwd", "dkdv", "dq");
    ``ip``: the dots' input precision (f32 "tf32" takes the table's tf32 row where
    ``cfg`` is for wgmma, or absent).

    The forward takes ``cfg``'s tiles when it sets block_m and block_n. The
    configurator sizes attention for the forward pass only, and the backward
    kernels hold two to three times the accumulators, so for them ``cfg``'s tiles
    are an upper bound on the ``_TILES`` defaults (and at most 2 stages), unless
    ``exact``: then a backward kernel takes ``cfg``'s tiles, warps and stages as
    they are (a schedule chosen for that kernel, e.g. by
    ``scripts/attention_variants.py``). Without ``cfg``: the defaults. Backward
    tiles never exceed the padded sequence."""
    # the tf32 row was measured on Hopper (wgmma); a config for mma.sync (sm_80 / sm_86, where
    # its dK/dV tile spills: 64x64 w8 4.6 KB, offline ptxas) keeps the f32 row
    wgmma = cfg is None or not cfg.instruction or cfg.instruction.startswith("wgmma")
    f32_row = "tf32" if ip == "tf32" and wgmma else "32"
    cls = "64" if dtype == torch.float64 else f32_row if dtype == torch.float32 else "16"
    bd = max(16, next_pow2(d))
    bm, bn, warps = _TILES[kernel][cls][0 if bd <= 64 else 1 if bd <= 128 else 2]
    # f64 has no multi-stage async-copy pipeline worth its shared memory
    stages = (1 if dtype == torch.float64 else 3 if kernel == "fwd"
              else _BWD_STAGES_SMALL_HEAD if cls == "16" and bd <= 64
              else _BWD_STAGES_TF32[kernel] if cls == "tf32" and bd <= 64 else 2)
    if cfg is not None and cfg.block_m and cfg.block_n:
        for name, v in (("block_m", cfg.block_m), ("block_n", cfg.block_n)):
            if v < 16 or v & (v - 1):
                raise ValueError(f"attention: cfg.{name}={v} must be a power of two >= 16 (tl.dot tile minimum)")
        if kernel == "fwd":
            return cfg.block_m, cfg.block_n, cfg.num_warps or warps, cfg.num_stages or stages
        if exact:
            return (max(16, min(cfg.block_m, next_pow2(tq))), max(16, min(cfg.block_n, next_pow2(tk))),
                    cfg.num_warps or warps, cfg.num_stages or stages)
        if cfg.block_m <= bm and cfg.block_n <= bn:  # cfg's tiles fit: its warps too
            warps = cfg.num_warps or warps
        bm, bn = min(bm, cfg.block_m), min(bn, cfg.block_n)
        stages = min(stages, cfg.num_stages or stages)
    bm = max(16, min(bm, next_pow2(tq)))
    bn = max(16, min(bn, next_pow2(tk)))
    return bm, bn, warps, stages


def _delta_rows(bd: int) -> int:
    return max(16, _DELTA_ELEMS // bd)


def _dtype(t) -> torch.dtype:
    return to_torch_dtype(elem_of(t))


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise ValueError(f"attention supports float32, bfloat16, float16 and float64 inputs, not {dtype}")


def _check_head_dim(d: int) -> None:
    if d > MAX_HEAD_DIM:
        raise ValueError(f"attention: head dim D={d} > {MAX_HEAD_DIM} is not supported by the Triton kernels")


def _input_precision(dtype: torch.dtype, precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"attention: precision must be one of {PRECISIONS}, got {precision!r}")
    return "tf32" if dtype == torch.float32 and precision == "tf32" else "ieee"


# --------------------------------------------------------------------------- source helpers


class _Gen:
    """Text snippets shared by the forward and backward kernels of one shape."""

    def __init__(self, b, h, tq, tk, d, dtype, causal, scale, bm, bn, ip, bias=False, flags=frozenset(), sums=False,
                 rounded=False, dropout=0.0, salt=0, prerounded=frozenset()):
        self.b, self.h, self.tq, self.tk, self.d = b, h, tq, tk, d
        # the inputs ("q", "k", "v", "do") whose values are tf32 already (``prerounded``): their
        # tiles go into the dots as loaded, not through ``tf32_rn``
        self.prerounded = frozenset(prerounded) if ip == "tf32" else frozenset()
        self.dropout, self.salt = float(dropout), int(salt)  # the probabilities' dropout (the op's), 0: none
        self.sums = sums  # the backward's column sums of dq, dk, dv (the op's ``sums``)
        self.rounded = rounded  # the backward's dq, dk, dv stored rounded to tf32 (the op's ``rounded``)
        self.flags = frozenset(flags)  # SOURCE_FLAGS variants of the text
        self.bias = bias  # an additive [B, H, Tq, Tk] (broadcast) score bias operand
        self.bd = max(16, next_pow2(d))
        self.dtype, self.causal, self.scale, self.bm, self.bn = dtype, causal, scale, bm, bn
        self.f64 = dtype == torch.float64
        self.acc = "tl.float64" if self.f64 else "tl.float32"
        self.ty = _TL[dtype]
        self.ip = ip
        # base-2 domain except for f64 (exp2 and log2(e) would cost digits there)
        self.exp = "tl.exp" if self.f64 else "tl.exp2"
        self.qk_scale = scale if self.f64 else scale * _LOG2E
        self.lse_to_exp = 1.0 if self.f64 else _LOG2E  # natural lse -> the exp domain

    def dot(self, a: str, b: str, acc: str | None = None, inputs: tuple[str | None, str | None] = (None, None)) -> str:
        """``tl.dot(a, b[, acc])``; ``inputs`` names the input ("q", "k", "v", "do") each operand's
        tile is loaded from, None for a tile the kernel computes: under tf32 every operand is
        rounded to nearest (the tensor cores would truncate) but a loaded tile of a prerounded input."""
        if self.ip == "tf32":
            a, b = (x if src in self.prerounded else f"tf32_rn({x})" for x, src in zip((a, b), inputs))
        args = [a, b] + ([acc] if acc else [])
        if self.dtype in (torch.float32, torch.float64):
            args.append(f'input_precision="{self.ip}"')
        if self.f64 and acc:
            args.append("out_dtype=tl.float64")
        return f"tl.dot({', '.join(args)})"

    def operand(self, x: str) -> str:
        """A probability tile as a dot operand: rounded to 16-bit inputs' dtype."""
        return x if self.dtype in (torch.float32, torch.float64) else f"{x}.to({self.ty})"

    def header(self, kind: str, constants: dict | None = None) -> str:
        constants = constants or {"BLOCK_M": self.bm, "BLOCK_N": self.bn, "BLOCK_D": self.bd}
        return (
            f"# Generated by nova.codegen.triton.attention ({kind}); do not edit.\n"
            f"# q [{self.b}, {self.h}, {self.tq}, {self.d}], k/v [{self.b}, {self.h}, {self.tk}, {self.d}], "
            f"{str(self.dtype).removeprefix('torch.')}, causal {self.causal}, scale {self.scale!r}, "
            f"dot precision {self.ip}\n"
            "import triton\nimport triton.language as tl\n\n"
            + "".join(f"{k} = tl.constexpr({v})\n" for k, v in constants.items())
            + (tf32_rn_fn() if self.ip == "tf32" or self.rounded else "")
            + (_dropout_keep_fn(self.dropout) if self.dropout else "")
        )

    def dropout_setup(self) -> str:
        """A program's dropout lines: ``seed_term``, the seed's and the salt's part of
        every hash (``nova.rng``'s x before the index's), and ``bh_term``, the head's
        part of the flat index, (b H + h) Tq Tk mod 2**32; nothing without dropout."""
        if not self.dropout:
            return ""
        salt = (self.salt * rng.SALT_MUL) & rng.M32
        return (f"seed_term = tl.load(seed_ptr).to(tl.uint32) * {rng.SEED_MUL} + {salt}\n"
                f"bh_term = pid_bh.to(tl.uint32) * {(self.tq * self.tk) % 2**32}")

    def keep(self, rows: str, cols: str) -> str:
        """The line setting ``keep``, where ``nova.rng`` keeps the scores of a
        score-shaped tile at flat index ((b H + h) Tq + i) Tk + j; ``rows`` / ``cols``:
        the tile's query / key indices, broadcast ("offs_m[:, None]", "offs_n[None, :]").
        The hash's first value, index * GOLDEN + seed_term (mod 2**32), is the sum of a
        row's part and a column's, each a vector multiplied once: one add a score in
        place of an add and a multiply-add (the same bits). Nothing without dropout."""
        if not self.dropout:
            return ""
        row = f"(bh_term + {rows}.to(tl.uint32) * {self.tk % 2**32}) * {rng.GOLDEN} + seed_term"
        return f"\n    keep = dropout_keep(({row}) + {cols}.to(tl.uint32) * {rng.GOLDEN})"

    def drop(self, x: str) -> str:
        """``x`` (a score-shaped tile) times its dropout multiplier (``keep``'s): 0
        where dropped, 1/(1-p) rounded to the statistics type (as
        ``rng.dropout_scale``'s) where kept; ``x`` itself without dropout."""
        if not self.dropout:
            return x
        kept = rng.kept_value(self.dropout, torch.float64 if self.f64 else torch.float32)
        return f"tl.where(keep, {x} * {float(kept)!r}, 0.0)"

    def out(self, x: str) -> str:
        """A gradient tile as stored: rounded to tf32 under ``rounded`` (its column
        sums add up ``x`` itself, the raw values)."""
        return f"tf32_rn({x})" if self.rounded else x

    def mask(self, *parts: str | None) -> str | None:
        parts = [p for p in parts if p]
        return " & ".join(f"({p})" for p in parts) if parts else None

    def d_ok(self, axis: str) -> str | None:
        """Mask of the padded head dim, broadcast along ``axis`` ("row": [1, BD], "col": [BD, 1])."""
        if self.d == self.bd:
            return None
        return "offs_d[None, :] < {}".format(self.d) if axis == "row" else "offs_d[:, None] < {}".format(self.d)

    def load(self, ptr: str, mask: str | None) -> str:
        return f"tl.load({ptr})" if mask is None else f"tl.load({ptr}, mask={mask}, other=0.0)"

    def store(self, ptr: str, value: str, mask: str | None) -> str:
        return f"tl.store({ptr}, {value})" if mask is None else f"tl.store({ptr}, {value}, mask={mask})"

    def bias_tile(self, rows: str, cols: str, mask: str | None) -> str:
        """`` + bias`` of the score tile (in the exp domain), or nothing without a
        bias. ``rows`` / ``cols``: index expressions of the tile's two axes, already
        broadcast ("offs_m[:, None] * szm", "offs_n[None, :] * szn", ...)."""
        if not self.bias:
            return ""
        tile = self.load(f"z_base + {rows} + {cols}", mask)
        to_exp = "" if self.f64 else f" * {_LOG2E!r}"
        return f" + {tile}.to({self.acc}){to_exp}"

    def dead_rows(self, p: str, lse: str) -> str:
        """A line zeroing ``p`` where the row's lse is -inf (every key masked by the
        bias: torch's SDPA gives 0 there), or nothing without a bias."""
        if not self.bias:
            return ""
        return f'\n    {p} = tl.where({lse} == float("-inf"), 0.0, {p})'

    def head_base(self, prefix: str) -> str:
        return f"{prefix}_ptr + b * s{prefix}b + h * s{prefix}h"

    def bh(self) -> str:
        return textwrap.dedent(f"""\
            pid_bh = tl.program_id(1)
            b = (pid_bh // {self.h}).to(tl.int64)
            h = (pid_bh % {self.h}).to(tl.int64)
            offs_d = tl.arange(0, BLOCK_D)
            """)


def _dropout_keep_fn(p: float) -> str:
    """``dropout_keep(start)``: whether ``nova.rng`` keeps the flat index whose hash
    starts at ``start`` = index * GOLDEN + seed_term (uint32, mod 2**32 as the
    reference's) at dropout probability ``p``: MurmurHash3's finalizer, kept iff the
    top 24 bits >= ceil(p 2**24) (u >= p, exactly), compared on the whole hash
    (``rng.keep_bits``), the arithmetic of ``nova.dropout_mask``'s Triton lowering."""
    bits = rng.keep_bits(p)
    # (a uint32 constant: the comparison is unsigned whatever the threshold's size)
    test = f"x >= tl.full([], {bits}, tl.uint32)" if bits is not None else "x != x"
    body = textwrap.indent(f"{rng.triton_mix('x', 'start')}\nreturn {test}", "    ")
    return f"\n\n@triton.jit\ndef dropout_keep(start):\n{body}\n"


def _strides(prefix: str) -> list[str]:
    return [f"s{prefix}{c}" for c in "bhtd"]


_BIAS_STRIDES = ["szb", "szh", "szm", "szn"]  # the bias: batch, head, query, key


def _kernel(name: str, params: list[str], body: str) -> str:
    return f"\n\n@triton.jit\ndef {name}(\n    " + ",\n    ".join(params) + ",\n):\n" + textwrap.indent(
        textwrap.dedent(body).strip("\n"), "    "
    ) + "\n"


def _ind(text: str, level: int) -> str:
    return textwrap.indent(textwrap.dedent(text).strip("\n"), "    " * level)


# --------------------------------------------------------------------------- forward


def _key_ranges(g: _Gen, tk: int, full_keys: int, explain: bool = False) -> str:
    """The key-block ranges a query block walks (forward and dQ alike): unmasked
    blocks up to ``full_hi``, masked ones in [masked_lo, masked_hi)."""
    if not g.causal:
        return f"""
            full_hi = {full_keys}
            masked_lo = {full_keys}
            masked_hi = {tk if tk % g.bn else full_keys}
        """
    why = """
            # key blocks wholly at or below the diagonal need no mask; the rest up to the
            # block's last query (and the key tail) are masked; none above the diagonal""" if explain else ""
    return f"""{why}
            full_hi = tl.minimum((start_m + 1) // BLOCK_N * BLOCK_N, {full_keys})
            masked_lo = full_hi
            masked_hi = tl.minimum(start_m + BLOCK_M, {tk})
        """


def attention_forward_source(g: _Gen) -> str:
    tq, tk = g.tq, g.tk
    m_ok = None if tq % g.bm == 0 else f"offs_m[:, None] < {tq}"
    full_keys = (tk // g.bn) * g.bn

    def key_loop(masked: bool) -> str:
        n_ok = f"offs_n[None, :] < {tk}" if masked and tk % g.bn else None
        keep = g.mask(n_ok, "offs_n[None, :] <= offs_m[:, None]" if g.causal else None)
        v_n_ok = f"offs_n[:, None] < {tk}" if masked and tk % g.bn else None
        if "tma_kv" in g.flags:  # zero-filled out of range, as the masked loads
            kt = "tl.trans(k_ptr.load([b32, h32, n0, 0]).reshape(BLOCK_N, BLOCK_D))"
            v = "v_ptr.load([b32, h32, n0, 0]).reshape(BLOCK_N, BLOCK_D)"
        else:
            kt = g.load("k_base + offs_n[None, :] * skt + offs_d[:, None] * skd", g.mask(n_ok, g.d_ok("col")))
            v = g.load("v_base + offs_n[:, None] * svt + offs_d[None, :] * svd", g.mask(v_n_ok, g.d_ok("row")))
        lo, hi = ("masked_lo", "masked_hi") if masked else ("0", "full_hi")
        where = f"\n    s = tl.where({keep}, s, float(\"-inf\"))" if masked and keep else ""
        bias = g.bias_tile("offs_m[:, None] * szm", "offs_n[None, :] * szn", g.mask(m_ok, n_ok))
        # with a bias a row can be all -inf so far (or for good): exp relative to 0 then
        m_ref = "m_safe" if g.bias else "m_new"
        safe = '\n    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)' if g.bias else ""
        if "fma_scale" in g.flags:  # raw scores; the scale inside the exponent (checked: > 0, no bias)
            scores = f"""
    s = {g.dot("q", "kt", inputs=("q", "k"))}{where}
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * {g.qk_scale!r})
    p = {g.exp}(s * {g.qk_scale!r} - m_new[:, None])"""
        else:
            scores = f"""
    s = {g.dot("q", "kt", inputs=("q", "k"))} * {g.qk_scale!r}{bias}{where}
    m_new = tl.maximum(m_i, tl.max(s, axis=1)){safe}
    p = {g.exp}(s - {m_ref}[:, None])"""
        # with dropout the row sum is of every probability, the product with v of the kept ones
        pv = "p" if not g.dropout else "pd"
        dropped = f"{g.keep('offs_m[:, None]', 'offs_n[None, :]')}\n    pd = {g.drop('p')}" if g.dropout else ""
        return f"""
for n0 in range({lo}, {hi}, BLOCK_N):
    offs_n = n0 + tl.arange(0, BLOCK_N)
    kt = {kt}{scores}
    alpha = {g.exp}(m_i - {m_ref})
    l_i = l_i * alpha + tl.sum(p, axis=1){dropped}
    v = {v}
    acc = {g.dot(g.operand(pv), "v", "acc * alpha[:, None]", (None, "v"))}
    m_i = m_new
""".strip("\n")

    ranges = _key_ranges(g, tk, full_keys, explain=True)
    lse = "m_i + tl.log(l_i)" if g.f64 else f"(m_i + tl.log2(l_i)) * {_LN2!r}"
    bias_base = f"\n            z_base = {g.head_base('z')}" if g.bias else ""
    # a row whose every key is masked (l_i = 0, lse = -inf) gives 0, as torch's SDPA
    out = "tl.where(l_i[:, None] == 0.0, 0.0, acc / l_i[:, None])" if g.bias else "acc / l_i[:, None]"
    q = g.load("q_base + offs_m[:, None] * sqt + offs_d[None, :] * sqd", g.mask(m_ok, g.d_ok("row")))
    if "tma_kv" in g.flags:  # k_ptr and v_ptr are descriptors; the box's (batch, head) as int32
        kv_bases = [f"b32 = pid_bh // {g.h}", f"h32 = pid_bh % {g.h}"]
    else:
        kv_bases = [f"k_base = {g.head_base('k')}", f"v_base = {g.head_base('v')}"]
    kv_bases = "\n            ".join(kv_bases)  # (the lines of the dedented block below)
    body = "\n".join([
        "start_m = tl.program_id(0) * BLOCK_M",
        g.bh(),
        g.dropout_setup(),
        _ind(f"""
            offs_m = start_m + tl.arange(0, BLOCK_M)
            q_base = {g.head_base('q')}
            {kv_bases}{bias_base}
            q = {q}
            m_i = tl.full((BLOCK_M,), float("-inf"), {g.acc})
            l_i = tl.zeros((BLOCK_M,), {g.acc})
            acc = tl.zeros((BLOCK_M, BLOCK_D), {g.acc})
        """, 0),
        _ind(ranges, 0),
        key_loop(False),
        key_loop(True) if (g.causal or tk % g.bn) else "",
        _ind(f"""
            out = {out}
            o_base = {g.head_base('o')}
            {g.store("o_base + offs_m[:, None] * sot + offs_d[None, :] * sod", f"out.to({g.ty})", g.mask(m_ok, g.d_ok("row")))}
            {g.store(f"lse_ptr + pid_bh.to(tl.int64) * {tq} + offs_m", lse, None if tq % g.bm == 0 else f"offs_m < {tq}")}
        """, 0),
    ])
    params = ["q_ptr", "k_ptr", "v_ptr", "o_ptr", "lse_ptr", *_strides("q"), *_strides("k"), *_strides("v")]
    if g.dropout:
        params[3:3] = ["seed_ptr"]
    if g.bias:
        params[3:3] = ["z_ptr"]
        params += _BIAS_STRIDES
    params += _strides("o")
    return g.header("attention forward") + _kernel("attention_fwd", params, body)


# --------------------------------------------------------------------------- backward


def attention_backward_source(g_kv: _Gen, g_q: _Gen) -> str:
    """The delta, dK/dV and dQ kernels; ``g_kv`` and ``g_q`` (same shape, own tiles)
    generate the dK/dV and the dQ kernel."""
    g = g_kv
    tq, tk = g.tq, g.tk
    # ---- delta = rowsum(dO * O), in the statistics type, [B*H, Tq]
    delta_body = _ind(f"""
        rows = tl.program_id(0) * {_delta_rows(g.bd)} + tl.arange(0, {_delta_rows(g.bd)})
        {g.bh().strip().replace(chr(10), chr(10) + '        ')}
        ok = (rows[:, None] < {tq}){' & (offs_d[None, :] < ' + str(g.d) + ')' if g.d != g.bd else ''}
        do = tl.load(do_ptr + b * sdob + h * sdoh + rows[:, None] * sdot + offs_d[None, :] * sdod, mask=ok, other=0.0)
        o = tl.load(o_ptr + b * sob + h * soh + rows[:, None] * sot + offs_d[None, :] * sod, mask=ok, other=0.0)
        delta = tl.sum(do.to({g.acc}) * o.to({g.acc}), axis=1)
        tl.store(delta_ptr + pid_bh.to(tl.int64) * {tq} + rows, delta, mask=rows < {tq})
    """, 0)

    lse_in = "tl.load(lse_ptr + b * slb + h * slh + {rows} * slt{mask}).to(" + g.acc + ") * " + repr(g.lse_to_exp)
    delta_in = "tl.load(delta_ptr + pid_bh.to(tl.int64) * " + str(tq) + " + {rows}{mask})"

    def row_mask(var: str) -> str:
        return "" if tq % g.bm == 0 else f", mask={var} < {tq}, other=0.0"

    # ---- dK, dV: one program per key block, walking query blocks (P^T in registers)
    tma = "tma_bwd" in g.flags
    # the walked operands' (batch, head) as int32 box coordinates, or their heads' bases
    box_bh = f"b32 = pid_bh // {g.h}\n            h32 = pid_bh % {g.h}"
    n_ok_row = None if tk % g.bn == 0 else f"offs_n[:, None] < {tk}"
    kv_mask = g.mask(n_ok_row, g.d_ok("row"))

    def query_loop(masked: bool) -> str:
        m_ok_col = None if tq % g.bm == 0 else f"offs_m[None, :] < {tq}"
        m_ok_row = None if tq % g.bm == 0 else f"offs_m[:, None] < {tq}"
        if tma:  # q_ptr and do_ptr are descriptors: zero-filled out of range, as the masked loads
            qt = "tl.trans(q_ptr.load([b32, h32, m0, 0]).reshape(BLOCK_M, BLOCK_D))"
            do = "do_ptr.load([b32, h32, m0, 0]).reshape(BLOCK_M, BLOCK_D)"
        else:
            qt = g.load("q_base + offs_m[None, :] * sqt + offs_d[:, None] * sqd", g.mask(m_ok_col, g.d_ok("col")))
            do = g.load("do_base + offs_m[:, None] * sdot + offs_d[None, :] * sdod", g.mask(m_ok_row, g.d_ok("row")))
        causal = "\n    pt = tl.where(offs_m[None, :] >= offs_n[:, None], pt, 0.0)" if masked else ""
        lo, hi = ("masked_lo", "masked_hi") if masked else ("full_lo", str(tq))
        bias = g.bias_tile("offs_n[:, None] * szn", "offs_m[None, :] * szm", g.mask(n_ok_row, m_ok_col))
        dead = g.dead_rows("pt", "lse[None, :]")
        return f"""
for m0 in range({lo}, {hi}, BLOCK_M):
    offs_m = m0 + tl.arange(0, BLOCK_M)
    qt = {qt}
    do = {do}
    lse = {lse_in.format(rows='offs_m', mask=row_mask('offs_m'))}
    dl = {delta_in.format(rows='offs_m', mask=row_mask('offs_m'))}
    pt = {g.exp}({g.dot("k", "qt", inputs=("k", "q"))} * {g.qk_scale!r}{bias} - lse[None, :]){dead}{causal}{g.keep("offs_m[None, :]", "offs_n[:, None]")}
    dv = {g.dot(g.operand(g.drop("pt")), "do", "dv", (None, "do"))}
    dpt = {g.drop(g.dot("v", "tl.trans(do)", inputs=("v", "do")))}
    dst = pt * (dpt - dl[None, :])
    dk = {g.dot(g.operand("dst"), "tl.trans(qt)", "dk", (None, "q"))}
""".strip("\n")

    if g.causal:
        ranges = f"""
            # queries below the block's first key only; blocks straddling the diagonal masked
            masked_lo = start_n // BLOCK_M * BLOCK_M
            full_lo = tl.cdiv(start_n + BLOCK_N - 1, BLOCK_M) * BLOCK_M
            masked_hi = tl.minimum(full_lo, {tq})
        """
    else:
        ranges = "full_lo = 0"
    bias_base = f"\n            z_base = {g.head_base('z')}" if g.bias else ""
    dkdv_body = "\n".join([
        "start_n = tl.program_id(0) * BLOCK_N",
        g.bh(),
        g.dropout_setup(),
        _ind(f"""
            offs_n = start_n + tl.arange(0, BLOCK_N)
            {box_bh if tma else f"q_base = {g.head_base('q')}{chr(10)}            do_base = {g.head_base('do')}"}{bias_base}
            k = {g.load(f"{g.head_base('k')} + offs_n[:, None] * skt + offs_d[None, :] * skd", kv_mask)}
            v = {g.load(f"{g.head_base('v')} + offs_n[:, None] * svt + offs_d[None, :] * svd", kv_mask)}
            dk = tl.zeros((BLOCK_N, BLOCK_D), {g.acc})
            dv = tl.zeros((BLOCK_N, BLOCK_D), {g.acc})
        """, 0),
        _ind(ranges, 0),
        query_loop(True) if g.causal else "",
        query_loop(False),
        _ind(f"""
            dk_base = {g.head_base('dk')}
            dv_base = {g.head_base('dv')}
            dk_out = (dk * {g.scale!r}).to({g.ty})
            dv_out = dv.to({g.ty})
            {g.store("dk_base + offs_n[:, None] * sdkt + offs_d[None, :] * sdkd", g.out("dk_out"), kv_mask)}
            {g.store("dv_base + offs_n[:, None] * sdvt + offs_d[None, :] * sdvd", g.out("dv_out"), kv_mask)}
        """, 0),
        _column_sums(g, "dkdv", "start_n // BLOCK_N", _sum_rows(g_q), {"dk_out": 0, "dv_out": 1}, kv_mask, g.tk, g.bn),
    ])

    # ---- dQ: one program per query block, walking key blocks
    g = g_q
    m_ok_row = None if tq % g.bm == 0 else f"offs_m[:, None] < {tq}"
    q_mask = g.mask(m_ok_row, g.d_ok("row"))
    full_keys = (tk // g.bn) * g.bn

    def key_loop(masked: bool) -> str:
        n_ok = f"offs_n[None, :] < {tk}" if masked and tk % g.bn else None
        keep = g.mask(n_ok, "offs_n[None, :] <= offs_m[:, None]" if g.causal else None)
        if tma:  # k_ptr and v_ptr are descriptors
            kt = "tl.trans(k_ptr.load([b32, h32, n0, 0]).reshape(BLOCK_N, BLOCK_D))"
            vt = "tl.trans(v_ptr.load([b32, h32, n0, 0]).reshape(BLOCK_N, BLOCK_D))"
        else:
            kt = g.load("k_base + offs_n[None, :] * skt + offs_d[:, None] * skd", g.mask(n_ok, g.d_ok("col")))
            vt = g.load("v_base + offs_n[None, :] * svt + offs_d[:, None] * svd", g.mask(n_ok, g.d_ok("col")))
        where = f"\n    p = tl.where({keep}, p, 0.0)" if masked and keep else ""
        lo, hi = ("masked_lo", "masked_hi") if masked else ("0", "full_hi")
        bias = g.bias_tile("offs_m[:, None] * szm", "offs_n[None, :] * szn", g.mask(m_ok_row, n_ok))
        dead = g.dead_rows("p", "lse[:, None]")
        return f"""
for n0 in range({lo}, {hi}, BLOCK_N):
    offs_n = n0 + tl.arange(0, BLOCK_N)
    kt = {kt}
    vt = {vt}
    p = {g.exp}({g.dot("q", "kt", inputs=("q", "k"))} * {g.qk_scale!r}{bias} - lse[:, None]){dead}{where}{g.keep("offs_m[:, None]", "offs_n[None, :]")}
    dp = {g.drop(g.dot("do", "vt", inputs=("do", "v")))}
    ds = p * (dp - dl[:, None])
    dq = {g.dot(g.operand("ds"), "tl.trans(kt)", "dq", (None, "k"))}
""".strip("\n")

    ranges = _key_ranges(g, tk, full_keys)
    bias_base = f"\n            z_base = {g.head_base('z')}" if g.bias else ""
    dq_body = "\n".join([
        "start_m = tl.program_id(0) * BLOCK_M",
        g.bh(),
        g.dropout_setup(),
        _ind(f"""
            offs_m = start_m + tl.arange(0, BLOCK_M)
            {box_bh if tma else f"k_base = {g.head_base('k')}{chr(10)}            v_base = {g.head_base('v')}"}{bias_base}
            q = {g.load(f"{g.head_base('q')} + offs_m[:, None] * sqt + offs_d[None, :] * sqd", q_mask)}
            do = {g.load(f"{g.head_base('do')} + offs_m[:, None] * sdot + offs_d[None, :] * sdod", q_mask)}
            lse = {lse_in.format(rows='offs_m', mask=row_mask('offs_m'))}
            dl = {delta_in.format(rows='offs_m', mask=row_mask('offs_m'))}
            dq = tl.zeros((BLOCK_M, BLOCK_D), {g.acc})
        """, 0),
        _ind(ranges, 0),
        key_loop(False),
        key_loop(True) if (g.causal or tk % g.bn) else "",
        _ind(f"""
            dq_base = {g.head_base('dq')}
            dq_out = (dq * {g.scale!r}).to({g.ty})
            {g.store("dq_base + offs_m[:, None] * sdqt + offs_d[None, :] * sdqd", g.out("dq_out"), q_mask)}
        """, 0),
        _column_sums(g, "dq", "start_m // BLOCK_M", 0, {"dq_out": None}, q_mask, g.tq, g.bm),
    ])

    lse_strides = ["slb", "slh", "slt"] + (_BIAS_STRIDES if g.bias else [])
    z = (["z_ptr"] if g.bias else []) + (["seed_ptr"] if g.dropout else [])
    dkdv_body = re.sub(r"\bBLOCK_([MN])\b", r"KV_BLOCK_\1", dkdv_body)
    dq_body = re.sub(r"\bBLOCK_([MN])\b", r"Q_BLOCK_\1", dq_body)
    header = g.header("attention backward", {
        "KV_BLOCK_M": g_kv.bm, "KV_BLOCK_N": g_kv.bn, "Q_BLOCK_M": g_q.bm, "Q_BLOCK_N": g_q.bn, "BLOCK_D": g.bd,
    })
    ps = ["ps_ptr"] if g.sums else []
    dkdv_params = ["q_ptr", "k_ptr", "v_ptr", *z, "do_ptr", "lse_ptr", "delta_ptr", "dk_ptr", "dv_ptr", *ps,
                   *_strides("q"), *_strides("k"), *_strides("v"), *_strides("do"), *lse_strides, *_strides("dk"),
                   *_strides("dv")]
    dq_params = ["q_ptr", "k_ptr", "v_ptr", *z, "do_ptr", "lse_ptr", "delta_ptr", "dq_ptr", *ps,
                 *_strides("q"), *_strides("k"), *_strides("v"), *_strides("do"), *lse_strides, *_strides("dq")]
    src = (
        header
        + _kernel("attention_bwd_delta", ["do_ptr", "o_ptr", "delta_ptr", *_strides("do"), *_strides("o")], delta_body)
        + _kernel("attention_bwd_dkdv", dkdv_params, dkdv_body)
        + _kernel("attention_bwd_dq", dq_params, dq_body)
        + (_sums_kernel(g_kv, g_q) if g.sums else "")
    )
    if "fused_bwd" in g_kv.flags:
        src += _fused_backward(g_kv, g_q, dkdv_params, dkdv_body, dq_params, dq_body)
    return src


# The column sums' partials: one row of H*D per program and gradient, [R, H*D] in the
# statistics type, R = B * (query blocks + 2 * key blocks): dq's rows first, then dk's,
# then dv's (``_sum_rows``); the final pass adds each gradient's rows up in order,
# up to [SUM_ROWS, SUM_COLS] at a time, one program per SUM_COLS columns and gradient: GPT-2
# 124M at batch 32 has 512 partial rows a gradient, one load a program (at [128, 32], four
# dependent loads: 13 us under Nsight Compute on an H100, long-scoreboard stalls).
SUM_ROWS, SUM_COLS = 512, 16
# A 16-bit gradient tile's column sum is the first row of ones[16, rows] @ tile, on the
# tensor cores with f32 accumulation (1 x a bf16 value is exact), in the kernels named here:
# tl.sum over the rows of the MMA-layout tile took the dQ kernel from 126 to 158 registers on
# sm_90a (4 -> 3 programs an SM; GPT-2 124M bf16 b32 on an H100: the attention launches
# 8.03 -> 8.81 ms a step, bench/results/runs/epilogue_variants_graph_12l_attnsums_h100_6f60ff2.json),
# the dot 128. The dK/dV kernel takes 151 registers either way (3 programs an SM), where
# tl.sum spares the tiles' trip through shared memory: measured slower there (an H100, the
# "attn-sums-dq-dot" variant of scripts/epilogue_variants.py, 4c64f5c: the attention launches
# 8.42 -> 8.61 ms a step, the graph 66.34 -> 66.71 ms,
# bench/results/runs/epilogue_variants_graph_12l_h100_4c64f5c.json).
SUMS_BY_DOT = frozenset({"dkdv", "dq"})


def _sum_rows(g: _Gen) -> int:
    """The partials' rows of the dq kernel (``g``'s query blocks, per batch)."""
    return g.b * math.ceil(g.tq / g.bm)


def _column_sums(g: _Gen, kernel: str, block: str, first: int, tiles: dict, mask: str | None, t: int,
                 bt: int) -> str:
    """The lines that add up each of ``tiles`` (name -> which of the walk's gradients:
    None for the only one) over its rows (masked rows 0) and store the program's
    partial row (``_sum_rows``): rows of gradient i start at ``first`` + i * B * blocks;
    nothing without sums. ``block``: the program's block index along the sequence of
    ``bt`` rows of ``t``; ``kernel`` ("dkdv", "dq"): whether 16-bit tiles are summed by a
    dot (``SUMS_BY_DOT``)."""
    if not g.sums:
        return ""
    blocks = math.ceil(t / bt)
    lines = [f"ps_row = b * {blocks} + {block}"]
    wide = g.dtype in (torch.float32, torch.float64) or kernel not in SUMS_BY_DOT
    if not wide:
        lines.append(f"ones = tl.full([16, {bt}], 1.0, tl.float32).to({g.ty})")
        lines.append("r16 = tl.arange(0, 16)")
    for name, i in tiles.items():
        row = f"({first + (i or 0) * g.b * blocks} + ps_row)"
        ptr = f"ps_ptr + {row} * {g.h * g.d} + h * {g.d} + offs_d"
        v = f"{name}.to({g.acc})" if wide else name
        x = v if mask is None else f"tl.where({mask}, {v}, 0.0)"  # masked rows add nothing
        if wide:  # the tile's rows added up in the statistics type (f32 / f64: the tile's own)
            d_mask = "" if g.d == g.bd else f", mask=offs_d < {g.d}"
            lines.append(f"tl.store({ptr}, tl.sum({x}, axis=0){d_mask})")
        else:  # 16-bit: ones @ tile on the tensor cores (f32 accumulation), row 0 stored
            keep = g.mask("r16[:, None] == 0", g.d_ok("row"))
            lines.append(f"tl.store({ptr}[None, :] + r16[:, None] * 0, tl.dot(ones, {x}), mask={keep})")
    return "\n".join(lines)


def _sums_kernel(g_kv: _Gen, g_q: _Gen) -> str:
    """``attention_bwd_sums``: the partials (``_sum_rows``) of gradient ``program_id(1)``
    (0 dq, 1 dk, 2 dv) added up in row order into its [H*D] part of the [3, H, D] sums."""
    g = g_kv
    hd = g.h * g.d
    rq, rkv = _sum_rows(g_q), g.b * math.ceil(g.tk / g.bn)
    tile = min(SUM_ROWS, next_pow2(max(rq, rkv, 1)))
    body = _ind(f"""
        cols = tl.program_id(0) * {SUM_COLS} + tl.arange(0, {SUM_COLS})
        which = tl.program_id(1)
        start = tl.where(which == 0, 0, {rq} + (which - 1) * {rkv})
        rows = tl.where(which == 0, {rq}, {rkv})
        acc = tl.zeros([{SUM_COLS}], {g.acc})
        for r0 in range(0, rows, {tile}):
            r = r0 + tl.arange(0, {tile})
            ok = (r[:, None] < rows) & (cols[None, :] < {hd})
            x = tl.load(ps_ptr + (start + r[:, None]).to(tl.int64) * {hd} + cols[None, :], mask=ok, other=0.0)
            acc += tl.sum(x, axis=0)
        tl.store(out_ptr + which * {hd} + cols, acc, mask=cols < {hd})
    """, 0)
    return _kernel("attention_bwd_sums", ["ps_ptr", "out_ptr"], body)


def _fused_backward(g_kv: _Gen, g_q: _Gen, dkdv_params, dkdv_body: str, dq_params, dq_body: str) -> str:
    """``fused_bwd``: the two walks as device functions of the program index (their
    own scopes: the same names hold tiles of other shapes), called by one kernel;
    program i runs key block i's dK/dV and query block i's dQ, each where it exists."""
    n_kv, n_q = math.ceil(g_kv.tk / g_kv.bn), math.ceil(g_q.tq / g_q.bm)
    pid = "tl.program_id(0)"

    def block(name, params, body):
        assert body.count(pid) == 1
        return _kernel(name, ["pid", *params], body.replace(pid, "pid"))

    def call(name, params, n):
        line = f"{name}(pid, {', '.join(params)})"
        return line if n == max(n_kv, n_q) else f"if pid < {n}:\n    {line}"

    params = [*dq_params[:dq_params.index("dq_ptr") + 1], "dk_ptr", "dv_ptr", *dq_params[dq_params.index("dq_ptr") + 1:],
              *_strides("dk"), *_strides("dv")]
    body = "\n".join(["pid = tl.program_id(0)", call("attention_bwd_dkdv_block", dkdv_params, n_kv),
                      call("attention_bwd_dq_block", dq_params, n_q)])
    return (block("attention_bwd_dkdv_block", dkdv_params, dkdv_body) + block("attention_bwd_dq_block", dq_params, dq_body)
            + _kernel("attention_bwd_fused", params, body))


# --------------------------------------------------------------------------- lowerings


def _check_spans(name: str, margin: int, *tensors: torch.Tensor) -> None:
    """Offsets inside one head are int32; the (batch, head) base is int64."""
    for t in tensors:
        span = sum((n + margin) * abs(s) for n, s in zip(t.shape[2:], t.stride()[2:]))
        if span > _INT32_MAX:
            raise ValueError(f"{name}: one head of an operand spans more than 2**31 elements; not supported")


def _check_inputs(name: str, op, inputs) -> None:
    if len(inputs) != len(op.operands):
        raise ValueError(f"{name}: expected {len(op.operands)} inputs, got {len(inputs)}")
    for i, (t, v) in enumerate(zip(inputs, op.operands)):
        if tuple(t.shape) != shape_of(v.type) or t.dtype != _dtype(v.type):
            raise ValueError(f"{name}: input {i} is {tuple(t.shape)} {t.dtype}, the op needs {shape_of(v.type)} {_dtype(v.type)}")


def _check_flags(flags) -> frozenset:
    flags = frozenset(flags or ())
    unknown = flags - set(SOURCE_FLAGS)
    if unknown:
        raise ValueError(f"attention: unknown source flags {sorted(unknown)}; known: {sorted(SOURCE_FLAGS)}")
    return flags


def _check_flags_apply(g: "_Gen") -> None:
    if {"tma_bwd", "fused_bwd"} <= g.flags:
        raise ValueError("attention: source flags tma_bwd and fused_bwd do not combine (one kernel, two boxes)")
    if g.f64 and g.flags & {"tma_kv", "tma_bwd"}:
        raise ValueError("attention: the TMA source flags take 16-bit and f32 inputs, not float64")
    if "fma_scale" in g.flags and (g.bias or not g.scale > 0):
        raise ValueError("attention: source flag fma_scale needs scale > 0 and no bias "
                         f"(scale {g.scale!r}, bias {g.bias})")


def prerounded_inputs(op) -> frozenset[str]:
    """The inputs of an attention op ("q", "k", "v"; the backward's "do" too) whose
    values are tf32 already (``nv.tf32_rounded``: the tf32_operands stage stored them
    rounded), which a tf32 kernel then reads into its dots as they are."""
    backward = isinstance(op, nv.AttentionBackwardOp)
    names = ("do", "q", "k", "v") if backward else ("q", "k", "v")
    return frozenset(n for n, v in zip(names, op.operands) if nv.tf32_rounded(v))


def _plan(op, cfg, precision: str, kernel: str, exact: bool = False, flags=frozenset(),
          prerounded=None) -> tuple[_Gen, int, int]:
    """The generator of one kernel of ``op`` (its shape, props and tiles), its
    num_warps and num_stages (``exact``: as ``attention_plan``'s; ``flags``: source
    variants, ``SOURCE_FLAGS``; ``prerounded``: the inputs known rounded to tf32, by
    default ``prerounded_inputs(op)``)."""
    backward = isinstance(op, nv.AttentionBackwardOp)
    if prerounded is None:
        prerounded = prerounded_inputs(op)
    elif set(prerounded) - set(ROUNDABLE_INPUTS):
        raise ValueError(f"attention: prerounded names {sorted(set(prerounded) - set(ROUNDABLE_INPUTS))} "
                         f"are not inputs {ROUNDABLE_INPUTS}")
    q_t, k_t = op.operands[1 if backward else 0].type, op.operands[2 if backward else 1].type
    (b, h, tq, d), tk = shape_of(q_t), shape_of(k_t)[2]
    dtype = _dtype(q_t)
    _check_dtype(dtype)
    _check_head_dim(d)
    p = op.props()
    bias, _ = nv.attention_tail(op.operands[6 if backward else 3:], p)
    if bias:
        _check_dtype(_dtype(bias[0].type))
    ip = _input_precision(dtype, precision)
    bm, bn, warps, stages = attention_plan(tq, tk, d, dtype, cfg, kernel, exact, ip)
    g = _Gen(b, h, tq, tk, d, dtype, bool(p["causal"]), float(p["scale"]), bm, bn, ip,
             bool(bias), _check_flags(flags), sums=backward and bool(p["sums"]), rounded=backward and bool(p["rounded"]),
             dropout=p["dropout"], salt=p["salt"], prerounded=prerounded)
    _check_flags_apply(g)
    return g, warps, stages


def _effective(cfg, g: _Gen, warps: int, stages: int) -> LoweringConfig:
    """The schedule a kernel runs with: ``cfg`` with the tiles actually used."""
    if cfg is not None:
        return dataclasses.replace(cfg, block_m=g.bm, block_n=g.bn, num_warps=warps, num_stages=stages)
    return LoweringConfig(kind="attention", block_m=g.bm, block_n=g.bn, block_k=g.bd, num_warps=warps,
                          num_stages=stages, instruction="mma", regime="compute-bound")


def _strides4(t: torch.Tensor) -> list[int]:
    return list(t.stride())


def _disjoint(t: torch.Tensor) -> bool:
    """No two elements of ``t`` share an address: ordered by stride, each dim steps
    past the whole extent of the dims below it (a permuted view of a contiguous
    tensor, e.g. [B, H, T, D] of a [B, T, H, D] buffer, or a window of a larger one,
    e.g. one gradient's slot in a cat's buffer)."""
    extent = 1
    for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.shape) if n > 1):
        if stride < extent:
            return False
        extent = stride * size
    return True


def _results(name: str, specs, outs, device, strided: tuple[int, ...]) -> list[torch.Tensor]:
    """``rowwise.results``, except that the ``strided`` outputs (o; dq, dk, dv) may
    be any layout without overlap (their kernels store through four strides): the
    layout the next op reads, e.g. [B, T, H, D] memory whose [B, T, C] reshape is a
    view. The others (lse) must be contiguous."""
    if outs is None:
        return results(name, specs, outs, device)
    if len(outs) != len(specs):
        raise ValueError(f"{name}: expected {len(specs)} outputs, got {len(outs)}")
    for i, (t, (shape, dtype)) in enumerate(zip(outs, specs)):
        layout_ok = t.is_contiguous() or (i in strided and _disjoint(t))
        if tuple(t.shape) != shape or t.dtype != dtype or not layout_ok:
            raise ValueError(f"{name}: output {i} is {tuple(t.shape)} {t.dtype} with strides {tuple(t.stride())}, the "
                             f"op needs a {'non-overlapping' if i in strided else 'contiguous'} {shape} {dtype}")  # fmt: skip
    return list(outs)


def _descriptors(name: str, rows: int, g: _Gen, *tensors: torch.Tensor) -> list:
    """Host-built TMA descriptors of [B, H, T, D] tensors with a [1, 1, rows, BLOCK_D] box
    (the TMA source flags' operands); a layout TMA cannot address is an error."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    descs = []
    for t in tensors:
        size = t.element_size()
        if t.stride(-1) != 1 or t.data_ptr() % 16 or any(st * size % 16 for st in t.stride()[:-1]):
            raise ValueError(f"{name}: the TMA source flags need a unit last stride and 16-byte aligned base and "
                             f"strides; got strides {tuple(t.stride())} of {t.dtype} at offset {t.data_ptr() % 16}")
        descs.append(TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, g.bd]))
    return descs


def _name(kind: str, g: _Gen) -> str:
    return (f"nova_attention_{kind}_{g.b}x{g.h}x{g.tq}x{g.tk}x{g.d}{'_causal' if g.causal else ''}"
            f"{'_bias' if g.bias else ''}{f'_dropout_salt{g.salt}' if g.dropout else ''}")


def _tail_args(g: _Gen, tail: list[torch.Tensor]) -> tuple[list, list[int]]:
    """([bias, seed] pointers, as far as the op has them; the bias broadcast to the
    scores [B, H, Tq, Tk] as a view, stride 0 on broadcast dims) and the bias's four
    strides; ([], []) with neither."""
    bias, seed = nv.attention_tail(tail, {"dropout": g.dropout})
    if not bias:
        return seed, []
    z = bias[0].expand(g.b, g.h, g.tq, g.tk)
    return [z, *seed], list(z.stride())


@lowers(nv.AttentionOp)
def lower_attention(op, cfg: LoweringConfig | None = None, *, precision: str = "fp32", source_flags=(),
                    prerounded=None, **_) -> Kernel:
    """``precision``: the module's policy ("fp32" | "tf32" | "bf16"); "tf32" lets
    fp32 q k^T and P v run on tf32 tensor cores, anything else keeps them exact.
    ``source_flags``: optional text variants (``SOURCE_FLAGS``; none by default).
    ``prerounded``: the inputs whose values are tf32 already (default: as the IR
    says, ``prerounded_inputs``); a caller that names one must pass it rounded."""
    g, warps, stages = _plan(op, cfg, precision, "fwd", flags=source_flags, prerounded=prerounded)
    src = attention_forward_source(g)
    kernel, _ = load_kernel(src, "attention_fwd")
    name = _name("fwd", g)
    specs = result_specs(op)  # out [B, H, Tq, D], lse [B, H, Tq]
    grid = (math.ceil(g.tq / g.bm), g.b * g.h)

    def launch(inputs, outs=None):
        _check_inputs(name, op, inputs)
        q, k, v, *tail = inputs
        z, z_strides = _tail_args(g, tail)
        out, lse = _results(name, specs, outs, q.device, strided=(0,))
        if out.numel() == 0:
            return [out, lse]
        if g.tk == 0:  # softmax over no keys: the reference's 0 / 0
            return [out.fill_(float("nan")), lse.fill_(float("-inf"))]
        _check_spans(name, max(g.bm, g.bn, g.bd), q, k, v, *z, out)
        kd, vd = _descriptors(name, g.bn, g, k, v) if "tma_kv" in g.flags else (k, v)
        kernel[grid](q, kd, vd, *z, out, lse, *_strides4(q), *_strides4(k), *_strides4(v), *z_strides, *_strides4(out),
                     num_warps=warps, num_stages=stages)
        return [out, lse]

    return Kernel(name, src, launch, config=_effective(cfg, g, warps, stages), extra={"precision": g.ip})


@lowers(nv.AttentionBackwardOp)
def lower_attention_backward(op, cfg: LoweringConfig | None = None, *, precision: str = "fp32",
                             tiles: dict[str, LoweringConfig] | None = None, source_flags=(), prerounded=None,
                             **_) -> Kernel:
    """Three kernels: delta, dK/dV, dQ (see the module docstring); ``precision`` as
    for the forward. ``Kernel.config`` is the dK/dV kernel's schedule; the dQ
    kernel's is in ``extra["dq_config"]``.

    ``tiles`` ({"dkdv": cfg, "dq": cfg}, either key optional) sets a backward
    kernel's schedule on its own: its block_m (queries), block_n (keys), warps and
    stages are used as given (capped only to the padded sequence), not capped by
    ``cfg``; a kernel not named keeps the rule above. The pipeline never passes it
    (default behaviour is unchanged); it is how ``scripts/attention_variants.py``
    measures other schedules. ``source_flags`` and ``prerounded`` as for the forward.

    ``extra["launch_kernels"](inputs, outs, delta, kernels)`` launches only the
    named kernels ("delta", "dkdv", "dq"; "fused" under the fused_bwd flag) into
    the given outs and delta [B*H, Tq] (each kernel timed alone; ``launch`` is
    delta, dK/dV, dQ in order, or delta and the fused kernel)."""
    tiles = tiles or {}
    unknown = set(tiles) - {"dkdv", "dq"}
    if unknown:
        raise ValueError(f"attention backward: tiles for unknown kernels {sorted(unknown)} (dkdv, dq)")
    g_kv, kv_warps, kv_stages = _plan(op, tiles.get("dkdv", cfg), precision, "dkdv", "dkdv" in tiles, source_flags,
                                      prerounded)
    g_q, q_warps, q_stages = _plan(op, tiles.get("dq", cfg), precision, "dq", "dq" in tiles, source_flags, prerounded)
    src = attention_backward_source(g_kv, g_q)
    delta_k, _ = load_kernel(src, "attention_bwd_delta")
    dkdv_k, _ = load_kernel(src, "attention_bwd_dkdv")
    dq_k, _ = load_kernel(src, "attention_bwd_dq")
    fused_k = load_kernel(src, "attention_bwd_fused")[0] if "fused_bwd" in g_kv.flags else None
    sums_k = load_kernel(src, "attention_bwd_sums")[0] if g_kv.sums else None
    g = g_q
    name = _name("bwd", g)
    stat = torch.float64 if g.f64 else torch.float32
    bh = g.b * g.h
    specs = result_specs(op)  # dq, dk, dv (, the column sums [3, H, D])
    # the column sums' partials (``_sum_rows``): dq's rows, then dk's and dv's
    partial_shape = (_sum_rows(g_q) + 2 * g.b * math.ceil(g.tk / g_kv.bn), g.h * g.d)

    every = ("delta", "fused") if fused_k is not None else ("delta", "dkdv", "dq")
    every += ("sums",) if sums_k is not None else ()

    def launch_kernels(inputs, outs, delta, kernels=every, partials=None):
        do, q, k, v, o, lse, *tail = inputs
        z, z_strides = _tail_args(g, tail)
        dq, dk, dv, *sums = outs
        if sums_k is not None and partials is None:
            partials = torch.empty(partial_shape, dtype=stat, device=q.device)
        ps = [partials] if sums_k is not None else []
        if "delta" in kernels:
            delta_k[(math.ceil(g.tq / _delta_rows(g.bd)), bh)](do, o, delta, *_strides4(do), *_strides4(o),
                                                                num_warps=4)
        common = [*_strides4(q), *_strides4(k), *_strides4(v), *_strides4(do), *lse.stride(), *z_strides]
        tma = "tma_bwd" in g.flags
        if "dkdv" in kernels:
            qd, dod = _descriptors(name, g_kv.bm, g, q, do) if tma else (q, do)
            dkdv_k[(math.ceil(g.tk / g_kv.bn), bh)](qd, k, v, *z, dod, lse, delta, dk, dv, *ps, *common, *_strides4(dk),
                                                     *_strides4(dv), num_warps=kv_warps, num_stages=kv_stages)
        if "dq" in kernels:
            kd, vd = _descriptors(name, g_q.bn, g, k, v) if tma else (k, v)
            dq_k[(math.ceil(g.tq / g_q.bm), bh)](q, kd, vd, *z, do, lse, delta, dq, *ps, *common, *_strides4(dq),
                                                  num_warps=q_warps, num_stages=q_stages)
        if "fused" in kernels:
            programs = max(math.ceil(g.tk / g_kv.bn), math.ceil(g.tq / g_q.bm))
            fused_k[(programs, bh)](q, k, v, *z, do, lse, delta, dq, dk, dv, *ps, *common, *_strides4(dq),
                                    *_strides4(dk), *_strides4(dv), num_warps=kv_warps, num_stages=kv_stages)
        if "sums" in kernels:
            sums_k[(math.ceil(g.h * g.d / SUM_COLS), 3)](partials, sums[0], num_warps=4)

    empty = bh * g.d == 0 or g.tq == 0 or g.tk == 0  # nothing to launch: zero gradients

    def launch(inputs, outs=None):
        _check_inputs(name, op, inputs)
        do, q, k, v, o, lse, *tail = inputs
        z, _ = _tail_args(g, tail)
        grads = _results(name, specs, outs, q.device, strided=(0, 1, 2))
        if empty:
            return [x.zero_() for x in grads]
        _check_spans(name, 256, do, q, k, v, o, *z, *grads[:3])
        delta = torch.empty((bh, g.tq), dtype=stat, device=q.device)
        launch_kernels(inputs, grads, delta)
        return grads

    scratch = nbytes((bh, g.tq), stat) + (nbytes(partial_shape, stat) if sums_k is not None else 0)
    return Kernel(name, src, launch, config=_effective(tiles.get("dkdv", cfg), g_kv, kv_warps, kv_stages),
                  extra={"precision": g.ip, "dq_config": _effective(tiles.get("dq", cfg), g_q, q_warps, q_stages),
                         "launch_kernels": launch_kernels},
                  scratch_bytes=0 if empty else scratch)


__all__ = ["MAX_HEAD_DIM", "ROUNDABLE_INPUTS", "SOURCE_FLAGS", "attention_plan", "prerounded_inputs",
           "attention_forward_source", "attention_backward_source", "lower_attention", "lower_attention_backward"]
