"""``nova sample``: generate text from the model a ``nova train`` run saved.

The text goes to stdout alone (prompt included), so it can be piped; which
checkpoint was used goes to stderr.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from nova.cli import checkpoint
from nova.cli.errors import UsageError
from nova.cli.train_config import TrainConfig, pick_device
from nova.data.tokenizer import decode, encode

HELP = "generate text from a trained model (DIR/best.pt, or DIR/checkpoint.pt)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", metavar="DIR", default=TrainConfig.out,
                   help=f"the run's output directory (default {TrainConfig.out})")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--checkpoint", choices=["best", "last"], default="best",
                   help="best: the lowest val loss (best.pt, the default); last: the latest step (checkpoint.pt)")
    p.add_argument("--tokens", type=int, default=200, help="bytes to generate (default 200)")
    p.add_argument("--temperature", type=float, default=0.8, help="> 0; lower is more conservative (default 0.8)")
    p.add_argument("--top-k", type=int, default=40, help="sample among the k likeliest bytes; 0: all (default 40)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0): the same seed gives the same text")
    p.add_argument("--device", default="cpu", help="default cpu (generation is eager PyTorch)")


def checkpoint_path(out: Path, which: str) -> Path:
    best, last = out / checkpoint.BEST, out / checkpoint.LAST
    if which == "last" or not best.is_file():
        if not last.is_file():
            raise UsageError(f"no checkpoint in {out} (neither {checkpoint.BEST} nor {checkpoint.LAST}); "
                             f"train one with nova train --out {out}")
        return last
    return best


def run(args: argparse.Namespace) -> int:
    if not args.prompt:
        raise UsageError("--prompt must not be empty (the model continues text, it needs at least one byte)")
    if args.tokens < 1:
        raise UsageError(f"--tokens must be >= 1, got {args.tokens}")
    if not args.temperature > 0:
        raise UsageError(f"--temperature must be > 0, got {args.temperature}")
    if args.top_k < 0:
        raise UsageError(f"--top-k must be >= 0, got {args.top_k}")
    path = checkpoint_path(Path(args.out), args.checkpoint)
    device = pick_device(args.device)
    try:
        model, ckpt = checkpoint.load_model(path, device)
    except ValueError as e:  # not a nova checkpoint
        raise UsageError(str(e)) from None
    val = [loss for step, loss in ckpt["history"]["val"] if step == ckpt["step"]]
    print(f"nova sample: {path} (step {ckpt['step']}" + (f", val loss {val[0]:.4f})" if val else ")"), file=sys.stderr)
    g = torch.Generator(device=device).manual_seed(args.seed)
    ids = model.generate(encode(args.prompt)[None].to(device), args.tokens, temperature=args.temperature,
                         top_k=args.top_k or None, generator=g)
    sys.stdout.write(decode(ids[0]) + "\n")
    return 0
