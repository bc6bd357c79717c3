"""The tf32_operands stage on and off in the 46M MLP LM's tf32 step, launch by launch:
``python scripts/tf32_stage_ab.py [--batch 8] [--out DIR]`` (CUDA). Compiles the step
without and with the stage (taken out of ``pipeline.STAGES``; after a first, cold,
profile that is not kept), times every
launch with ``step.profile()`` and prints the launches whose time moved most, with
their op, shape and config. Writes ``tf32_stage_ab.json``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import nova
from nova import pipeline
from nova.models import MLPLM, MLPLMConfig


def profile(with_stage: bool, batch: int) -> list[dict]:
    saved = list(pipeline.STAGES)
    try:
        if not with_stage:
            pipeline.STAGES[:] = [s for s in saved if s[0] != "tf32_operands"]
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = MLPLM(MLPLMConfig(vocab_size=50304, block_size=1024, n_layer=6, n_embd=384))
        step = nova.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True), precision="tf32")
        x = torch.randint(0, 50304, (batch, 1024), device="cuda")
        step(x, x.roll(1, 1))
        m = step.profile(x, x.roll(1, 1), repeat=5)
    finally:
        pipeline.STAGES[:] = saved
    return [{"op": k.op, "shape": k.shape, "config": k.config, "ms": s * 1e3} for k, s in zip(m.kernels, m.measured_s)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--out", type=Path, default=Path("."))
    opts = ap.parse_args()
    profile(True, opts.batch)  # a first profile of the process runs cold (every launch slower): not kept
    off, on = profile(False, opts.batch), profile(True, opts.batch)
    print(f"launches {len(on)} with the stage, {len(off)} without; total {sum(r['ms'] for r in on):.3f} / "
          f"{sum(r['ms'] for r in off):.3f} ms")
    pairs = list(zip(on, off)) if len(on) == len(off) else []
    for a, b in sorted(pairs, key=lambda p: -abs(p[0]["ms"] - p[1]["ms"]))[:25]:
        print(f"{a['ms']:8.4f} {b['ms']:8.4f}  {a['op'][:24]:24s} {a['shape'][:34]:34s} {a['config'][:60]}"
              + ("" if a["config"] == b["config"] else f"  | off: {b['config'][:60]}"))
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / "tf32_stage_ab.json").write_text(json.dumps({"with": on, "without": off}, indent=1))


if __name__ == "__main__":
    main()
