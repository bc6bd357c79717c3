import os
import sys

# shared test helpers (tests/hf_models.py, ...) import by module name from any test folder
sys.path.insert(0, os.path.dirname(__file__))

# verify the IR after every pipeline stage in tests (read once by nova.config)
os.environ.setdefault("NOVA_VERIFY_EACH_STAGE", "1")
# no on-disk step cache in tests: tests monkeypatch stages after autodiff (the cache would
# serve the unpatched IR) and compare pipelines; tests/runtime/test_cache.py turns it on
os.environ.setdefault("NOVA_STEP_CACHE", "0")

import torch  # noqa: E402

# without a GPU, generated Triton kernels run in Triton's interpreter. Triton decides
# between compiling and interpreting when triton.language is first imported, so this is
# set here, before any test module is collected (a module setting it later would be
# order-dependent: another module collected first may have imported triton already)
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

if os.environ.get("TRITON_INTERPRET") == "1":
    import triton_interpreter  # noqa: E402  (tests/triton_interpreter.py)

    triton_interpreter.drop_dead_work()

# one thread per test process: the suite runs in parallel workers on 2 cores, and
# oversubscribed OpenMP threads make small CPU kernels 100x slower
torch.set_num_threads(1)


import pytest  # noqa: E402


@pytest.fixture
def float64_default():
    """torch's default dtype is float64 for the test (and restored after it)."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(saved)
