"""Atomic file writes and the training checkpoint format.

A checkpoint holds only tensors and plain Python values, so it loads with
``torch.load(weights_only=True)``: opening one never runs pickled code.
Every write goes to a temporary file in the same directory, is fsynced, and
then renamed over the target: a crash leaves either the old file or the new
one, never a torn one.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch

from nova.atomic import atomic_write  # noqa: F401  (checkpoint.atomic_write: used by train and explain)

FORMAT = "nova-train-checkpoint/1"
LAST = "checkpoint.pt"  # the latest saved step of a run: what --resume continues
BEST = "best.pt"  # the step with the lowest validation loss so far: what to sample from




def rng_state(data_generator: torch.Generator) -> dict:
    state = {"torch": torch.get_rng_state(), "data": data_generator.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict, data_generator: torch.Generator) -> None:
    torch.set_rng_state(state["torch"])
    data_generator.set_state(state["data"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(path: str | Path, *, model, optimizer, step: int, config: dict, rng: dict, history: dict, meta: dict) -> None:
    payload = {
        "format": FORMAT,
        "step": step,
        "config": config,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "rng": rng,
        "history": history,
        "meta": meta,  # facts to check on resume (e.g. a digest of the training text)
    }
    atomic_write(path, lambda f: torch.save(payload, f))


def load(path: str | Path) -> dict:
    """The checkpoint at ``path``; ValueError, naming the file, if it is not a readable one."""
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, pickle.UnpicklingError) as e:  # truncated, not a torch file, or foreign objects
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{path} cannot be read as a checkpoint: {reason}") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ValueError(f"{path} is not a nova train checkpoint (expected format {FORMAT!r})")
    return payload


def load_for(flag: str, path: Path) -> dict:
    """``load(path)`` for the command-line option ``flag``: a missing or unreadable
    checkpoint is a one-line UsageError naming the option."""
    from nova.cli.errors import UsageError

    if not path.is_file():
        raise UsageError(f"{flag}: no checkpoint at {path}")
    try:
        return load(path)
    except ValueError as e:
        raise UsageError(f"{flag}: {e}") from None


def load_model(path: str | Path, device: str | torch.device = "cpu"):
    """The trained GPT of a checkpoint, in eval mode, and the checkpoint itself.

        model, ckpt = load_model("runs/train/best.pt")
        logits = model.logits(ids)   # ids: int64 (B, T) byte values
    """
    from nova.cli.train_config import CONFIG_FIELDS, TrainConfig
    from nova.models import GPT

    payload = load(path)
    cfg = TrainConfig(**{k: v for k, v in payload["config"].items() if k in CONFIG_FIELDS})
    model = GPT(cfg.model_config())
    model.load_state_dict(payload["model"])
    return model.to(device).eval(), payload
