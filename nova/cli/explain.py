"""``nova explain``: what Nova makes of a training step, stage by stage.

It builds the GPT and AdamW that ``nova train`` builds (its sizes from the
flags, or the model of the checkpoint in ``--out``), compiles the step, runs
it once on a random batch (the batch's shapes select the program), and prints
``step.explain()``: a summary in ``//`` lines (the stages with their op counts,
the fusion groups, the most expensive kernels with their predicted time, the
memory plan). ``--ir`` appends every stage's IR (the short form of
``nova.ir.pretty``); ``--out-dir DIR`` writes it to ``DIR/NN-stage.mlir``, one
file per stage in pipeline order, and lists the files after the summary.
``--measure`` (CUDA) times every kernel and shows it beside the prediction.
``--plots DIR`` draws ``memory_timeline.png`` and, on the Triton backend,
``roofline.png`` there. Nothing is trained or saved: the step runs on a
throwaway copy of the model.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch

from nova.cli import checkpoint
from nova.cli.errors import UsageError
from nova.cli.train_config import TrainConfig, add_engine_arguments, add_model_arguments, pick_device, validate

HELP = ("compile one training step of the train command's GPT and summarize it: stages, fusion groups, "
        "the most expensive kernels, the memory plan (and its IR after every stage)")

# How CompiledStep.explain() heads each stage's text.
STAGE_HEADER = re.compile(r"^// ===== after stage: (\S+) =====$", re.MULTILINE)
MODEL_FLAGS = ("block_size", "n_layer", "n_head", "n_embd", "dropout")  # fixed by a checkpoint


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    add_engine_arguments(p)
    p.add_argument("--out", metavar="DIR", default=argparse.SUPPRESS,
                   help="explain the model of the checkpoint in DIR (a nova train --out) instead of the flags' model")
    p.add_argument("--out-dir", metavar="DIR", default=None, help="write each stage's IR to DIR/NN-STAGE.mlir")
    p.add_argument("--ir", action="store_true", help="print each stage's IR after the summary")
    p.add_argument("--measure", action="store_true",
                   help="time every kernel with CUDA events and show it beside the prediction (CUDA only)")
    p.add_argument("--top", type=int, default=10, metavar="N", help="how many of the most expensive kernels to list")
    p.add_argument("--plots", metavar="DIR", default=None,
                   help="draw the memory plan's timeline to DIR/memory_timeline.png and, on the Triton backend, "
                        "every kernel on the device's roofline to DIR/roofline.png")


def split_stages(text: str) -> list[tuple[str, str]]:
    """(stage, IR) pairs of an explain() text, in pipeline order."""
    heads = list(STAGE_HEADER.finditer(text))
    if not heads:
        raise RuntimeError("step.explain() returned no '// ===== after stage: NAME =====' headers")
    return [(h.group(1), text[h.end():nxt.start() if nxt else len(text)].strip("\n") + "\n")
            for h, nxt in zip(heads, heads[1:] + [None])]


def config_from(args: argparse.Namespace) -> tuple[TrainConfig, dict | None]:
    """The settings to build from, and the checkpoint's weights with --out."""
    given = {k: v for k, v in vars(args).items() if k in MODEL_FLAGS + ("batch_size", "precision", "backend", "device")}
    weights = None
    if "out" not in args:
        cfg = TrainConfig(**given)
    else:
        clash = [k for k in MODEL_FLAGS if k in given]
        if clash:
            raise UsageError(f"--out takes the model from its checkpoint; drop --{clash[0].replace('_', '-')}")
        payload = checkpoint.load_for("--out", Path(args.out) / checkpoint.LAST)
        saved, weights = payload["config"], payload["model"]
        cfg = TrainConfig(**{**{k: saved[k] for k in MODEL_FLAGS + ("batch_size",)}, **given})
    validate(cfg)
    return cfg, weights


def run(args: argparse.Namespace) -> int:
    from nova.cli.train import make_optimizer, make_step
    from nova.models import GPT

    cfg, weights = config_from(args)
    for flag, value in (("--plots", args.plots), ("--out-dir", args.out_dir)):
        if value is not None and Path(value).exists() and not Path(value).is_dir():
            raise UsageError(f"{flag} {value} is a file, not a directory")
    if args.top < 1:
        raise UsageError(f"--top must be at least 1, got {args.top}")
    device = pick_device(cfg.device)
    if args.measure and device.type != "cuda":
        raise UsageError(f"--measure times kernels with CUDA events: it needs a CUDA device, not {device}")
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model_config()).to(device)
    if weights is not None:
        model.load_state_dict(weights)
    step = make_step(cfg, model, make_optimizer(model, cfg), device)
    if args.measure and step.backend != "triton":
        raise UsageError(f"--measure times the Triton backend's kernels; --backend {cfg.backend} runs {step.backend}")
    ids = torch.randint(0, cfg.model_config().vocab_size, (cfg.batch_size, cfg.block_size + 1))
    x, y = ids[:, :-1].contiguous().to(device), ids[:, 1:].contiguous().to(device)
    loss = step(x, y).item()
    text = step.explain(plots=args.plots, ir=args.ir, ir_dir=args.out_dir, measure=args.measure, top=args.top)
    print(f"nova explain: {model.num_params() / 1e6:.2f}M-param GPT, batch {cfg.batch_size}x{cfg.block_size}, "
          f"{cfg.precision}, backend {step.backend}, device {device}; one step ran, loss {loss:.4f}", file=sys.stderr)
    sys.stdout.write(text.rstrip("\n") + "\n")
    if args.out_dir is not None:
        from nova.pipeline import STAGES

        for i, (name, _) in enumerate(STAGES):
            path = Path(args.out_dir) / f"{i:02d}-{name}.mlir"
            print(f"{path}  {path.read_text().count(chr(10))} lines")
    return 0
