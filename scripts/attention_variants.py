#!/usr/bin/env python3
"""Which schedules of Nova's FlashAttention-2 kernels reach torch SDPA (an experiment,
evidence for the configurator's attention rule): bf16 attention of one shape (causal
unless --full) with random inputs, or f32 under the tf32 policy (--precision tf32),
timed for

  sdpa_fwd / sdpa_bwd   torch SDPA with the flash, the cuDNN and the memory-efficient
                        backend (sdpa_kernel; "unavailable" recorded when a backend
                        refuses: flash and cuDNN take no f32), the math backend under --dry
  nova_fwd              Nova's forward over a grid of (BLOCK_M, BLOCK_N, warps, stages)
  nova_dkdv, nova_dq    the two backward kernels alone, each over its own grid
                        (lower_attention_backward's ``tiles``), and nova_delta
  nova_bwd              the whole backward launch (delta + dK/dV + dQ)
  default: true         the schedule the configure stage picks today on this device
                        (configure_op -> lower_attention / lower_attention_backward)

and the forward / backward kernels' optional source variants (``attention.SOURCE_FLAGS``:
fma_scale, fused_bwd; ``--source-flags`` picks some, none with an empty list) at the
default schedule (right after the defaults) and at a few other tiles (after the grids).
Under tf32, --prerounded passes q, k, v and dO rounded to tf32 and tells the kernels
so (``lower_attention(prerounded=)``: their tiles go into the dots without
``tf32_rn``, as where the tf32_operands stage stored them rounded); the grids are
then TF32_GRIDS.

Every row is checked before it is timed, against a float32 reference (SDPA's math
backend on the same inputs in f32, lse from the masked scores): max abs error on o and
lse (forward), dq, dk, dv (backward kernels: the ones they write), delta. A row is
"wrong" when an error exceeds max(2% of the reference's max |value|, 2x SDPA's own
error on that output), or is NaN; a wrong row has no time. A kernel that fails to
compile or load records "error"; one that spills registers records "spills" (its
registers and spill bytes) and is not timed.

Timing: a CUDA graph of --launches launches, replayed --repeats times under CUDA events
after one warm-up replay; ms = median replay / launches (the device alone, no host
launch cost). SDPA's backward is autograd.grad of its output, also graph-captured;
where a capture fails the row is timed eagerly and says so ("timing"). TFLOP/s counts
the matmuls a kernel does, halved when causal: forward 4 B H T^2 D, dK/dV 8 (4 matmuls),
dQ 6 (3), and for a whole backward (Nova's or SDPA's) the FlashAttention convention
10 (2.5x the forward: the recomputation of q k^T not counted).

    python scripts/attention_variants.py [--batch 32] [--heads 12] [--seq 1024] [--dim 64]
        [--out DIR] [--budget-s 200]
    TRITON_INTERPRET=1 python scripts/attention_variants.py --batch 1 --heads 1 --seq 64 --dim 16 --dry

prints the rows sorted by kernel and time and writes DIR/attention_variants_<commit>.json
(commit: $NOVA_COMMIT, else ``git rev-parse --short HEAD``, else "unknown"). --budget-s
bounds the grids' wall time (SDPA and the defaults come first; grid rows past the
budget are recorded "skipped"). --dry runs on the CPU through the Triton interpreter:
a couple of variants per kernel, host timing (meaningless; the plumbing is the test).
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.timing import time_graph  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

# (BLOCK_M, BLOCK_N, num_warps, num_stages); BLOCK_M = queries, BLOCK_N = keys in every kernel
FWD_GRID = list(itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4, 5)))
DKDV_GRID = list(itertools.product((16, 32, 64), (64, 128), (4, 8), (1, 2, 3)))
DQ_GRID = list(itertools.product((64, 128), (16, 32, 64), (4, 8), (1, 2, 3)))
# the Triton tutorial's Hopper backward (06-fused-attention, D = 64): 32x128 / 128x32, 4 warps, 5 stages
DKDV_GRID += [(32, 128, 4, 5), (32, 128, 8, 4), (16, 128, 4, 5)]
DQ_GRID += [(128, 32, 4, 5), (128, 32, 8, 4)]
# the source variants (attention.SOURCE_FLAGS) beyond the default schedule: forward tiles;
# backward (dK/dV tiles, dQ tiles) pairs (a fused backward runs with the dK/dV warps and stages)
FLAG_FWD = [(128, 64, 4, 3), (128, 64, 8, 4), (128, 128, 8, 3), (64, 64, 4, 4), (64, 128, 4, 3)]
FLAG_BWD = [((32, 128, 4, 5), (128, 32, 4, 5)), ((32, 128, 4, 3), (128, 32, 4, 3)), ((64, 128, 8, 2), (128, 64, 8, 2)),
            ((16, 128, 4, 3), (128, 16, 4, 3)), ((32, 64, 4, 3), (64, 32, 4, 3))]
DRY_FLAG_FWD = [(16, 32, 4, 1)]
DRY_FLAG_BWD = [((16, 32, 4, 1), (32, 16, 4, 1))]
DRY_GRIDS = {"fwd": [(32, 16, 4, 1), (16, 32, 4, 2)], "dkdv": [(16, 32, 4, 1)], "dq": [(32, 16, 4, 1)]}
# f32 operands under tf32 (twice the bytes of a bf16 tile): the tiles that compile to wgmma
# for sm_90a at D = 64 without spills or near it (offline ptxas, 255 registers the cap), the
# defaults' 64x32 w8 s2 (mma) beside them
TF32_GRIDS = {
    "fwd": [(64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3), (64, 128, 4, 2),
            (128, 128, 8, 2), (128, 32, 8, 3)],
    "dkdv": [(64, 32, 8, 2), (32, 64, 4, 2), (32, 64, 4, 3), (32, 64, 8, 3), (16, 64, 4, 3), (64, 64, 4, 2),
             (64, 64, 8, 2), (64, 128, 8, 2), (32, 128, 4, 2), (32, 128, 8, 3)],
    "dq": [(64, 32, 8, 2), (64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 3), (128, 64, 8, 2), (128, 32, 4, 3),
           (128, 32, 8, 3), (64, 64, 8, 2)],
}

REL_TOL = 2e-2  # of the reference's max |value|: about 2.5 bf16 ulps at that magnitude
SDPA_FACTOR = 2.0  # or twice SDPA's own error on that output, whichever is larger
FLOP_FACTOR = {"nova_fwd": 4, "sdpa_fwd": 4, "nova_dkdv": 8, "nova_dq": 6, "nova_bwd": 10, "sdpa_bwd": 10}


# --------------------------------------------------------------------------- checking


def max_abs_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| in float64; inf when ``got`` has a NaN or inf the reference has not."""
    got, ref = got.detach().double(), ref.detach().double()
    if got.shape != ref.shape:
        return math.inf
    bad = ~torch.isfinite(got) & torch.isfinite(ref)
    if bool(bad.any()):
        return math.inf
    return float((got - ref).abs().max()) if got.numel() else 0.0


