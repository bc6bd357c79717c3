"""The LM head fused with the loss (nova.linear_cross_entropy, its backward, and
both in one pass: nova.linear_cross_entropy_with_grad).

A first version with the token-chunk loop on the host: per chunk of ``chunk``
rows (the op's property), the matmul template writes that chunk's logits
h[r0:r1] @ w^T into one [chunk, V] buffer reused by every chunk, and one
generated kernel walks each row in column blocks (online max / sum over the
vocabulary, the bias added in the row kernel so the logits round as the
unfused matmul + add do). Forward: the row's loss into an f32 buffer that one
program sums in order (a mean divides by the rows that count: NaN for a batch
of padding, as torch). Backward: d = (softmax - (1 - ls) onehot - ls / V) *
scale written over the logits in place (the head's type: the cast back the
unfused VJP makes), then dh[r0:r1] = d @ w (straight into dh's rows) and
dw += d^T @ h[r0:r1] (the first chunk's product straight into an f32
accumulator, later ones added to it in the matmul's epilogue: the accumulator
tile + the old value, in place; rounded once at the end), dbias += column sums
of d. With the loss's cotangent known before the loss (the loss_grad stage's
merged op), one pass does both: per chunk one logits matmul and one row kernel
that stores the row's loss and writes d over the logits (one log-sum-exp pass),
then the backward's matmuls; every result bit for bit the separate ops'. Peak
memory is O(chunk x V), not O(N x V). With ``ROW_STATS_FROM_LOGITS`` the logits matmul's
epilogue stores each tile's row statistics and the row kernel reads the row once (below).
Statistics are f32; 16-bit heads run their matmuls in bf16 / f16 with f32
accumulation. An f32 head under the tf32 policy without a bias writes d rounded to
nearest tf32 (``PREROUND_TF32``), which dh's matmul takes as ``prerounded``; under
the tf32 policy the weight is rounded once a launch (``HOIST_WEIGHT_TF32``).

``launch(inputs, outs)`` writes into ``outs`` when given. An f32 dw or dbias is
its own accumulator, and a bias of the head's type needs no second copy of d
(the column sum reads the logits buffer), so the scratch (``Kernel.scratch_bytes``)
is the logits buffer, the per-row losses and / or the scale, the accumulators of
16-bit gradients, and the largest matmul's own scratch. Out-of-range targets are masked (their row's loss is NaN,
their gradient the plain softmax); the guard stage counts them on the device.
"""

from __future__ import annotations

import dataclasses

import torch

from nova.codegen.triton import matmul as mm
from nova.codegen.triton.elementwise import Operand
from nova.codegen.triton.lowering import Kernel, Scratch, arena_scratch, lowers
from nova.codegen.triton.rowwise import _FINAL_BLOCK, _TL, LOOP_BLOCK, _check_inputs, _code, _kernel
from nova.codegen.triton.rowwise import lowering_device, next_pow2, result_specs, results
from nova.codegen.triton.source import load_kernel
from nova.ir import dialect as nv
from nova.ir.types import elem_of, shape_of, to_torch_dtype
from nova.schedule.config import LoweringConfig
from nova.schedule.configurator import STEP_MATMUL_PRECISION, configure_matmul

