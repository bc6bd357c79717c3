"""``nova bench matmul``: Nova's analytically configured matmul against cuBLAS and
against the best of a brute-force search over Nova's own template.

For every shape M, N, K in {128, 512, 2048, 8192} (64 shapes) and each precision
(tf32: fp32 operands rounded to nearest tf32 on the tensor cores, as cuBLAS does,
which is Nova's tf32, the template's "tf32-rn"; bf16: bf16 operands and output):

* nova:    the kernel with the Analytic Configurator's config, the configurator
           call timed with time.perf_counter (first call for that shape);
* cublas:  torch.matmul (allow_tf32 on for tf32);
* search:  the whole space of 214 (tf32) / 157 (bf16) configs of the same
           template (tiles, BLOCK_K, warps, stages, group_m, split_k, persistent,
           TMA or pointer loads, and for tf32 the staged K-major paths; fewer where
           a shape makes configs equivalent, never fewer than 120), each timed briefly; the 3 fastest are re-timed
           like the other two and checked for accuracy; the best of them is the
           "searched best".

Timing: CUDA-graph replay of many calls, median over repetitions, warm-up
excluded, on torch.randn inputs rotated over as many input sets as it takes to
exceed twice the L2 (capped at MAX_INPUT_SETS; shapes whose capped sets still
fit in L2 are measured L2-warm, for cuBLAS and Nova alike).

Compile cost: the template keeps M/N/K/strides runtime, so one binary per
(config, dtype) serves every shape; all binaries are compiled up front in
parallel worker processes (Triton's on-disk cache hands them to this process).
Point TRITON_CACHE_DIR at a persistent directory to reuse them across parts.

--dry-run exercises all of this on the CPU: two tiny shapes through the Triton
interpreter with three configs, torch CPU matmul in place of cuBLAS, wall-clock
timing; the numbers are meaningless, the outputs are complete.

--shapes gpt2 [--batch 8,32] measures instead every distinct matmul launch of the
GPT-2 124M AdamW step (the layer matmuls forward and backward, the fused LM head's
chunk matmuls) with the operands as the step has them: the shapes, strides, offsets,
output dtype and bias that bench/step_matmuls.py read off the compiled step
(bench/gpt2_matmul_shapes.json; with --dry-run, a tiny GPT compiled live). Nova's
config is the configurator's answer to the configure stage's arguments, cuBLAS runs
on the same views, the search is the one above; per step, the count-weighted totals.
Writes matmul_gpt2.json/.md/.png (docs/configurator.md, "GPT-2 step shapes").
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import hashlib
import itertools
import json
import math
import multiprocessing
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python bench/matmul.py` from a checkout without an install
    sys.path.insert(0, str(REPO))

from bench.timing import time_graph  # noqa: E402
from nova.cli.errors import RunFailed, UsageError  # noqa: E402
from nova.schedule.config import LoweringConfig  # noqa: E402
from nova.schedule.configurator import STEP_MATMUL_PRECISION  # noqa: E402

GRID = (128, 512, 2048, 8192)
QUICK_SHAPES = [  # one of each regime: small, square, skinny M/N, short K, long K
    (128, 128, 128), (512, 512, 512), (2048, 2048, 2048), (8192, 8192, 8192),
    (128, 8192, 8192), (8192, 128, 8192), (8192, 8192, 128), (2048, 512, 8192),
]
DRY_SHAPES = [(33, 17, 45), (32, 48, 64)]
PRECISIONS = ("tf32", "bf16")
# the matmul template's spelling: nova's tf32 is a tf32 step's; bf16 means bf16 operands
NOVA_PRECISION = {"tf32": STEP_MATMUL_PRECISION["tf32"], "bf16": "bf16"}
CUBLAS_REFERENCE_TFLOPS = {"tf32": 65.5, "bf16": 112.8}  # geomean over the 64 shapes, measured on this H200
MAX_INPUT_SETS = 32
SMEM_BUDGET = 200 * 1024  # operand ring buffers; H200 allows 227 KiB per block, the rest is epilogue headroom
# (graph length in ms, most calls in one graph, replays): capturing costs one Python
# launch (~tens of us) per call, so the brief search timings keep graphs short
SEARCH_TIMING = (0.2, 32, 3)
FINAL_TIMING = (2.0, 256, 15)  # nova, cublas and the search finalists
FINALISTS = 3
WITHIN = 0.03  # "within 3% of the searched best"
# relative Frobenius error against float64 beyond which a kernel is wrong, not rounded: tf32 rounds each
# operand (~2e-4 measured), a 16-bit C once more (~1.1e-3); 10x headroom (tests/gpu/test_step_matmuls_gpu.py's).
# A finalist beyond it is discarded; Nova's configured kernel beyond it is an error of the run (at e1ea8b7
# a racing 384x1536x8192 tf32 kernel printed 2.5e-2 here and nothing failed)
ACCURACY_LIMIT = {"tf32": 2e-3, "bf16": 5e-3}


# --------------------------------------------------------------------------- search space


def _cfg(bm, bn, bk, warps, stages, group_m=8, split_k=1, persistent=False, tma=False, stage="") -> LoweringConfig:
    return LoweringConfig(
        kind="matmul", block_m=bm, block_n=bn, block_k=bk, group_m=group_m, split_k=split_k,
        persistent=persistent, num_warps=warps, num_stages=stages,
        instruction=("wgmma+tma" if tma else "wgmma") + stage, regime="search",
    )


def search_space(precision: str) -> list[LoweringConfig]:
    """The brute-force space over the template's knobs. Core: every wgmma-sized tile
    with the warps that fit it and every BLOCK_K x stages ring that fits shared
    memory, on the TMA path (the configurator's path on Hopper). Around it: the
    pointer path for the common tiles, small mma tiles for launch-bound shapes,
    split-K, GROUP_M 1..16 and persistent grids. Shuffled with a fixed seed, so a
    --search-budget below its size is an unbiased sample."""
    elt = 4 if precision == "tf32" else 2
    bks = (32, 64) if elt == 4 else (32, 64, 128)
    bk = bks[0] if elt == 4 else 64  # the usual choice, for the variants around the core
    tiles = [(64, 64), (64, 128), (128, 64), (128, 128), (64, 256), (256, 64), (128, 256), (256, 128)]
    space: list[LoweringConfig] = []

    def add(bm, bn, bk, warps, stages, **kw):
        cfg = _cfg(bm, bn, bk, warps, stages, **kw)
        if stages * (bm + bn) * bk * elt <= SMEM_BUDGET and cfg not in space:
            space.append(cfg)

    for bm, bn in tiles:  # core
        area = bm * bn
        warp_choices = (4,) if area <= 64 * 64 else (4, 8) if area <= 128 * 128 else (8,)
        for k in bks:
            for warps in warp_choices:
                for stages in (2, 3, 4, 5) if elt == 4 else (3, 4, 5):
                    add(bm, bn, k, warps, stages, tma=True)
    for bm, bn, warps in [(64, 64, 4), (64, 128, 4), (128, 64, 4), (128, 128, 8), (128, 256, 8), (256, 128, 8)]:
        for stages in (3, 4):  # pointer loads (cp.async) instead of TMA
            add(bm, bn, bk, warps, stages)
    for bm, bn in [(16, 16), (32, 32), (32, 64), (64, 32)]:  # mma tiles for tiny shapes
        for stages in (2, 3):
            add(bm, bn, 64, 4, stages, tma=True)
            add(bm, bn, 64, 4, stages)
    for bm, bn in [(64, 64), (64, 128), (128, 64), (128, 128)]:
        for split_k in (2, 4, 8):
            for stages in (3, 4):
                add(bm, bn, bk, 4, stages, split_k=split_k, tma=True)
    for bm, bn, warps in [(128, 128, 8), (128, 256, 8)]:
        for group_m in (1, 2, 4, 16):
            add(bm, bn, bk, warps, 3, group_m=group_m, tma=True)
    for bm, bn, warps in [(64, 128, 4), (128, 128, 8), (128, 256, 8), (256, 128, 8)]:
        for stages in (3, 4):
            add(bm, bn, bk, warps, stages, persistent=True, tma=True)
    if elt == 4:  # the staged tf32 path: B (and A) copied K-major and rounded first
        for bm, bn in tiles:
            area = bm * bn
            for warps in (4,) if area <= 64 * 64 else (4, 8) if area <= 128 * 128 else (8,):
                for stages in (3, 4):
                    add(bm, bn, 32, warps, stages, tma=True, stage="+stage_b")
                    for k in bks:
                        add(bm, bn, k, warps, stages, tma=True, stage="+stage_a+stage_b")
        for bm, bn in [(64, 64), (64, 128), (128, 64)]:
            for split_k in (2, 4):
                add(bm, bn, 32, 4, 4, split_k=split_k, tma=True, stage="+stage_a+stage_b")
        # what the configurator also reaches on this path: split-K with only B staged (A rounded in
        # registers: the weight gradients at small M), and rule 8d's persistent loop over both staged
        for bm, bn, warps in [(128, 128, 8), (128, 256, 8)]:
            for split_k in (2, 4, 7):
                add(bm, bn, 32, warps, 4, split_k=split_k, tma=True, stage="+stage_b")
            for stages in (3, 4, 5):
                add(bm, bn, 32, warps, stages, persistent=True, tma=True, stage="+stage_a+stage_b")
    random.Random(0).shuffle(space)
    return space


def dry_space(precision: str) -> list[LoweringConfig]:
    return [_cfg(16, 16, 16, 4, 2), _cfg(32, 16, 16, 4, 2, group_m=2, split_k=2), _cfg(16, 32, 32, 4, 2, persistent=True)]


def candidates(space, M, N, K, budget, num_sms) -> list[LoweringConfig]:
    """The first ``budget`` configs of ``space`` that are distinct on this shape: a
    group wider than the grid, a split that K is too short for, or a persistent grid
    with no more tiles than SMs behave like a config already listed."""
    from nova.codegen.triton.matmul import cdiv, split_k_plan

    seen, out = set(), []
    for cfg in space:
        splits = split_k_plan(K, cfg)[1]
        pid_m = cdiv(M, cfg.block_m)
        tiles = pid_m * cdiv(N, cfg.block_n) * splits
        key = (
            cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages,
            min(cfg.group_m, pid_m), splits, cfg.persistent and tiles > num_sms, cfg.instruction,
        )
        if key not in seen:
            seen.add(key)
            out.append(cfg)
        if len(out) >= budget:
            break
    return out


def variant_line(model: str, batch: int, row: dict, names, width: int = 40) -> str:
    """One launch's times under each variant, a line (scripts/tf32_variants.py, split_variants.py)."""
    return (f"{model} b{batch} {row['source'][:width]:{width}s} {row['M']}x{row['N']}x{row['K']} "
            f"{'/'.join(row['layouts'])} x{row['count']} [{row['config']}]: "
            + "  ".join(f"{v} {row.get(v) if row.get(v) is not None else '-'}" for v in names))


def describe(cfg: LoweringConfig | None) -> str:
    if cfg is None:
        return "-"
    text = f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages} g{cfg.group_m}"
    text += f" sk{cfg.split_k}" if cfg.split_k > 1 else ""
    text += (" pers" if cfg.persistent else "") + (" tma" if "tma" in cfg.instruction else "")
    tokens = cfg.instruction.split("+")
    text += "".join(f" {t}" for t in ("stage_a", "stage_b", "ws") if t in tokens)
    if cfg.tail_at:  # rule 8f's second launch
        text += f" tail {cfg.tail_axis}{cfg.tail_at}" + (f" sk{cfg.tail_split}" if cfg.tail_split > 1 else "")
    return text