def tolerances(refs: dict[str, torch.Tensor], sdpa_errs: dict[str, float] | None = None) -> dict[str, float]:
    """Per output: max(REL_TOL x max |ref|, SDPA_FACTOR x SDPA's own error there)."""
    sdpa_errs = sdpa_errs or {}
    out = {}
    for k, r in refs.items():
        scale = float(r.double().abs().max()) if r.numel() else 0.0
        out[k] = max(REL_TOL * scale, SDPA_FACTOR * sdpa_errs.get(k, 0.0))
    return out


def check(got: dict[str, torch.Tensor], refs: dict[str, torch.Tensor], tol: dict[str, float]) -> dict:
    """{"max_abs_err": {name: err}, "tol": {name: tol}, "ok": bool, "wrong": [names]} for
    the outputs in ``got`` (a NaN error is wrong: ``not err <= tol``)."""
    errs = {k: max_abs_err(v, refs[k]) for k, v in got.items()}
    wrong = sorted(k for k, e in errs.items() if not e <= tol[k])
    return {"max_abs_err": errs, "tol": {k: tol[k] for k in errs}, "ok": not wrong, "wrong": wrong}


# --------------------------------------------------------------------------- timing


def time_eager(fn, launches: int, repeats: int) -> float:
    """ms per call with CUDA events around ``launches`` eager calls (the host cost included)."""
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(repeats):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(launches):
            fn()
        e.record()
        ts.append((s, e))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in ts) / launches


