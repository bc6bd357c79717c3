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
  * each compiled kernel's launcher is built on the pool too: Triton 3.6 compiles a
    small C module per distinct launch signature with the system's C compiler (about
    0.3-0.6 s each, serially at the first launch otherwise: most of what a cold first
    step spent beyond the kernels' own compiles); built here, it lands in Triton's
    on-disk cache, where the first launch finds it;
  * leaving ``ahead()`` waits for every compile and launcher and puts each kernel into
    its JITFunction's cache, where the first run finds it under the same key.

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
from nova.log import get_logger

_LOG = get_logger(__name__)

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
    ``submitted`` to the pool (distinct specializations) and the ``launchers`` built
    there (distinct launch signatures)."""
    import triton
    from triton import knobs

    stats = {"submitted": 0, "launchers": 0}
    seen: set[str] = set()
    signatures: set[str] = set()
    lock = threading.Lock()
    walker = threading.get_ident()
    launchers: list = []  # the launcher builds' futures, on the pool the hook submits to

    def build_launcher(compiled) -> None:
        """The launcher of the kernel ``compiled`` (a future of the pool, submitted
        before this task, so already running: no wait on a queued task) built into
        Triton's cache. A failure is left to the first launch, which builds it again
        and raises there, where it belongs."""
        from triton.runtime.driver import driver

        kernel = compiled.result()
        src = kernel.src
        key = repr((sorted(src.signature.items()), sorted(getattr(src, "constants", {}).items(), key=repr),
                    getattr(kernel.metadata, "tensordesc_meta", None)))  # fmt: skip
        with lock:
            if key in signatures:
                return
            signatures.add(key)
        driver.active.launcher_cls(src, kernel.metadata)
        with lock:
            stats["launchers"] += 1

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):  # noqa: A002 (Triton's names)
        if threading.get_ident() != walker or getattr(_LOCAL, "preloading", False):
            return None  # another thread's launch, or our own preload: compile as usual (ours on the pool)
        data = compile["specialization_data"]
        if data not in seen:
            seen.add(data)
            _LOCAL.preloading = True
            try:
                future = fn.jit_function.preload(data)  # submitted to the pool (AsyncCompileMode), returns at once
            finally:
                _LOCAL.preloading = False
            stats["submitted"] += 1
            if future is not None:  # its launcher next, on the pool, after the compile
                launchers.append(pool.submit(build_launcher, future.future))
        return True  # handled: this launch neither compiles nor launches

    previous = knobs.runtime.jit_cache_hook
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="nova-compile") as pool:
        with triton.AsyncCompileMode(pool):  # leaving it waits for every compile and caches the kernels
            knobs.runtime.jit_cache_hook = hook
            try:
                yield stats
            finally:
                knobs.runtime.jit_cache_hook = previous
        for f in launchers:
            try:
                f.result()
            except Exception:  # noqa: BLE001  (the first launch builds it again and raises there)
                _LOG.debug("a launcher did not build ahead", exc_info=True)
