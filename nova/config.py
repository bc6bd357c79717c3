"""Nova's settings: one typed object, read from the environment once.

  NOVA_VERIFY_EACH_STAGE=1   run the IR verifier after every pipeline stage
                             (the final IR is always verified); tests turn it on
  NOVA_PROGRAM_CACHE_SIZE=N  programs a compiled step keeps (default 8): one per batch
                             shape / parameter set / mode, least recently used evicted
  NOVA_CACHE_DIR=DIR         where generated kernels and compiled steps are kept
                             (default ~/.cache/nova); read at each use
  NOVA_STEP_CACHE=0          do not read or write the step cache (<cache dir>/steps:
                             a second compile of the same model skips every stage
                             after autodiff; nova.runtime.cache); on by default
  NOVA_COMPILE_THREADS=N     threads compiling a step's Triton kernels before its first
                             run (default: the CPUs, at most 16; 1: each at its first
                             launch; nova.runtime.compile_ahead)
  TRITON_INTERPRET=1         (Triton's own) run generated kernels on the CPU
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Settings:
    verify_each_stage: bool = False
    # a step keeps this many programs (LRU): each holds its IR and, on the GPU, its
    # kernels; a changing sequence length would otherwise keep one per length forever
    program_cache_size: int = 8
    step_cache: bool = True  # NOVA_STEP_CACHE: read and write <cache dir>/steps

    @staticmethod
    def from_env() -> "Settings":
        return Settings(verify_each_stage=os.environ.get("NOVA_VERIFY_EACH_STAGE", "0") not in ("", "0"),
                        program_cache_size=positive_int_env("NOVA_PROGRAM_CACHE_SIZE", 8),
                        step_cache=os.environ.get("NOVA_STEP_CACHE", "1") not in ("", "0"))  # fmt: skip


def positive_int_env(name: str, default: int) -> int:
    """The environment variable ``name`` as a positive integer (``default`` when unset);
    anything else is an error that names it."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be a positive integer, got {raw!r}") from None
    if n < 1:
        raise ValueError(f"{name} must be a positive integer, got {raw!r}")
    return n


SETTINGS = Settings.from_env()


def triton_interpreted() -> bool:
    """Whether Triton runs kernels in its CPU interpreter. Read live, not once:
    it is Triton's own variable, which Triton itself reads when a kernel is created."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def cache_dir() -> Path:
    """Nova's on-disk cache root: ``$NOVA_CACHE_DIR`` or ``~/.cache/nova``. Read live,
    so a test or a tool can point one process at a fresh directory."""
    return Path(os.environ.get("NOVA_CACHE_DIR") or Path.home() / ".cache" / "nova")
