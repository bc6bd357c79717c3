"""What the tf32 matmuls of a step cost beside cuBLAS, and what rounding costs them:
``python scripts/tf32_variants.py --shapes-file F [--shapes-file G] [--out DIR]``
(F from ``python bench/step_matmuls.py --model mlp46m --batch 8 --precisions tf32 --out F``).

For every distinct tf32 launch of the step (the step's operand views, its config),
CUDA-graph timed as ``nova bench matmul`` times (bench/matmul.py's StepShapeBench):

* ``cublas``: torch on the same views under TF32;
* ``nova``: the step's kernel as it runs (tf32-rn: each operand rounded to nearest
  tf32 in the kernel, or staged through the rounding copy, as the config says);
* ``pre_a``: the same config with A already rounded (``prerounded=("a",)``, in the
  step's layout; in the runs up to 2db2bbf the rounded copies were contiguous, so an
  M-major A or N-major B was timed K-major in these rows): what a
  producer writing its output rounded would leave the matmul to do;
* ``pre_ab``: both operands already rounded (a K-major B read in place, no staging);
* ``trunc``: the config without staging, the tensor core truncating (precision
  "tf32"): the kernel with no rounding at all, an upper bound of the template;
* ``--tile KIND:BMxBNxBK:sS:wW`` (repeatable; KIND ``pers`` for the persistent
  flattened loop, ``grid`` for one program a tile): that schedule on both operands
  already rounded (as ``pre_ab``), its C bit for bit ``pre_ab``'s or not recorded
  (``<name>_same_bits``: the same BLOCK_K adds the same products in the same order);
  ``--only PREFIX`` keeps the launches whose source starts with it.

Also a probe of cuBLAS's own rounding: A = 1 + 0.75 ulp(tf32), B = ones, so that each
product is 1 + 2^-10 when the operand is rounded to nearest and 1 when truncated.
Writes ``tf32_variants.json`` to ``--out``: per launch the times, and per step the
totals (time x count)."""

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

VARIANTS = ("cublas", "nova", "pre_a", "pre_ab", "trunc")


def rounding_probe(device) -> dict:
    """cuBLAS's products of 1 + 0.75 * 2^-10 and 1 (K of them): K (1 + 2^-10) if it rounds
    A to nearest tf32, K if it truncates."""
    K = 256
    a = torch.full((128, K), 1 + 0.75 * 2.0**-10, device=device)
    b = torch.ones((K, 128), device=device)
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        c = (a @ b)[0, 0].item()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    return {"K": K, "cublas": c, "if_rounded": K * (1 + 2.0**-10), "if_truncated": float(K),
            "cublas_rounds": abs(c - K * (1 + 2.0**-10)) < abs(c - K)}


def parse_tile(text: str, cfg):
    """``KIND:BMxBNxBK:sS:wW[:kSPLIT][:b]`` -> (name, config): ``cfg`` on the staged TMA path
    (both operands K-major in shared memory: a prerounded K-major one is read in place, an
    M- or N-major one copied by the staging pass; ``:b``: B alone, A rounded in registers),
    with that tile, ring, warps and split (default 1), persistent for KIND ``pers``
    (split_variants.parse_tile reads the rest)."""
    from split_variants import parse_tile as tile_of  # scripts/split_variants.py

    b_only = text.endswith(":b")  # B alone staged: A rounded in registers (an M-major A, the step's dw)
    c = tile_of(text[:-2] if b_only else text, cfg)
    return text, dataclasses.replace(c, instruction="wgmma+tma+stage_b" if b_only else "wgmma+tma+stage_a+stage_b")


def rounded_like(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to nearest tf32 in a tensor of ``t``'s own strides (the step's layout:
    an M-major A stays M-major, so a launch takes it as the step's launch would)."""
    from nova.codegen.triton.matmul import round_to_tf32

    out = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device)
    return out.copy_(round_to_tf32(t))