def time_host(fn, launches: int, repeats: int) -> float:
    """--dry: wall ms per call on the host (the interpreter; the figure means nothing)."""
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(launches):
            fn()
        ts.append((time.perf_counter() - t) * 1e3 / launches)
    return statistics.median(ts)


# --------------------------------------------------------------------------- the runner


class Bench:
    def __init__(self, opts):
        self.opts = opts
        self.dry = opts.dry
        if opts.source_flags is None:
            from nova.codegen.triton.attention import SOURCE_FLAGS

            opts.source_flags = sorted(SOURCE_FLAGS)
        self.dev = torch.device("cpu" if opts.dry else "cuda")
        self.rows: list[dict] = []
        self.t0 = time.perf_counter()
        b, h, t, d = opts.batch, opts.heads, opts.seq, opts.dim
        self.shape = (b, h, t, d)
        self.causal = not opts.full
        self.scale = d**-0.5
        gen = torch.Generator(device=self.dev).manual_seed(0)
        self.tf32 = opts.precision == "tf32"
        self.dtype = torch.float32 if self.tf32 else torch.bfloat16
        self.prerounded = ("q", "k", "v", "do") if opts.prerounded else None
        self.q, self.k, self.v, self.do = (torch.randn(self.shape, device=self.dev, dtype=self.dtype, generator=gen)
                                           for _ in range(4))
        if opts.prerounded:  # the values a tf32_operands stage would have stored
            from nova.codegen.triton.matmul import round_to_tf32

            self.q, self.k, self.v, self.do = (round_to_tf32(x) for x in (self.q, self.k, self.v, self.do))
        self._reference()

    # ---- reference and SDPA

    def _reference(self):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        q, k, v = (x.float().requires_grad_() for x in (self.q, self.k, self.v))
        with sdpa_kernel(SDPBackend.MATH):
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=self.causal, scale=self.scale)
        dq, dk, dv = torch.autograd.grad(o, (q, k, v), self.do.float())
        with torch.no_grad():
            lse = torch.stack([self._lse(q[i], k[i]) for i in range(q.shape[0])])
        self.ref = {"o": o.detach(), "lse": lse, "dq": dq, "dk": dk, "dv": dv}
        self.o_in = o.detach().to(self.dtype)  # the backward kernels' o (in the inputs' dtype) and lse inputs
        self.lse = lse.contiguous()
        self.ref["delta"] = (self.do.float() * self.o_in.float()).sum(-1).reshape(-1, self.shape[2])
        self.sdpa_err: dict[str, float] = {}

    def _lse(self, q, k):
        s = (q @ k.transpose(-1, -2)) * self.scale
        if self.causal:
            t = s.shape[-1]
            s = s.masked_fill(torch.ones(t, t, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
        return torch.logsumexp(s, -1)

    def timer(self):
        if self.dry:
            return lambda fn, stream=None: (time_host(fn, 1, 1), "host")

        def timed(fn, stream=None):
            try:
                return time_graph(fn, self.opts.launches, self.opts.repeats, stream), "cuda graph"
            except Exception as e:  # noqa: BLE001 - a capture SDPA refuses: eager, and the row says so
                torch.cuda.synchronize()
                return time_eager(fn, self.opts.launches, self.opts.repeats), f"eager ({type(e).__name__})"
        return timed

    def sdpa_rows(self):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backends = [("math", SDPBackend.MATH)] if self.dry else [("flash", SDPBackend.FLASH_ATTENTION),
                                                                 ("cudnn", SDPBackend.CUDNN_ATTENTION),
                                                                 ("efficient", SDPBackend.EFFICIENT_ATTENTION)]
        timed = self.timer()
        # autograd runs a backward op on its forward op's stream: the forward runs on the
        # stream the backward's graph is then captured on
        stream = None if self.dry else torch.cuda.Stream()
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())

        def ctx():
            return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)
        for name, backend in backends:
            q, k, v = (x.detach().clone().requires_grad_() for x in (self.q, self.k, self.v))
            for kind in ("sdpa_fwd", "sdpa_bwd"):
                row = {"kernel": kind, "backend": name, "tiles": None}
                try:
                    with sdpa_kernel(backend), ctx():
                        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=self.causal,
                                                                             scale=self.scale)
                        if kind == "sdpa_fwd":
                            got = {"o": o}

                            def fn():
                                torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=self.causal,
                                                                                 scale=self.scale)
                        else:
                            grads = torch.autograd.grad(o, (q, k, v), self.do, retain_graph=True)
                            got = dict(zip(("dq", "dk", "dv"), grads))

                            def fn():
                                torch.autograd.grad(o, (q, k, v), self.do, retain_graph=True)
                        res = check(got, self.ref, tolerances({k2: self.ref[k2] for k2 in got}))
                        row.update(res)
                        if res["ok"]:
                            for k2, e in res["max_abs_err"].items():
                                self.sdpa_err[k2] = max(self.sdpa_err.get(k2, 0.0), e)
                            row["ms"], row["timing"] = timed(fn, stream)
                        row["status"] = "ok" if res["ok"] else "wrong"
                except Exception as e:  # noqa: BLE001 - recorded
                    row.update(status="unavailable", error=f"{type(e).__name__}: {str(e)[:200]}")
                self.add(row)

    # ---- Nova

    def ops(self):
        from nova.ir import dialect as nv
        from nova.ir.builder import OpBuilder
        from nova.ir.module import Slot, new_step
        from nova.ir.types import from_torch_dtype, tensor

        def build(op_cls, inputs):
            _, fn = new_step([Slot("batch", f"x{i}", tensor(t.shape, from_torch_dtype(t.dtype)))
                              for i, t in enumerate(inputs)])
            return OpBuilder(fn.body.block).create(op_cls, list(fn.body.block.args),
                                                   {"causal": self.causal, "scale": self.scale})
        self.fwd_ins = [self.q, self.k, self.v]
        self.bwd_ins = [self.do, self.q, self.k, self.v, self.o_in, self.lse]
        return build(nv.AttentionOp, self.fwd_ins), build(nv.AttentionBackwardOp, self.bwd_ins)

    def default_config(self, op):
        """What the configure stage writes on ``op`` on this device."""
        from nova.schedule.devices import DEVICES, from_torch_device
        from nova.transforms.configure import configure_op

        spec = DEVICES["H200"] if self.dry else from_torch_device(self.dev)
        return configure_op(op, spec, self.opts.precision)

    def nova_rows(self):
        from nova.codegen.triton import attention as A
        from nova.codegen.triton.source import load_kernel
        from nova.schedule.config import LoweringConfig

        fwd_op, bwd_op = self.ops()
        cfg = self.default_config(fwd_op)
        bcfg = self.default_config(bwd_op)
        b, h, t, d = self.shape
        timed = self.timer()
        tol_f = tolerances({k: self.ref[k] for k in ("o", "lse")}, self.sdpa_err)
        tol_b = tolerances({k: self.ref[k] for k in ("dq", "dk", "dv", "delta")}, self.sdpa_err)
        o = torch.empty_like(self.q)
        lse = torch.empty(b, h, t, device=self.dev, dtype=torch.float32)
        dq, dk, dv = (torch.empty_like(self.q) for _ in range(3))
        delta = torch.empty(b * h, t, device=self.dev, dtype=torch.float32)

        def tiles_of(c):
            return {"block_m": c.block_m, "block_n": c.block_n, "num_warps": c.num_warps, "num_stages": c.num_stages}

        def measure(row, lower, run, got, tol, kernel_names):
            """Lower, run once, check, then time ``run`` (a zero-argument launch)."""
            if not row.get("default") and time.perf_counter() - self.t0 > self.opts.budget_s:
                row.update(status="skipped", error=f"time budget {self.opts.budget_s}s spent")
                return self.add(row)
            t_c = time.perf_counter()
            try:
                kernel = lower()
                for out in got().values():
                    out.fill_(float("nan"))  # a kernel that writes nothing is caught
                run(kernel)()
                if not self.dry:
                    torch.cuda.synchronize()
                row["compile_s"] = round(time.perf_counter() - t_c, 3)
                row.update(self.compiled_stats(kernel.source, kernel_names, load_kernel))
                row["effective"] = self.effective(kernel, row["kernel"])
                res = check(got(), self.ref, tol)
                row.update(res)
                if row.get("n_spills"):
                    row["status"] = "spills"
                elif not res["ok"]:
                    row["status"] = "wrong"
                else:
                    row["ms"], row["timing"] = timed(run(kernel))
                    row["status"] = "ok"
            except Exception as e:  # noqa: BLE001 - a config that does not compile or load: recorded
                row.update(status="error", error=f"{type(e).__name__}: {str(e)[:300]}")
                if not self.dry:
                    torch.cuda.synchronize()
            self.add(row)

        def fwd_lower(c, flags=()):
            return lambda: A.lower_attention(fwd_op, c, precision=self.opts.precision, prerounded=self.prerounded,
                                             **self.flag_kw(flags))

        def fwd_run(kernel):
            return lambda: kernel.launch(self.fwd_ins, [o, lse])

        def bwd_lower(tiles=None, flags=()):
            return lambda: A.lower_attention_backward(bwd_op, bcfg, precision=self.opts.precision, tiles=tiles,
                                                      prerounded=self.prerounded, **self.flag_kw(flags))

        def bwd_run(kernels):
            def run(kernel):
                if kernels != ("delta",) and kernels != ("delta", "dkdv", "dq"):  # its delta input first
                    kernel.extra["launch_kernels"](self.bwd_ins, (dq, dk, dv), delta, ("delta",))
                if kernels == ("delta", "dkdv", "dq"):
                    return lambda: kernel.launch(self.bwd_ins, [dq, dk, dv])
                return lambda: kernel.extra["launch_kernels"](self.bwd_ins, (dq, dk, dv), delta, kernels)
            return run

        got_f = lambda: {"o": o, "lse": lse}  # noqa: E731
        got_kv = lambda: {"dk": dk, "dv": dv}  # noqa: E731
        got_q = lambda: {"dq": dq}  # noqa: E731
        got_all = lambda: {"dq": dq, "dk": dk, "dv": dv}  # noqa: E731
        got_delta = lambda: {"delta": delta}  # noqa: E731

        # the defaults first: what the step runs today
        measure({"kernel": "nova_fwd", "default": True, "tiles": tiles_of(cfg)}, fwd_lower(cfg), fwd_run, got_f, tol_f,
                ["attention_fwd"])
        measure({"kernel": "nova_bwd", "default": True, "tiles": None}, bwd_lower(), bwd_run(("delta", "dkdv", "dq")),
                got_all, tol_b, ["attention_bwd_delta", "attention_bwd_dkdv", "attention_bwd_dq"])
        measure({"kernel": "nova_dkdv", "default": True}, bwd_lower(), bwd_run(("dkdv",)), got_kv, tol_b,
                ["attention_bwd_dkdv"])
        measure({"kernel": "nova_dq", "default": True}, bwd_lower(), bwd_run(("dq",)), got_q, tol_b,
                ["attention_bwd_dq"])
        measure({"kernel": "nova_delta", "default": True}, bwd_lower(), bwd_run(("delta",)), got_delta, tol_b,
                ["attention_bwd_delta"])
        def lc(bm, bn, w, s):
            return LoweringConfig(kind="attention", block_m=bm, block_n=bn, block_k=max(16, 1 << (d - 1).bit_length()),
                                  num_warps=w, num_stages=s)

        def flag_rows(flag, fwd_tiles, bwd_tiles):
            """``flag`` (a SOURCE_FLAGS variant of the forward or of the backward) at the
            default schedule (tiles None) and at the given ones."""
            forward = A.SOURCE_FLAGS[flag].startswith("forward")
            for tiles in fwd_tiles if forward else bwd_tiles:
                if forward:
                    c = cfg if tiles is None else lc(*tiles)
                    measure({"kernel": "nova_fwd", "flags": [flag], "tiles": tiles_of(c)}, fwd_lower(c, (flag,)),
                            fwd_run, got_f, tol_f, ["attention_fwd"])
                else:
                    tl = None if tiles is None else {"dkdv": lc(*tiles[0]), "dq": lc(*tiles[1])}
                    names = ["attention_bwd_delta", "attention_bwd_fused" if flag == "fused_bwd" else "attention_bwd_dkdv"]
                    measure({"kernel": "nova_bwd", "flags": [flag]}, bwd_lower(tl, (flag,)),
                            bwd_run(("delta", "dkdv", "dq")), got_all, tol_b,
                            names + ([] if flag == "fused_bwd" else ["attention_bwd_dq"]))

        for flag in self.opts.source_flags:  # the source variants at the default schedule
            flag_rows(flag, [None], [None])

        grids = (DRY_GRIDS if self.dry else TF32_GRIDS if self.tf32
                 else {"fwd": FWD_GRID, "dkdv": DKDV_GRID, "dq": DQ_GRID})
        for tiles in grids["fwd"]:
            c = lc(*tiles)
            measure({"kernel": "nova_fwd", "tiles": tiles_of(c)}, fwd_lower(c), fwd_run, got_f, tol_f, ["attention_fwd"])
        for tiles in grids["dkdv"]:
            c = lc(*tiles)
            measure({"kernel": "nova_dkdv", "tiles": tiles_of(c)}, bwd_lower({"dkdv": c}), bwd_run(("dkdv",)), got_kv,
                    tol_b, ["attention_bwd_dkdv"])
        for tiles in grids["dq"]:
            c = lc(*tiles)
            measure({"kernel": "nova_dq", "tiles": tiles_of(c)}, bwd_lower({"dq": c}), bwd_run(("dq",)), got_q, tol_b,
                    ["attention_bwd_dq"])
        for flag in self.opts.source_flags:  # and at a few other schedules, after the grids
            flag_rows(flag, DRY_FLAG_FWD if self.dry else FLAG_FWD, DRY_FLAG_BWD if self.dry else FLAG_BWD)

    def flag_kw(self, flags) -> dict:
        return {"source_flags": frozenset(flags)} if flags else {}

    def effective(self, kernel, kind) -> dict | None:
        """The tiles the kernel actually ran with (the lowering caps some)."""
        def tiles(c):
            return {"block_m": c.block_m, "block_n": c.block_n, "num_warps": c.num_warps, "num_stages": c.num_stages}
        if kind == "nova_bwd":
            return {"dkdv": tiles(kernel.config), "dq": tiles(kernel.extra["dq_config"])}
        if kind == "nova_delta":
            return None
        return tiles(kernel.extra["dq_config"] if kind == "nova_dq" else kernel.config)

    def compiled_stats(self, source, names, load_kernel) -> dict:
        """Registers and spill bytes of the compiled kernels (CUDA only; the interpreter has none)."""
        if self.dry:
            return {}
        regs, spills = 0, 0
        for name in names:
            jit, _ = load_kernel(source, name)
            for cache in jit.device_caches.values():
                for ck in cache[0].values():
                    ck = ck.result() if hasattr(ck, "result") else ck
                    ck._init_handles()
                    regs, spills = max(regs, ck.n_regs), max(spills, ck.n_spills)
        return {"n_regs": regs, "n_spills": spills}

    # ---- output

    def add(self, row: dict):
        b, h, t, d = self.shape
        if row.get("ms") and row["kernel"] in FLOP_FACTOR:
            flop = FLOP_FACTOR[row["kernel"]] * b * h * t * t * d / (2 if self.causal else 1)
            row["tflops"] = round(flop / (row["ms"] * 1e-3) / 1e12, 2)
        elif row.get("ms"):  # the delta pass: dO and O read, delta (f32) written
            row["gbps"] = round((2 * b * h * t * d * self.dtype.itemsize + b * h * t * 4) / (row["ms"] * 1e-3) / 1e9, 1)
        row.setdefault("default", False)
        row.setdefault("flags", [])
        row.setdefault("ms", None)
        self.rows.append(row)
        print(fmt(row), flush=True)


