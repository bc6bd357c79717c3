"""Atomic file writes: a temporary file in the same directory, then ``os.replace``,
so a reader sees the old file or the whole new one, never a part."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def atomic_write(path: str | Path, write: Callable[[BinaryIO], None], durable: bool = True) -> None:
    """Writes ``path`` through ``write(f)``. ``durable``: fsync the file and its
    directory, so the new file survives a power loss (checkpoints, the step cache);
    without it (the kernel-source cache, thousands of small files per compile) the
    write is still atomic, only not forced to disk."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    if durable and hasattr(os, "O_DIRECTORY"):  # the rename itself survives a power loss
        dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
