"""What the Analytic Configurator plans for every matmul launch of the GPT-2 124M
step (bench/gpt2_matmul_shapes.json), without a GPU:

    python bench/gpt2_matmul_plans.py [--batch 8,32] [--precisions bf16,tf32] [--json PATH]

Per distinct launch: the config (``plan_matmul`` with the configure stage's
arguments), the kernel the template runs on the step's operands (TMA or pointer
loads, split count, staged operands, and whether a tf32 B tile reaches wgmma
N-major, i.e. through registers), tiles / waves / wave efficiency, the roofline
time max(FLOP / P, bytes / BW) (plus the split-K partials' traffic and the extra
launches the kernel makes), and, for the nearest shape of the 64-shape grid
(each dim rounded to the nearest of 128 / 512 / 2048 / 8192 in log scale),
what bench/results/matmul.json measured there: Nova/best and the searched best
config. Per step: the sum of count x roofline time. The markdown goes to
docs/configurator.md's "GPT-2 step shapes" section.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for p in (str(REPO), str(REPO / "bench")):
    if p not in sys.path:
        sys.path.insert(0, p)

import step_matmuls as sm  # noqa: E402

GRID = (128, 512, 2048, 8192)
GRID_JSON = REPO / "bench" / "results" / "matmul.json"


def nearest(x: int) -> int:
    return min(GRID, key=lambda g: abs(math.log2(g) - math.log2(x)))


def kernel(cfg, launch) -> dict:
    """The variant the launcher takes (matmul._run's decisions) on the step's operands."""
    import torch

    from nova.codegen.triton import matmul as mm

    dtype = getattr(torch, launch["dtype"])
    a, b = sm.strided(launch["a"], dtype, "meta"), sm.strided(launch["b"], dtype, "meta")
    a3, b3 = a[None], b[None]
    tokens = cfg.instruction.split("+")
    staged = [x for x in ("a", "b") if f"stage_{x}" in tokens]
    if "a" in staged:
        a3 = torch.empty(a3.shape, dtype=dtype, device="meta")
    if "b" in staged:
        b3 = torch.empty((1, b3.shape[2], b3.shape[1]), dtype=dtype, device="meta").transpose(1, 2)
    tma = mm._tma_plan(cfg, a3, b3)
    # tf32 wgmma reads K-major shared memory only: a B tile whose N is contiguous goes through registers
    b_nmajor = dtype == torch.float32 and (tma[0].b == "row" if tma else b3.stride(2) == 1)
    return {"tma": tma is not None, "splits": mm.split_k_plan(launch["K"], cfg)[1], "staged": staged,
            "b_through_registers": b_nmajor}


def plan(launch, device):
    from nova.schedule import configurator as cf

    args = launch["configure"]
    return cf.plan_matmul(args["M"], args["N"], args["K"], args["batch"], args["dtype"], args["dtype"],
                          args["out_dtype"], args["precision"], args["a_layout"], args["b_layout"],
                          args["has_bias"], device)  # fmt: skip


def roofline_s(p, launch, cfg, k, device) -> float:
    from nova.schedule.configurator import LAUNCH_SECONDS

    bw, peak = device.mem_bandwidth, device.flops(p.path)
    nbytes = p.bytes
    launches = 1
    if k["splits"] > 1:  # fp32 partials written and read back, one more kernel
        nbytes += 8 * launch["M"] * launch["N"] * launch["batch"] * k["splits"]
        launches += 1
    for x, n in (("a", launch["M"] * launch["K"]), ("b", launch["K"] * launch["N"])):
        if x in k["staged"]:  # read and written by the staging copy, then read by TMA
            nbytes += 2 * 4 * n
            launches += 1
    return max(p.flops / peak, nbytes / bw) + (launches - 1) * LAUNCH_SECONDS


def wave_model_s(p, launch, cfg, device) -> float:
    """The configurator's step-5 model of the kernel: ceil(items / S) waves of one
    tile's K / splits at an SM's share of the peak, plus the fp32 partials and the
    reduction's launch when split (docs/configurator.md, step 5)."""
    from nova.codegen.triton import matmul as mm
    from nova.schedule.configurator import LAUNCH_SECONDS

    S = device.sm_count
    splits = mm.split_k_plan(launch["K"], cfg)[1]
    tau = 2 * cfg.block_m * cfg.block_n * launch["K"] / (device.flops(p.path) / S)
    t = math.ceil(p.tiles * splits / S) * tau / splits
    if splits > 1:
        t += 8 * launch["M"] * launch["N"] * launch["batch"] * splits / device.mem_bandwidth + LAUNCH_SECONDS
    return t


def grid_rows():
    if not GRID_JSON.exists():
        return {}
    doc = json.loads(GRID_JSON.read_text())
    return {(r["precision"], r["M"], r["N"], r["K"]): r for r in doc["shapes"]}


def _describe(cfg_dict) -> str:
    from nova.schedule.config import LoweringConfig

    cfg = LoweringConfig.from_dict(cfg_dict)
    text = f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages} g{cfg.group_m}"
    text += f" sk{cfg.split_k}" if cfg.split_k > 1 else ""
    tokens = cfg.instruction.split("+")
    return text + (" tma" if "tma" in tokens else "") + "".join(f" {t}" for t in ("stage_a", "stage_b") if t in tokens)


