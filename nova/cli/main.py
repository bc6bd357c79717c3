"""The ``nova`` command line: ``nova <subcommand> [options]``.

Each subcommand is a module listed in COMMANDS that provides ``HELP`` (its
description), ``add_arguments(parser)`` and ``run(args) -> int``. Adding a
subcommand means writing that module and adding one line here.

Only the module of the subcommand being run is imported: ``nova train`` does
not pay for (or depend on) what ``nova bench`` imports, and vice versa.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import platform
import sys

import nova
from nova.cli.errors import RunFailed, UsageError

# name -> (module, one-line help for `nova --help`)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("nova.cli.train", "train a small byte-level GPT and report its loss"),
    "sample": ("nova.cli.sample", "generate text from a model nova train saved"),
    "explain": ("nova.cli.explain", "print a compiled training step's IR after every pipeline stage"),
    "bench": ("nova.cli.bench", "run a benchmark on the GPU"),
}


def version() -> str:
    # Read from the installed metadata, not imported: `nova --version` stays instant.
    def installed(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    return (f"nova {nova.__version__} (torch {installed('torch')}, triton {installed('triton')}, "
            f"xdsl {installed('xdsl')}, Python {platform.python_version()})")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser, with full options for ``command`` and a stub for the others."""
    parser = argparse.ArgumentParser(prog="nova", description="Nova: a JIT compiler for whole training steps.")
    parser.add_argument("--version", action="version", version=version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        if name != command:
            sub.add_parser(name, help=help_text)
            continue
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=help_text, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # The top-level options (-h, --version) take no value, so the first word is the command.
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command).parse_args(argv)
    try:
        return args._run(args)
    except UsageError as e:
        print(f"nova {args.command}: error: {e}", file=sys.stderr)
        return 2
    except RunFailed as e:
        print(f"nova {args.command}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # Ctrl-C outside a training loop (which handles it itself): nothing to save.
        print(f"\nnova {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