def tiles_name(tiles: dict | None) -> str:
    if not tiles:
        return ""
    if "dkdv" in tiles:
        return f"kv {tiles_name(tiles['dkdv'])}, q {tiles_name(tiles['dq'])}"
    return f"{tiles['block_m']}x{tiles['block_n']} w{tiles['num_warps']} s{tiles['num_stages']}"


def summarize(rows: list[dict]) -> dict:
    """Per kernel kind its fastest correct row and the default's time; then Nova
    against the fastest SDPA backend (forward; backward as the default launch and as
    the fastest dK/dV + fastest dQ + the delta kernel)."""
    out = {}
    for kind in ("sdpa_fwd", "sdpa_bwd", "nova_fwd", "nova_bwd", "nova_dkdv", "nova_dq", "nova_delta"):
        ok = [r for r in rows if r["kernel"] == kind and r["status"] == "ok"]
        if ok:
            best = min(ok, key=lambda r: r["ms"])
            dflt = [r for r in ok if r["default"] and not r["flags"]]
            out[kind] = {"best_ms": best["ms"], "best": best.get("effective") or best.get("tiles"),
                         "best_backend": best.get("backend"), "best_flags": best["flags"],
                         "default_ms": dflt[0]["ms"] if dflt else None}
    if all(k in out for k in ("nova_dkdv", "nova_dq", "nova_delta")):
        out["nova_bwd_best_parts_ms"] = out["nova_dkdv"]["best_ms"] + out["nova_dq"]["best_ms"] + out["nova_delta"]["best_ms"]
    for p in ("fwd", "bwd"):
        s, n = out.get(f"sdpa_{p}"), out.get(f"nova_{p}")
        if s and n:
            best = out.get("nova_bwd_best_parts_ms", n["best_ms"]) if p == "bwd" else n["best_ms"]
            out[f"{p}_sdpa_over_nova_default"] = s["best_ms"] / n["default_ms"] if n["default_ms"] else None
            out[f"{p}_sdpa_over_nova_best"] = s["best_ms"] / min(best, n["best_ms"])
    return out


