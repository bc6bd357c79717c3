"""Turn generated Triton source text into a callable ``@triton.jit`` kernel.

Every kernel template in this folder emits Python source text; this module is the
one place that makes such text executable. ``@triton.jit`` reads the function's
source back with ``inspect``, so the text must live in a real file: it is written
to ``<cache>/<sha256>.py`` (atomically: temporary file, then ``os.replace``) and
imported from there with ``importlib``. The file name is the hash of the text, so
the same source always maps to the same file and, within a process, to the same
kernel object (and therefore to Triton's per-kernel compile cache).

The source is never unpickled or trusted from the cache: if a file with the
expected name exists but holds other text, it is rewritten.

Under ``TRITON_INTERPRET=1`` the interpreter's ``tl.dot`` multiplies the raw uint16
bit patterns of bfloat16 operands (triton-lang/triton#11584, declined upstream as
"not supported yet"), and its fp32 -> bf16 cast truncates where the GPU rounds to
nearest even; ``load_kernel`` installs small fixes for both, so the same kernel
text is tested on the CPU that runs on the GPU.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
import threading
from pathlib import Path

_LOCK = threading.Lock()
_LOADED: dict[tuple[str, str, bool], tuple[object, Path]] = {}  # (sha, name, interpreted) -> (kernel, path)
_SOURCES: dict[int, str] = {}  # id(kernel) -> source text, for dumping


def default_cache_dir() -> Path:
    """Where generated kernel sources are written: ``<nova cache dir>/triton``
    (``nova.config.cache_dir()``: ``$NOVA_CACHE_DIR`` or ``~/.cache/nova``)."""
    from nova.config import cache_dir

    return cache_dir() / "triton"


def source_hash(source: str) -> str:
    return hashlib.sha256(source.encode("utf-8")).hexdigest()


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def interpreting() -> bool:
    """Whether ``@triton.jit`` currently builds interpreted kernels (TRITON_INTERPRET)."""
    import triton

    return bool(triton.knobs.runtime.interpret)


def _fix_interpreter_bf16_dot() -> None:
    """Make the interpreter widen bfloat16 ``tl.dot`` operands to float32 (exact:
    bf16 is the top half of an fp32) before its ``np.matmul``. Idempotent."""
    import numpy as np
    import triton.language as tl

    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "_nova_bf16_fix", False):
        return
    original = builder.create_dot

    def widen(t):
        if t.dtype.scalar != tl.bfloat16:
            return t
        bits = np.asarray(t.data).astype(np.uint32) << 16
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    create_dot._nova_bf16_fix = True
    builder.create_dot = create_dot


def _fix_interpreter_bf16_rounding() -> None:
    """Make the Triton interpreter round fp32 -> bf16 to nearest even, as the GPU's
    ``cvt.rn.bf16.f32`` does (the interpreter truncates, and its own RTNE path rounds
    ties away and drops the carry into the exponent); bf16 -> fp32 becomes the exact
    16-bit shift. Only the interpreter changes; idempotent."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.cast_impl, "_nova_bf16_fix", False):
        return
    original = builder.cast_impl

    def cast_impl(self, src, dst_type):
        s, d = src.dtype.scalar, dst_type.scalar
        if s == tl.float32 and d == tl.bfloat16:
            data = np.asarray(src.data, dtype=np.float32)
            bits = data.view(np.uint32)
            r = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
            r = np.where(np.isnan(data), (bits >> np.uint32(16)) | np.uint32(0x40), r).astype(np.uint16)
            return interpreter.TensorHandle(r, tl.bfloat16)
        if s == tl.bfloat16 and d == tl.float32:
            bits = np.asarray(src.data).astype(np.uint32) << np.uint32(16)
            return interpreter.TensorHandle(bits.view(np.float32), tl.float32)
        return original(self, src, dst_type)

    cast_impl._nova_bf16_fix = True
    builder.cast_impl = cast_impl


def load_kernel(source: str, name: str, cache_dir: str | os.PathLike | None = None):
    """Return ``(kernel, path)``: the object named ``name`` defined by ``source``
    (normally a ``@triton.jit`` function) and the file it was loaded from.

    Loading the same text twice in one process returns the same kernel object
    (one per mode: compiled, or interpreted under TRITON_INTERPRET=1).
    """
    interpreted = interpreting()  # @triton.jit picks compiled vs interpreted at import
    if interpreted:
        _fix_interpreter_bf16_dot()
        _fix_interpreter_bf16_rounding()
    digest = source_hash(source)
    key = (digest, name, interpreted)
    with _LOCK:
        hit = _LOADED.get(key)
        if hit is not None:
            return hit
        directory = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        path = directory / f"{digest}.py"
        try:
            current = path.read_text(encoding="utf-8")
        except (FileNotFoundError, UnicodeDecodeError):
            current = None
        if current != source:
            _write_atomic(path, source)
        module_name = f"nova_generated_{digest[:24]}" + ("_interpreted" if interpreted else "")
        module = sys.modules.get(module_name)
        if module is None or getattr(module, "__file__", None) != str(path):
            spec = importlib.util.spec_from_file_location(module_name, path)
            if spec is None or spec.loader is None:
                raise ImportError(f"cannot import generated kernel source {path}")
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                sys.modules.pop(module_name, None)
                raise
        try:
            kernel = getattr(module, name)
        except AttributeError:
            raise ValueError(f"generated source {path} defines no {name!r}") from None
        _LOADED[key] = (kernel, path)
        _SOURCES[id(kernel)] = source
        return kernel, path


def kernel_source(kernel) -> str:
    """The source text a kernel returned by ``load_kernel`` was built from."""
    try:
        return _SOURCES[id(kernel)]
    except KeyError:
        raise KeyError("kernel was not loaded through nova.codegen.triton.source.load_kernel") from None
