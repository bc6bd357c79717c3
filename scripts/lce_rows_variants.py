#!/usr/bin/env python3
"""The fused LM head's row kernel (``lce_rows_with_grad``: a chunk row's log-sum-exp,
its loss, and d over its logits in place) in its variants, timed alone on one chunk
of random logits (an experiment, evidence for ``linear_ce.GRAD_PASS_REVERSED`` and
``linear_ce.KEEP_ROWS_IN_L2``):

  base       the lowering's kernel as it is
  reversed   the gradient pass walks the row's blocks last to first
  evict      evict_last loads in the first pass, evict_first in the second
  both       the two together
each at 8 and 16 warps (lane-wise sums and software-pipelined row loops were variants
here too, measured slower and removed: bench/results/runs/lce_rows_variants_bf16_459b619.json). The kernel reads a row twice; at GPT-2's vocabulary a bf16 row
is 100 KB and the rows in flight exceed the L2, so the ideal (one DRAM read, one
write of the chunk) is printed beside each time as GB/s over 2 x the chunk's bytes.
Every variant's loss and d are compared with the base's, bit for bit (and by relative
difference, should a variant change the order of the sums).
CUDA-graph timed (``bench.timing.time_graph``, median replay).

    python scripts/lce_rows_variants.py [--chunk 4096] [--vocab 50304] [--dtypes bf16,f32] [--out DIR]
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
from nova.codegen.triton.rowwise import LOOP_BLOCK, next_pow2  # noqa: E402
from nova.codegen.triton.source import load_kernel  # noqa: E402

def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits, as integers of its width (so that NaNs and signed zeros compare)."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


VARIANTS = {"base": {}, "reversed": {"grad_reversed": True, "keep_rows": False},
            "evict": {"grad_reversed": False, "keep_rows": True}, "both": {"grad_reversed": True, "keep_rows": True}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--dtypes", default="bf16,f32")
    ap.add_argument("--warps", default="8,16")
    ap.add_argument("--launches", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of " + " ".join(VARIANTS))
    o = ap.parse_args()
    unknown = [v for v in o.variants.split(",") if v not in VARIANTS]
    if unknown or o.variants.split(",")[0] != "base":
        raise SystemExit(f"lce_rows_variants: variants must start with base and be among {', '.join(VARIANTS)}")
    dev = torch.device("cuda")
    V, C = o.vocab, o.chunk
    g = torch.Generator(device=dev).manual_seed(0)
    block = min(LOOP_BLOCK, next_pow2(V))
    result = {"chunk": C, "vocab": V, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "commit": os.environ.get("NOVA_COMMIT"), "defaults": {"GRAD_PASS_REVERSED": linear_ce.GRAD_PASS_REVERSED,
              "KEEP_ROWS_IN_L2": linear_ce.KEEP_ROWS_IN_L2}, "rows": []}  # fmt: skip
    for dname in o.dtypes.split(","):
        dtype = {"bf16": torch.bfloat16, "f32": torch.float32}[dname]
        ty = {"bf16": "tl.bfloat16", "f32": "tl.float32"}[dname]
        z0 = (torch.randn(C, V, device=dev, generator=g) * 3).to(dtype)
        t = torch.randint(0, V, (C,), device=dev, generator=g)
        scale = torch.full((1,), 1.0 / C, device=dev)
        ideal = 2 * z0.numel() * z0.element_size()
        want = None
        for vname in o.variants.split(","):
            src = linear_ce.linear_ce_source(V, -100, 0.0, False, ty, ty, block, **VARIANTS[vname])
            k = load_kernel(src, "lce_rows_with_grad")[0]
            for warps in [int(w) for w in o.warps.split(",")]:
                z, loss = z0.clone(), torch.empty(C, device=dev)
                k[(C,)](z, t, loss, scale, num_warps=warps)
                got = (loss.clone(), z.clone())
                if want is None:
                    want = got
                same = all(torch.equal(_bits(a), _bits(b)) for a, b in zip(got, want))
                # a variant that changes the sums' order: how far from the base (relative, f32)
                err = max(((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(got, want))
                ms = time_graph(lambda: k[(C,)](z, t, loss, scale, num_warps=warps), o.launches, o.repeats)
                row = {"dtype": dname, "variant": vname, "warps": warps, "ms": ms, "gbps_of_ideal": ideal / ms / 1e6,
                       "same_bits_as_base": same, "rel_diff_from_base": err}  # fmt: skip
                result["rows"].append(row)
                print(f"{dname:5s} {vname:9s} w{warps:<3d} {ms:7.4f} ms  {ideal / ms / 1e6:6.0f} GB/s of 2x chunk  "
                      f"{'same bits' if same else f'other bits, rel diff {err:.1e}'}", flush=True)
        del z0
    if o.out:
        o.out.mkdir(parents=True, exist_ok=True)
        (o.out / "lce_rows_variants.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