def fmt(row: dict) -> str:
    tiles = row.get("effective") or row.get("tiles")
    name = (row["kernel"] + (f" [{row['backend']}]" if row.get("backend") else "")
            + (" " + "+".join(row["flags"]) if row.get("flags") else "") + (" (default)" if row.get("default") else ""))
    t = tiles_name(tiles)
    ms = f"{row['ms']:.4f}" if row.get("ms") else "-"
    errs = " ".join(f"{k}={v:.2e}" for k, v in (row.get("max_abs_err") or {}).items())
    tail = row.get("error") or ""
    rate = f"{row['tflops']:7.1f} TF/s" if row.get("tflops") else f"{row['gbps']:7.0f} GB/s" if row.get("gbps") else " " * 12
    return f"{name:30s} {t:34s} {ms:>9s} ms {rate} {row['status']:8s} {errs} {tail}"


def commit() -> str:
    if os.environ.get("NOVA_COMMIT"):
        return os.environ["NOVA_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--full", action="store_true", help="no causal mask")
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--launches", type=int, default=10, help="launches per CUDA graph")
    ap.add_argument("--repeats", type=int, default=7, help="graph replays timed (the median is kept)")
    ap.add_argument("--budget-s", type=float, default=200.0, help="wall seconds for the grids")
    ap.add_argument("--source-flags", nargs="*", default=None,
                    help="source variants to measure (default: every attention.SOURCE_FLAGS flag)")
    ap.add_argument("--dry", action="store_true", help="CPU through the Triton interpreter (TRITON_INTERPRET=1)")
    ap.add_argument("--precision", choices=("bf16", "tf32"), default="bf16",
                    help="bf16 inputs, or f32 inputs under the tf32 policy")
    ap.add_argument("--prerounded", action="store_true",
                    help="tf32: q, k, v and dO rounded to tf32, and the kernels told so")
    opts = ap.parse_args(argv)
    if opts.prerounded and opts.precision != "tf32":
        ap.error("--prerounded needs --precision tf32")
    return opts


