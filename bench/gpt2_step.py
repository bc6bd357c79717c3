"""GPT-2 124M training steps on the GPU: Nova's Triton backend against eager PyTorch.

    python bench/gpt2_step.py --precision fp32 --steps 20 --out bench/results

Both start from the same weights and see the same random batches; the script
records each step's loss from both, the relative difference, compile time and
step times (CUDA events, warm-up excluded), and writes JSON to --out.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import time
from pathlib import Path

import torch

import nova
from nova.models import GPT, gpt2_124m


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--precision", default="fp32", choices=["fp32", "tf32", "bf16"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()

    torch.manual_seed(0)
    cfg = gpt2_124m(n_layer=args.layers, block_size=args.seq)
    ref = GPT(cfg).cuda()
    mine = copy.deepcopy(ref)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=6e-4, weight_decay=0.1)
    opt = torch.optim.AdamW(mine.parameters(), lr=6e-4, weight_decay=0.1)
    step = nova.compile(mine, opt, precision=args.precision, backend="triton")
    torch.backends.cuda.matmul.allow_tf32 = args.precision == "tf32"
    g = torch.Generator(device="cuda").manual_seed(1)
    rows = []
    t_compile = None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for i in range(args.steps):
        x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device="cuda", generator=g)
        y = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device="cuda", generator=g)
        t0 = time.perf_counter()
        start.record()
        loss = step(x, y)
        end.record()
        torch.cuda.synchronize()
        if i == 0:
            t_compile = time.perf_counter() - t0
        nova_ms = start.elapsed_time(end)
        start.record()
        opt_ref.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            ref_loss = ref(x, y)
        ref_loss.backward()
        opt_ref.step()
        end.record()
        torch.cuda.synchronize()
        eager_ms = start.elapsed_time(end)
        rel = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
        rows.append({"step": i, "nova_loss": loss.item(), "eager_loss": ref_loss.item(), "rel_diff": rel,
                     "nova_ms": nova_ms, "eager_ms": eager_ms})  # fmt: skip
        print(f"step {i:2d} nova {loss.item():.6f} eager {ref_loss.item():.6f} rel {rel:.2e} "
              f"nova {nova_ms:.1f} ms eager {eager_ms:.1f} ms", flush=True)  # fmt: skip
    timed = rows[3:] if len(rows) > 3 else rows
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "commit": os.environ.get("NOVA_COMMIT")
        or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "model": f"GPT-2 124M ({args.layers} layers), B={args.batch}, T={args.seq}",
        "precision": args.precision,
        "compile_and_first_step_s": t_compile,
        "max_rel_loss_diff": max(r["rel_diff"] for r in rows),
        "median_step_ms": {"nova": med([r["nova_ms"] for r in timed]), "eager": med([r["eager_ms"] for r in timed])},
        "num_kernels": len(step.kernel_sources()),
        "steps": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"gpt2_step_{args.precision}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "steps"}, indent=1))


if __name__ == "__main__":
    main()
