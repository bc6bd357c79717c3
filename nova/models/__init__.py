"""Models that Nova trains, tests and benchmarks, with their preset sizes."""

from nova.models.gpt import GPT, GPTConfig
from nova.models.mlp_lm import MLPLM, MLPLMConfig

__all__ = ["GPT", "GPTConfig", "MLPLM", "MLPLMConfig", "gpt_tiny", "gpt2_124m", "mlp_46m"]


def gpt_tiny(**overrides) -> GPTConfig:
    """A GPT small enough for unit tests: byte vocabulary, 2 layers, d=64."""
    return GPTConfig(**{**dict(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=64), **overrides})


def gpt2_124m(**overrides) -> GPTConfig:
    """GPT-2 small. vocab 50304 = 50257 padded up to a multiple of 128 for the matmuls."""
    return GPTConfig(**{**dict(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768), **overrides})


def mlp_46m(**overrides) -> MLPLMConfig:
    """The Nova paper's MLP-only LM (about 46M parameters, mostly the two vocab matrices)."""
    return MLPLMConfig(**{**dict(vocab_size=50304, block_size=1024, n_layer=6, n_embd=384, hidden=1536), **overrides})