_NEG_INF = '-float("inf")'
_COL_BLOCK = 128  # columns per program of the bias-gradient column sum
# An f32 head under the tf32 policy without a bias: the row kernel writes the logits'
# gradient d rounded to nearest tf32, so that dh = d @ w's staged config (tf32 wgmma
# reads K-major shared memory; d is [chunk, V] with V contiguous: that layout already)
# takes d as it is instead of copying the [chunk, V] buffer rounded (824 MB read and
# written a 4096-row chunk at GPT-2's vocabulary); dw = d^T @ h still stages d^T (a
# transposing copy), rounding again: the same bits. Measured on the H200 (scripts/
# lm_head_parts.py --precision tf32, bench/results/runs/lm_head_parts_tf32_b1d3930.json):
# dh 0.81 ms a 4096-row chunk against 1.05 with d copied.
PREROUND_TF32 = True
# An f32 head under the tf32 policy: the weight is rounded to tf32 once a launch, into
# the two layouts tf32 wgmma reads (K contiguous): w itself for the logits h @ w^T, and
# w^T dense for dh = d @ w; every chunk's matmuls take them as ``prerounded`` instead
# of each staging its own copy (the staged configs copied the [V, D] weight, 154 MB read
# and written at GPT-2's size, for every chunk's logits and dh). The same bits: rounding
# is idempotent, and the copies are the staging pass's own.
HOIST_WEIGHT_TF32 = True
# The row kernel reads a chunk row twice: the log-sum-exp pass, then the gradient pass.
# At GPT-2's vocabulary a row is 100 KB (bf16), and the rows in flight (one program a
# row, several programs an SM) exceed the 50 MB L2, so the second read can come from
# DRAM again: 3 x 412 MB a 4096-row chunk instead of 2. Two ways to keep more of the
# row for its second read (scripts/lce_rows_variants.py, one 4096-row chunk at GPT-2's
# vocabulary alone on the H200, bit for bit the same d and losses): the gradient pass walking
# the row backwards (the blocks read last are the likeliest still cached), and eviction hints
# (evict_last on the first pass, evict_first on the second). With the target's logit taken in
# the first pass (bench/results/runs/lce_rows_variants_6cd738f.json): bf16 0.336 ms with the
# hints alone, 0.376 reversed as well; f32 0.611 / 0.587. Before that change (the same
# kernel but for xt, lce_rows_variants_9168703.json) bf16 0.333 plain and 0.331 with the hints.
# The hints stay; the reversed pass, slower at bf16 (the GPT-2 bf16 step's head), does not.
GRAD_PASS_REVERSED = False
KEEP_ROWS_IN_L2 = True
# The row statistics from the logits matmul's epilogue (``mm.Epilogue.row_stats``): each tile
# of the logits stores, per row, the maximum of its columns and the sum of their exponentials
# (of the logits as stored, rounded to the head's type), [chunk, cdiv(V, BLOCK_N)] each; the row
# kernel combines a row's tiles into its log-sum-exp and reads the row once, for the gradient
# pass, instead of twice (the log-sum-exp pass is gone). A 4096-row bf16 chunk at GPT-2's
# vocabulary: the row kernel's 412 MB read goes, the matmul's epilogue gains an exponential and
# a maximum a logit (the row kernel took 0.338 ms on the H200 against 0.17-0.26 for one or two
# reads at 4.8 TB/s). The loss and d differ from the two-pass kernel's by f32 rounding (the sum
# of exponentials in another order). Heads without a bias or label smoothing, with a config (the
# one the configure stage writes: its BLOCK_N sets the statistics' width; a split config runs
# unsplit); the others keep the two-pass row kernel. On since 2026-12-05 (eighth session):
# GPT-2 124M bf16 b32 on an H100, `nova bench gpt2 --engines torch.compile,nova` in one call,
# Nova 506,154 tok/s (64.7 ms) plain and 510,088 (64.2 ms) with it, torch.compile 499,597 /
# 498,057 beside them (bench/results/runs/gpt2_124m_bf16_b32_h100_rowstats_*_63a1179.json);
# tests/gpu/test_linear_ce_gpu.py passed there. 16-bit heads only (``ROW_STATS_F32``)
ROW_STATS_FROM_LOGITS = True
# f32 heads too (the tf32 GPT-2 step's and the 46M MLP's, whose LM head is most of its step): a
# 4096-row chunk's logits are 824 MB there (its row kernel took 0.611 ms on the H200), but the
# logits' epilogue runs beside tf32's slower products (234 registers offline): on since the H100
# run at 1b29c22 (with matmul.STREAM_K_F32: GPT-2 tf32 b16 1.122x -> 1.146x torch.compile, MLP LM
# 46M tf32 b8 0.936x -> 0.966x)
ROW_STATS_F32 = True
# The logits' gradient d computed where dh = d @ w and dw = d^T @ h read it (``mm.Prologue``), from
# the logits and two per-row vectors (the log-sum-exp, the row's weight: the scale where the target
# counts), instead of written over the logits by the row kernel: with the row statistics the row
# kernel then reads one logit a row (the target's) and the tiles' statistics, and a 4096-row chunk's
# 824 MB (f32, the tf32 steps' heads) or 412 MB (bf16) of logits are neither read nor written by it
# (the row kernel took 0.611 / 0.338 ms a chunk on the H200 before the statistics). d is formed
# from each logit as the row kernel forms it, so the products are the same bits; the matmuls do
# an exponential a loaded element instead (recomputed for each of A's column tiles: N / BLOCK_N
# times). Heads with the row statistics (``stats_cols_of``). Off (``D_PROLOGUE`` 16-bit heads,
# ``D_PROLOGUE_F32`` f32 ones): slower on the 46M MLP on an H100 at b04da52 (838,205 against 942,656
# tok/s, `bench-gpt2 --set codegen.triton.linear_ce.D_PROLOGUE_F32=True`): the exponentials a loaded
# element, and the prologue's loop waits for each wgmma (docs/performance.md, tenth session).
D_PROLOGUE = False
D_PROLOGUE_F32 = False
# the statistics' logits in the warp-specialized kernel where the op's config is one (stats_config);
# False: the 8-warp persistent TMA kernel instead (scripts/epilogue_variants.py "lce-stats-nows")
ROW_STATS_WS = True
# Measured and left out (bench/results/runs/lce_rows_variants_bf16_459b619.json, a 4096-row bf16
# chunk on the H200: 0.338 ms shipped): the log-sum-exp pass's sums kept per lane and added up
# after the loop (fewer barriers, twice the registers: 0.367 ms) and both row loops
# software-pipelined 2 or 3 deep with tl.range (0.475-0.668 ms); docs/performance.md, 2026-12-05.


def _logit(z_ptr: str, cvar: str, mask: str, other: str, has_bias: bool, logit_ty: str,
           eviction: str | None = None) -> str:
    """The f32 logit at columns ``cvar``: the matmul's value, + bias rounded to the logits' type."""
    ev = f", eviction_policy=\"{eviction}\"" if eviction else ""
    x = f"tl.load({z_ptr} + {cvar}, mask={mask}, other={other}{ev}).to(tl.float32)"
    if not has_bias:
        return x
    return f"({x} + tl.load(b_ptr + {cvar}, mask={mask}, other=0.0).to(tl.float32)).to({logit_ty}).to(tl.float32)"


