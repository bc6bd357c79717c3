"""Nova's reverse-mode autodiff over the nova dialect (its own VJP rules)."""

from nova.autodiff.grad import AutodiffPass, append_backward
from nova.autodiff.rules import NON_DIFFERENTIABLE, VJP_RULES

__all__ = ["AutodiffPass", "NON_DIFFERENTIABLE", "VJP_RULES", "append_backward"]
