"""The kernel cache executes only verified text: a forged or truncated
``__pycache__/*.pyc`` beside a cached kernel file is never loaded, and the source
that ``@triton.jit`` / ``inspect`` read back is the text that was verified."""

from __future__ import annotations

import importlib.util
import inspect
import marshal
import os
import uuid

import torch

from nova.codegen.triton.source import kernel_source, load_kernel, source_hash


def _unique(body: str) -> str:
    # a fresh text per test: load_kernel caches by hash within the process
    return f"# {uuid.uuid4().hex}\n" + body


def _plant_pyc(py_path, code_text: str | None, truncated: bool = False) -> str:
    """A .pyc in __pycache__ whose header matches ``py_path``'s mtime and size, as
    the import system checks it; its code is ``code_text`` (or cut short)."""
    pyc = importlib.util.cache_from_source(str(py_path))
    os.makedirs(os.path.dirname(pyc), exist_ok=True)
    st = os.stat(py_path)
    header = importlib.util.MAGIC_NUMBER + (0).to_bytes(4, "little")
    header += (int(st.st_mtime) & 0xFFFFFFFF).to_bytes(4, "little") + (st.st_size & 0xFFFFFFFF).to_bytes(4, "little")
    body = marshal.dumps(compile(code_text or "x = 1\n", str(py_path), "exec"))
    data = header + (body[: len(body) // 3] if truncated else body)
    with open(pyc, "wb") as f:
        f.write(data)
    return pyc


def test_a_forged_pyc_is_not_run(tmp_path):
    genuine = _unique("def probe():\n    return 'genuine'\n")
    path = tmp_path / f"{source_hash(genuine)}.py"
    path.write_text(genuine, encoding="utf-8")
    # what the import system would run for this file: same mtime and size, other code
    forged = "import builtins\nbuiltins.NOVA_FORGED_PYC_RAN = True\ndef probe():\n    return 'forged'\n"
    pyc = _plant_pyc(path, forged)
    spec = importlib.util.spec_from_file_location("nova_test_forged_check", path)  # the old loading path
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    assert m.probe() == "forged"  # the forgery is effective through importlib
    del __import__("builtins").NOVA_FORGED_PYC_RAN

    fn, got = load_kernel(genuine, "probe", cache_dir=tmp_path)
    assert got == path
    assert fn() == "genuine"
    assert not hasattr(__import__("builtins"), "NOVA_FORGED_PYC_RAN")
    assert os.path.exists(pyc)  # untouched and ignored
    assert inspect.getsource(fn) == "def probe():\n    return 'genuine'\n"


def test_a_truncated_pyc_is_harmless(tmp_path):
    genuine = _unique("def probe():\n    return 41 + 1\n")
    path = tmp_path / f"{source_hash(genuine)}.py"
    path.write_text(genuine, encoding="utf-8")
    _plant_pyc(path, genuine, truncated=True)
    fn, _ = load_kernel(genuine, "probe", cache_dir=tmp_path)
    assert fn() == 42


def test_a_tampered_cache_file_is_rewritten_and_not_run(tmp_path):
    genuine = _unique("def probe():\n    return 'genuine'\n")
    path = tmp_path / f"{source_hash(genuine)}.py"
    path.write_text("def probe():\n    return 'tampered'\n", encoding="utf-8")
    fn, _ = load_kernel(genuine, "probe", cache_dir=tmp_path)
    assert fn() == "genuine"
    assert path.read_text(encoding="utf-8") == genuine
    # the text inspect reads is pinned: changing the file afterwards changes nothing
    path.write_text("def probe():\n    return 'later'\n", encoding="utf-8")
    import linecache

    linecache.checkcache()
    assert "genuine" in inspect.getsource(fn)


def test_a_triton_kernel_runs_from_the_verified_text(tmp_path, device):
    """A real @triton.jit kernel (interpreted on the CPU) with a forged .pyc beside it."""
    src = _unique(
        "import triton\nimport triton.language as tl\n\n\n@triton.jit\n"
        "def add_one(x_ptr, n, BLOCK: tl.constexpr):\n"
        "    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)\n"
        "    m = i < n\n"
        "    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=m) + 1.0, mask=m)\n"
    )
    path = tmp_path / f"{source_hash(src)}.py"
    path.write_text(src, encoding="utf-8")
    _plant_pyc(path, src.replace("+ 1.0", "+ 100.0"))
    kernel, _ = load_kernel(src, "add_one", cache_dir=tmp_path)
    assert kernel_source(kernel) == src
    x = torch.zeros(10, device=device)
    kernel[(1,)](x, 10, BLOCK=16)
    assert torch.equal(x.cpu(), torch.ones(10))