def variant_launchers(sb, cfg, tiles=()):
    """{variant: launch(i)} over sb's input sets (the rounded copies made once, outside the timing)."""
    from nova.codegen.triton.matmul import matmul

    ra = [rounded_like(a) for a in sb.A]
    rb = [rounded_like(b) for b in sb.B]
    bias = sb.bias
    plain = dataclasses.replace(cfg, instruction="+".join(t for t in cfg.instruction.split("+") if not t.startswith("stage")))

    def run(A, B, c, prec, pre):
        return lambda i: matmul(A[i], B[i], bias=bias[i] if bias else None, cfg=c, precision=prec, out=sb.C[i],
                                prerounded=pre)

    out = {
        "cublas": sb.cublas_launcher(),
        "nova": run(sb.A, sb.B, cfg, "tf32-rn", ()),
        "pre_a": run(ra, sb.B, cfg, "tf32-rn", ("a",)),
        "pre_ab": run(ra, rb, cfg, "tf32-rn", ("a", "b")),
        "trunc": run(sb.A, sb.B, plain, "tf32", ()),
    }
    for text in tiles:
        name, c = parse_tile(text, cfg)
        out[name] = run(ra, rb, c, "tf32-rn", ("a", "b"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes-file", type=Path, action="append", required=True)
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--tile", action="append", default=[], metavar="pers|grid:BMxBNxBK:sS:wW[:kSPLIT][:b]")
    ap.add_argument("--only", default="", metavar="PREFIX", help="the launches whose source starts with PREFIX")
    ap.add_argument("--dry-run", action="store_true", help="on the CPU through Triton's interpreter (wall clock: "
                    "checks the script, its numbers mean nothing)")
    opts = ap.parse_args()
    import matmul as bm  # bench/matmul.py
    from nova.schedule.config import LoweringConfig

    device = torch.device("cpu" if opts.dry_run else "cuda")
    timer = bm.WallTimer() if opts.dry_run else bm.GpuTimer()
    doc = {"device": "cpu (dry run)" if opts.dry_run else torch.cuda.get_device_name(), "torch": torch.__version__, "probe": rounding_probe(device),
           "steps": []}
    print("cuBLAS rounding probe:", doc["probe"], flush=True)
    for path in opts.shapes_file:
        model = json.loads(path.read_text())
        for step in model["steps"]:
            if step["precision"] != "tf32":
                continue
            names = (*VARIANTS, *opts.tile)
            rows, totals = [], dict.fromkeys(names, 0.0)
            for launch in step["shapes"]:
                if not launch["source"].startswith(opts.only):
                    continue
                sb = bm.StepShapeBench(launch, "tf32", device, timer)
                cfg = LoweringConfig.from_dict(launch["config"])
                row = {k: launch[k] for k in ("source", "M", "N", "K", "batch", "layouts", "count")}
                row["config"] = bm.describe(cfg)
                with bm._cublas_precision("tf32"):
                    for name, launch_fn in variant_launchers(sb, cfg, opts.tile).items():
                        try:
                            ms = sb.time(launch_fn, final=True)
                            if name in opts.tile:  # its C against pre_ab's (both on the first input set)
                                launch_fn(0)
                                mine = sb.C[0].clone()
                                variant_launchers(sb, cfg)["pre_ab"](0)
                                row[name + "_same_bits"] = bool(torch.equal(mine, sb.C[0]))
                        except Exception as e:  # recorded: a variant the template rejects here
                            row[name], row[name + "_error"] = None, f"{type(e).__name__}: {str(e)[:200]}"
                            continue
                        row[name] = round(ms, 5)
                        totals[name] += ms * launch["count"]
                rows.append(row)
                print(bm.variant_line(model["model"], step["batch"], row, names), flush=True)
                del sb
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            doc["steps"].append({"model": model["model"], "batch": step["batch"], "launches": rows,
                                 "totals_ms": {k: round(v, 4) for k, v in totals.items()}})
            print(f"== {model['model']} tf32 b{step['batch']} per step (ms):",
                  {k: round(v, 3) for k, v in totals.items()}, flush=True)
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / "tf32_variants.json").write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