def main(argv=None) -> int:
    opts = parse(argv)
    if opts.dry:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    elif not torch.cuda.is_available():
        print("attention_variants: needs a CUDA device (or --dry for the interpreter)", file=sys.stderr)
        return 2
    sys.path.insert(0, str(REPO))
    import triton

    from nova.codegen.triton import attention as A

    if opts.source_flags is None:
        opts.source_flags = sorted(A.SOURCE_FLAGS)
    unknown = set(opts.source_flags) - set(A.SOURCE_FLAGS)
    if unknown:
        print(f"attention_variants: unknown source flags {sorted(unknown)}; known: {sorted(A.SOURCE_FLAGS)}",
              file=sys.stderr)
        return 2
    torch.manual_seed(0)
    bench = Bench(opts)
    bench.sdpa_rows()
    bench.nova_rows()
    rows = bench.rows
    print("\nsorted by kernel, then time:")
    for row in sorted(rows, key=lambda r: (r["kernel"], r["ms"] is None, r["ms"] or 0)):
        print(fmt(row))
    summary = summarize(rows)
    print("\nsummary:", json.dumps(summary, indent=1))
    c = commit()
    doc = {"device": "cpu (TRITON_INTERPRET=1)" if opts.dry else torch.cuda.get_device_name(),
           "torch": torch.__version__, "triton": triton.__version__, "python": sys.version.split()[0], "commit": c,
           "shape": {"batch": opts.batch, "heads": opts.heads, "seq": opts.seq, "dim": opts.dim,
                     "causal": not opts.full, "dtype": "float32" if opts.precision == "tf32" else "bfloat16",
                     "scale": opts.dim**-0.5},
           "precision": opts.precision, "prerounded": opts.prerounded,
           "settings": {"launches": opts.launches, "repeats": opts.repeats, "budget_s": opts.budget_s,
                        "dry": opts.dry, "rel_tol": REL_TOL, "sdpa_factor": SDPA_FACTOR,
                        "source_flags": opts.source_flags, "flop_factor": FLOP_FACTOR},
           "wall_s": round(time.perf_counter() - bench.t0, 1), "summary": summary, "rows": rows}
    opts.out.mkdir(parents=True, exist_ok=True)
    tag = "" if opts.precision == "bf16" else "_tf32" + ("_prerounded" if opts.prerounded else "")
    path = opts.out / f"attention_variants{tag}_{c}.json"
    path.write_text(json.dumps(doc, indent=1, default=str))
    print(f"wrote {path} ({doc['wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