# --------------------------------------------------------------------------- timing


class GpuTimer:
    """Median time of one call: a CUDA graph holds ``inner`` calls over the rotating
    input sets (enough calls to last about ``target_ms``); warm-up launches and a
    warm-up replay are not timed; each timed replay is bracketed by CUDA events."""

    def measure(self, launch, n_sets: int, est_ms: float, timing: tuple) -> float:
        target_ms, max_inner, reps = timing
        for i in range(min(n_sets, 2)):  # warm-up: binary load, allocator, cuBLAS heuristics
            launch(i)
        inner = max(n_sets, min(max_inner, math.ceil(target_ms / max(est_ms, 1e-3))))
        calls = itertools.count()  # the graph's calls walk the input sets in turn
        return time_graph(lambda: launch(next(calls) % n_sets), inner, reps)


class WallTimer:
    """The dry run's stand-in: wall clock on the CPU (the interpreter's numbers mean nothing)."""

    def measure(self, launch, n_sets: int, est_ms: float, timing: tuple) -> float:
        launch(0)
        times = []
        for r in range(2):
            t0 = time.perf_counter()
            launch(r % n_sets)
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


# --------------------------------------------------------------------------- compile ahead


def compile_ahead(jobs: list[tuple[LoweringConfig, tuple[int, int, int]]], dtype_name, precision, workers, log):
    """Compile every (config, representative shape) in parallel processes. Returns
    {config: error or None}; configs over the shared-memory limit count as errors."""
    if not jobs:
        return {}
    from nova.codegen.triton.matmul import precompile_specs

    limit = torch.cuda.get_device_properties(0).shared_memory_per_block_optin
    specs = [(i, cfg.to_dict(), *shape, dtype_name, precision) for i, (cfg, shape) in enumerate(jobs)]
    chunks = [specs[i :: workers * 2] for i in range(workers * 2) if specs[i :: workers * 2]]
    t0 = time.perf_counter()
    status: dict[LoweringConfig, str | None] = {}
    ctx = multiprocessing.get_context("spawn")  # CUDA does not survive fork
    with cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        for result in pool.map(precompile_specs, chunks):
            for index, smem, err in result:
                cfg = jobs[index][0]
                if err is None and smem > limit:
                    err = f"needs {smem} B of shared memory, the device has {limit}"
                if err is not None or cfg not in status:
                    status[cfg] = err
    failed = sum(e is not None for e in status.values())
    log(f"  compiled {len(jobs)} kernels in {time.perf_counter() - t0:.1f} s on {workers} processes ({failed} rejected)")
    return status


# --------------------------------------------------------------------------- one shape


def _tflops(M, N, K, ms):
    return 2.0 * M * N * K / (ms * 1e-3) / 1e12 if ms else None


def _rel_err(c: torch.Tensor, ref: torch.Tensor) -> float:
    return ((c.double() - ref).norm() / ref.norm()).item()


class ShapeBench:
    """Inputs, reference and timing of one (shape, precision)."""

    def __init__(self, M, N, K, precision, device, timer):
        self.M, self.N, self.K, self.precision, self.timer = M, N, K, precision, timer
        self.dtype = torch.float32 if precision == "tf32" else torch.bfloat16
        # nova's tf32 is cuBLAS's: operands rounded to nearest tf32 (the template's
        # "tf32-rn"; plain "tf32" lets the tensor core truncate them)
        self.nova_precision = NOVA_PRECISION[precision]
        elt = self.dtype.itemsize
        set_bytes = (M * K + K * N + M * N) * elt
        if device.type == "cuda":
            l2 = torch.cuda.get_device_properties(device).L2_cache_size
            self.n_sets = max(1, min(MAX_INPUT_SETS, math.ceil(2 * l2 / set_bytes)))
            self.l2_warm = self.n_sets * set_bytes <= l2
        else:
            self.n_sets, self.l2_warm = 2, True
        self.A = [torch.randn(M, K, device=device, dtype=self.dtype) for _ in range(self.n_sets)]
        self.B = [torch.randn(K, N, device=device, dtype=self.dtype) for _ in range(self.n_sets)]
        self.C = [torch.empty(M, N, device=device, dtype=self.dtype) for _ in range(self.n_sets)]
        self.ref = self.A[0].double() @ self.B[0].double()
        peak = 3e14 if precision == "tf32" else 6e14  # optimistic rate: only sizes the graphs
        self.est_ms = max(2.0 * M * N * K / peak * 1e3, 2e-3)

    def nova_launcher(self, cfg, precision=None):
        from nova.codegen.triton.matmul import matmul

        prec = precision or self.nova_precision
        return lambda i: matmul(self.A[i], self.B[i], cfg=cfg, precision=prec, out=self.C[i])

    def cublas_launcher(self):
        return lambda i: torch.matmul(self.A[i], self.B[i], out=self.C[i])

    def time(self, launch, final: bool) -> float:
        return self.timer.measure(launch, self.n_sets, self.est_ms, FINAL_TIMING if final else SEARCH_TIMING)

    def error(self, launch) -> float:
        launch(0)
        return _rel_err(self.C[0], self.ref)