def rows_for(steps, device):
    grid = grid_rows()
    seen, rows = {}, []
    for s in steps:
        for launch in s["shapes"]:
            key = sm.signature(launch)
            if key in seen:
                seen[key]["uses"].append((s["precision"], s["batch"], launch["source"], launch["count"]))
                continue
            p = plan(launch, device)
            cfg = p.config
            k = kernel(cfg, launch)
            bench_p = "tf32" if launch["dtype"] == "float32" else "bf16"
            g = grid.get((bench_p, nearest(launch["M"]), nearest(launch["N"]), nearest(launch["K"])))
            row = {
                "source": launch["source"].removeprefix("nova."), "M": launch["M"], "N": launch["N"], "K": launch["K"],
                "dtype": launch["dtype"], "out": launch["out_dtype"], "layouts": "/".join(launch["layouts"]),
                "configure_layouts": f"{launch['configure']['a_layout']}/{launch['configure']['b_layout']}",
                "config": _describe(cfg.to_dict()), "kernel": k, "tiles": p.tiles, "items": p.work_items,
                "waves": p.waves, "wave_eff": p.wave_efficiency, "regime": cfg.regime,
                "ai": p.ai_flop_per_byte, "ridge": p.ridge, "roofline_us": roofline_s(p, launch, cfg, k, device) * 1e6,
                "wave_model_us": wave_model_s(p, launch, cfg, device) * 1e6,
                "ideal_us": max(p.flops / device.flops(p.path), p.bytes / device.mem_bandwidth) * 1e6,
                "grid": None if g is None else {
                    "shape": f"{g['M']}x{g['N']}x{g['K']}", "nova_vs_best": g["nova_vs_best"],
                    "nova_vs_cublas": g["nova_vs_cublas"], "nova": _describe(g["nova"]["config"]),
                    "best": _describe(g["search"]["best"]["config"]) if g["search"]["best"] else None},
                "uses": [(s["precision"], s["batch"], launch["source"], launch["count"])],
            }  # fmt: skip
            seen[key] = row
            rows.append(row)
    totals = []
    for s in steps:
        t = sum(r["roofline_us"] * c for r in rows for (p, b, _, c) in r["uses"] if (p, b) == (s["precision"], s["batch"]))
        ideal = sum(r["ideal_us"] * c for r in rows for (p, b, _, c) in r["uses"] if (p, b) == (s["precision"], s["batch"]))
        wave = sum(r["wave_model_us"] * c for r in rows for (p, b, _, c) in r["uses"] if (p, b) == (s["precision"], s["batch"]))
        totals.append({"precision": s["precision"], "batch": s["batch"], "launches": s["launches"],
                       "roofline_ms": t / 1e3, "wave_model_ms": wave / 1e3, "ideal_ms": ideal / 1e3})
    return rows, totals


def markdown(rows, totals) -> str:
    out = ["| prec | launch | M x N x K | layouts step (configure) | config | kernel | tiles / waves / eff "
           "| AI / ridge | roofline us | wave model us | grid shape: Nova/best, best config | count per step |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        k = r["kernel"]
        kern = ("tma" if k["tma"] else "pointer") + (f" sk{k['splits']}" if k["splits"] > 1 else "")
        kern += "".join(f" stage_{x}" for x in k["staged"]) + (" B via registers" if k["b_through_registers"] else "")
        g = r["grid"]
        gtext = "-" if g is None else f"{g['shape']}: {g['nova_vs_best']:.2f}, {g['best']}"
        uses = ", ".join(f"b{b} x{c}" + (" (bwd)" if "backward:logits" in src else "") for _, b, src, c in r["uses"])
        out.append(
            f"| {'tf32' if r['dtype'] == 'float32' else 'bf16'} | {r['source']} | {r['M']}x{r['N']}x{r['K']} "
            f"| {r['layouts']} ({r['configure_layouts']}) | {r['config']} | {kern} "
            f"| {r['tiles']} / {r['waves']:.2f} / {r['wave_eff']:.2f} | {r['ai']:.0f} / {r['ridge']:.0f} "
            f"| {r['roofline_us']:.1f} | {r['wave_model_us']:.1f} | {gtext} | {uses} |"
        )
    out += ["", "| step | launches | ideal (compulsory bytes, peak FLOP/s), ms | roofline of the configured kernels, ms "
            "| wave model, ms |", "|---|---|---|---|---|"]
    for t in totals:
        out.append(f"| {t['precision']} b{t['batch']} | {t['launches']} | {t['ideal_ms']:.2f} | {t['roofline_ms']:.2f} "
                   f"| {t['wave_model_ms']:.2f} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    from nova.schedule.devices import DEVICES

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", default="8,32")
    ap.add_argument("--precisions", default="bf16,tf32")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    opts = ap.parse_args(argv)
    doc = json.loads(sm.SHAPES_JSON.read_text())
    batches = {int(b) for b in opts.batch.split(",")}
    steps = [s for s in doc["steps"] if s["batch"] in batches and s["precision"] in opts.precisions.split(",")]
    rows, totals = rows_for(steps, DEVICES["H200"])
    print(markdown(rows, totals))
    if opts.json:
        opts.json.write_text(json.dumps({"rows": rows, "totals": totals}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
