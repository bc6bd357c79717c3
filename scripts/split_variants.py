"""Split-K against no split and other tiles on a step's long-K matmuls (the weight
gradients, K = tokens), beside cuBLAS: an experiment before a change to the
configurator's step 5 (docs/configurator.md).

    python scripts/split_variants.py --shapes-file bench/gpt2_matmul_shapes.json --precision bf16 \
        --batch 32 [--min-k 8192] --tile grid:128x128x64:s4:w8:k1 [--tile ...] [--out DIR]

Every distinct launch of the step (its operand views and config, as ``nova bench matmul``
times them: bench/matmul.py's StepShapeBench, CUDA-graph timed, random data) whose K is at
least ``--min-k``: ``cublas``, ``nova`` (the step's config) and each ``--tile
KIND:BMxBNxBK:sS:wW[:kSPLIT]`` (KIND ``grid``: one program a work item; ``pers``: the
persistent loop), the step's instruction otherwise. Each variant's C is checked against the
float64 product (``<name>_err``: max relative error, as ``nova bench matmul`` reports it).
Writes ``split_variants.json`` to ``--out``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
for p in (REPO, REPO / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))


def parse_tile(text: str, cfg):
    """``KIND:BMxBNxBK:sS:wW[:kSPLIT]`` -> ``cfg`` with that tile, ring, warps, split."""
    kind, tile, stages, warps, *rest = text.split(":")
    split = rest[0] if rest else "k1"
    if (kind not in ("pers", "grid") or not stages.startswith("s") or not warps.startswith("w")
            or not split.startswith("k") or len(rest) > 1):  # fmt: skip
        raise SystemExit(f"--tile {text}: expected pers|grid:BMxBNxBK:sS:wW[:kSPLIT]")
    bm, bn, bk = (int(x) for x in tile.split("x"))
    return dataclasses.replace(cfg, block_m=bm, block_n=bn, block_k=bk, num_stages=int(stages[1:]),
                               num_warps=int(warps[1:]), persistent=kind == "pers", split_k=int(split[1:]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes-file", type=Path, required=True)
    ap.add_argument("--precision", default="bf16", choices=("bf16", "tf32"))
    ap.add_argument("--batch", type=int, default=None, help="the step of this batch (default: every step)")
    ap.add_argument("--min-k", type=int, default=8192)
    ap.add_argument("--tile", action="append", default=[], metavar="pers|grid:BMxBNxBK:sS:wW[:kSPLIT]")
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--dry-run", action="store_true", help="on the CPU through Triton's interpreter (checks the "
                    "script; its numbers mean nothing)")
    opts = ap.parse_args()
    import matmul as bm  # bench/matmul.py
    from nova.schedule.config import LoweringConfig

    device = torch.device("cpu" if opts.dry_run else "cuda")
    timer = bm.WallTimer() if opts.dry_run else bm.GpuTimer()
    doc = {"device": "cpu (dry run)" if opts.dry_run else torch.cuda.get_device_name(), "torch": torch.__version__,
           "precision": opts.precision, "tiles": opts.tile, "steps": []}  # fmt: skip
    model = json.loads(opts.shapes_file.read_text())
    for step in model["steps"]:
        if step["precision"] != opts.precision or (opts.batch is not None and step["batch"] != opts.batch):
            continue
        rows = []
        for launch in step["shapes"]:
            if launch["K"] < opts.min_k:
                continue
            sb = bm.StepShapeBench(launch, opts.precision, device, timer)
            cfg = LoweringConfig.from_dict(launch["config"])
            row = {k: launch[k] for k in ("source", "M", "N", "K", "batch", "layouts", "count")}
            row["config"] = bm.describe(cfg)
            variants = {"cublas": sb.cublas_launcher(), "nova": sb.nova_launcher(cfg)}
            variants.update({t: sb.nova_launcher(parse_tile(t, cfg)) for t in opts.tile})
            with bm._cublas_precision(opts.precision):
                for name, fn in variants.items():
                    try:
                        row[name] = round(sb.time(fn, final=True), 5)
                        fn(0)
                        ref = sb.ref
                        row[name + "_err"] = float(((sb.C[0].double() - ref).abs().max() / ref.abs().max()).item())
                    except Exception as e:  # recorded: a variant the template rejects here
                        row[name], row[name + "_error"] = None, f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(row)
            print(bm.variant_line(model["model"], step["batch"], row, variants, 30), flush=True)
            del sb
            if device.type == "cuda":
                torch.cuda.empty_cache()
        doc["steps"].append({"model": model["model"], "batch": step["batch"], "launches": rows})
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / "split_variants.json").write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
