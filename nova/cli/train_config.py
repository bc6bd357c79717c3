"""The settings of a ``nova train`` run: defaults, flags, resume rules, and the
checks that turn a bad setting into one clear line (exit status 2) before
anything is built, instead of a traceback from deep inside torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from dataclasses import dataclass

import torch

from nova.cli.errors import UsageError
from nova.data.dataset import DataError, TextDataset, load_text
from nova.data.tokenizer import VOCAB_SIZE
from nova.models import GPTConfig


@dataclass
class TrainConfig:
    """Every setting of a run. The defaults are the no-flag run, sized for a 3-minute
    budget on 2 CPU cores. Measured on 2 idle cores: 57 s with --engine eager,
    100 s with the nova engine on its reference backend; val loss 5.56 -> 0.30
    nats/byte, against a unigram entropy of 3.04."""

    data: str | None = None  # None: the built-in corpus
    steps: int = 600
    batch_size: int = 32
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    lr: float = 2e-3
    min_lr_ratio: float = 0.1  # the cosine decays to lr * min_lr_ratio
    warmup_steps: int | None = None  # None: 10% of the steps, at most 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99  # 0.99 rather than 0.999: short runs need the second moment to adapt fast
    precision: str = "fp32"
    backend: str = "auto"
    engine: str = "nova"
    device: str = "auto"
    seed: int = 1337
    eval_interval: int = 50
    eval_batches: int = 8
    ckpt_interval: int = 100
    stop_at: int | None = None
    threads: int | None = None  # None: every core this process may run on
    out: str = "runs/train"

    def warmup(self) -> int:
        return self.warmup_steps if self.warmup_steps is not None else max(1, min(100, self.steps // 10))

    def model_config(self) -> GPTConfig:
        return GPTConfig(vocab_size=VOCAB_SIZE, block_size=self.block_size, n_layer=self.n_layer,
                         n_head=self.n_head, n_embd=self.n_embd, dropout=self.dropout)


CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(TrainConfig))

# Settings that define the model, data stream or optimizer: a resumed run must keep them.
FIXED_ON_RESUME = (
    "data", "batch_size", "block_size", "n_layer", "n_head", "n_embd", "dropout",
    "lr", "min_lr_ratio", "warmup_steps", "weight_decay", "beta1", "beta2", "seed",
)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The flags that size the model and its batch (shared by train and explain)."""
    S = argparse.SUPPRESS
    d = TrainConfig()
    p.add_argument("--batch-size", type=int, default=S, help=f"sequences per step (default {d.batch_size})")
    p.add_argument("--block-size", type=int, default=S, help=f"tokens per sequence (default {d.block_size})")
    p.add_argument("--n-layer", type=int, default=S, help=f"transformer blocks (default {d.n_layer})")
    p.add_argument("--n-head", type=int, default=S, help=f"attention heads (default {d.n_head})")
    p.add_argument("--n-embd", type=int, default=S, help=f"model width, a multiple of --n-head (default {d.n_embd})")
    p.add_argument("--dropout", type=float, default=S, help=f"dropout probability in [0, 1) (default {d.dropout})")


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    S = argparse.SUPPRESS
    p.add_argument("--precision", choices=["fp32", "tf32", "bf16"], default=S, help="default fp32")
    # No choices= here: nova.api.BACKENDS is the list, so new backends need no CLI change.
    p.add_argument("--backend", default=S, help="nova backend: auto (default), reference, triton")
    p.add_argument("--device", default=S, help="cpu, cuda, cuda:N, ... (default: cuda if available, else cpu)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    # default=SUPPRESS: only flags the user typed reach the namespace, so a
    # resumed run can tell "given" from "default" and keep the checkpoint's values.
    S = argparse.SUPPRESS
    d = TrainConfig()
    p.add_argument("--data", metavar="FILE", default=S, help="UTF-8 text file to train on (default: built-in corpus)")
    p.add_argument("--steps", type=int, default=S, help=f"optimizer steps (default {d.steps})")
    add_model_arguments(p)
    p.add_argument("--lr", type=float, default=S, help=f"peak learning rate, > 0 (default {d.lr})")
    add_engine_arguments(p)
    p.add_argument("--engine", choices=["nova", "eager"], default=S,
                   help="nova: the compiled step (default); eager: plain PyTorch, for comparison")
    p.add_argument("--seed", type=int, default=S, help=f"seed for init, data order and dropout (default {d.seed})")
    p.add_argument("--eval-interval", type=int, default=S, help=f"steps between val evaluations (default {d.eval_interval})")
    p.add_argument("--ckpt-interval", type=int, default=S, help=f"steps between checkpoints (default {d.ckpt_interval})")
    p.add_argument("--stop-at", type=int, default=S, metavar="STEP",
                   help="stop after this step as if interrupted (checkpoint written); the LR schedule still spans --steps")
    p.add_argument("--threads", type=int, default=S,
                   help="CPU threads for torch (default: available cores; on a busy machine use fewer, "
                   "as OpenMP threads that spin-wait for a shared core slow every kernel several-fold)")
    p.add_argument("--out", metavar="DIR", default=S, help=f"output directory (default {d.out})")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_true", help="continue from DIR/checkpoint.pt")
    mode.add_argument("--force", action="store_true", help="start a new run even if DIR already holds a checkpoint")


def resolve_config(given: dict, saved: dict | None) -> TrainConfig:
    """The run's settings: defaults, then the checkpoint's (if resuming), then the flags given."""
    if saved is None:
        cfg = TrainConfig(**given)
    else:
        # --stop-at belongs to one invocation: a resumed run does not inherit it.
        cfg = TrainConfig(**{**saved, "stop_at": None})
        for key in FIXED_ON_RESUME:
            if key in given and given[key] != saved[key]:
                raise UsageError(f"{flag(key)} cannot change on resume "
                                 f"(checkpoint has {saved[key]!r}, got {given[key]!r})")
        cfg = dataclasses.replace(cfg, **given)
    validate(cfg)
    return cfg


def validate(cfg: TrainConfig) -> None:
    """Every check that needs only the settings, each naming the flag at fault."""
    for key in ("steps", "batch_size", "block_size", "n_head", "n_embd", "eval_interval", "ckpt_interval"):
        if getattr(cfg, key) < 1:
            raise UsageError(f"{flag(key)} must be >= 1, got {getattr(cfg, key)}")
    for key in ("n_layer",):
        if getattr(cfg, key) < 0:
            raise UsageError(f"{flag(key)} must be >= 0, got {getattr(cfg, key)}")
    for key in ("stop_at", "threads"):
        if getattr(cfg, key) is not None and getattr(cfg, key) < 1:
            raise UsageError(f"{flag(key)} must be >= 1, got {getattr(cfg, key)}")
    if cfg.n_embd % cfg.n_head:
        up = -(-cfg.n_embd // cfg.n_head) * cfg.n_head
        raise UsageError(f"--n-embd {cfg.n_embd} is not divisible by --n-head {cfg.n_head} "
                         f"(each head takes n_embd / n_head channels); try --n-embd {up}")
    if not 0.0 <= cfg.dropout < 1.0:  # also rejects nan; p = 1 would zero every activation
        raise UsageError(f"--dropout must be in [0, 1), got {cfg.dropout}")
    if not (math.isfinite(cfg.lr) and cfg.lr > 0):
        raise UsageError(f"--lr must be a finite number > 0, got {cfg.lr}")
    if cfg.engine == "nova":
        from nova.api import BACKENDS  # the nova engine imports the compiler anyway

        if cfg.backend not in BACKENDS:
            raise UsageError(f"--backend must be one of {', '.join(BACKENDS)}, got {cfg.backend!r}")


def pick_device(name: str) -> torch.device:
    """The torch device for ``--device NAME``, checked to exist here."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UsageError(f"--device {name!r} is not a torch device name (try auto, cpu, cuda or cuda:N)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
            raise UsageError(f"--device {name}: no CUDA device is available (torch {torch.__version__}, {build}); "
                             "use --device cpu")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise UsageError(f"--device {name}: this machine has {count} CUDA device(s), cuda:0..cuda:{count - 1}")
    elif device.type == "meta":
        raise UsageError("--device meta holds no data, so nothing can train on it; use cpu or cuda")
    else:
        try:  # mps, xpu, ...: torch knows the name, but is the backend here?
            torch.empty(1, device=device)
        except (RuntimeError, AssertionError) as e:
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UsageError(f"--device {name} is not usable here: {reason}") from None
    return device


def available_cores() -> int:
    # sched_getaffinity respects taskset/cpusets; os.cpu_count() does not.
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def load_data(cfg: TrainConfig) -> tuple[str, TextDataset]:
    """The training text and its train/val split, or a UsageError saying what is wrong with the file."""
    try:
        text = load_text(cfg.data)
        where = cfg.data or "the built-in corpus"
        if not text:
            raise DataError(f"data file is empty: {where}")
        nul = text.find("\0")
        if nul >= 0:
            # Text files hold no NUL bytes; a binary file, or UTF-16 (ASCII text with a NUL
            # after every byte), can still decode as UTF-8 and would train on garbage.
            at = len(text[:nul].encode("utf-8"))
            raise DataError(f"data file holds {text.count(chr(0))} NUL byte(s), the first at byte {at}: {where} "
                            "is binary, or UTF-16 text (convert it to UTF-8)")
        return text, TextDataset.from_text(text, cfg.block_size)
    except DataError as e:
        raise UsageError(str(e)) from None
