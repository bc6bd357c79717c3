"""Nova's logging: every module logs under the ``nova`` logger tree.

A fallback (a kernel variant a case cannot use, a copy a layout forces) is logged
once per distinct reason at INFO, so ``logging.basicConfig(level=logging.INFO)``
shows what the backend did instead and why, without one line per step.
"""

from __future__ import annotations

import logging
import threading

_SEEN: set[tuple[str, str]] = set()
_LOCK = threading.Lock()


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(name if name.startswith("nova") else f"nova.{name}")


def once(logger: logging.Logger, key: str, message: str, *args) -> None:
    """``logger.info(message, *args)`` the first time ``key`` is seen in this process."""
    with _LOCK:
        if (logger.name, key) in _SEEN:
            return
        _SEEN.add((logger.name, key))
    logger.info(message, *args)
