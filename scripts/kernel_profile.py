"""Where the GPU time of one GPT-2 training step goes, kernel by kernel, for Nova
and torch.compile side by side (torch.profiler, CUDA activity only):
``python scripts/kernel_profile.py [--model 124m|355m|mlp46m] [--precision bf16|tf32] [--batch 8]
[--steps 3] [--out DIR]`` (mlp46m: the Nova paper's MLP LM, bench/gpt2.py's).
Prints the kernels grouped by name (total ms per step, launches per step) and
writes ``kernel_profile_<model>[_tf32]_b<batch>.json`` to ``--out``. Nova runs its launch list
(no CUDA graph) so that every kernel is its own profiler event."""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import nova
from nova.models import GPT, GPTConfig, MLPLM, MLPLMConfig

PRESETS = {"124m": (12, 12, 768), "355m": (24, 16, 1024), "mlp46m": (6, 0, 384)}  # layers, heads, width (bench/gpt2.py's)


def _family(name: str) -> str:
    """A kernel's name without its shape suffix: nova_reduce_sum_8x1024x768_d0_1_f32 -> nova_reduce_sum."""
    return re.sub(r"(_\d+(x\d+)*)(_.*)?$", "", name)[:60]


def _kernels(run, steps: int) -> tuple[dict, float]:
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run()
        torch.cuda.synchronize()
    by_name: dict = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by_name[e.name][0] += e.device_time / 1e3 / steps  # ms per step
            by_name[e.name][1] += 1 / steps
    total = sum(v[0] for v in by_name.values())
    return {k: {"ms": round(v[0], 4), "launches": round(v[1], 2)} for k, v in by_name.items()}, total


def model_config(name: str):
    """The GPTConfig (or the 46M MLP LM's MLPLMConfig) of a preset."""
    n_layer, n_head, n_embd = PRESETS[name]
    if name == "mlp46m":
        return MLPLMConfig(vocab_size=50304, block_size=1024, n_layer=n_layer, n_embd=n_embd)
    return GPTConfig(vocab_size=50304, block_size=1024, n_layer=n_layer, n_head=n_head, n_embd=n_embd)


def step_runner(engine: str, cfg, precision: str, x, y, cuda_graph: bool):
    """(model, optimizer, run): one training step of ``engine`` ("nova" or "torch.compile",
    autocast under bf16, the global tf32 flags under tf32 as bench/gpt2.py sets them) on a
    fresh CUDA model of ``cfg`` with fused AdamW."""
    with torch.device("cuda"):
        model = MLPLM(cfg) if isinstance(cfg, MLPLMConfig) else GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tf32 = precision == "tf32"
    # tf32: the global flags for torch.compile, off for Nova (its argument)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32 and engine != "nova"
    if engine == "nova":
        step = nova.compile(model, opt, precision=precision, cuda_graph=cuda_graph)

        def run():
            step(x, y)
    else:
        fwd = torch.compile(model)

        def run():
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=not tf32):
                loss = fwd(x, y)
            loss.backward()
            opt.step()

    return model, opt, run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--model", choices=sorted(PRESETS), default="124m")
    ap.add_argument("--precision", choices=["bf16", "tf32"], default="bf16")
    opts = ap.parse_args()
    torch.manual_seed(0)
    cfg = model_config(opts.model)
    tf32 = opts.precision == "tf32"
    x = torch.randint(0, 50304, (opts.batch, 1024), device="cuda")
    y = torch.randint(0, 50304, (opts.batch, 1024), device="cuda")
    doc = {"model": opts.model, "precision": opts.precision, "batch": opts.batch, "device": torch.cuda.get_device_name(), "engines": {}}
    for engine in ("nova", "torch.compile"):
        model, opt, run = step_runner(engine, cfg, opts.precision, x, y, cuda_graph=False)
        kernels, total = _kernels(run, opts.steps)
        families: dict = defaultdict(lambda: [0.0, 0.0])
        for k, v in kernels.items():
            families[_family(k)][0] += v["ms"]
            families[_family(k)][1] += v["launches"]
        doc["engines"][engine] = {"total_ms": round(total, 3), "kernels": kernels,
                                  "families": {k: {"ms": round(a, 3), "launches": round(b, 1)} for k, (a, b) in families.items()}}
        print(f"== {engine}: {total:.2f} ms of kernels per step, {sum(v['launches'] for v in kernels.values()):.0f} launches")
        for k, (ms, n) in sorted(families.items(), key=lambda kv: -kv[1][0])[:25]:
            print(f"  family {ms:9.3f} ms {n:7.1f}x  {k}")
        for k, v in sorted(kernels.items(), key=lambda kv: -kv[1]["ms"])[: opts.top]:
            print(f"  {v['ms']:9.3f} ms {v['launches']:6.1f}x  {k[:110]}")
        del model, opt, run
        torch.cuda.empty_cache()
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / f"kernel_profile_{opts.model}{'_tf32' if tf32 else ''}_b{opts.batch}.json").write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