def bench_shape(sb: ShapeBench, nova_cfg, cfg_ms, cands, search_seconds, deadline, log, keep_search=True,
                tf32_variants=()) -> dict:
    M, N, K, p = sb.M, sb.N, sb.K, sb.precision
    row = {"M": M, "N": N, "K": K, "precision": p, "flops": 2 * M * N * K, "input_sets": sb.n_sets,
           "l2_warm": sb.l2_warm, "configurator_ms": cfg_ms}
    launch = sb.nova_launcher(nova_cfg)
    try:
        ms = sb.time(launch, final=True)
        row["nova"] = {"config": nova_cfg.to_dict(), "ms": ms, "tflops": _tflops(M, N, K, ms), "rel_err": sb.error(launch)}
        if row["nova"]["rel_err"] > ACCURACY_LIMIT[p]:
            row["nova"]["inaccurate"] = True
            log(f"  ERROR: nova's config {describe(nova_cfg)} on {M}x{N}x{K} {p}: relative error "
                f"{row['nova']['rel_err']:.2e} against float64, beyond {ACCURACY_LIMIT[p]:.0e}")
    except Exception as e:  # recorded and shouted about, so one bad config does not lose the whole run
        _recover()
        row["nova"] = {"config": nova_cfg.to_dict(), "ms": None, "tflops": None, "rel_err": None,
                       "error": f"{type(e).__name__}: {str(e)[:300]}"}
        log(f"  ERROR: nova's config {describe(nova_cfg)} failed on {M}x{N}x{K} {p}: {row['nova']['error']}")
    for variant in tf32_variants if p == "tf32" else ():
        # the same config with another fp32 operand treatment (e.g. tf32-rn: operands
        # rounded to nearest tf32 in the kernel): its cost and accuracy beside nova's
        launch = sb.nova_launcher(nova_cfg, variant)
        try:
            ms = sb.time(launch, final=True)
            row[f"nova_{variant}"] = {"ms": ms, "tflops": _tflops(M, N, K, ms), "rel_err": sb.error(launch)}
        except Exception as e:
            _recover()
            row[f"nova_{variant}"] = {"ms": None, "tflops": None, "rel_err": None,
                                      "error": f"{type(e).__name__}: {str(e)[:300]}"}
            log(f"  ERROR: {variant} with {describe(nova_cfg)} failed on {M}x{N}x{K}: {row[f'nova_{variant}']['error']}")
    with _cublas_precision(p):
        launch = sb.cublas_launcher()
        ms = sb.time(launch, final=True)
        row["cublas"] = {"ms": ms, "tflops": _tflops(M, N, K, ms), "rel_err": sb.error(launch)}

    search = {"candidates": len(cands), "timed": 0, "failed": [], "truncated": False}
    t0 = time.perf_counter()
    timed = []
    for cfg in cands:
        if time.perf_counter() - t0 > search_seconds or time.perf_counter() > deadline:
            search["truncated"] = True
            break
        try:
            timed.append((sb.time(sb.nova_launcher(cfg), final=False), cfg))
        except Exception as e:  # a config that does not run on this shape is skipped, and listed
            search["failed"].append({"config": describe(cfg), "error": f"{type(e).__name__}: {str(e)[:160]}"})
            _recover()
    search["timed"] = len(timed)
    if keep_search:  # every candidate's (brief) search time, keyed by its describe() text
        search["all"] = {describe(cfg): ms for ms, cfg in timed}
    timed.sort(key=lambda t: t[0])
    best = None
    for _, cfg in timed[:FINALISTS]:
        launch = sb.nova_launcher(cfg)
        err = sb.error(launch)
        if err > ACCURACY_LIMIT[p]:
            search["failed"].append({"config": describe(cfg), "error": f"rel err {err:.2e}"})
            continue
        ms = sb.time(launch, final=True)
        if best is None or ms < best["ms"]:
            best = {"config": cfg.to_dict(), "ms": ms, "tflops": _tflops(M, N, K, ms), "rel_err": err}
    search["seconds"] = time.perf_counter() - t0
    search["best"] = best
    row["search"] = search
    nova_ms = row["nova"]["ms"]
    row["nova_vs_cublas"] = row["cublas"]["ms"] / nova_ms if nova_ms else None
    row["nova_vs_best"] = best["ms"] / nova_ms if best and nova_ms else None
    row["within_3pct_of_best"] = bool(best and nova_ms and nova_ms <= (1 + WITHIN) * best["ms"])
    log(
        f"  {p} {M:>5}x{N:<5}x{K:<5} nova {_fmt(row['nova']['tflops']):>7}  cublas {_fmt(row['cublas']['tflops']):>7}  "
        f"best {_fmt(best['tflops'] if best else None):>7} TFLOP/s  ({search['timed']} searched in "
        f"{search['seconds']:.1f} s)  cfg {cfg_ms:.3f} ms  err {_fmt(row['nova']['rel_err'], '.1e')}  [{describe(nova_cfg)}]"
    )
    return row


class _cublas_precision:
    def __init__(self, precision):
        self.precision = precision

    def __enter__(self):
        self.saved = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = self.precision == "tf32"

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32 = self.saved


def _recover():
    if torch.cuda.is_available():
        try:
            torch.cuda.synchronize()
        except Exception:
            pass


# --------------------------------------------------------------------------- the run


def _shapes(opts) -> list[tuple[int, int, int]]:
    if opts.dry_run:
        shapes = list(DRY_SHAPES)
    elif opts.quick:
        shapes = list(QUICK_SHAPES)
    else:
        shapes = [(M, N, K) for M in GRID for N in GRID for K in GRID]
    i, n = opts.part
    return shapes[i - 1 :: n]  # strided: every part gets a similar mix of big and small shapes


def run(opts, checkpoint=None, log=print) -> dict:
    """Measure every shape of this part; ``checkpoint(doc)`` gets the results so far
    after each shape (a run killed by a time limit still leaves them behind)."""
    if getattr(opts, "shapes", "grid") == "gpt2":
        return run_gpt2(opts, checkpoint, log)
    from nova.codegen.triton import matmul as mm

    device = torch.device("cpu" if opts.dry_run else "cuda")
    timer = WallTimer() if opts.dry_run else GpuTimer()
    spec = mm.device_spec(device)
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else spec.num_sms
    shapes = _shapes(opts)
    started = time.perf_counter()
    deadline = started + opts.time_limit
    mm.configure(64, 64, 64, 1, torch.float32, torch.float32, "tf32", "row", "row", False, spec)  # imports, not timed
    rows = []
    for precision in opts.precisions:
        dtype = torch.float32 if precision == "tf32" else torch.bfloat16
        space = (dry_space if opts.dry_run else search_space)(precision)
        log(f"{precision}: {len(shapes)} shapes, search space {len(space)} configs, budget {opts.search_budget}")
        plans = []
        for M, N, K in shapes:
            t0 = time.perf_counter()
            nova_cfg = mm.configure(M, N, K, 1, dtype, dtype, NOVA_PRECISION[precision], "row", "row", False, spec)
            cfg_ms = (time.perf_counter() - t0) * 1e3
            plans.append(((M, N, K), nova_cfg, cfg_ms, candidates(space, M, N, K, opts.search_budget, num_sms)))
        if device.type == "cuda":
            jobs, seen = [], set()
            for shape, nova_cfg, _, cands in plans:
                for cfg in [nova_cfg, *cands]:
                    key = _binary_key(cfg, *shape)
                    if key not in seen:
                        seen.add(key)
                        jobs.append((cfg, shape))
            status = compile_ahead(jobs, str(dtype).removeprefix("torch."), NOVA_PRECISION[precision], opts.workers, log)
            if precision == "tf32":
                for variant in opts.tf32_variants:
                    vjobs = list({_binary_key(c, *s): (c, s) for s, c, _, _ in plans}.values())
                    compile_ahead(vjobs, "float32", variant, opts.workers, log)
            plans = [
                (shape, nova_cfg, cfg_ms, [c for c in cands if status.get(c) is None])
                for shape, nova_cfg, cfg_ms, cands in plans
            ]
        for (M, N, K), nova_cfg, cfg_ms, cands in plans:
            sb = ShapeBench(M, N, K, precision, device, timer)
            rows.append(bench_shape(sb, nova_cfg, cfg_ms, cands, opts.search_seconds, deadline, log,
                                    keep_search=opts.keep_search, tf32_variants=opts.tf32_variants))
            del sb
            if checkpoint is not None:
                checkpoint(_document(rows, opts, device, time.perf_counter() - started, complete=False))
            if device.type == "cuda" and M * N * K >= 2048**3:
                torch.cuda.empty_cache()
    log(f"done in {time.perf_counter() - started:.0f} s")
    return _document(rows, opts, device, time.perf_counter() - started)


