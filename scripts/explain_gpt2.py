"""``step.explain()`` of the GPT-2 124M training step with measured kernel times:
``python scripts/explain_gpt2.py [--batch 8] [--precision bf16] [--out DIR]``.

Compiles the step (AdamW, the given precision) on CUDA, runs it twice (the second
call replays the CUDA graph), times a few graph replays with CUDA events, then
``step.profile()`` (every launch of the list timed, parameters and state put back)
and prints ``step.explain()`` with the measured times beside the predicted ones.
Writes to ``--out``: explain.txt, roofline.png, memory_timeline.png,
profile.json (every launch: op, kind, bytes, FLOPs, bound, predicted and measured
seconds) and ir.tar.gz (the IR of every stage, short form). On a machine without
CUDA it stops with profile()'s error."""

from __future__ import annotations

import argparse
import json
import tarfile
import time
from pathlib import Path

import torch

import nova
from nova.models import GPT, GPTConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("explain_gpt2"))
    opts = ap.parse_args()
    opts.out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=50304, block_size=1024, n_layer=opts.layers, n_head=12, n_embd=768)
    with torch.device(device):
        model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step = nova.compile(model, opt, precision=opts.precision)
    x = torch.randint(0, cfg.vocab_size, (opts.batch, cfg.block_size), device=device)
    y = torch.randint(0, cfg.vocab_size, (opts.batch, cfg.block_size), device=device)
    t0 = time.perf_counter()
    step(x, y)
    compile_s = time.perf_counter() - t0
    step(x, y)  # the second call captures and replays the graph
    replay_ms = None
    if device == "cuda":
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        for _ in range(5):
            step(x, y)
        b.record()
        b.synchronize()
        replay_ms = a.elapsed_time(b) / 5
    t0 = time.perf_counter()
    m = step.profile(repeat=opts.repeat)
    profile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    text = step.explain(plots=opts.out, ir_dir=opts.out / "ir")
    explain_s = time.perf_counter() - t0
    (opts.out / "explain.txt").write_text(text)
    with tarfile.open(opts.out / "ir.tar.gz", "w:gz") as tar:
        tar.add(opts.out / "ir", arcname="ir")
    rows = [{"index": k.index, "op": k.op, "kind": k.kind, "shape": k.shape, "config": k.config, "bytes": k.bytes,
             "flops": k.flops, "launches": k.launches, "bound": k.bound, "predicted_s": k.predicted_s,
             "measured_s": t, "loc": k.loc} for k, t in zip(m.kernels, m.measured_s)]  # fmt: skip
    doc = {"batch": opts.batch, "precision": opts.precision, "device": torch.cuda.get_device_name() if device == "cuda"
           else "cpu", "mode": step.mode, "compile_s": compile_s, "profile_s": profile_s, "explain_s": explain_s,
           "graph_step_ms": replay_ms, "sum_measured_ms": m.total_s * 1e3, "gap_ms": m.gap_s * 1e3,
           "sum_predicted_ms": sum(k.predicted_s for k in m.kernels) * 1e3, "kernels": rows}  # fmt: skip
    (opts.out / "profile.json").write_text(json.dumps(doc, indent=1))
    print(text)
    print(f"compile {compile_s:.1f} s, profile {profile_s:.1f} s, explain {explain_s:.1f} s; one graph-replay step "
          f"{replay_ms:.2f} ms; the launch list's kernels measured one by one: {m.total_s * 1e3:.2f} ms "
          f"(+ {m.gap_s * 1e3:.2f} ms between them), predicted {doc['sum_predicted_ms']:.2f} ms")


if __name__ == "__main__":
    main()
