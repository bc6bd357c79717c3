"""Errors a command reports as one clear line (exit status 2) instead of a traceback.

Only for mistakes in what the user asked for (a missing file, a bad flag
combination). Failures inside Nova itself are not UsageErrors: they propagate
with their traceback, so nothing is hidden.
"""


class UsageError(Exception):
    pass


class RunFailed(Exception):
    """A run that started but cannot go on for a reason the user can act on
    (the loss diverged); reported as one line with exit status 1."""