def linear_ce_source(V: int, ignore: int, ls: float, has_bias: bool, logit_ty: str, z_ty: str, block: int,
                     preround: bool = False, grad_reversed: bool | None = None, keep_rows: bool | None = None,
                     stats_tiles: int = 0, row_vectors: bool = False) -> str:
    """Row kernels over a chunk's logits buffer (row stride V), a count of the rows
    that count, the final sum, the backward's scale and the bias-gradient column
    sum: ``lce_rows`` (the row losses), ``lce_rows_backward`` (d over the logits)
    and ``lce_rows_with_grad`` (both from one log-sum-exp pass: the same code). With
    a bias of another type than the head (``logit_ty != z_ty``) the backward also
    writes d in the bias's type to ``db_ptr``, for the column sum; otherwise the
    logits buffer holds that d. ``preround``: d is written rounded to nearest tf32
    (an f32 head under the tf32 policy, no bias: both matmuls reading d round it
    so anyway, and take it as ``prerounded``). ``grad_reversed`` (default
    ``GRAD_PASS_REVERSED``): the gradient pass walks the row's blocks last to first;
    ``keep_rows`` (default ``KEEP_ROWS_IN_L2``): the log-sum-exp pass loads with
    ``evict_last`` and the gradient pass with ``evict_first``. Neither changes a bit:
    each column's d depends on its own logit and the row's statistics only.
    The sum of the logits is taken only with label smoothing (its one use).
    ``stats_tiles`` (``ROW_STATS_FROM_LOGITS``): the row's statistics come from the logits
    matmul's epilogue, ``stats_tiles`` maxima and sums of exponentials a row (``rm_ptr``,
    ``rs_ptr``), combined here; the row is read once, by the gradient pass (the target's
    logit is loaded before it, and the program's threads wait for each other before any
    of them writes d over the row). No bias and no label smoothing. ``row_vectors``
    (``D_PROLOGUE``, with ``stats_tiles``): also ``lce_rows_lse`` and ``lce_rows_lse_with_grad``,
    which store each row's log-sum-exp and weight instead of writing d."""
    if stats_tiles and (has_bias or ls):
        raise ValueError("linear_ce: the row statistics from the logits' epilogue take no bias and no label smoothing")
    grad_reversed = GRAD_PASS_REVERSED if grad_reversed is None else grad_reversed
    keep_rows = KEEP_ROWS_IN_L2 if keep_rows is None else keep_rows
    blocks = f"range(0, {V}, BLOCK)"
    bias_p = ["b_ptr"] if has_bias else []
    separate_d = has_bias and logit_ty != z_ty
    # the running sums: one per program, a reduction across its warps every block

    def running(name: str, term: str) -> str:
        return f"{name} += tl.sum({term}, axis=0)"

    scale_s = "s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe), axis=0)"
    sx_init = "\n        sx = tl.zeros((), tl.float32)" if ls else ""
    sx_step = f"\n            {running('sx', f'tl.where(c < {V}, x, 0.0)')}" if ls else ""
    head = f"""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        z_row = z_ptr + row * {V}
        t = tl.load(t_ptr + row)"""
    lse_of_m_s = f"""
        lse = tl.where(m == {_NEG_INF}, 0.0, m) + tl.log(s)
        valid = t != {ignore}
        inb = (t >= 0) & (t < {V})"""
    if not stats_tiles:  # one pass over the row: online maximum and sum
        lse = head + f"""
        m = tl.full((), {_NEG_INF}, tl.float32)
        s = tl.zeros((), tl.float32){sx_init}
        xt = tl.zeros((), tl.float32)
        for c0 in {blocks}:
            c = c0 + cols
            x = {_logit("z_row", "c", f"c < {V}", _NEG_INF, has_bias, logit_ty, "evict_last" if keep_rows else None)}
            m_new = tl.maximum(m, tl.max(x, axis=0))
            m_safe = tl.where(m_new == {_NEG_INF}, 0.0, m_new)
            {scale_s}{sx_step}
            {running('xt', 'tl.where(c == t, x, 0.0)')}  # the target's logit, from the block holding it
            m = m_new""" + lse_of_m_s + "\n    "
    else:  # the log-sum-exp of the row's tiles' statistics
        tb = next_pow2(stats_tiles)
        lse = head + f"""
        tcols = tl.arange(0, {tb})
        tm = tl.load(rm_ptr + row * {stats_tiles} + tcols, mask=tcols < {stats_tiles}, other={_NEG_INF})
        ts = tl.load(rs_ptr + row * {stats_tiles} + tcols, mask=tcols < {stats_tiles}, other=0.0)
        m = tl.max(tm, axis=0)
        m_safe = tl.where(m == {_NEG_INF}, 0.0, m)
        s = tl.sum(ts * tl.exp(tm - m_safe), axis=0)""" + lse_of_m_s + """
        xt = tl.load(z_row + t, mask=valid & inb, other=0.0).to(tl.float32)
        tl.debug_barrier()  # every thread has the target's logit before any writes d over it
    """
    loss = "lse - xt" if not ls else f"{1.0 - ls!r} * (lse - xt) + {ls!r} * (lse - sx * {1.0 / V!r})"
    # xt comes from the first pass (exactly the logit: one nonzero term), not a load after it: with the
    # gradient written over the logits in place, another thread of the program may already have stored
    # d over the target's column (seen on the H200 with the gradient pass reversed: a wrong loss)
    row_loss = f"""
        xt = tl.where(valid & inb, xt, 0.0)
        loss = tl.where(valid, {loss}, 0.0)
        loss = tl.where(valid & ((t < 0) | (t >= {V})), float("nan"), loss)
        tl.store(loss_ptr + row, loss)
    """
    fwd = _code(lse, row_loss)
    hit, miss = (1.0, 0.0) if not ls else (1.0 - ls + ls / V, ls / V)
    nblocks = -(-V // block)
    loop = (f"for i in range(0, {nblocks}):\n            c0 = ({nblocks - 1} - i) * BLOCK" if grad_reversed
            else f"for c0 in {blocks}:")
    row_grad = f"""
        wrow = tl.where(valid, 1.0, 0.0) * tl.load(scale_ptr)
        {loop}
            c = c0 + cols
            x = {_logit("z_row", "c", f"c < {V}", "0.0", has_bias, logit_ty, "evict_first" if keep_rows else None)}
            d = ((tl.exp(x - lse) - tl.where(c == t, {hit!r}, {miss!r})) * wrow).to({logit_ty})
            tl.store(z_row + c, {"tf32_rn(d)" if preround else f"d.to({z_ty})"}, mask=c < {V})
            {"tl.store(db_ptr + row * " + str(V) + " + c, d, mask=c < " + str(V) + ")" if separate_d else "pass"}
    """
    bwd = _code(lse, row_grad)
    # the row's loss, then its gradient over the logits it has read (one log-sum-exp pass, not two)
    both = _code(lse, row_loss, row_grad)
    # (D_PROLOGUE) the row's log-sum-exp and weight, from which dh's and dw's prologues form d
    vector_stores = """
        tl.store(lse_ptr + row, lse)
        tl.store(w_ptr + row, tl.where(valid, 1.0, 0.0) * tl.load(scale_ptr))
    """
    final = _code(_count_source(ignore), f"""
        total = tl.zeros(({_FINAL_BLOCK},), tl.float32)
        for r0 in range(0, n_rows, {_FINAL_BLOCK}):
            rr = r0 + r
            total += tl.load(loss_ptr + rr, mask=rr < n_rows, other=0.0)
        total = tl.sum(total, axis=0)
        tl.store(out_ptr, ((total / count) if MEAN else total).to(out_ptr.dtype.element_ty))
    """)
    scale = _code(_count_source(ignore), """
        g = tl.load(g_ptr).to(tl.float32)
        tl.store(scale_ptr, (g / tl.maximum(count, 1.0)) if MEAN else g)
    """)
    colsum = f"""
        pid = tl.program_id(0)
        c = pid * {_COL_BLOCK} + tl.arange(0, {_COL_BLOCK})
        acc = tl.load(acc_ptr + c, mask=c < {V}, other=0.0)
        part = tl.zeros(({_COL_BLOCK},), tl.float32)
        for r in range(0, n_rows):
            part += tl.load(d_ptr + r * {V} + c, mask=c < {V}, other=0.0).to(tl.float32)
        tl.store(acc_ptr + c, acc + part, mask=c < {V})
    """
    header = (f"# Generated by nova.codegen.triton.linear_ce; do not edit.\n# vocabulary {V}, ignore_index {ignore}, "
              f"label_smoothing {ls!r}, bias {has_bias}, logits {logit_ty}, head {z_ty}, block {block}"
              + (f", statistics of {stats_tiles} column tiles" if stats_tiles else "") + "\n"
              f"import triton\nimport triton.language as tl\n\nBLOCK = tl.constexpr({block})\n"
              + (mm.tf32_rn_fn() if preround else ""))
    stats_p = ["rm_ptr", "rs_ptr"] if stats_tiles else []
    vectors = ""
    if stats_tiles and row_vectors:
        vectors = (_kernel("lce_rows_lse", ["z_ptr", "t_ptr", *stats_p, "scale_ptr", "lse_ptr", "w_ptr"],
                           _code(lse, vector_stores))
                   + _kernel("lce_rows_lse_with_grad", ["z_ptr", "t_ptr", *stats_p, "loss_ptr", "scale_ptr", "lse_ptr",
                                                        "w_ptr"], _code(lse, row_loss, vector_stores)))
    return (header
            + _kernel("lce_rows", ["z_ptr", "t_ptr", *stats_p, *bias_p, "loss_ptr"], fwd)
            + _kernel("lce_rows_backward", ["z_ptr", "t_ptr", *stats_p, *bias_p, "scale_ptr",
                                            *(["db_ptr"] if separate_d else [])], bwd)
            + _kernel("lce_rows_with_grad", ["z_ptr", "t_ptr", *stats_p, *bias_p, "loss_ptr", "scale_ptr",
                                             *(["db_ptr"] if separate_d else [])], both)
            + _kernel("lce_final", ["t_ptr", "loss_ptr", "out_ptr", "n_rows", "st", "MEAN: tl.constexpr"], final)
            + _kernel("lce_scale", ["g_ptr", "t_ptr", "scale_ptr", "n_rows", "st", "MEAN: tl.constexpr"], scale)
            + _kernel("lce_colsum", ["d_ptr", "acc_ptr", "n_rows"], colsum) + vectors)


def d_prologues(logit_ty: str, z_ty: str, rounded: bool) -> tuple[mm.Prologue, mm.Prologue]:
    """(dh's, dw's) ``mm.Prologue`` (``D_PROLOGUE``): d = (exp(x - lse) - onehot) * weight
    from the loaded logits x, as ``lce_rows_backward`` forms it (without label smoothing or
    a bias), stored in the head's type or rounded to nearest tf32 (``rounded``: what that
    kernel writes under ``PREROUND_TF32``, and what the matmul would round it to). dh's A
    is the chunk's logits [rows, V] (the vectors along A's rows, the vocabulary along K),
    dw's is their transpose [V, rows] (the vectors along K)."""
    out = "tf32_rn(d)" if rounded else f"d.to({z_ty})"

    def body(lse: str, w: str, hit: str) -> str:
        return (f"d = ((tl.exp(a.to(tl.float32) - {lse}) - tl.where({hit}, 1.0, 0.0)) * {w}).to({logit_ty})\n"
                f"a = {out}")

    vectors = (("lse", "m"), ("w", "m"), ("t", "m"))
    dh = mm.Prologue(vectors, body("lse[:, None]", "w[:, None]", "p_k[None, :] == t[:, None]"), rounded)
    dw = mm.Prologue(tuple((n, "k") for n, _ in vectors),
                     body("lse[None, :]", "w[None, :]", "p_m[:, None] == t[None, :]"), rounded)
    return dh, dw


def _count_source(ignore: int) -> str:
    """``count``: the rows whose target is not ignored (out-of-range ones included)."""
    return f"""
        r = tl.arange(0, {_FINAL_BLOCK})
        count = tl.zeros(({_FINAL_BLOCK},), tl.float32)
        for r0 in range(0, n_rows, {_FINAL_BLOCK}):
            rr = r0 + r
            t = tl.load(t_ptr + rr.to(tl.int64) * st, mask=rr < n_rows, other={ignore})
            count += (t != {ignore}).to(tl.float32)
        count = tl.sum(count, axis=0)
    """


_LAYOUTS = ("row", "col", "strided")  # mm.layout's answers


def accumulate(M: int, N: int, out_dtype: torch.dtype = torch.float32) -> mm.Epilogue:
    """The epilogue of ``acc += a @ b`` for an f32 [M, N] ``acc`` given as both its
    operand and its output (``mm.matmul_epilogue(a, b, ep, [acc], f32, outs=[acc])``):
    each element of the old value is read and written by the program of its tile, and
    ``old + tile`` is one f32 rounding, as the matmul's f32 result added in afterwards
    (``old + part``) is: the same bits, without the partial's buffer and pass. With a
    16-bit ``out_dtype`` the sum is stored rounded once to it (the last chunk's, into a
    16-bit weight gradient: what the f32 sum copied into it would hold)."""
    f32 = torch.float32
    return mm.Epilogue(shape=(M, N), operands=(Operand((M, N), f32, load="raw"),), body="e_acc = ex0 + e_tile",
                       stores=(("e_acc", "f32", out_dtype),), out_shapes=((M, N),))


class Configs:
    """The configurator's schedule of each distinct matmul of a lowering, asked once
    (the chunk's and the last chunk's shapes, the operands' layouts): the launches of
    every step then look it up instead of configuring again."""

    def __init__(self, precision: str):
        self.precision = precision
        self.known: dict[tuple, LoweringConfig] = {}

    def __call__(self, a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, epilogue: bool = False,
                 prerounded: tuple[str, ...] = ()):
        key = (a.shape[-2], b.shape[-1], a.shape[-1], a.dtype, out_dtype, mm.layout(a), mm.layout(b), epilogue,
               a.device.type, prerounded)  # fmt: skip
        cfg = self.known.get(key)
        if cfg is None:
            # (one launch each, tail=False: the chunks' launches take operand prologues, rule 8f's cut does not)
            cfg = self.known[key] = configure_matmul(
                key[0], key[1], key[2], 1, a.dtype, a.dtype, out_dtype, self.precision, key[5], key[6], False,
                mm.device_spec(a.device), epilogue=epilogue, prerounded=prerounded, tail=False)  # fmt: skip
        return cfg


def accumulate_into(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, precision: str, ep: mm.Epilogue | None = None,
                    record: dict | None = None, configs: Configs | None = None,
                    prerounded: tuple[str, ...] = (), out: torch.Tensor | None = None, prologue=None) -> None:
    """``acc += a @ b`` (f32 ``acc``) through ``accumulate``'s epilogue, configured as the
    launcher configures ``a @ b`` (``mm.matmul(cfg=None)``) but as an epilogue kernel
    (``epilogue=True``: the configurator's rule for kernels storing through pointers);
    the same tile, BLOCK_K and split, so the same sums per tile. ``configs``: the
    lowering's schedules (asked once per shape). ``prerounded`` and ``prologue`` as for ``mm.matmul``.
    ``out``: where the sum goes instead of ``acc`` (``ep`` storing its dtype)."""
    cfg = (configs or Configs(precision))(a, b, torch.float32, epilogue=True)
    ep = ep or accumulate(*acc.shape)
    mm.matmul_epilogue(a, b, ep, [acc], torch.float32, cfg=cfg, precision=precision,
                       outs=[out if out is not None else acc], record=record, prerounded=prerounded, prologue=prologue)


def _matmul_scratch(M: int, N: int, K: int, dtype, out_dtype, precision: str, cfg, a_layouts, b_layouts,
                    b_rounded: bool = False, a_rounded: bool = False) -> int:
    """The most bytes ``mm.matmul`` allocates besides its ``out`` for one [M, K] @ [K, N]:
    the split-K partials and the tf32 staging copies it plans (its ``_run``), over the
    layouts the operands may have (h and w come with the strides they have);
    ``b_rounded`` / ``a_rounded``: B / A comes prerounded in the staged layout (not
    copied), and is configured so (``prerounded``), as the launch configures it."""
    worst = 0
    pre = ("a",) * a_rounded + ("b",) * b_rounded
    for la in a_layouts:
        for lb in b_layouts:
            c = cfg or mm.configure(M, N, K, 1, dtype, out_dtype, precision, la, lb, False,
                                    mm.device_spec(lowering_device()), prerounded=pre, tail=False)
            splits = mm.split_k_plan(K, c)[1] if c.split_k > 1 else 1
            tokens = c.instruction.split("+")
            staged = ("stage_a" in tokens and not a_rounded) * M * K + ("stage_b" in tokens and not b_rounded) * K * N
            worst = max(worst, 4 * (staged + (splits * M * N if splits > 1 else 0)))
    return worst


FORWARD, BACKWARD, WITH_GRAD = "forward", "backward", "with_grad"  # the three ops' lowerings
_KIND = {nv.LinearCrossEntropyOp: FORWARD, nv.LinearCrossEntropyBackwardOp: BACKWARD,
         nv.LinearCrossEntropyWithGradOp: WITH_GRAD}


def _held(N, D, V, chunk, head, bias_dtype, separate_d: bool, kind: str,
          stats_cols: int = 0, d_prologue: bool = False) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """The buffers ``forward`` / ``backward_`` / ``with_grad`` below take from their
    ``Scratch``, in the order they take them (the arena rule plans exactly these).
    ``stats_cols``: the logits' BLOCK_N where their epilogue stores the row statistics
    (``stats_cols_of``), two f32 [chunk, cdiv(V, stats_cols)] buffers after the logits';
    ``d_prologue`` (``uses_d_prologue``): the rows' log-sum-exp and weight after them."""
    f32 = torch.float32
    stats = [((chunk, triton_cdiv(V, stats_cols)), f32)] * 2 if stats_cols else []
    if kind == FORWARD:
        return [((N,), f32), ((chunk, V), head), *stats]  # the row losses, the one logits buffer
    parts = [((N,), f32)] if kind == WITH_GRAD else []  # the row losses
    parts.append(((1,), f32))  # the scale
    if head != f32:
        parts.append(((V, D), f32))  # a 16-bit dw's accumulator
    parts.append(((chunk, V), head))
    parts += stats
    if d_prologue:
        parts += [((chunk,), f32)] * 2
    if separate_d:
        parts.append(((chunk, V), bias_dtype))
    if bias_dtype not in (None, f32):
        parts.append(((V,), f32))  # a 16-bit dbias's accumulator
    return parts


def hoists_weight(head, prec: str) -> bool:
    """Whether the launch rounds the weight to tf32 once (``HOIST_WEIGHT_TF32``)."""
    return HOIST_WEIGHT_TF32 and head == torch.float32 and prec == "tf32-rn"


def _scratch(N, D, V, chunk, head, bias_dtype, separate_d: bool, kind: str, prec: str, cfg, stats_cols: int = 0,
             d_prologue: bool = False) -> int:
    """Kernel.scratch_bytes: what the launch takes (``_held``), the weight's rounded
    copies (``hoists_weight``: one for the forward, two with the gradients), plus the
    largest matmul's own scratch (the matmuls run one at a time)."""
    rows = {chunk, N % chunk or chunk}  # a full chunk and the last one
    f32 = torch.float32
    hoist = hoists_weight(head, prec)
    lw = ("col",) if hoist else _LAYOUTS  # B of the logits and of dh, rounded once: K contiguous
    mms = [_matmul_scratch(r, V, D, head, head, prec, cfg, _LAYOUTS, lw, hoist) for r in rows]  # the logits
    if kind != FORWARD:
        pre_d = PREROUND_TF32 and head == f32 and prec == "tf32-rn" and bias_dtype is None  # _lower's preround
        mms += [_matmul_scratch(r, D, V, head, head, prec, None, ("row",), lw, hoist, pre_d) for r in rows]  # dh
        mms += [_matmul_scratch(V, D, r, head, f32, prec, None, ("col",), _LAYOUTS) for r in rows]  # d^T @ h
    copies = (1 if kind == FORWARD else 2) * V * D * 4 if hoist else 0
    held = _held(N, D, V, chunk, head, bias_dtype, separate_d, kind, stats_cols, d_prologue)
    return Scratch.size(*held) + copies + max(mms)


def _shapes(op):
    """(N, D, V, chunk, head dtype, bias dtype, separate_d, kind) of a lowering: the
    fields ``_held`` takes, then its kind."""
    kind = _KIND[type(op)]
    g_in = 0 if kind == FORWARD else 1
    h_t, w_t = op.operands[g_in].type, op.operands[g_in + 1].type
    has_bias = len(op.operands) == g_in + 4
    (N, D), (V, _) = shape_of(h_t), shape_of(w_t)
    head = to_torch_dtype(elem_of(h_t))
    logit_t = op.operands[g_in + 3].type if has_bias else h_t
    bias_dtype = to_torch_dtype(elem_of(logit_t)) if has_bias else None
    chunk = min(op.props()["chunk"], max(N, 1))
    return N, D, V, chunk, head, bias_dtype, has_bias and bias_dtype != head, kind


def stats_cols_of(op, cfg: LoweringConfig | None) -> int:
    """The logits' BLOCK_N where their epilogue stores the row statistics
    (``ROW_STATS_FROM_LOGITS``), else 0: a head without a bias or label smoothing, with a
    config (the op's, which the launch then runs unsplit), 16-bit unless ``ROW_STATS_F32``."""
    _, _, _, _, head, bias_dtype, _, _ = _shapes(op)
    ls = float(op.props()["label_smoothing"])
    if not ROW_STATS_FROM_LOGITS or cfg is None or bias_dtype or ls or (head == torch.float32 and not ROW_STATS_F32):
        return 0
    return cfg.block_n


def uses_d_prologue(op, cfg: LoweringConfig | None) -> bool:
    """Whether the backward's matmuls form d from the logits (``D_PROLOGUE``, ``D_PROLOGUE_F32``):
    a lowering with gradients whose logits carry their row statistics (``stats_cols_of``)."""
    _, _, _, _, head, _, _, kind = _shapes(op)
    on = D_PROLOGUE_F32 if head == torch.float32 else D_PROLOGUE
    return on and kind != FORWARD and stats_cols_of(op, cfg) > 0


def stats_config(cfg: LoweringConfig) -> LoweringConfig:
    """The logits' config with their row statistics: the op's tile (its BLOCK_N is the
    statistics' width, ``stats_cols_of``) unsplit (the statistics are a whole tile's). With
    ``ROW_STATS_WS`` a warp-specialized config stays so (the plain logits' kernel, plus the
    statistics; the offline sm_90a build partitions, 168 registers, where column sums fail
    Triton 3.6's partitioner); without it the persistent TMA kernel at 8 warps (two warp
    groups share the 128x256 accumulator; at 4 warps it is 256 registers a thread and
    spills) and at most 3 stages: 188 registers, no spills."""
    cfg = dataclasses.replace(cfg, split_k=1)
    tokens = cfg.instruction.split("+")
    if "ws" not in tokens or ROW_STATS_WS:
        return cfg
    return dataclasses.replace(cfg, instruction="+".join(t for t in tokens if t != "ws"),
                               num_warps=max(cfg.num_warps, 8), num_stages=min(cfg.num_stages, 3))


@arena_scratch(nv.LinearCrossEntropyOp, nv.LinearCrossEntropyBackwardOp, nv.LinearCrossEntropyWithGradOp)
def _arena(op) -> int:
    from nova.schedule.cost import config_of

    cfg = config_of(op)
    return Scratch.size(*_held(*_shapes(op), stats_cols_of(op, cfg), uses_d_prologue(op, cfg)))


def _lower(op, cfg: LoweringConfig | None, precision: str, max_block: int) -> Kernel:
    N, D, V, chunk, head, bias_dtype, separate_d, kind = _shapes(op)
    g_in = 0 if kind == FORWARD else 1
    has_bias = bias_dtype is not None
    if head == torch.float64:
        raise NotImplementedError(f"{op.name}: the Triton lowering takes f32, bf16 or f16 heads (the matmul template's types)")
    logit_ty = _TL[bias_dtype] if has_bias else _TL[head]
    p = op.props()
    ignore, ls, mean = p["ignore_index"], float(p["label_smoothing"]), p["reduction"] == "mean"
    block = min(max_block, next_pow2(V))
    prec = STEP_MATMUL_PRECISION[precision]
    # d written rounded to tf32 where its only readers are the tf32 matmuls (no bias column sum):
    # dh's staged config then reads it in place instead of copying the [chunk, V] f32 buffer
    preround = PREROUND_TF32 and head == torch.float32 and prec == "tf32-rn" and not has_bias
    d_rounded = ("a",) if preround else ()  # dh = d @ w's prerounded operand
    hoist = hoists_weight(head, prec)
    w_rounded = ("b",) if hoist else ()  # the logits' and dh's B: the weight, rounded once
    # h stored rounded by its producer (the tf32_operands stage): the logits' A and dw's B
    h_rounded = head == torch.float32 and prec == "tf32-rn" and nv.tf32_rounded(op.operands[g_in])
    h_a, h_b = (("a",), ("b",)) if h_rounded else ((), ())
    stats_cols = stats_cols_of(op, cfg)
    n_tiles = triton_cdiv(V, stats_cols) if stats_cols else 0
    d_pro = uses_d_prologue(op, cfg)  # d formed by dh's and dw's prologues, not written by the row kernel
    if d_pro:
        pro_dh, pro_dw = d_prologues(logit_ty, _TL[head], head == torch.float32 and prec == "tf32-rn")
    src = linear_ce_source(V, ignore, ls, has_bias, logit_ty, _TL[head], block, preround, stats_tiles=n_tiles,
                           row_vectors=d_pro)
    k = {n: load_kernel(src, n)[0] for n in ("lce_rows", "lce_rows_backward", "lce_rows_with_grad", "lce_final",
                                             "lce_scale", "lce_colsum")}  # fmt: skip
    if d_pro:
        k.update({n: load_kernel(src, n)[0] for n in ("lce_rows_lse", "lce_rows_lse_with_grad")})
    name = f"nova_linear_cross_entropy{'' if kind == FORWARD else '_' + kind}_{N}x{D}x{V}_chunk{chunk}"
    warps = 4 if block <= 1024 else 8
    specs = result_specs(op)
    used: dict[str, str] = {}
    f32 = torch.float32
    dw_add = accumulate(V, D)
    # the last chunk's epilogue under a 16-bit weight (dw has w's type): the sum stored rounded into dw
    dw_last = accumulate(V, D, to_torch_dtype(elem_of(op.operands[g_in + 1].type)))
    configs = Configs(prec)

    def chunks():
        return ((r0, min(N, r0 + chunk)) for r0 in range(0, N, chunk))

    stats_cfg = stats_config(cfg) if stats_cols else None  # the logits with their row statistics

    def logits(h, w, r0, r1, buf, stats=()):
        """The chunk's logits into ``buf``; with ``stats`` (the two statistics buffers) their
        row statistics too, from the matmul's epilogue."""
        z = buf[: r1 - r0]
        if not stats:
            mm.matmul(h[r0:r1], w.t(), cfg=cfg, precision=prec, out=z, record=used, prerounded=h_a + w_rounded)
            return z
        rounding = "" if head == f32 else f".to({_TL[head]}).to(tl.float32)"  # the logit as stored
        ep = mm.Epilogue(shape=(r1 - r0, V), operands=(), body=f"e_z = e_tile{rounding}",
                         stores=(("e_z", "f32", head),), out_shapes=((r1 - r0, V),), row_stats="e_z",
                         row_stats_cols=stats_cols)  # fmt: skip
        mm.matmul_epilogue(h[r0:r1], w.t(), ep, [], head, cfg=stats_cfg, precision=prec,
                           outs=[z, *(x[: r1 - r0] for x in stats)], record=used, prerounded=h_a + w_rounded)
        return z

    def take_stats(sc: Scratch) -> tuple:
        return tuple(sc.take((chunk, n_tiles), f32) for _ in range(2)) if stats_cols else ()

    def rounded(w, transposed: bool):
        """w (``transposed``: w^T, dense [D, V]) rounded to tf32 into a new buffer (launch
        scratch, like the staging copies it replaces): K contiguous for the logits
        (w^T's view) and for dh (w's view of the dense w^T)."""
        src = w.t() if transposed else w
        dst = torch.empty(tuple(src.shape), dtype=f32, device=w.device)
        mm.stage_tf32(src.unsqueeze(0), dst.unsqueeze(0), record=used)
        return dst

    def forward(inputs, outs, sc: Scratch):
        h, w, t, *b = inputs
        dev = h.device
        (out,) = results(name, specs, outs, dev)
        rows = sc.take((N,), f32)
        buf = sc.take((chunk, V), head)  # the one logits buffer every chunk reuses
        stats = take_stats(sc)
        w = rounded(w, False) if hoist else w
        for r0, r1 in chunks():
            z = logits(h, w, r0, r1, buf, stats)
            k["lce_rows"][(r1 - r0,)](z, t[r0:r1], *stats, *b, rows[r0:], num_warps=warps)
        k["lce_final"][(1,)](t, rows, out, N, t.stride(0), MEAN=mean, num_warps=4)  # rounds to the loss's type
        return [out]

    def accumulator(out: torch.Tensor, sc: Scratch) -> torch.Tensor:
        """``out`` itself when it is f32, else an f32 buffer copied into it at the end."""
        return out if out.dtype == f32 else sc.take(tuple(out.shape), f32)

    def gradients(inputs, outs, sc: Scratch, rows: torch.Tensor | None):
        """The backward, and with ``rows`` (the row losses' buffer) the forward's row losses
        from the same logits: ``rows`` is None for nova.linear_cross_entropy_backward.
        Takes from ``sc`` in ``_held``'s order after the row losses: scale, dw
        accumulator, buffers, db accumulator."""
        g, h, w, t, *b = inputs
        dh, dw, *db = outs
        scale = sc.take((1,), f32)
        k["lce_scale"][(1,)](g, t, scale, N, t.stride(0), MEAN=mean, num_warps=4)
        dw_acc = accumulator(dw, sc)
        buf = sc.take((chunk, V), head)
        stats = take_stats(sc)
        vectors = (sc.take((chunk,), f32), sc.take((chunk,), f32)) if d_pro else ()  # each row's lse and weight
        dbuf = sc.take((chunk, V), bias_dtype) if separate_d else None
        db_acc = accumulator(db[0], sc).zero_() if b else None
        # dh's B: w, or under the hoist the [V, D] view of the rounded dense w^T (K contiguous)
        wl, wd = (rounded(w, False), rounded(w, True).t()) if hoist else (w, w)
        spans = list(chunks())
        for r0, r1 in spans:
            z = logits(h, wl, r0, r1, buf, stats)
            db_arg = [dbuf] if separate_d else []
            pro_h = pro_w = None
            if d_pro:  # the rows' log-sum-exp and weight; d is formed by the matmuls' prologues below
                lse_v, w_v = (x[: r1 - r0] for x in vectors)
                pro_h, pro_w = (pro_dh, [lse_v, w_v, t[r0:r1]]), (pro_dw, [lse_v, w_v, t[r0:r1]])
                if rows is None:
                    k["lce_rows_lse"][(r1 - r0,)](z, t[r0:r1], *stats, scale, lse_v, w_v, num_warps=warps)
                else:
                    k["lce_rows_lse_with_grad"][(r1 - r0,)](z, t[r0:r1], *stats, rows[r0:], scale, lse_v, w_v,
                                                            num_warps=warps)
            elif rows is None:
                k["lce_rows_backward"][(r1 - r0,)](z, t[r0:r1], *stats, *b, scale, *db_arg, num_warps=warps)
            else:  # the row's loss and its logits' gradient d over them: one log-sum-exp
                k["lce_rows_with_grad"][(r1 - r0,)](z, t[r0:r1], *stats, *b, rows[r0:], scale, *db_arg,
                                                    num_warps=warps)
            if b:
                k["lce_colsum"][(triton_cdiv(V, _COL_BLOCK),)](dbuf if separate_d else z, db_acc, r1 - r0, num_warps=4)
            # (with the prologues, configured as the launches reading d from the buffer: the same tiles, K steps
            # and splits, so the same sums)
            mm.matmul(z, wd, cfg=configs(z, wd, dh.dtype, prerounded=d_rounded + w_rounded), precision=prec,
                      out=dh[r0:r1], record=used, prerounded=(() if d_pro else d_rounded) + w_rounded, prologue=pro_h)
            if r0 == 0:  # the first chunk's product is the accumulator's first value: no zeroing
                mm.matmul(z.t(), h[r0:r1], cfg=configs(z.t(), h[r0:r1], f32), precision=prec, out=dw_acc, record=used,
                          prerounded=h_b, prologue=pro_w)
            elif r1 == N and dw_acc is not dw:  # the last chunk's sum, rounded once into the 16-bit dw
                accumulate_into(dw_acc, z.t(), h[r0:r1], prec, dw_last, record=used, configs=configs, prerounded=h_b,
                                out=dw, prologue=pro_w)
            else:
                accumulate_into(dw_acc, z.t(), h[r0:r1], prec, dw_add, record=used, configs=configs, prerounded=h_b,
                                prologue=pro_w)
        if dw_acc is not dw and len(spans) == 1:
            dw.copy_(dw_acc)  # rounded once
        if b and db_acc is not db[0]:
            db[0].copy_(db_acc)
        return [dh, dw, *db]

    def backward_(inputs, outs, sc: Scratch):
        return gradients(inputs, results(name, specs, outs, inputs[0].device), sc, None)

    def with_grad(inputs, outs, sc: Scratch):
        t = inputs[3]
        loss, *grads = results(name, specs, outs, inputs[0].device)
        rows = sc.take((N,), f32)
        grads = gradients(inputs, grads, sc, rows)
        k["lce_final"][(1,)](t, rows, loss, N, t.stride(0), MEAN=mean, num_warps=4)  # rounds to the loss's type
        return [loss, *grads]

    run = {FORWARD: forward, BACKWARD: backward_, WITH_GRAD: with_grad}[kind]

    def launch(inputs, outs=None, scratch=None):
        _check_inputs(name, op, inputs)
        if N == 0:
            raise ValueError(f"{name}: no rows")
        return run(inputs, outs, Scratch(scratch, inputs[0].device))

    # the row kernels read the target and the bias with unit stride (the backend copies other layouts
    # first, and says so); h and w go to the matmul template, which reads any strides
    contiguous = tuple(range(g_in + 2, len(op.operands)))
    scratch = _scratch(N, D, V, chunk, head, bias_dtype, separate_d, kind, prec, cfg, stats_cols, d_pro) if N else 0
    held = Scratch.size(*_held(N, D, V, chunk, head, bias_dtype, separate_d, kind, stats_cols, d_pro)) if N else 0
    return Kernel(name, src, launch, needs_contiguous=contiguous, config=cfg, extra={"chunk": chunk, "matmul_sources": used},
                  scratch_bytes=scratch, arena_scratch_bytes=held)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


@lowers(nv.LinearCrossEntropyOp)
def lower_linear_cross_entropy(op, cfg: LoweringConfig | None = None, *, precision: str = "fp32",
                               max_block: int = LOOP_BLOCK, **_) -> Kernel:
    """``max_block``: columns per step of the row loop (tests use small ones to loop over a small V)."""
    return _lower(op, cfg, precision, max_block)


@lowers(nv.LinearCrossEntropyBackwardOp)
def lower_linear_cross_entropy_backward(op, cfg: LoweringConfig | None = None, *, precision: str = "fp32",
                                        max_block: int = LOOP_BLOCK, **_) -> Kernel:
    return _lower(op, cfg, precision, max_block)


@lowers(nv.LinearCrossEntropyWithGradOp)
def lower_linear_cross_entropy_with_grad(op, cfg: LoweringConfig | None = None, *, precision: str = "fp32",
                                         max_block: int = LOOP_BLOCK, **_) -> Kernel:
    """The loss and the gradients in one pass over the chunks: per chunk one logits
    matmul and one row kernel (``lce_rows_with_grad``: the row's loss and d over the
    logits), then the bias column sum, dh and dw as the backward's; the loss's final
    sum last. Every result is bit for bit the forward's or the backward's lowering's."""
    return _lower(op, cfg, precision, max_block)
