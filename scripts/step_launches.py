"""Every launch of a compiled GPT-2 (or 46M MLP LM) training step, measured one by one:
``python scripts/step_launches.py [--model 124m|mlp46m] [--precision bf16|tf32] [--batch 32] [--out DIR]``
(CUDA). Compiles the step as ``nova bench gpt2`` does (fused AdamW), runs it, then
``step.profile()`` twice (the first profile of a process runs cold: not kept) and
prints the launches by measured time with their op, kind, shape, config, FLOPs, the
cost model's prediction and the achieved TFLOP/s or GB/s, then the totals per kind
(a fused group by its body's ops). ``--layers N`` overrides the preset's depth;
``--set MODULE.NAME=VALUE`` (repeatable; MODULE under ``nova.``, e.g.
``codegen.triton.rowwise.PARTIALS_PER_SM=8``) sets a module constant before the
compile (the step cache keys on it), to measure a variant; ``--tag`` names the output.
Writes ``step_launches_<model>_<precision>_b<batch>[_<tag>].json``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
from collections import defaultdict
from pathlib import Path

import torch

import nova
from nova.ir import dialect as nv
from nova.runtime import cache
from nova.schedule.cost import kernel_steps

from kernel_profile import model_config  # noqa: E402  (scripts/ is on sys.path when run as a script)


def launches(model: str, precision: str, batch: int, layers: int | None = None) -> list[dict]:
    from nova.models import GPT, MLPLM

    cfg = model_config(model)
    if layers:
        cfg = dataclasses.replace(cfg, n_layer=layers)
    torch.manual_seed(0)
    with torch.device("cuda"):
        net = (MLPLM if model == "mlp46m" else GPT)(cfg)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    step = nova.compile(net, opt, precision=precision)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), device="cuda")
    y = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), device="cuda")
    step(x, y)
    step.profile(x, y, repeat=3)  # cold: not kept
    m = step.profile(x, y, repeat=5)
    prog = step._last
    steps = kernel_steps(prog.fn, prog.compilation.memory.placements)
    rows = []
    for i, (k, s) in enumerate(zip(m.kernels, m.measured_s)):
        body = [o.name.removeprefix("nova.") for o in steps[i].op.inner_ops()] if i < len(steps) and isinstance(
            steps[i].op, nv.FusedOp) else []  # fmt: skip
        rows.append({"index": k.index, "op": k.op, "kind": k.kind, "shape": k.shape, "config": k.config,
                     "ops": k.ops, "body": body, "flops": k.flops, "bytes": k.bytes,
                     "predicted_ms": k.predicted_s * 1e3, "ms": s * 1e3, "loc": k.loc})  # fmt: skip
    return rows


def _group(r: dict) -> str:
    """A launch's op and cost kind; a fused group's with its body's op names."""
    return f"{r['op']} {r['kind']}" + (f" [{' '.join(r['body'])}]" if r["body"] else "")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="124m", choices=["124m", "355m", "mlp46m"])
    ap.add_argument("--precision", default="bf16", choices=["bf16", "tf32", "fp32"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", type=Path, default=Path("."))
    opts = ap.parse_args()
    try:  # the step cache's key holds the changed switches: no other setting's step is read back
        settings = cache.set_switches(opts.set)
    except ValueError as e:
        raise SystemExit(f"--set: {e}") from None
    print(f"settings: {settings or 'defaults'}")
    rows = launches(opts.model, opts.precision, opts.batch, opts.layers)
    total = sum(r["ms"] for r in rows)
    print(f"{len(rows)} launches, {total:.3f} ms measured, {sum(r['predicted_ms'] for r in rows):.3f} ms predicted")
    print("     ms  pred ms  TFLOP/s   GB/s  op / kind / shape / config")
    for r in sorted(rows, key=lambda r: -r["ms"])[:opts.top]:
        tf = r["flops"] / r["ms"] / 1e9 if r["ms"] else 0.0
        gb = r["bytes"] / r["ms"] / 1e6 if r["ms"] else 0.0
        print(f"{r['ms']:7.4f} {r['predicted_ms']:8.4f} {tf:8.1f} {gb:6.0f}  {r['op']} {r['kind']} ({r['ops']} ops) "
              f"{r['shape'][:40]} [{r['config'][:70]}] {' '.join(r['body'])[:60]}")
    groups: dict = defaultdict(lambda: [0.0, 0.0, 0, 0])
    for r in rows:
        g = groups[_group(r)]
        g[0] += r["ms"]
        g[1] += r["predicted_ms"]
        g[2] += 1
        g[3] += r["flops"]
    print("per kind: ms measured / predicted, launches, TFLOP/s")
    for name, (ms, pred, n, fl) in sorted(groups.items(), key=lambda x: -x[1][0]):
        print(f"  {ms:8.3f} {pred:8.3f} {n:4d} {fl / ms / 1e9 if ms else 0:7.1f}  {name}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    meta = {"model": opts.model, "precision": opts.precision, "batch": opts.batch,
            "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "commit": os.environ.get("NOVA_COMMIT", commit), "total_ms": total, "layers": opts.layers,
            "settings": {k: repr(v) for k, v in settings.items()}}  # fmt: skip
    opts.out.mkdir(parents=True, exist_ok=True)
    tag = f"_{opts.tag}" if opts.tag else ""
    path = opts.out / f"step_launches_{opts.model}_{opts.precision}_b{opts.batch}{tag}.json"
    path.write_text(json.dumps({**meta, "launches": rows}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
