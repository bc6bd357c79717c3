"""Which compiled matmul kernels of the step shape files write the A registers of a
wgmma still in flight (``nova.codegen.triton.wgmma_check``), as configured on this GPU
and in variants of the configured tile (A staged too; two stages; four warps), one line
a launch. Needs a GPU (Triton compiles for the device present).

    python scripts/wgmma_census.py [--out DIR]"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

import step_matmuls as sm  # noqa: E402

from nova.codegen.triton import matmul as mm  # noqa: E402
from nova.codegen.triton import wgmma_check  # noqa: E402


def variants(cfg):
    yield "configured", cfg
    parts = cfg.instruction.split("+")
    if cfg.instruction.startswith("wgmma+tma") and "stage_b" in parts and "stage_a" not in parts:
        yield "stage_a too", dataclasses.replace(cfg, instruction=cfg.instruction.replace("stage_b", "stage_a+stage_b"))
    if cfg.num_stages > 2:
        yield "2 stages", dataclasses.replace(cfg, num_stages=2)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    o = p.parse_args(argv)
    spec = mm.device_spec(torch.device("cuda"))
    lines = []
    for r in sm.committed_launches():
        cfg = sm.configured(r["configure"], spec)
        what = f"{r['dtype']} {r['M']}x{r['N']}x{r['K']} {'/'.join(r['layouts'])} pre={r.get('prerounded', [])}"
        line = {"launch": what}
        for label, c in variants(cfg):
            try:
                ks = sm.precompile_launch(r, c)
                n = sum(len(wgmma_check.hazards(wgmma_check.sass_of(k.asm["cubin"]))) for k in ks)
                line[label] = f"{n} hazards ({c.block_m}x{c.block_n} w{c.num_warps} s{c.num_stages} sk{c.split_k} {c.instruction})"
            except Exception as e:  # noqa: BLE001 (reported)
                line[label] = f"error {type(e).__name__}: {str(e)[:120]}"
        print(json.dumps(line), flush=True)
        lines.append(line)
    if o.out:
        Path(o.out).mkdir(parents=True, exist_ok=True)
        (Path(o.out) / "wgmma_census.json").write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                                                     "lines": lines}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
