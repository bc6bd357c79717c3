"""``nova bench <benchmark>``: the benchmark programs of ``bench/``.

The programs live in the repository's ``bench/`` folder, beside their results,
not in the installed package; this command loads them from the checkout that
holds this package (an editable install), so ``nova bench matmul`` and
``python bench/matmul.py`` run the same code.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from nova.cli.errors import UsageError

HELP = ("run a benchmark on the GPU (matmul: Nova vs cuBLAS vs a config search; "
        "gpt2: training steps in eager, torch.compile and Nova)")
BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"
BENCHMARKS = {
    "matmul": "Nova's configured matmul vs cuBLAS vs the best of a config search",
    "gpt2": "GPT-2 training steps (tok/s, peak memory, compile time, loss) in eager, torch.compile and Nova",
}


def load_benchmark(name: str) -> ModuleType:
    path = BENCH_DIR / f"{name}.py"
    if not path.is_file():
        raise UsageError(f"{path} not found: nova bench runs from a source checkout (pip install -e .)")
    module_name = f"nova_bench_{name}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # dataclasses and pickling look modules up by name
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[module_name]
            raise
    return sys.modules[module_name]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    for name, help_text in BENCHMARKS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        try:
            load_benchmark(name).add_arguments(p)
        except UsageError:
            pass  # no checkout: `run` says so when the benchmark is asked for


def apply_switches(items: list[str]) -> dict[str, str]:
    """A benchmark's --set MODULE.NAME=VALUE items set on Nova's modules
    (``nova.runtime.cache.set_switches``; a bad one is a ``UsageError``); returns every
    switch of this process that differs from its source (``changed_switches``), which the
    results record."""
    from nova.runtime import cache

    try:
        cache.set_switches(items)
    except ValueError as e:
        raise UsageError(f"--set: {e}") from None
    return cache.changed_switches()


def without_triton(e: ModuleNotFoundError) -> UsageError:
    """The error for a benchmark that reached for Triton where it is not installed."""
    if e.name != "triton":
        raise e
    return UsageError("this benchmark needs Triton, which is not installed here: on Linux `pip install -e .` "
                      "brings it (or pip install 'triton==3.6.0'); Triton has no wheels for other systems")


def run(args: argparse.Namespace) -> int:
    try:
        load_benchmark(args.benchmark).run_args(args, log=lambda s: print(s, flush=True))
    except ModuleNotFoundError as e:
        raise without_triton(e) from None
    return 0


def bench_matmul_main(argv: list[str] | None = None) -> int:
    """``nova bench matmul ARGS`` as a function (for tests and scripts)."""
    try:
        try:
            return load_benchmark("matmul").main(argv)
        except ModuleNotFoundError as e:
            raise without_triton(e) from None
    except UsageError as e:
        print(f"nova bench matmul: error: {e}", file=sys.stderr)
        return 2
