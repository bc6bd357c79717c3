"""Turn generated Triton source text into a callable ``@triton.jit`` kernel.

Every kernel template in this folder emits Python source text; this module is the
one place that makes such text executable. ``@triton.jit`` reads the function's
source back with ``inspect``, so the text must live in a real file: it is written
to ``<cache>/<sha256>.py`` (atomically: temporary file, then ``os.replace``) so
that it can be read and diffed, but it is never imported: the import system would
run a ``__pycache__/*.pyc`` whose recorded timestamp and size match (a forged one
in a shared ``NOVA_CACHE_DIR`` would run, a truncated one fails). Only the text in
hand is executed: ``compile()`` of that exact string into a fresh module object,
registered in ``linecache`` under a ``<nova kernel ...>`` name (no file on disk
can stand in for it) so that ``@triton.jit`` and ``inspect.getsource`` read back
the same text. The same source maps, within a process, to the same kernel object
(and therefore to Triton's per-kernel compile cache).

Triton picks interpreted vs compiled when a ``@triton.jit`` object is created, and
``triton.language``'s own library functions (``tl.cdiv``, ``tl.sum``, ...) are
created once, when it is first imported. A kernel of the other mode than that
library cannot be built (a compiled kernel would call the interpreter from inside
the compiler: ``InterpreterError ... 'block_argument' object has no attribute
'dtype'``), so ``load_kernel`` refuses it with an error that says so.

Under ``TRITON_INTERPRET=1`` the interpreter's ``tl.dot`` multiplies the raw uint16
bit patterns of bfloat16 operands (triton-lang/triton#11584, declined upstream as
"not supported yet"), and its fp32 -> bf16 cast truncates where the GPU rounds to
nearest even; ``load_kernel`` installs small fixes for both, so the same kernel
text is tested on the CPU that runs on the GPU.
"""

from __future__ import annotations

import hashlib
import linecache
import os
import sys
import threading
import types
from pathlib import Path

from nova.atomic import atomic_write

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


def library_interpreted() -> bool:
    """Whether ``triton.language``'s own ``@jit`` library (``tl.cdiv``, ``tl.sum``, ...)
    was created for the interpreter: fixed for the process when it was first imported."""
    import triton.language as tl

    return type(tl.standard.cdiv).__name__ == "InterpretedFunction"


def _check_mode(interpreted: bool) -> None:
    library = library_interpreted()
    if library == interpreted:
        return
    have, want = ("interpreted", "compiled") if library else ("compiled", "interpreted")
    raise RuntimeError(
        f"cannot build a {want} Triton kernel in this process: triton.language was imported "
        f"{'with' if library else 'without'} TRITON_INTERPRET=1, so its library functions (tl.cdiv, tl.sum, ...) "
        f"are {have} for the whole process and a {want} kernel cannot call them; set or unset TRITON_INTERPRET "
        "before triton is first imported, or build the kernel in another process"
    )


def _exec_verified(source: str, name: str, digest: str, path: Path, module_name: str):
    """Executes exactly ``source`` as a fresh module; returns its ``name``."""
    filename = f"<nova kernel {path}>"
    # mtime None: linecache.checkcache() never drops or re-reads it; a '<...>' name is
    # never looked up on disk, so no file can replace the text triton.jit reads back
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    code = compile(source, filename, "exec", dont_inherit=True)
    module = types.ModuleType(module_name)
    module.__dict__["__nova_source_sha256__"] = digest
    sys.modules[module_name] = module  # inspect.getmodule() and triton find the globals by name
    try:
        exec(code, module.__dict__)
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    try:
        return getattr(module, name)
    except AttributeError:
        raise ValueError(f"generated source {path} defines no {name!r}") from None


def load_kernel(source: str, name: str, cache_dir: str | os.PathLike | None = None):
    """Return ``(kernel, path)``: the object named ``name`` defined by ``source``
    (normally a ``@triton.jit`` function) and the file its text was written to.

    Loading the same text twice in one process returns the same kernel object
    (one per mode: compiled, or interpreted under TRITON_INTERPRET=1). Raises
    ``RuntimeError`` where the mode differs from ``triton.language``'s (see above).
    """
    interpreted = interpreting()  # @triton.jit picks compiled vs interpreted at creation
    digest = source_hash(source)
    key = (digest, name, interpreted)
    with _LOCK:
        hit = _LOADED.get(key)
        if hit is not None:
            return hit
        if interpreted:
            _fix_interpreter_bf16_dot()
            _fix_interpreter_bf16_rounding()
        directory = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        path = directory / f"{digest}.py"
        try:
            current = path.read_text(encoding="utf-8")
        except (FileNotFoundError, UnicodeDecodeError):
            current = None
        if current != source:
            atomic_write(path, lambda f: f.write(source.encode("utf-8")), durable=False)  # for reading and diffing only: never executed
        module_name = f"nova_generated_{digest[:24]}" + ("_interpreted" if interpreted else "")
        kernel = _exec_verified(source, name, digest, path, module_name)
        if type(kernel).__module__.startswith("triton."):  # a @triton.jit object
            try:
                _check_mode(interpreted)
            except RuntimeError:
                sys.modules.pop(module_name, None)
                raise
            if not interpreted:  # unless NOVA_WGMMA_CHECK=0: every compile of a generated kernel read for wgmma races
                from nova.codegen.triton.wgmma_check import install

                install()
        _LOADED[key] = (kernel, path)
        _SOURCES[id(kernel)] = source
        return kernel, path


def kernel_source(kernel) -> str:
    """The source text a kernel returned by ``load_kernel`` was built from."""
    try:
        return _SOURCES[id(kernel)]
    except KeyError:
        raise KeyError("kernel was not loaded through nova.codegen.triton.source.load_kernel") from None
