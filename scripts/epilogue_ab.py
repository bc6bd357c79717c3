#!/usr/bin/env python3
"""A/B of the fuse stage's matmul epilogues on one GPT-2 step, in one process: the
same model, optimizer and batches compiled with epilogues (as shipped) and without
(every matmul's elementwise consumers in their own kernels), timed step by step;
prints ms per step, launches and peak memory of each, and whether the two runs'
losses are bit-identical (they must be: the epilogue rounds as the unfused kernels).

    python scripts/epilogue_ab.py [--batch 32] [--precision bf16] [--steps 20]
    python scripts/epilogue_ab.py --tiny    # a 1-layer GPT, on the CPU through the interpreter

On the device: NOVA_COMMIT=<sha> bash scripts/gpu_check.sh ... runs the repository's
scripts with its environment; call this one the same way (python3 scripts/epilogue_ab.py)."""
from __future__ import annotations

import argparse
import copy
import os
import time

os.environ.setdefault("NOVA_STEP_CACHE", "0")  # the two compiles differ only in a monkeypatched rule

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import nova  # noqa: E402
from nova.models import GPT, GPTConfig, gpt2_124m  # noqa: E402
from nova.transforms import fuse as fz  # noqa: E402


def _run(model, batches, precision: str, epilogues: bool, steps: int):
    device = batches[0][0].device
    real = fz.epilogue_head
    if not epilogues:
        fz.epilogue_head = lambda op: False
    try:
        step = nova.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-4), precision=precision, backend="triton")
        losses = [step(*batches[0]).item()]  # compiles (and runs the first step eagerly)
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        out = [step(*batches[(i + 1) % len(batches)]) for i in range(steps)]
        if device.type == "cuda":
            torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3 / steps
        losses += [x.item() for x in out]
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
        launches = sum(not st.is_view for st in step._last.kernels.steps)
    finally:
        fz.epilogue_head = real
    return ms, peak, launches, losses


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    if args.tiny:
        cfg, T, batch, steps = GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=32), 8, 2, 2
    else:
        cfg, T, batch, steps = gpt2_124m(), 1024, args.batch, args.steps
    base = GPT(cfg).to(device)
    g = torch.Generator(device=device).manual_seed(1)
    batches = [(torch.randint(0, cfg.vocab_size, (batch, T), generator=g, device=device),
                torch.randint(0, cfg.vocab_size, (batch, T), generator=g, device=device)) for _ in range(4)]  # fmt: skip
    results = {}
    for name, on in (("without epilogues", False), ("with epilogues", True)):
        results[name] = _run(copy.deepcopy(base), batches, args.precision, on, steps)
        ms, peak, launches, _ = results[name]
        print(f"{name:18s}: {ms:8.2f} ms/step, {launches} launch steps, peak {peak:.2f} GiB", flush=True)
    same = results["with epilogues"][3] == results["without epilogues"][3]
    print(f"losses bit-identical over {steps + 1} steps: {same}")
    off, on = results["without epilogues"][0], results["with epilogues"][0]
    print(f"epilogues: {off - on:+.2f} ms/step ({(off - on) / off * 100:+.1f}%)")


if __name__ == "__main__":
    main()