def _binary_key(cfg, M, N, K):
    """What makes two (config, shape) pairs need different binaries."""
    from nova.codegen.triton.matmul import split_k_plan

    k_split, splits = split_k_plan(K, cfg)
    even = M % cfg.block_m == 0 and N % cfg.block_n == 0 and K % k_split == 0
    div16 = tuple(x % 16 == 0 for x in (M, N, K))
    return dataclasses.replace(cfg, split_k=min(splits, 2), regime=""), even, div16


def _git():
    def git(*args):
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=10).stdout.strip()

    if os.environ.get("NOVA_COMMIT"):  # the device machine's copy of the tree may carry a stale .git
        return {"commit": os.environ["NOVA_COMMIT"], "dirty": None}
    try:
        return {"commit": git("rev-parse", "HEAD") or "unknown", "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except Exception:
        return {"commit": "unknown", "dirty": None}


def _document(rows, opts, device, seconds, complete=True) -> dict:
    import triton

    return {
        "benchmark": "matmul",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu (dry run: Triton interpreter)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "git": _git(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "settings": {
            "part": f"{opts.part[0]}/{opts.part[1]}", "search_budget": opts.search_budget,
            "precisions": list(opts.precisions), "quick": opts.quick, "dry_run": opts.dry_run,
            "search_seconds": opts.search_seconds, "time_limit": opts.time_limit, "seconds": seconds,
            "complete": complete, "keep_search": getattr(opts, "keep_search", False),
            "tf32_variants": list(getattr(opts, "tf32_variants", ())),
            "shapes": getattr(opts, "shapes", "grid"),
            "switches": getattr(opts, "switches", {}),
        },
        "shapes": rows,
        "summary": summarize(rows),
    }


# --------------------------------------------------------------------------- report


def _geomean(xs):
    xs = [x for x in xs if x]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def summarize(rows) -> dict:
    out = {}
    for p in PRECISIONS:
        rs = [r for r in rows if r["precision"] == p]
        if not rs:
            continue
        searched = [r for r in rs if r["search"]["best"]]
        nova, cublas = _geomean(r["nova"]["tflops"] for r in rs), _geomean(r["cublas"]["tflops"] for r in rs)
        out[p] = {
            "shapes": len(rs),
            "shapes_searched": len(searched),
            "geomean_tflops_nova": nova,
            "geomean_tflops_cublas": cublas,
            "geomean_nova_vs_cublas": nova / cublas if nova and cublas else None,
            "geomean_tflops_searched_best": _geomean(r["search"]["best"]["tflops"] for r in searched),
            "geomean_nova_vs_searched_best": _geomean(r["nova_vs_best"] for r in searched),
            "fraction_within_3pct_of_searched_best": (
                sum(r["within_3pct_of_best"] for r in searched) / len(searched) if searched else None
            ),
            "max_configurator_ms": max(r["configurator_ms"] for r in rs),
            "max_rel_err_nova": max((r["nova"]["rel_err"] for r in rs if r["nova"]["rel_err"] is not None), default=None),
            "nova_failures": sum(r["nova"]["ms"] is None for r in rs),
            "nova_inaccurate": sum(bool(r["nova"].get("inaccurate")) for r in rs),
            "max_rel_err_cublas": max(r["cublas"]["rel_err"] for r in rs),
            "cublas_reference_geomean_tflops": CUBLAS_REFERENCE_TFLOPS[p],
        }
        for v in sorted({k[5:] for r in rs for k in r if k.startswith("nova_tf32")}):
            vr = [r[f"nova_{v}"] for r in rs if r.get(f"nova_{v}")]
            vt = _geomean(x["tflops"] for x in vr)
            out[p][f"variant_{v}"] = {
                "shapes": len(vr), "geomean_tflops": vt,
                "geomean_vs_cublas": vt / cublas if vt and cublas else None,
                "geomean_vs_nova": vt / nova if vt and nova else None,
                "max_rel_err": max((x["rel_err"] for x in vr if x["rel_err"] is not None), default=None),
            }
    out["max_configurator_ms"] = max((r["configurator_ms"] for r in rows), default=None)
    out["max_tf32_rel_err"] = out.get("tf32", {}).get("max_rel_err_nova")
    return out


def _fmt(x, spec=".1f"):
    if x is None:
        return "-"
    if spec == ".1f" and abs(x) < 0.1:
        spec = ".2g"  # the dry run's tiny CPU rates
    return format(x, spec)


def markdown(doc) -> str:
    s = doc["settings"]
    lines = [
        "# nova bench matmul",
        "",
        f"{doc['device']} | torch {doc['torch']} | triton {doc['triton']} | commit {doc['git']['commit'][:12]}"
        + (" (dirty)" if doc["git"].get("dirty") else "")
        + f" | search budget {s['search_budget']} | {doc['created']}",
        "",
        "| precision | shapes | Nova TFLOP/s | cuBLAS TFLOP/s | Nova/cuBLAS | searched best TFLOP/s | Nova/best "
        "| within 3% of best | max configurator ms | max rel err |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in PRECISIONS:
        m = doc["summary"].get(p)
        if m:
            lines.append(
                f"| {p} | {m['shapes']} | {_fmt(m['geomean_tflops_nova'])} | {_fmt(m['geomean_tflops_cublas'])} "
                f"| {_fmt(m['geomean_nova_vs_cublas'], '.3f')} | {_fmt(m['geomean_tflops_searched_best'])} "
                f"| {_fmt(m['geomean_nova_vs_searched_best'], '.3f')} "
                f"| {_fmt(m['fraction_within_3pct_of_searched_best'], '.0%')} | {m['max_configurator_ms']:.3f} "
                f"| {_fmt(m['max_rel_err_nova'], '.1e')} |"
            )
    for p in PRECISIONS:
        for key, v in sorted((doc["summary"].get(p) or {}).items()):
            if key.startswith("variant_"):
                lines.append(
                    f"\n{p} variant {key[8:]} (nova's configs): {v['shapes']} shapes, geomean "
                    f"{_fmt(v['geomean_tflops'])} TFLOP/s = {_fmt(v['geomean_vs_nova'], '.3f')}x nova {p}, "
                    f"{_fmt(v['geomean_vs_cublas'], '.3f')}x cuBLAS; max rel err {_fmt(v['max_rel_err'], '.1e')}"
                )
    lines += ["", "TFLOP/s are geometric means over shapes.", ""]
    lines += [
        "| prec | M | N | K | Nova | cuBLAS | best | Nova/cuBLAS | Nova/best | cfg ms | rel err | Nova config | best config |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["shapes"]:
        best = r["search"]["best"]
        lines.append(
            f"| {r['precision']} | {r['M']} | {r['N']} | {r['K']} | {_fmt(r['nova']['tflops'])} "
            f"| {_fmt(r['cublas']['tflops'])} | {_fmt(best['tflops'] if best else None)} "
            f"| {_fmt(r['nova_vs_cublas'], '.2f')} | {_fmt(r['nova_vs_best'], '.2f')} | {r['configurator_ms']:.3f} "
            f"| {_fmt(r['nova']['rel_err'], '.1e')} | {describe(LoweringConfig.from_dict(r['nova']['config']))} "
            f"| {describe(LoweringConfig.from_dict(best['config'])) if best else '-'} |"
        )
    return "\n".join(lines) + "\n"


def chart(doc, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    precs = [p for p in PRECISIONS if p in doc["summary"]]
    fig, axes = plt.subplots(len(precs), 1, figsize=(16, 4.5 * len(precs)), squeeze=False)
    for ax, p in zip(axes[:, 0], precs):
        rs = sorted((r for r in doc["shapes"] if r["precision"] == p), key=lambda r: (r["flops"], r["M"], r["N"]))
        x = range(len(rs))
        best = [r["search"]["best"]["tflops"] if r["search"]["best"] else float("nan") for r in rs]
        ax.plot(x, [r["cublas"]["tflops"] for r in rs], "s-", ms=4, label="cuBLAS")
        ax.plot(x, best, "^--", ms=4, label="searched best (Nova template)")
        ax.plot(x, [r["nova"]["tflops"] or float("nan") for r in rs], "o-", ms=4, label="Nova (Analytic Configurator)")
        ax.set_yscale("log")
        ax.set_ylabel("TFLOP/s")
        m = doc["summary"][p]
        ax.set_title(
            f"{p}: geomean Nova {_fmt(m['geomean_tflops_nova'])} vs cuBLAS {_fmt(m['geomean_tflops_cublas'])} TFLOP/s; "
            f"{_fmt(m['fraction_within_3pct_of_searched_best'], '.0%')} of shapes within 3% of searched best"
        )
        ax.set_xticks(list(x))
        ax.set_xticklabels([f"{r['M']}x{r['N']}x{r['K']}" for r in rs], rotation=90, fontsize=7)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="upper left")
    fig.suptitle(f"nova bench matmul on {doc['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write(doc, out_dir: Path, stem: str) -> list[Path]:
    paths = [out_dir / f"{stem}.json", out_dir / f"{stem}.md", out_dir / f"{stem}.png"]
    _write_text(paths[0], json.dumps(doc, indent=1))
    gpt2 = doc["settings"].get("shapes") == "gpt2"
    _write_text(paths[1], (markdown_gpt2 if gpt2 else markdown)(doc))
    (chart_gpt2 if gpt2 else chart)(doc, paths[2])
    return paths


def _search_rank(row) -> tuple[bool, int]:
    """(the search ran to the end, configs timed): the better-searched row wins a merge."""
    search = row.get("search") or {}
    done = bool(search.get("best")) and not search.get("truncated") and search.get("timed") == search.get("candidates")
    return done, search.get("timed", 0) if search.get("best") else 0


def merge(files: list[Path]) -> dict:
    docs = [json.loads(Path(f).read_text()) for f in files]
    if not docs:
        raise UsageError("--merge: no part JSONs to merge")
    # a shape measured in several files: the row whose search ran to the end (else
    # timed more configs) wins, on a tie the later file's; every row keeps the commit
    # it was measured at
    rows = {}
    for d in docs:
        for r in d["shapes"]:
            r = dict(r, commit=r.get("commit", d["git"]["commit"]))
            key = (r["precision"], r["M"], r["N"], r["K"], r.get("id"))  # id: a GPT-2 step launch
            if key not in rows or _search_rank(r) >= _search_rank(rows[key]):
                rows[key] = r
    doc = dict(docs[0])
    doc["shapes"] = sorted(rows.values(), key=lambda r: (PRECISIONS.index(r["precision"]), r["M"], r["N"], r["K"]))
    doc["settings"] = dict(doc["settings"], part="merged", merged_from=[str(f) for f in files],
                           seconds=sum(d["settings"]["seconds"] for d in docs))
    commits = {d["git"]["commit"] for d in docs}
    if len(commits) > 1:
        doc["git"] = dict(doc["git"], commit="mixed:" + ",".join(sorted(commits)))
    doc["summary"] = summarize(doc["shapes"])
    if doc["settings"].get("shapes") == "gpt2":
        doc["steps"] = step_totals(doc["shapes"])
    return doc


# --------------------------------------------------------------------------- GPT-2 step shapes (--shapes gpt2)

# --dry-run --shapes gpt2: a GPT small enough for the interpreter, compiled live (the extraction runs too)
DRY_GPT = dict(vocab_size=32, block_size=8, n_layer=1, n_head=1, n_embd=16)


def _step_matmuls():
    """bench/step_matmuls.py as the top-level module ``step_matmuls`` (bench/ on
    sys.path), so compile workers, which get this process's sys.path, import it too."""
    bench_dir = str(Path(__file__).resolve().parent)
    if bench_dir not in sys.path:
        sys.path.insert(0, bench_dir)
    import step_matmuls

    return step_matmuls


def gpt2_steps(opts, log=print) -> list[dict]:
    """The steps (precision, batch) asked for, each with its distinct launches."""
    sm = _step_matmuls()
    if opts.dry_run:
        steps = []
        for p in opts.precisions:
            for b in opts.batch:
                steps.append(sm.extract(DRY_GPT, b, p))
                log(f"compiled the dry-run GPT ({p}, batch {b}): {steps[-1]['launches']} matmul launches")
        return steps
    path = opts.shapes_file or sm.SHAPES_JSON
    doc = json.loads(Path(path).read_text())
    steps = [s for s in doc["steps"] if s["precision"] in opts.precisions and s["batch"] in opts.batch]
    missing = {(p, b) for p in opts.precisions for b in opts.batch} - {(s["precision"], s["batch"]) for s in steps}
    if missing:
        raise UsageError(f"{path} has no step for {sorted(missing)}: regenerate it with "
                         f"`{sm.REGENERATE} --batch ... --precisions ...`")
    return steps


def gpt2_launches(steps) -> list[dict]:
    """One entry per distinct launch over all steps: {"launch", "uses": [{precision,
    batch, source, count}]}, in first-use order (the LM head's chunk launches are
    the same at every batch size, so they are measured once)."""
    sm = _step_matmuls()
    unique: dict[str, dict] = {}
    for s in steps:
        for r in s["shapes"]:
            e = unique.setdefault(sm.signature(r), {"launch": r, "uses": []})
            e["uses"].append({"precision": s["precision"], "batch": s["batch"], "source": r["source"], "count": r["count"]})
    return list(unique.values())


class StepShapeBench(ShapeBench):
    """One GPT-2 step launch: operands with the step's shapes, strides and offsets
    (a transposed weight is a transposed view, a chunk of h a row slice), the step's
    output dtype and bias; cuBLAS gets the same views."""

    def __init__(self, launch, precision, device, timer):
        sm = _step_matmuls()
        self.launch, self.timer, self.precision = launch, timer, precision
        self.M, self.N, self.K = launch["M"], launch["N"], launch["K"]
        self.dtype = getattr(torch, launch["dtype"])
        self.out_dtype = getattr(torch, launch["out_dtype"])
        self.nova_precision = launch["precision"]
        batch = launch["batch"]
        shape = (batch, self.M, self.N) if launch["batched"] else (self.M, self.N)

        def extent(spec):
            return spec["offset"] + 1 + sum((n - 1) * st for n, st in zip(spec["shape"], spec["strides"]) if n)

        set_bytes = (extent(launch["a"]) + extent(launch["b"])) * self.dtype.itemsize
        set_bytes += batch * self.M * self.N * self.out_dtype.itemsize
        if device.type == "cuda":
            l2 = torch.cuda.get_device_properties(device).L2_cache_size
            self.n_sets = max(1, min(MAX_INPUT_SETS, math.ceil(2 * l2 / set_bytes)))
            self.l2_warm = self.n_sets * set_bytes <= l2
        else:
            self.n_sets, self.l2_warm = 2, True
        self.A = [sm.strided(launch["a"], self.dtype, device) for _ in range(self.n_sets)]
        self.B = [sm.strided(launch["b"], self.dtype, device) for _ in range(self.n_sets)]
        # an operand the step's producer stores rounded to tf32 (the tf32_operands stage, the LM head's
        # hoisted weight and d): rounded here too, and the launch takes it as prerounded, as the step's does
        self.prerounded = tuple(launch.get("prerounded", ()))
        if self.prerounded:
            from nova.codegen.triton.matmul import round_to_tf32

            for t in (self.A if "a" in self.prerounded else []) + (self.B if "b" in self.prerounded else []):
                t.copy_(round_to_tf32(t))
        self.bias = [torch.randn(self.N, device=device, dtype=self.dtype) for _ in range(self.n_sets)] if launch["bias"] else None
        self.C = [torch.empty(shape, device=device, dtype=self.out_dtype) for _ in range(self.n_sets)]
        self.ref = self.A[0].double() @ self.B[0].double()
        if self.bias is not None:
            self.ref += self.bias[0].double()
        peak = 3e14 if precision == "tf32" else 6e14  # optimistic rate: only sizes the graphs
        self.est_ms = max(2.0 * batch * self.M * self.N * self.K / peak * 1e3, 2e-3)
        self.cublas_note = None

    def nova_launcher(self, cfg, precision=None):
        from nova.codegen.triton.matmul import matmul

        prec = precision or self.nova_precision
        bias, pre = self.bias, self.prerounded
        return lambda i: matmul(self.A[i], self.B[i], bias=bias[i] if bias else None, cfg=cfg, precision=prec,
                                out=self.C[i], prerounded=pre)

    def cublas_launcher(self):
        A, B, C, bias = self.A, self.B, self.C, self.bias
        if self.out_dtype != self.dtype:  # the LM head's fp32 weight gradient of 16-bit operands
            try:
                torch.mm(A[0], B[0], out_dtype=self.out_dtype)
                return lambda i: torch.mm(A[i], B[i], out_dtype=self.out_dtype)
            except (TypeError, RuntimeError) as e:  # no mm(out_dtype=) here: the operands' dtype out
                self.cublas_note = f"out dtype {self.dtype} (torch.mm(out_dtype=) failed: {str(e)[:80]})"
                return lambda i: torch.matmul(A[i], B[i])
        if bias is not None:
            return lambda i: torch.addmm(bias[i], A[i], B[i], out=C[i])
        return lambda i: torch.matmul(A[i], B[i], out=C[i])

    def error(self, launch) -> float:
        out = launch(0)
        return _rel_err(out if out is not None else self.C[0], self.ref)


def _strides_class(spec: dict, elt: int) -> tuple:
    """What Triton specialises an operand's binary on: unit strides, 16-byte divisibility."""
    return tuple((st == 1, st * elt % 16 == 0) for st in spec["strides"]) + (spec["offset"] * elt % 16 == 0,)


def _launch_binary_key(cfg, launch):
    elt = torch.empty((), dtype=getattr(torch, launch["dtype"])).element_size()
    return (_binary_key(cfg, launch["M"], launch["N"], launch["K"]), launch["dtype"], launch["out_dtype"], launch["bias"],
            launch["precision"], _strides_class(launch["a"], elt), _strides_class(launch["b"], elt))


def compile_ahead_launches(jobs, workers, log):
    """compile_ahead for step launches: [(config, launch)] compiled on meta tensors with
    the launch's strides (bench/step_matmuls.py: precompile_launch_specs)."""
    if not jobs:
        return {}
    sm = _step_matmuls()
    limit = torch.cuda.get_device_properties(0).shared_memory_per_block_optin
    specs = [(i, cfg.to_dict(), launch, launch["precision"]) for i, (cfg, launch) in enumerate(jobs)]
    chunks = [specs[i :: workers * 2] for i in range(workers * 2) if specs[i :: workers * 2]]
    t0 = time.perf_counter()
    status: dict = {}
    ctx = multiprocessing.get_context("spawn")
    with cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        for result in pool.map(sm.precompile_launch_specs, chunks):
            for index, smem, err in result:
                cfg, launch = jobs[index]
                if err is None and smem > limit:
                    err = f"needs {smem} B of shared memory, the device has {limit}"
                status[_launch_binary_key(cfg, launch)] = err
    failed = sum(e is not None for e in status.values())
    log(f"  compiled {len(jobs)} kernels in {time.perf_counter() - t0:.1f} s on {workers} processes ({failed} rejected)")
    return status


def _variant(cfg, launch) -> dict:
    """Which kernel the template runs for this config on these operands: TMA
    descriptors or pointer loads (the launcher's _tma_plan on the step's strides),
    the split count the launcher makes, the staged operands."""
    from nova.codegen.triton import matmul as mm

    sm = _step_matmuls()
    dtype = getattr(torch, launch["dtype"])
    a, b = sm.strided(launch["a"], dtype, "meta"), sm.strided(launch["b"], dtype, "meta")
    a3, b3 = (a if a.dim() == 3 else a[None]), (b if b.dim() == 3 else b[None])
    tokens = cfg.instruction.split("+")
    staged = [x for x in ("a", "b") if f"stage_{x}" in tokens]
    if staged and dtype == torch.float32:  # the staged copies are dense K-major: TMA reads those
        a3 = torch.empty(a3.shape, dtype=dtype, device="meta") if "a" in staged else a3
        b3 = torch.empty((b3.shape[0], b3.shape[2], b3.shape[1]), dtype=dtype, device="meta").transpose(1, 2) if "b" in staged else b3
    return {"tma": mm._tma_plan(cfg, a3, b3) is not None, "splits": mm.split_k_plan(launch["K"], cfg)[1], "staged": staged}


def run_gpt2(opts, checkpoint=None, log=print) -> dict:
    """--shapes gpt2: every distinct matmul launch of the asked-for steps, measured as
    the grid's shapes are (nova's config from the configurator with the configure
    stage's arguments, cuBLAS on the same views, the template's search), then the
    per-step totals (time x count)."""
    from nova.codegen.triton import matmul as mm

    sm = _step_matmuls()
    device = torch.device("cpu" if opts.dry_run else "cuda")
    timer = WallTimer() if opts.dry_run else GpuTimer()
    spec = mm.device_spec(device)
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else spec.num_sms
    started = time.perf_counter()
    deadline = started + opts.time_limit
    steps = gpt2_steps(opts, log)
    entries = gpt2_launches(steps)
    i, n = opts.part
    entries = entries[i - 1 :: n]
    sm.configured(entries[0]["launch"]["configure"], spec) if entries else None  # imports, not timed
    rows = []
    for precision in opts.precisions:
        mine = [e for e in entries if e["uses"][0]["precision"] == precision]
        space = (dry_space if opts.dry_run else search_space)(precision)
        log(f"{precision}: {len(mine)} distinct launches of GPT-2 steps at batch {','.join(map(str, opts.batch))}, "
            f"search space {len(space)} configs, budget {opts.search_budget}")
        plans = []
        for e in mine:
            L = e["launch"]
            t0 = time.perf_counter()
            nova_cfg = sm.configured(L["configure"], spec)
            cfg_ms = (time.perf_counter() - t0) * 1e3
            plans.append((e, nova_cfg, cfg_ms, candidates(space, L["M"], L["N"], L["K"], opts.search_budget, num_sms)))
        if device.type == "cuda":
            jobs, seen = [], set()
            for e, nova_cfg, _, cands in plans:
                for cfg in [nova_cfg, *cands]:
                    key = _launch_binary_key(cfg, e["launch"])
                    if key not in seen:
                        seen.add(key)
                        jobs.append((cfg, e["launch"]))
            status = compile_ahead_launches(jobs, opts.workers, log)
            plans = [(e, nova_cfg, cfg_ms, [c for c in cands if status.get(_launch_binary_key(c, e["launch"])) is None])
                     for e, nova_cfg, cfg_ms, cands in plans]
        for e, nova_cfg, cfg_ms, cands in plans:
            L = e["launch"]
            sb = StepShapeBench(L, precision, device, timer)
            row = bench_shape(sb, nova_cfg, cfg_ms, cands, opts.search_seconds, deadline, log,
                              keep_search=opts.keep_search)
            batch = L["batch"]
            for fig in (row["nova"], row["cublas"], row["search"]["best"]):
                if fig and fig.get("ms") and batch > 1:
                    fig["tflops"] *= batch
            row.update(
                id=hashlib.sha1(sm.signature(L).encode()).hexdigest()[:12],  # the same in every part
                source=L["source"], uses=e["uses"], batch=batch, dtype=L["dtype"], out_dtype=L["out_dtype"],
                bias=L["bias"], epilogue=bool(L.get("epilogue")),  # the step runs it with a fused epilogue (timed without)
                a=L["a"], b=L["b"], layouts=L["layouts"],
                configure_layouts=[L["configure"]["a_layout"], L["configure"]["b_layout"]],
                config_as_in_step=L["config"] == nova_cfg.to_dict(),
                variant=_variant(nova_cfg, L),
                best_variant=_variant(LoweringConfig.from_dict(row["search"]["best"]["config"]), L) if row["search"]["best"] else None,
                cublas_note=sb.cublas_note,
            )
            rows.append(row)
            del sb
            if checkpoint is not None:
                doc = _document(rows, opts, device, time.perf_counter() - started, complete=False)
                doc["steps"] = step_totals(rows)
                checkpoint(doc)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    log(f"done in {time.perf_counter() - started:.0f} s")
    doc = _document(rows, opts, device, time.perf_counter() - started)
    doc["benchmark"] = "matmul --shapes gpt2"
    doc["steps"] = step_totals(rows)
    return doc


GAP_ROWS = 5  # the launches a step lists by their count x (Nova - cuBLAS)


def step_totals(rows) -> list[dict]:
    """Per step (precision, batch): the sum over its launches of count x time, for
    Nova's configs, cuBLAS and the template's best (the faster of the searched best and
    Nova's own config: the template can run either), with the launches measured; and
    ``gaps``, the GAP_ROWS launches whose count x (Nova - cuBLAS) is largest (where the
    step's matmul time against cuBLAS goes; negative where Nova is ahead)."""
    steps: dict[tuple, dict] = {}
    for r in rows:
        for u in r["uses"]:
            s = steps.setdefault((u["precision"], u["batch"]), {
                "precision": u["precision"], "batch": u["batch"], "launches": 0, "distinct": 0,
                "nova_ms": 0.0, "cublas_ms": 0.0, "best_ms": 0.0, "missing": 0, "by_source": {}, "gaps": []})
            nova, cublas = r["nova"]["ms"], r["cublas"]["ms"]
            best = min(x for x in (nova, (r["search"]["best"] or {}).get("ms")) if x) if nova or r["search"]["best"] else None
            s["launches"] += u["count"]
            s["distinct"] += 1
            if nova is None or cublas is None or best is None:
                s["missing"] += u["count"]
                continue
            s["nova_ms"] += u["count"] * nova
            s["cublas_ms"] += u["count"] * cublas
            s["best_ms"] += u["count"] * best
            s["gaps"].append({"id": r.get("id"), "source": u["source"], "M": r["M"], "N": r["N"], "K": r["K"],
                              "count": u["count"], "gap_ms": u["count"] * (nova - cublas)})
            kind = u["source"].split(":")[-1] if ":" in u["source"] else "layers"
            k = s["by_source"].setdefault(kind, {"launches": 0, "nova_ms": 0.0, "cublas_ms": 0.0, "best_ms": 0.0})
            k["launches"] += u["count"]
            k["nova_ms"] += u["count"] * nova
            k["cublas_ms"] += u["count"] * cublas
            k["best_ms"] += u["count"] * best
    out = []
    for key in sorted(steps, key=lambda k: (PRECISIONS.index(k[0]) if k[0] in PRECISIONS else 9, k[1])):
        s = steps[key]
        s["nova_vs_cublas"] = s["cublas_ms"] / s["nova_ms"] if s["nova_ms"] else None
        s["nova_vs_best"] = s["best_ms"] / s["nova_ms"] if s["nova_ms"] else None
        s["best_vs_cublas"] = s["cublas_ms"] / s["best_ms"] if s["best_ms"] else None
        s["gaps"] = sorted(s["gaps"], key=lambda g: -g["gap_ms"])[:GAP_ROWS]
        out.append(s)
    return out


def _uses_text(r) -> str:
    return "; ".join(f"{u['precision']} b{u['batch']} {u['source'].removeprefix('nova.')} x{u['count']}" for u in r["uses"])


def markdown_gpt2(doc) -> str:
    s = doc["settings"]
    lines = [
        "# nova bench matmul --shapes gpt2",
        "",
        f"{doc['device']} | torch {doc['torch']} | triton {doc['triton']} | commit {doc['git']['commit'][:12]}"
        + (" (dirty)" if doc["git"].get("dirty") else "")
        + f" | search budget {s['search_budget']} | {doc['created']}",
        "",
        "Every distinct matmul launch of the GPT-2 124M AdamW step (layer matmuls forward and backward, the fused "
        "LM head's chunk matmuls), with the operand layouts the step gives it, each timed without the step's "
        "fused epilogue ('(epilogue)': the step runs one, at the config shown). Step totals: sum of count x time "
        "(best: the faster of the searched best and Nova's config).",
        "",
        "| step | launches | Nova ms | cuBLAS ms | best ms | Nova/cuBLAS | Nova/best | best/cuBLAS | not measured |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for t in doc.get("steps", []):
        lines.append(
            f"| {t['precision']} b{t['batch']} | {t['launches']} | {_fmt(t['nova_ms'], '.3f')} | {_fmt(t['cublas_ms'], '.3f')} "
            f"| {_fmt(t['best_ms'], '.3f')} | {_fmt(t['nova_vs_cublas'], '.3f')} | {_fmt(t['nova_vs_best'], '.3f')} "
            f"| {_fmt(t['best_vs_cublas'], '.3f')} | {t['missing']} |"
        )
    lines += ["", "Per kind of launch (ms per step, Nova / cuBLAS / best):", ""]
    for t in doc.get("steps", []):
        parts = [f"{k} ({v['launches']}): {_fmt(v['nova_ms'], '.3f')} / {_fmt(v['cublas_ms'], '.3f')} / "
                 f"{_fmt(v['best_ms'], '.3f')}" for k, v in sorted(t["by_source"].items())]
        lines.append(f"* {t['precision']} b{t['batch']}: " + "; ".join(parts))
    lines += ["", f"The {GAP_ROWS} launches behind cuBLAS by most a step (count x (Nova - cuBLAS), ms):", ""]
    for t in doc.get("steps", []):
        parts = [f"{g['M']}x{g['N']}x{g['K']} {g['source'].removeprefix('nova.')} x{g['count']}: {g['gap_ms']:+.3f}"
                 for g in t.get("gaps", [])]  # (files written before the gaps have none)
        lines.append(f"* {t['precision']} b{t['batch']}: " + ("; ".join(parts) or "-"))
    lines += [
        "",
        "| prec | source | M | N | K | layouts (step / configure) | out | Nova ms | cuBLAS ms | best ms | Nova/cuBLAS "
        "| Nova/best | Nova config | kernel | best config | uses (count per step) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["shapes"]:
        best = r["search"]["best"]
        v = r.get("variant") or {}
        kernel = ("tma" if v.get("tma") else "pointer") + (f" sk{v['splits']}" if v.get("splits", 1) > 1 else "")
        kernel += "".join(f" stage_{x}" for x in v.get("staged", []))
        lines.append(
            f"| {r['precision']} | {r['source'].removeprefix('nova.')}{' (epilogue)' if r.get('epilogue') else ''} "
            f"| {r['M']} | {r['N']} | {r['K']} "
            f"| {'/'.join(r['layouts'])} ({'/'.join(r['configure_layouts'])}) | {r['out_dtype']} "
            f"| {_fmt(r['nova']['ms'], '.4f')} | {_fmt(r['cublas']['ms'], '.4f')} | {_fmt(best['ms'] if best else None, '.4f')} "
            f"| {_fmt(r['nova_vs_cublas'], '.2f')} | {_fmt(r['nova_vs_best'], '.2f')} "
            f"| {describe(LoweringConfig.from_dict(r['nova']['config']))} | {kernel} "
            f"| {describe(LoweringConfig.from_dict(best['config'])) if best else '-'} | {_uses_text(r)} |"
        )
    return "\n".join(lines) + "\n"


def chart_gpt2(doc, path: Path) -> None:
    """Per step: each distinct launch's count x time, Nova / cuBLAS / best, as stacked bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = doc.get("steps") or []
    fig, axes = plt.subplots(1, max(1, len(steps)), figsize=(max(7.0, 4.5 * len(steps)), 6), squeeze=False)
    for ax, t in zip(axes[0], steps):
        parts = []
        for r in doc["shapes"]:
            for u in r["uses"]:
                if (u["precision"], u["batch"]) == (t["precision"], t["batch"]) and r["nova"]["ms"] and r["cublas"]["ms"]:
                    best = min(x for x in (r["nova"]["ms"], (r["search"]["best"] or {}).get("ms")) if x)
                    label = f"{u['source'].removeprefix('nova.')} {r['M']}x{r['N']}x{r['K']}"
                    parts.append((label, u["count"] * r["nova"]["ms"], u["count"] * r["cublas"]["ms"], u["count"] * best))
        parts.sort(key=lambda p: -p[1])
        bottoms = [0.0, 0.0, 0.0]
        cmap = plt.get_cmap("tab20")
        for j, (label, *ms) in enumerate(parts):
            ax.bar(range(3), ms, bottom=bottoms, color=cmap(j % 20), label=label if j < 12 else None)
            bottoms = [b + m for b, m in zip(bottoms, ms)]
        ax.set_xticks(range(3))
        ax.set_xticklabels(["Nova", "cuBLAS", "best"])
        ax.set_ylabel("ms per step (count x time)")
        ax.set_title(f"{t['precision']} batch {t['batch']}: Nova/cuBLAS {_fmt(t['nova_vs_cublas'], '.2f')}, "
                     f"Nova/best {_fmt(t['nova_vs_best'], '.2f')}", fontsize=9)
        ax.legend(fontsize=6, loc="upper right")
    fig.suptitle(f"nova bench matmul --shapes gpt2 on {doc['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- command line


def _part(text: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--part wants i/n, got {text!r}") from None
    if not 1 <= i <= n:
        raise argparse.ArgumentTypeError(f"--part {text}: need 1 <= i <= n")
    return i, n


def _precisions(text: str) -> tuple[str, ...]:
    ps = tuple(p.strip() for p in text.split(",") if p.strip())
    bad = [p for p in ps if p not in PRECISIONS]
    if bad or not ps:
        raise argparse.ArgumentTypeError(f"--precisions: choose from {','.join(PRECISIONS)}, got {text!r}")
    return ps


def _batches(text: str) -> tuple[int, ...]:
    try:
        bs = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--batch wants a list of integers, got {text!r}") from None
    if not bs or min(bs) < 1:
        raise argparse.ArgumentTypeError(f"--batch wants positive integers, got {text!r}")
    return bs


def _variants(text: str) -> tuple[str, ...]:
    vs = tuple(v.strip() for v in text.split(",") if v.strip())
    bad = [v for v in vs if v not in ("tf32", "tf32x3")]
    if bad:
        raise argparse.ArgumentTypeError(f"--tf32-variants: choose from tf32,tf32x3, got {text!r}")
    return vs


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--part", type=_part, default=(1, 1), metavar="I/N", help="run the I-th of N interleaved subsets of the shapes")
    p.add_argument("--search-budget", type=int, default=200, metavar="N",
                   help="most configs searched per shape (default 200: the whole space, >= 120 configs; 0: no search)")
    p.add_argument("--precisions", type=_precisions, default=PRECISIONS, metavar="LIST", help="tf32,bf16 (default both)")
    p.add_argument("--quick", action="store_true", help=f"{len(QUICK_SHAPES)} representative shapes instead of 64")
    p.add_argument("--out", type=Path, default=None, help="output directory (default bench/results; a temp dir for --dry-run)")
    p.add_argument("--dry-run", action="store_true", help="2 tiny shapes, 3 configs, through the Triton interpreter on the CPU")
    p.add_argument("--merge", nargs="*", type=Path, default=None, metavar="JSON",
                   help="merge part JSONs (default: every matmul_part*.json in --out) into matmul.json/.md/.png")
    p.add_argument("--search-seconds", type=float, default=20.0, help="cap on one shape's search (default 20)")
    p.add_argument("--time-limit", type=float, default=540.0, help="after this many seconds of the run, stop searching (default 540)")
    p.add_argument("--keep-search", action=argparse.BooleanOptionalAction, default=True,
                   help="store every searched config's time per shape (search.all: {config text: ms}; default on, "
                   "~1 MB for the full grid) so configurator changes can be scored offline "
                   "(bench/configurator_vs_search.py)")
    p.add_argument("--tf32-variants", type=_variants, default=(), metavar="LIST",
                   help="for tf32 shapes also time nova's config with these fp32 operand treatments "
                   "(row nova_<variant>; default none; choices tf32 (the tensor core truncates), tf32x3; "
                   "both on the register path only: a staged config rounds, and records an error here)")
    p.add_argument("--shapes", choices=("grid", "gpt2"), default="grid",
                   help="grid: the 64 M x N x K shapes (default); gpt2: every distinct matmul launch of the GPT-2 "
                   "124M AdamW step with the layouts the step gives it (bench/gpt2_matmul_shapes.json, "
                   "regenerated by python bench/step_matmuls.py; --dry-run: a tiny GPT compiled live), with "
                   "per-step totals (time x count); writes matmul_gpt2.*")
    p.add_argument("--batch", type=_batches, default=(8, 32), metavar="LIST",
                   help="with --shapes gpt2: the step batch sizes (default 8,32; --dry-run: the tiny GPT's)")
    p.add_argument("--shapes-file", type=Path, default=None, metavar="JSON",
                   help="with --shapes gpt2: the extracted launches (default bench/gpt2_matmul_shapes.json)")
    p.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                   help="set one of Nova's module switches for the run (repeatable; MODULE under nova.), e.g. "
                   "schedule.configurator.STREAM_K_TILES=False: Nova's configs as that variant gives them, "
                   "recorded in the results (settings.switches)")
    p.add_argument("--workers", type=int, default=max(1, min(16, (os.cpu_count() or 2) - 1)), help="compile processes")


def run_args(opts, log=print) -> list[Path]:
    if getattr(opts, "set", None):
        from nova.cli.bench import apply_switches

        opts.switches = apply_switches(opts.set)
    if opts.merge is not None:
        out_dir = opts.out or REPO / "bench" / "results"
        base = "matmul_gpt2" if getattr(opts, "shapes", "grid") == "gpt2" else "matmul"
        files = opts.merge or sorted(out_dir.glob(f"{base}_part*.json"))
        doc = merge(files)
        paths = write(doc, out_dir, base)
        log(f"merged {len(files)} files into " + ", ".join(map(str, paths)))
        _fail_if_inaccurate(doc, paths)
        return paths
    if opts.dry_run:
        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"  # before any kernel is created
        from nova.codegen.triton.source import interpreting

        if not interpreting():
            raise UsageError("--dry-run needs the Triton interpreter, but this process already built compiled kernels")
        out_dir = opts.out or Path(tempfile.mkdtemp(prefix="nova-bench-matmul-"))
    else:
        if not torch.cuda.is_available():
            raise UsageError("nova bench matmul needs a CUDA device (or --dry-run)")
        out_dir = opts.out or REPO / "bench" / "results"
    i, n = opts.part
    base = "matmul_gpt2" if getattr(opts, "shapes", "grid") == "gpt2" else "matmul"
    stem = base if n == 1 else f"{base}_part{i}of{n}"
    doc = run(opts, lambda d: _write_text(out_dir / f"{stem}.json", json.dumps(d, indent=1)), log)
    paths = write(doc, out_dir, stem)
    log("wrote " + ", ".join(map(str, paths)))
    _fail_if_inaccurate(doc, paths)
    return paths


def _fail_if_inaccurate(doc: dict, paths: list[Path]) -> None:
    """The run fails (``RunFailed``: exit 1 from ``nova bench matmul``), its results written, where
    one of Nova's configured kernels was beyond the accuracy limit."""
    bad = sum(bool(r["nova"].get("inaccurate")) for r in doc["shapes"])
    if bad:
        raise RunFailed(f"{bad} of Nova's configured kernels beyond the accuracy limit against float64 (the ERROR "
                        f"lines; results in {paths[0]})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nova bench matmul", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    opts = parser.parse_args(argv)
    try:
        run_args(opts, log=lambda s: print(s, flush=True))
    except RunFailed as e:
        print(f"nova bench matmul: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
