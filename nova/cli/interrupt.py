"""Ctrl-C as "stop cleanly": the first SIGINT asks the training loop to stop
after the step in flight, so no step is cut in half; a second one raises
KeyboardInterrupt at once, as Python's default handler would.

A step interrupted anyway (the second Ctrl-C, or a KeyboardInterrupt from
elsewhere) is not lost either: the loop saves the last completed step. The
compiled step writes nothing back from a step that did not finish; with
``--engine eager`` a second Ctrl-C that lands inside ``optimizer.step()`` can
leave that one step half-applied (PyTorch updates parameters one by one).
"""

from __future__ import annotations

import signal
import sys
import threading


class StopRequest:
    """Context manager; ``requested`` turns True on the first Ctrl-C."""

    def __init__(self, message: str = "stopping after this step (Ctrl-C again to stop now)"):
        self.message = message
        self.requested = False
        self._previous = None
        self._installed = False

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print(f"\ninterrupt: {self.message}", file=sys.stderr, flush=True)

    def __enter__(self) -> "StopRequest":
        # Signal handlers can only be set from the main thread; elsewhere (a
        # library caller's worker) a KeyboardInterrupt still reaches the loop.
        # SIG_IGN means the shell wants Ctrl-C not to reach us (a background job): keep it.
        main_thread = threading.current_thread() is threading.main_thread()
        if main_thread and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            self._previous = signal.signal(signal.SIGINT, self._handle)
            self._installed = True
        return self

    def __exit__(self, *exc) -> None:
        if self._installed:
            # None: the previous handler was not set from Python; the default is the closest.
            signal.signal(signal.SIGINT, self._previous if self._previous is not None else signal.SIG_DFL)
            self._installed = False
