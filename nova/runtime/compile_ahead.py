"""Every Triton kernel of a launch list compiled in parallel, before its first run.

Triton compiles a kernel at its first launch, one after the other: GPT-2's step has
about 80 distinct kernels, 20-40 s of a cold compile on the H200 machine, most of it
in Triton's MLIR and LLVM passes and ptxas, which run without the GIL. So before the
first run the executable walks its launch list once inside ``ahead()``:

  * a launch of a kernel Triton has not compiled yet neither compiles nor launches:
    Triton's ``jit_cache_hook`` (called before every compile, with the launch's
    specialization) hands that specialization to ``JITFunction.preload`` under
    ``triton.AsyncCompileMode``, which compiles it on a thread pool, and answers
    "handled", so that ``run`` returns without a launch;
  * leaving ``ahead()`` waits for every compile and puts each kernel into its
    JITFunction's cache, where the first run finds it under the same key.

A kernel already compiled (by another program of the process) does launch during
the walk, on whatever the arena holds: so the walk must be harmless to run on
garbage. The executable sees to that (``Executable.compile_ahead``): only kernel
launches are walked (no copies back into parameters, no collectives), and a launch
that writes the caller's tensors in place (parameters, optimizer state, buffers)
writes views of the arena instead, which the first run overwrites anyway. A
kernel's launch never reads a device value on the host (the lowering contract), so
garbage cannot change what it launches.

``NOVA_COMPILE_THREADS`` (default: the CPUs, at most 16) sets the pool; 1 turns the
walk off (kernels compile at their first launch). Under ``TRITON_INTERPRET=1``
nothing is compiled and there is no walk.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

from nova.config import positive_int_env

_LOCAL = threading.local()  # .preloading: the hook's own preload call is a real compile request


def threads() -> int:
    """``NOVA_COMPILE_THREADS``, or the CPUs this process may use (at most 16)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return positive_int_env("NOVA_COMPILE_THREADS", max(1, min(16, cpus)))


@contextmanager
def ahead(workers: int) -> Iterator[dict]:
    """See the module docstring. Yields a dict that counts, on leaving, the kernels
    ``submitted`` to the pool (distinct specializations)."""
    import triton
    from triton import knobs

    stats = {"submitted": 0}
    seen: set[str] = set()
    walker = threading.get_ident()

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):  # noqa: A002 (Triton's names)
        if threading.get_ident() != walker or getattr(_LOCAL, "preloading", False):
            return None  # another thread's launch, or our own preload: compile as usual (ours on the pool)
        data = compile["specialization_data"]
        if data not in seen:
            seen.add(data)
            _LOCAL.preloading = True
            try:
                fn.jit_function.preload(data)  # submitted to the pool (AsyncCompileMode), returns at once
            finally:
                _LOCAL.preloading = False
            stats["submitted"] += 1
        return True  # handled: this launch neither compiles nor launches

    previous = knobs.runtime.jit_cache_hook
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="nova-compile") as pool:
        with triton.AsyncCompileMode(pool):  # leaving it waits for every compile and caches the kernels
            knobs.runtime.jit_cache_hook = hook
            try:
                yield stats
            finally:
                knobs.runtime.jit_cache_hook = previous
