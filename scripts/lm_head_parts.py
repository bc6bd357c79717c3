#!/usr/bin/env python3
"""Where the time of the fused LM head + cross-entropy goes (an experiment, evidence
for its chunk size and its matmul schedules): the parts of one chunk of
``nova.linear_cross_entropy_with_grad`` timed alone, for several chunk sizes,
beside cuBLAS (torch.matmul) on the same shapes:

  logits      z = h[r0:r1] @ w^T             [chunk, V], K = D   (the head's type)
  rows        lce_rows_with_grad over z       the row losses, d over z in place
  dh          dh[r0:r1] = d @ w               [chunk, D], K = V
  dw_first    dw_acc = d^T @ h[r0:r1]         [V, D] f32, K = chunk (the first chunk)
  dw_add      dw_acc += d^T @ h[r0:r1]        the later chunks (accumulate epilogue)

with the schedule the lowering asks the configurator for (``linear_ce.Configs``),
and ``--dh-split`` alternatives for dh. ``--precision tf32``: an f32 head under the
tf32 policy ("tf32-rn" matmuls, cuBLAS with TF32 allowed), the row kernel writing d
rounded to tf32 and dh taking it ``prerounded`` (``linear_ce.PREROUND_TF32``), beside
``dh_copied`` (the same matmul rounding, and staging, d itself); the logits and dh
take the weight rounded once (``linear_ce.HOIST_WEIGHT_TF32``), its two copies timed as
``weight``. The per-step estimate is N / chunk chunks of (logits + rows + dh + dw_add)
+ one dw_first - dw_add (+ weight under tf32). At bf16 also ``logits_stats`` and
``rows_stats``: the logits with their row statistics from the epilogue and the row kernel
that reads each row once (``linear_ce.ROW_STATS_FROM_LOGITS``), and the estimate with them.
Random inputs; ``bench.timing.time_graph`` (CUDA graph, median replay).

    python scripts/lm_head_parts.py [--rows 32768] [--chunks 2048,4096,8192] [--precision bf16|tf32] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.timing import time_graph  # noqa: E402
from nova.codegen.triton import linear_ce  # noqa: E402
from nova.codegen.triton import matmul as mm  # noqa: E402
from nova.codegen.triton.rowwise import LOOP_BLOCK, next_pow2  # noqa: E402
from nova.codegen.triton.source import load_kernel  # noqa: E402
from nova.schedule.config import LoweringConfig  # noqa: E402


def describe(cfg) -> str:
    d = cfg.to_dict()
    return " ".join(f"{k}={v}" for k, v in d.items() if v not in (None, "", 0, 1) or k in ("block_m", "block_n"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=32768)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--chunks", default="2048,4096,8192")
    ap.add_argument("--dh-split", default="1,2,4,8", help="split-K alternatives timed for dh (1: unsplit)")
    ap.add_argument("--precision", choices=["bf16", "tf32"], default="bf16", help="the head's: bf16, or f32 under tf32")
    ap.add_argument("--launches", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", type=Path, default=None)
    o = ap.parse_args()
    dev = torch.device("cuda")
    bf16, f32 = torch.bfloat16, torch.float32
    N, D, V = o.rows, o.dim, o.vocab
    g = torch.Generator(device=dev).manual_seed(0)
    tf32 = o.precision == "tf32"
    head = f32 if tf32 else bf16
    torch.backends.cuda.matmul.allow_tf32 = tf32  # cuBLAS's rows: the precision of the head's policy
    h = (torch.randn(N, D, device=dev, generator=g) * 0.5).to(head)
    w = (torch.randn(V, D, device=dev, generator=g) * 0.02).to(head)
    t = torch.randint(0, V, (N,), device=dev, generator=g)
    block = min(LOOP_BLOCK, next_pow2(V))
    ty = "tl.float32" if tf32 else "tl.bfloat16"
    src = linear_ce.linear_ce_source(V, -100, 0.0, False, ty, ty, block, preround=tf32 and linear_ce.PREROUND_TF32)
    rows_k = load_kernel(src, "lce_rows_with_grad")[0]
    warps = 4 if block <= 1024 else 8
    prec = "tf32-rn" if tf32 else "bf16"
    rounded = ("a",) if tf32 and linear_ce.PREROUND_TF32 else ()
    # the weight as the lowering gives it to the logits and dh under tf32 (linear_ce.HOIST_WEIGHT_TF32): rounded
    # once a launch, w and a dense w^T (the "weight" part below times those two copies)
    hoist = linear_ce.hoists_weight(head, prec)
    w_rounded = ("b",) if hoist else ()
    wl = mm.round_to_tf32(w) if hoist else w
    wd = mm.round_to_tf32(w).t().contiguous().t() if hoist else w
    configs = linear_ce.Configs(prec)
    result = {"rows": N, "dim": D, "vocab": V, "precision": o.precision, "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "commit": os.environ.get("NOVA_COMMIT"), "chunks": []}  # fmt: skip
    for chunk in [int(c) for c in o.chunks.split(",")]:
        z = torch.empty(chunk, V, device=dev, dtype=head)
        dh = torch.empty(chunk, D, device=dev, dtype=head)
        dw = torch.zeros(V, D, device=dev, dtype=f32)
        loss = torch.empty(chunk, device=dev, dtype=f32)
        scale = torch.full((1,), 1.0 / N, device=dev, dtype=f32)
        hc, tc = h[:chunk], t[:chunk]
        c_logits = configs(hc, wl.t(), head)
        c_dh = configs(z, wd, head)
        c_dw = configs(z.t(), hc, f32)
        c_add = configs(z.t(), hc, f32, epilogue=True)
        ep = linear_ce.accumulate(V, D)
        mm.matmul(hc, wl.t(), cfg=c_logits, precision=prec, out=z, prerounded=w_rounded)
        parts = {
            "logits": (lambda: mm.matmul(hc, wl.t(), cfg=c_logits, precision=prec, out=z, prerounded=w_rounded),
                       c_logits, 2 * chunk * V * D),
            "rows": (lambda: rows_k[(chunk,)](z, tc, loss, scale, num_warps=warps), None, 0),
            "dh": (lambda: mm.matmul(z, wd, cfg=c_dh, precision=prec, out=dh, prerounded=rounded + w_rounded), c_dh,
                   2 * chunk * V * D),
            "dw_first": (lambda: mm.matmul(z.t(), hc, cfg=c_dw, precision=prec, out=dw), c_dw, 2 * chunk * V * D),
            "dw_add": (lambda: mm.matmul_epilogue(z.t(), hc, ep, [dw], f32, cfg=c_add, precision=prec, outs=[dw]),
                       c_add, 2 * chunk * V * D),
            "cublas_logits": (lambda: torch.matmul(hc, w.t(), out=z), None, 2 * chunk * V * D),
            "cublas_dh": (lambda: torch.matmul(z, w, out=dh), None, 2 * chunk * V * D),
            "cublas_dw": (lambda: torch.matmul(z.t(), hc), None, 2 * chunk * V * D),
        }
        if not tf32:  # the row statistics from the logits' epilogue (linear_ce.ROW_STATS_FROM_LOGITS)
            s_cfg = linear_ce.stats_config(c_logits)
            n_t = -(-V // s_cfg.block_n)
            rm = torch.empty(chunk, n_t, device=dev, dtype=f32)
            rs = torch.empty(chunk, n_t, device=dev, dtype=f32)
            s_ep = mm.Epilogue(shape=(chunk, V), operands=(), body="e_z = e_tile.to(tl.bfloat16).to(tl.float32)",
                               stores=(("e_z", "f32", head),), out_shapes=((chunk, V),), row_stats="e_z",
                               row_stats_cols=s_cfg.block_n)  # fmt: skip
            s_src = linear_ce.linear_ce_source(V, -100, 0.0, False, ty, ty, block, stats_tiles=n_t)
            s_rows = load_kernel(s_src, "lce_rows_with_grad")[0]
            parts["logits_stats"] = (lambda: mm.matmul_epilogue(hc, wl.t(), s_ep, [], head, cfg=s_cfg, precision=prec,
                                                                outs=[z, rm, rs]), s_cfg, 2 * chunk * V * D)
            parts["rows_stats"] = (lambda: s_rows[(chunk,)](z, tc, rm, rs, loss, scale, num_warps=warps), None, 0)
        if rounded:
            parts["dh_copied"] = (lambda: mm.matmul(z, wd, cfg=c_dh, precision=prec, out=dh, prerounded=w_rounded),
                                  c_dh, 2 * chunk * V * D)
        if hoist:  # once a launch, not a chunk: the weight's two rounded copies
            parts["weight"] = (lambda: (mm.stage_tf32(w.unsqueeze(0), wl.unsqueeze(0)),
                                        mm.stage_tf32(w.t().unsqueeze(0), wd.t().unsqueeze(0))), None, 0)
        for s in [int(x) for x in o.dh_split.split(",")]:
            if s > 1:
                alt = LoweringConfig.from_dict({**c_dh.to_dict(), "split_k": s})
                parts[f"dh_split{s}"] = (lambda alt=alt: mm.matmul(z, wd, cfg=alt, precision=prec, out=dh,
                                                                   prerounded=rounded + w_rounded), alt, 2 * chunk * V * D)  # fmt: skip
        row = {"chunk": chunk, "parts": {}}
        for name, (fn, cfg, flops) in parts.items():
            try:
                fn()
                ms = time_graph(fn, o.launches, o.repeats)
                err = None
            except Exception as e:  # a schedule that does not compile or launch: recorded, not timed
                ms, err = None, f"{type(e).__name__}: {str(e)[:200]}"
            row["parts"][name] = {"ms": ms, "tflops": flops / ms / 1e9 if ms and flops else None,
                                  "config": describe(cfg) if cfg is not None else None, "error": err}  # fmt: skip
            print(f"chunk {chunk:5d} {name:15s} {('%.3f ms' % ms) if ms else err:>12} "
                  f"{('%.0f TF/s' % (flops / ms / 1e9)) if ms and flops else '':>10}  {describe(cfg) if cfg else ''}")
        p = row["parts"]
        n = -(-N // chunk)
        if all(p[k]["ms"] for k in ("logits", "rows", "dh", "dw_add", "dw_first")):
            row["step_ms"] = n * (p["logits"]["ms"] + p["rows"]["ms"] + p["dh"]["ms"] + p["dw_add"]["ms"]) + \
                p["dw_first"]["ms"] - p["dw_add"]["ms"] + (p["weight"]["ms"] if hoist else 0)
            row["cublas_step_ms"] = n * (p["cublas_logits"]["ms"] + p["rows"]["ms"] + p["cublas_dh"]["ms"] +
                                         p["cublas_dw"]["ms"])  # fmt: skip
            row["scratch_mib"] = (chunk * V * head.itemsize) / 2**20
            print(f"chunk {chunk:5d}: estimated LM head {row['step_ms']:.2f} ms a step ({n} chunks), with cuBLAS "
                  f"matmuls {row['cublas_step_ms']:.2f} ms; logits buffer {row['scratch_mib']:.0f} MiB")
            if p.get("logits_stats", {}).get("ms") and p.get("rows_stats", {}).get("ms"):
                row["stats_step_ms"] = row["step_ms"] + n * (p["logits_stats"]["ms"] + p["rows_stats"]["ms"]
                                                             - p["logits"]["ms"] - p["rows"]["ms"])  # fmt: skip
                print(f"chunk {chunk:5d}: with the row statistics from the logits' epilogue {row['stats_step_ms']:.2f} "
                      f"ms a step")
        result["chunks"].append(row)
        del z, dh, dw
        torch.cuda.empty_cache()
    if o.out:
        o.out.mkdir(parents=True, exist_ok=True)
        (o.out / f"lm_head_parts_{o.precision}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
