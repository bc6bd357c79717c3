"""Kernel tests run the generated Triton kernels through the interpreter when no
CUDA device is present. Triton decides between compiling and interpreting when a
``@triton.jit`` function is created, so the variable is set before any kernel is
loaded (the kernels are created lazily, inside the tests)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
