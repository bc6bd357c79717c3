"""Nova's exceptions: each says what went wrong and where."""


class NovaError(Exception):
    """Base of every error Nova raises on purpose."""


class UnsupportedError(NovaError):
    """The model uses ops (or op arguments) Nova cannot compile; raised at
    compile time, before anything runs, listing every offending op."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = problems  # (what, where)
        lines = "\n".join(f"  - {what}  at {where}" for what, where in problems)
        super().__init__(f"Nova cannot compile {len(problems)} op(s):\n{lines}")


class AutodiffError(NovaError):
    """Reverse-mode differentiation reached an op it has no rule for."""


class CaptureError(NovaError):
    """The model or its inputs do not fit Nova's contract (scalar loss, ...)."""


class BatchError(NovaError):
    """A batch whose dtype, device or rank differs from what the step takes."""
