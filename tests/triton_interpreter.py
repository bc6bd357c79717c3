"""Two pieces of work that Triton 3.6's interpreter does and whose results nothing reads, skipped.
tests/conftest.py applies this in the test processes, tests/distributed/workers.py in the ranks it
spawns. No value a kernel computes changes; the suite's time does (CI allows 20 minutes)."""

from __future__ import annotations

import dataclasses


def drop_dead_work() -> None:
    from triton.runtime import interpreter

    if getattr(interpreter, "_nova_dead_work_dropped", False):
        return
    interpreter._nova_dead_work_dropped = True

    # 1. The integer-overflow sanitizer (InterpreterOptions.sanitize_overflow, on by default) widens
    # every int32 add, sub and mul to int64, computes it again, compares it with the int32 range and
    # hands the result to device_assert, which returns without looking at it unless the options'
    # debug flag is on (triton/language/semantic.py, device_assert). No check is lost: the assert
    # never ran. cProfile: 20 of the 53 s of interpreted kernels in one test_steady.py case.
    interpreter.interpreter_builder.options = dataclasses.replace(
        interpreter.interpreter_builder.options, sanitize_overflow=False
    )

    # 2. Every call of a @triton.jit function from inside a kernel (tl.sum, tl.max and tl.cdiv are
    # such functions, in triton/language/standard.py) patches triton.language again
    # (InterpretedFunction.__call__ -> _patch_lang: inspect.getmembers over the modules, about 1 ms)
    # and drops the scope it returns unrestored. Nothing is restored before the launch ends
    # (GridExecutor.__call__ restores its own scope last), so a second patch of the same globals
    # within a launch sets what is set already: here each globals is patched once a launch.
    # cProfile: 24 of the 105 s of one test_fused_reduction.py case.
    patch_lang = interpreter._patch_lang
    patched: set[int] = set()  # id(fn.__globals__) of what was patched since the launch began

    class LaunchScope:
        def __init__(self, scope):
            self.scope = scope

        def restore(self):
            patched.clear()
            self.scope.restore()

    def patch_lang_once(fn):
        key = id(fn.__globals__)
        if key in patched:
            return interpreter._LangPatchScope()  # a call inside the launch: nothing to set again
        scope = patch_lang(fn)
        patched.add(key)
        return LaunchScope(scope)

    interpreter._patch_lang = patch_lang_once
