"""The step cache: a compiled step's final IR on disk, found by a structural hash.

A second process compiling the same model skips every stage after ``autodiff``:
capture, fold, fuse_loss and autodiff still run (they turn the live model into
IR, and their IR is what the key hashes), then the final IR is read back from
``<cache_dir>/steps/<key[:2]>/<key>.json``. A hit's IR prints to the same text
as a cold compile's.

The key (``key_inputs``) is a SHA-256 over everything that changes the final IR
(DESIGN.md rule 7): the IR after autodiff (ops, types, attributes, shapes,
dtypes: a SHA-256 of its table, ``ir_digest``, which says all the printed text
says at a fifth of the cost of printing it), the precision, the optimizer's
structure (``OptimizerSpec``: kinds, parameter names and flags; learning rates
and betas are runtime ``hyper`` arguments, not part of the program), the step
dtype, the device spec (None for the reference target), the guard and remat
options, the stage names, Nova's version and a hash of its own source files (an
edited compiler never reads an old entry), the module switches this process set to
other values than the source's (``changed_switches``: a script's variant, a test's
monkeypatch), and the torch, triton and xDSL versions.

``nova.loc`` strings name source files by absolute path. A path can differ
between two processes compiling the same model (a Jupyter cell lives in
``/tmp/ipykernel_<pid>/``, a test's model file in a fresh temporary directory),
so the directory part of every path in a location is replaced by a placeholder
(``<nova-dir-0>``, ...) in the hashed table and in the stored IR, and bound back
to this process's directories when an entry is read: a hit reports the same
locations a cold compile would.

An entry is JSON and nothing in it is executed or unpickled: the final IR (as
a table of ops over its distinct attributes: ``encode``; the common builtin kinds
as JSON rows rebuilt directly, the rest in MLIR syntax; ops with regions, nested
blocks and block arguments included) and the kept fields are checked against its
SHA-256, the IR is rebuilt (the MLIR text read by xDSL's parser) and verified
(once: the pipeline does not verify a hit again). The checksum catches an entry
damaged by accident, not a forged one (anyone who can write the cache directory
can write a matching SHA-256), and the kernels a hit runs are generated from the
IR's types and properties, so a hit is verified as a cold compile's IR is: by
``verify``, which raises exactly where xDSL's ``module.verify()`` raises, with
the same error, and runs each op's verifier once per distinct op (a GPT-2 step's
8,922 ops are ~700 distinct ones: a quarter of the time on CI; why that is the
same check is in its docstring). Writes are atomic (a temporary
file in the same directory, fsync, ``os.replace``), so two processes compiling
the same key at once both succeed and leave one whole entry. A corrupt or
foreign entry is logged with the reason and rebuilt by the fresh compile.

On a hit the Compilation's fields that later code reads are restored: the
optimizer spec recomputed (``RESTORE``), the remat choices and the memory plan
from the entry's kept fields (``KEPT``). The plan keeps its buffer offsets only:
storage kinds, liveness and in-place updates are recomputed from the IR, and the
offsets must be a valid placement of them (``nova.runtime.stored_plan``: the same
buffers and sizes, aligned, no two live buffers sharing a byte, the IR's
annotations agreeing) before anything binds to them; the best-fit placement and
the annotation, most of the stage's time, do not run again. A stage after
autodiff that sets another Compilation field must add its restore there, and an
option a stage reads must be added to ``key_inputs``. The cyclic garbage
collector is paused while an entry is read or made (``nova.runtime.collector``:
decoding a GPT-2 step makes ~100k objects, and the full collections they would
trigger walk every object of the process).
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import functools
import hashlib
import json
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from xdsl.dialects.builtin import ModuleOp

from nova.atomic import atomic_write
from nova.log import get_logger
from nova.runtime.collector import paused

FORMAT = 3  # the entry layout; an entry of another format is rebuilt (2: the memory plan's offsets kept;
# 3: the common attribute kinds as JSON rows)
AFTER = "autodiff"  # the stage whose IR is hashed; every later stage is cached

log = get_logger("nova.runtime.cache")


# ----------------------------------------------------------------------------
# the key


@functools.cache
def source_digest() -> str:
    """SHA-256 over Nova's own ``.py`` files (relative path and bytes), once per process."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    return h.hexdigest()


@functools.cache
def _versions() -> dict[str, str | None]:
    import importlib.metadata

    import xdsl

    import nova

    try:
        triton = importlib.metadata.version("triton")  # not imported: it is slow to load
    except importlib.metadata.PackageNotFoundError:
        triton = None
    xdsl_version = getattr(xdsl, "__version__", None)
    return {"nova": str(nova.__version__), "torch": str(torch.__version__), "triton": triton,
            "xdsl": None if xdsl_version is None else str(xdsl_version)}  # fmt: skip


class Unhashable(TypeError):
    """An option whose value has no stable text (its repr could hold an address)."""


def _plain(v):
    """``v`` as JSON values; raises ``Unhashable`` for anything without a stable form."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {f.name: _plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
    if isinstance(v, torch.dtype):
        return str(v)
    if isinstance(v, enum.Enum):
        return f"{type(v).__name__}.{v.name}"
    raise Unhashable(f"{type(v).__name__}")


# nova.loc = "<owner>, node <name>, <path>:<line>: <code>" (nova.capture.importer._location)
_PATH = re.compile(r"^(.*?, node [^,]*, )(.+?)(:\d+: )")
_PLACEHOLDER = re.compile(r"<nova-dir-(\d+)>")


def normalise_location(loc: str, dirs: list[str], fixed: bool = False) -> str:
    """``loc`` with its path's directory replaced by ``<nova-dir-i>`` (``i``: its
    place in ``dirs``, appended there unless ``fixed``; an unknown directory stays)."""

    def path(m: re.Match) -> str:
        head, p, tail = m.groups()
        d, sep, base = p.rpartition("/")
        if not sep or "\\" in d:  # printed with escapes: left as it is (then part of the key)
            return m.group(0)
        if d not in dirs:
            if fixed:
                return m.group(0)
            dirs.append(d)
        return f"{head}<nova-dir-{dirs.index(d)}>/{base}{tail}"

    return _PATH.sub(path, loc, count=1)


def bind_location(loc: str, dirs: list[str]) -> str:
    """The inverse of ``normalise_location``."""

    def one(p: re.Match) -> str:
        i = int(p.group(1))
        if i >= len(dirs):
            raise ValueError(f"location placeholder <nova-dir-{i}> has no directory")
        return dirs[i]

    return _PLACEHOLDER.sub(one, loc)


# a module-level assignment of an upper-case name: the line's first column (inside a def
# or a class it is indented); a type annotation allowed
_SWITCH_LINE = re.compile(r"^([A-Z_][A-Z0-9_]*)\s*(?::[^=]*)?=(?!=)\s*(.*)$")
_SWITCH_LINES_MAX = 200  # a literal longer than this is not a switch (and would be slow to find)


@functools.cache
def _written_switches(path: str) -> dict[str, object]:
    """The module-level ``NAME = <literal>`` assignments of upper-case names in a source
    file, with the values as written (``ast.literal_eval``; others are skipped, and so
    are empty containers: those are registries the module's imports fill, such as
    ``nova.schedule.cost.RULES``, not switches). Read line by line, not by parsing the
    file (a fifth of a second for Nova's sources, on every compile's key): a match's
    value runs on over the next lines until it parses as an expression."""
    out: dict[str, object] = {}
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        m = _SWITCH_LINE.match(line)
        if m is None or not any(ch.isalpha() for ch in m.group(1)):
            continue
        text, node = m.group(2), None
        for j in range(i + 1, min(len(lines), i + _SWITCH_LINES_MAX) + 1):
            try:
                node = ast.parse(text.strip(), mode="eval")
                break
            except SyntaxError:
                if j < len(lines):
                    text += "\n" + lines[j]
        if node is None:
            continue
        try:
            value = ast.literal_eval(node)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            continue  # not a literal (a computed constant): its inputs are switches themselves
        if not (isinstance(value, (dict, list, set, tuple)) and not value):
            out[m.group(1)] = value
    return out


_PLAIN_SWITCH = (bool, int, float, str, type(None))


def _switch_text(v) -> str:
    """A switch's value as stable text; ``Unhashable`` for a value whose repr could hold an address."""
    if isinstance(v, _PLAIN_SWITCH):
        return repr(v)
    if isinstance(v, (list, tuple)):
        inner = ", ".join(_switch_text(x) for x in v)
        return f"[{inner}]" if isinstance(v, list) else f"({inner})"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_switch_text(k)}: {_switch_text(x)}" for k, x in v.items()) + "}"
    if isinstance(v, (set, frozenset)):
        return "{" + ", ".join(sorted(_switch_text(x) for x in v)) + "}"
    raise Unhashable(f"switch value {type(v).__name__}")


def set_switches(items: list[str]) -> dict[str, str]:
    """``MODULE.NAME=VALUE`` texts (MODULE under ``nova.``, e.g.
    ``transforms.transpose_matmul.ENABLED=True``) set on their modules, for a benchmark
    or a script measuring a variant: NAME must be one of the module's switches (an
    upper-case name assigned a literal in its source) and VALUE a literal of the written
    value's type, else ``ValueError`` says which. The step cache's key holds the change
    (``changed_switches``). Returns the settings as ``changed_switches`` writes them."""
    import importlib

    done: dict[str, str] = {}
    for item in items:
        target, eq, text = item.partition("=")
        mod, _, name = target.rpartition(".")
        if not eq or not mod or not name:
            raise ValueError(f"switch {item!r}: expected MODULE.NAME=VALUE (MODULE under nova.)")
        try:
            module = importlib.import_module(f"nova.{mod}")
        except ImportError as e:
            raise ValueError(f"switch {item!r}: no module nova.{mod} ({e})") from None
        written = _written_switches(module.__file__).get(name)
        if written is None:
            raise ValueError(f"switch {item!r}: nova.{mod} has no switch {name} (an upper-case name assigned a "
                             f"literal in {Path(module.__file__).name})")
        try:
            value = ast.literal_eval(text.strip())
        except (ValueError, TypeError, SyntaxError) as e:
            raise ValueError(f"switch {item!r}: {text!r} is not a Python literal ({e})") from None
        if isinstance(written, float) and type(value) is int:
            value = float(value)
        if type(value) is not type(written):
            raise ValueError(f"switch {item!r}: nova.{target} is a {type(written).__name__} "
                             f"(written {written!r}), got a {type(value).__name__}")
        setattr(module, name, value)
        done[f"nova.{target}"] = _switch_text(value)
    return done


def changed_switches() -> dict[str, str]:
    """Nova's module-level switches (upper-case names assigned a literal in the source,
    e.g. ``nova.transforms.transpose_matmul.ENABLED``) whose value in this process is not
    the one written in the source: a script or a test that flips one compiles another
    program from the same source, so the key holds what was changed. A module not imported
    has its written values (nothing changed), so the key is the same in every process
    that changed nothing, whichever modules it has loaded. Raises ``Unhashable`` for a
    changed value without a stable text (the compile is then not cached)."""
    out: dict[str, str] = {}
    for name in sorted(sys.modules):
        if name != "nova" and not name.startswith("nova."):
            continue
        mod = sys.modules[name]
        path = getattr(mod, "__file__", None)
        if not path or not path.endswith(".py"):
            continue
        here = vars(mod)
        for attr, written in _written_switches(path).items():
            if attr not in here:
                continue
            v = here[attr]
            if type(v) is not type(written) or v != written:
                out[f"{name}.{attr}"] = _switch_text(v)
    return out


def key_inputs(c, ir_sha256: str, spec, stages: list[str]) -> dict:
    """Everything the key hashes, readable. ``ir_sha256``: the IR after AFTER (``ir_digest``)."""
    return {
        "format": FORMAT,
        "ir_after": AFTER,
        "ir_sha256": ir_sha256,
        "precision": _plain(c.precision),
        "optimizer": _plain(spec),
        "step_dtype": _plain(c.step_dtype),
        "device": _plain(c.device),
        # options other stages read (getattr: a Compilation without them has the default)
        "skip_nonfinite": _plain(getattr(c, "skip_nonfinite", False)),
        "memory_budget": _plain(getattr(c, "memory_budget", None)),
        "recompute": _plain(getattr(c, "recompute", True)),  # nova.compile(remat=)
        "data_parallel": _plain(getattr(c, "data_parallel", None)),  # the distribute stage (mode, ranks, buckets)
        "stages": list(stages),
        "switches": changed_switches(),  # module switches flipped in this process (tests, scripts' variants)
        **_versions(),
        "nova_source_sha256": source_digest(),
    }


def step_key(inputs: dict) -> str:
    text = json.dumps(inputs, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def entry_path(key: str, root: Path | None = None) -> Path:
    from nova.config import cache_dir

    return (root or cache_dir()) / "steps" / key[:2] / f"{key}.json"


# ----------------------------------------------------------------------------
# entries


class Corrupt(Exception):
    """An entry that cannot be used; the message is the reason, for the log."""


class NotStorable(Exception):
    """A compile whose entry is not written; the message is the reason, for the log."""




# The final IR is stored as a table, not as one MLIR text: xDSL's parser reads a
# GPT-2 step's 1.3 MB of generic text in 4 s (15 s with the configurator's
# lowering configs), longer than the stages it would replace. The table keeps
# each distinct attribute and type once: the common builtin kinds (strings,
# integers, integer arrays such as nova.offset, arrays, dictionaries such as the
# arguments' nova.storage / nova.offset, tensor and function types) as JSON rows
# built directly as xDSL attributes (``_plain_attr``; parsing their text was half
# of a GPT-2 hit's decode), the rest as MLIR text that one xDSL parse reads back
# (an array attribute of them); ops are rebuilt from their names, operand numbers
# and table indices, and the module is verified. Nothing is executed.
#
#   attrs  [a JSON row (a list) or the MLIR text (a string) of each distinct
#          attribute / type; a row's parts are earlier entries]
#   func   [properties {name: i}, attributes {name: i}, [argument type i]]
#   module attributes {name: i}
#   ops    [[name, [operand value], [result type i], {property: i}, {attribute: i}, loc(, regions)]]
#          values: numbered in definition order: the arguments 0..n-1, then for
#          each op the values of its regions (block arguments, nested results),
#          then its own results; loc: the op's nova.loc string (normalised; its
#          attribute index is -1), or null; regions (only on an op that has any):
#          [[[block argument type i], [op, ...]] per block] per region
#
# The same table (with this process's directories collected, not fixed) is what
# the key hashes: it says everything the printed IR says, and costs a fifth of
# printing it (each distinct attribute is printed once).


def _printer_text(attr) -> str:
    import io

    from xdsl.printer import Printer

    out = io.StringIO()
    Printer(stream=out, print_generic_format=True).print_attribute(attr)
    return out.getvalue()


@functools.cache
def _builtin():
    """The builtin attribute classes the table writes as JSON rows (imported once)."""
    from xdsl.dialects import builtin as b

    return b


def _plain_attr(a, aid) -> list | None:
    """``a`` as a JSON row of the attribute table (``aid``: the index of a part,
    entered first), or None where it is written as MLIR text. Only exact builtin
    classes (a subclass prints differently) of the common kinds:

      ["s", text]                      StringAttr
      ["i", value, type]               IntegerAttr of an integer or index type
      ["d", element type, [value]]     DenseArrayBase of an integer type (nova.offset)
      ["a", [attr]]                    ArrayAttr
      ["m", {name: attr}]              DictionaryAttr (in order: the printed IR keeps it)
      ["t", [dim], element type]       TensorType without an encoding
      ["f", [input], [output]]         FunctionType

    (``type``, ``attr``, ...: indices of earlier rows)."""
    b = _builtin()
    k = type(a)
    if k is b.StringAttr:
        return ["s", a.data]
    if k is b.IntegerAttr and type(a.type) in (b.IntegerType, b.IndexType):
        return ["i", a.value.data, aid(a.type)]
    if k is b.DenseArrayBase and type(a.elt_type) is b.IntegerType:
        return ["d", aid(a.elt_type), list(a.iter_values())]
    if k is b.ArrayAttr:
        return ["a", [aid(x) for x in a.data]]
    if k is b.DictionaryAttr:
        return ["m", {n: aid(x) for n, x in a.data.items()}]
    if k is b.TensorType and type(a.encoding) is b.NoneAttr:
        return ["t", [d.data for d in a.shape.data], aid(a.element_type)]
    if k is b.FunctionType:
        return ["f", [aid(x) for x in a.inputs.data], [aid(x) for x in a.outputs.data]]
    return None


def _rebuild_attr(row: list, attrs: list):
    """The attribute of a JSON row (``_plain_attr``); ``attrs``: the rows before it,
    rebuilt. Raises ``ValueError`` for a malformed row."""
    b = _builtin()

    def part(i):
        if type(i) is not int or not 0 <= i < len(attrs):  # only earlier rows: no cycles
            raise ValueError(f"an attribute row refers to {i!r} (row {len(attrs)})")
        return attrs[i]

    def ints(xs) -> list:
        if not isinstance(xs, list) or not all(type(x) is int for x in xs):
            raise ValueError(f"an attribute row of kind {tag!r} without a list of integers")
        return xs

    def typed(x, *classes):
        if type(x) not in classes:
            raise ValueError(f"an attribute row of kind {tag!r} with a {type(x).__name__} part")
        return x

    tag = row[0] if row else None
    n = {"s": 2, "i": 3, "d": 3, "a": 2, "m": 2, "t": 3, "f": 3}.get(tag)
    if n is None or len(row) != n:
        raise ValueError(f"an attribute row {str(row)[:60]}")
    if tag == "s":
        return b.StringAttr(typed(row[1], str))
    if tag == "i":
        return b.IntegerAttr(typed(row[1], int), typed(part(row[2]), b.IntegerType, b.IndexType))
    if tag == "d":
        return b.DenseArrayBase.from_list(typed(part(row[1]), b.IntegerType), ints(row[2]))
    if tag == "a":
        return b.ArrayAttr([part(i) for i in typed(row[1], list)])
    if tag == "m":
        return b.DictionaryAttr({typed(k, str): part(i) for k, i in typed(row[1], dict).items()})
    if tag == "t":
        return b.TensorType(part(row[2]), ints(row[1]))
    return b.FunctionType.from_lists([part(i) for i in typed(row[1], list)], [part(i) for i in typed(row[2], list)])


def encode(module: ModuleOp, dirs: list[str], fixed: bool = True) -> dict:
    """The table of ``module`` (a module holding only @train_step with one block;
    ops may hold regions, nested to any depth, but no successors); raises
    ``ValueError`` for anything else. Locations are normalised against ``dirs``
    (``normalise_location``: with ``fixed``, an unknown directory stays as it is;
    without, it is appended to ``dirs``)."""
    from xdsl.dialects import func
    from xdsl.dialects.builtin import StringAttr

    ops = list(module.ops)
    if len(ops) != 1 or not isinstance(ops[0], func.FuncOp) or len(ops[0].body.blocks) != 1:
        raise ValueError("the module is not one func.func with one block")
    fn = ops[0]
    index: dict = {}
    texts: list = []

    def aid(a) -> int:
        try:
            i = index.get(a)
        except TypeError:  # an unhashable attribute: keyed by its text
            i, a = None, _printer_text(a)
            i = index.get(a)
        if i is None:
            row = a if isinstance(a, str) else _plain_attr(a, aid)  # its parts get lower indices
            i = index[a] = len(texts)
            texts.append(row if row is not None else _printer_text(a))
        return i

    def named(d) -> dict:
        return {k: aid(v) for k, v in d.items()}

    values: dict = {}

    def number(v) -> int:
        i = values.get(v)
        if i is None:
            raise ValueError(f"a value used before its definition: {v}")
        return i

    def block_ops(block) -> list:
        table = []
        for op in block.ops:
            if op.successors:
                raise ValueError(f"{op.name} has successors")
            attrs = {}
            for k, v in op.attributes.items():  # in order: the printed IR keeps it
                attrs[k] = -1 if k == "nova.loc" and isinstance(v, StringAttr) else aid(v)
            loc = normalise_location(op.attributes["nova.loc"].data, dirs, fixed) if attrs.get("nova.loc") == -1 else None
            row = [op.name, [number(v) for v in op.operands], [aid(r.type) for r in op.results],
                   named(op.properties), attrs, loc]  # fmt: skip
            if op.regions:
                row.append([[blocks(b) for b in r.blocks] for r in op.regions])
            table.append(row)
            for r in op.results:
                values[r] = len(values)
        return table

    def blocks(b) -> list:
        types = [aid(a.type) for a in b.args]
        for a in b.args:
            values[a] = len(values)
        return [types, block_ops(b)]

    block = fn.body.block
    arg_types = [aid(a.type) for a in block.args]
    for a in block.args:
        values[a] = len(values)
    return {
        "attrs": texts,
        "func": [named(fn.properties), named(fn.attributes), arg_types],
        "module": named(module.attributes),
        "ops": block_ops(block),
    }


def decode(ir: dict, dirs: list[str], ctx=None) -> ModuleOp:
    """The module ``encode`` was given; raises on anything malformed (a corrupt
    entry). ``ctx``: the xDSL context whose ops it may hold (Nova's by default)."""
    from xdsl.dialects import func
    from xdsl.dialects.builtin import ArrayAttr, StringAttr
    from xdsl.ir import Block, Region
    from xdsl.parser import Parser

    from nova.ir.module import context

    ctx = ctx if ctx is not None else context()
    rows = ir["attrs"]
    if not isinstance(rows, list) or not all(isinstance(t, (str, list)) for t in rows):
        raise ValueError("the attribute table is not a list of strings and rows")
    texts = [t for t in rows if isinstance(t, str)]
    table = Parser(ctx, "[" + ", ".join(texts) + "]").parse_attribute() if texts else ArrayAttr([])
    if not isinstance(table, ArrayAttr) or len(table.data) != len(texts):
        raise ValueError("the attribute table does not read back entry by entry")
    parsed = iter(table.data)
    attrs: list = []
    for row in rows:
        attrs.append(next(parsed) if isinstance(row, str) else _rebuild_attr(row, attrs))
    classes: dict = {}

    def named(d: dict) -> dict:
        return {str(k): attrs[i] for k, i in d.items()}

    def index(i) -> int:
        if type(i) is not int or i < 0:  # a negative index would count from the end
            raise ValueError(f"an index {i!r} in the table")
        return i

    def fill(block: Block, rows: list) -> None:
        for row in rows:
            name, operands, results, props, op_attrs, loc = row[:6]
            regions = row[6] if len(row) == 7 else []
            if len(row) not in (6, 7) or not regions and len(row) == 7:
                raise ValueError(f"an op row of {len(row)} fields")
            cls = classes.get(name)
            if cls is None:
                cls = classes[name] = ctx.get_optional_op(name)
                if cls is None:
                    raise ValueError(f"unknown op {name!r}")
            a = {str(k): StringAttr(bind_location(loc, dirs)) if i == -1 else attrs[index(i)] for k, i in op_attrs.items()}
            made = [Region([new_block(b) for b in r]) for r in regions]
            op = cls.create(operands=[values[index(i)] for i in operands], result_types=[attrs[index(i)] for i in results],
                            properties=named(props), attributes=a, regions=made)  # fmt: skip
            block.add_op(op)
            values.extend(op.results)

    def new_block(b: list) -> Block:
        types, rows = b
        block = Block(arg_types=[attrs[index(i)] for i in types])
        values.extend(block.args)
        fill(block, rows)
        return block

    fprops, fattrs, arg_types = ir["func"]
    block = Block(arg_types=[attrs[index(i)] for i in arg_types])
    values = list(block.args)
    fill(block, ir["ops"])
    fn = func.FuncOp.create(properties=named(fprops), attributes=named(fattrs), regions=[Region(block)])
    return ModuleOp.create(attributes=named(ir["module"]), regions=[Region(Block([fn]))])


# ----------------------------------------------------------------------------
# verifying a decoded module
#
# xDSL's ``module.verify()`` runs every op's generic IRDL verifier (operand and
# result constraints, properties, attributes, traits) and its custom ``verify_``:
# 28 us an op, 0.26 s for a GPT-2 step's 8,922 ops, most of a hit's lookup. Most
# of those ops repeat: 12 layers of the same ops on the same types. ``verify``
# runs exactly that check, but once per class of ops whose outcome it cannot tell
# apart (the argument is in ``verify``'s docstring).


def _local_verifier(cls) -> bool:
    """Whether ``cls``'s ``verify_`` reads nothing but the op's own operand types,
    result types, properties and declared attributes: its IRDL definition's checks
    (``OpDef.verify``), traits whose ``verify`` is the base no-op (Pure, ...), and a
    custom verifier that is none or ``NovaOp.verify_`` (type inference from operand
    types and properties, compared with the result types). Anything else (a custom
    verifier of its own, HasParent, IsTerminator, ...), or an xDSL whose generated
    ``verify_`` does not look as expected, is False: verified op by op."""
    from xdsl.irdl import IRDLOperation
    from xdsl.traits import OpTrait

    from nova.ir.dialect import NovaOp

    if not issubclass(cls, IRDLOperation):
        return False
    f = cls.__dict__.get("verify_")
    cells = getattr(f, "__closure__", None) or ()
    names = getattr(getattr(f, "__code__", None), "co_freevars", ())
    if len(names) != len(cells) or set(names) - {"op_def", "custom_verify"} or "op_def" not in names:
        return False
    free = dict(zip(names, (c.cell_contents for c in cells), strict=True))
    custom = free.get("custom_verify")
    if custom is not None and custom not in (NovaOp.__dict__["verify_"], IRDLOperation.verify_):
        return False
    op_def = free["op_def"]
    if op_def is not cls.get_irdl_definition() or op_def.regions or op_def.successors:
        return False
    return all(type(t).verify is OpTrait.verify for t in op_def.traits)


_LOCAL: dict[type, dict | None] = {}  # op class -> its declared attributes if _local_verifier(class), else None
_UNSEEN = object()


def verify(module: ModuleOp) -> None:
    """Raises where ``module.verify()`` raises; the same checks, each distinct op once.

    Every op gets the structural checks of ``Operation.verify`` (no erased operand,
    its parent pointers, a terminator where its block needs one: an op that ends
    its block is verified as it is); an op with regions or of a class without a
    local verifier (``_local_verifier``) gets all of ``Operation.verify``. An op of
    a class with one is verified in full the first time its *verification inputs*
    are seen: its class, the objects of its operand types, result types,
    properties and declared attributes (by identity: the module holds them all,
    and a decoded entry shares one object per distinct attribute), with no regions
    or successors. Its verifier reads nothing else, so a later op with the same
    inputs would get the same outcome: pass. The walk is xDSL's order (an op's
    regions before its own verifier), so the error raised is the one
    ``module.verify()`` raises (where an op with regions fails both its own
    structural checks and inside its regions, the inner error comes first here)."""
    from xdsl.ir import ErasedSSAValue
    from xdsl.traits import NoTerminator
    from xdsl.utils.exceptions import VerifyException

    seen: set = set()

    def one(op) -> None:
        cls = type(op)
        declared = _LOCAL.get(cls, _UNSEEN)
        if declared is _UNSEEN:
            declared = _LOCAL[cls] = cls.get_irdl_definition().attributes if _local_verifier(cls) else None
        if declared is not None and not op.regions and not op.successors and op.next_op is not None:
            key = (cls, tuple(id(v.type) for v in op.operands), tuple(id(r.type) for r in op.results),
                   tuple((k, id(v)) for k, v in op.properties.items()),
                   tuple((k, id(v)) for k, v in op.attributes.items() if k in declared))  # fmt: skip
            if key in seen:
                for v in op.operands:
                    if isinstance(v, ErasedSSAValue):
                        raise ValueError("Erased SSA value is used by the operation")
                return
            op.verify(verify_nested_ops=False)
            seen.add(key)
            return
        for region in op.regions:
            for block in region.blocks:
                for inner in block.ops:
                    if inner.parent is not block:
                        raise ValueError("Parent pointer of operation does not refer to containing region")
                    one(inner)
                if block.first_op is None and len(region.blocks) == 1 and not op.has_trait(NoTerminator):
                    raise VerifyException(f"Operation {op.name} contains empty block in single-block region "
                                          "that expects at least a terminator")  # fmt: skip
                if block.parent is not region:
                    raise ValueError("Parent pointer of block does not refer to containing region")
        op.verify(verify_nested_ops=False)

    one(module)


def checksum(entry: dict) -> str:
    """SHA-256 over an entry's IR table and kept fields."""
    text = json.dumps([entry.get("ir"), entry.get("fields")], separators=(",", ":"))  # order kept: the IR's
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def store(path: Path, key: str, inputs: dict, ir: dict, stages: list[str], fields: dict | None = None) -> None:
    """Writes an entry atomically. ``ir``: the final IR's table (``encode``);
    ``fields``: the Compilation fields kept as data (``KEPT``)."""
    entry = {"format": FORMAT, "key": key, "inputs": inputs, "stages": list(stages), "ir": ir, "fields": fields or {}}
    entry["sha256"] = checksum(entry)
    data = json.dumps(entry, separators=(",", ":")).encode("utf-8")
    atomic_write(path, lambda f: f.write(data))


def load(path: Path, key: str, inputs: dict, dirs: list[str], times: dict | None = None) -> tuple[ModuleOp, dict] | None:
    """The verified final IR of the entry at ``path`` and its kept fields; None
    where there is none. Raises ``Corrupt`` (with the reason) for an entry that
    cannot be used. ``times``: seconds of each part, as ``cache.lookup/<part>``."""
    t = _Timer(times)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise Corrupt(f"unreadable ({e.strerror or e})") from None
    try:
        entry = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise Corrupt(f"not valid JSON ({e}; {len(data)} bytes: truncated?)") from None
    if not isinstance(entry, dict):
        raise Corrupt(f"not an entry (a JSON {type(entry).__name__})")
    if entry.get("format") != FORMAT:
        raise Corrupt(f"format version {entry.get('format')!r}, this Nova reads {FORMAT}")
    if entry.get("key") != key:
        raise Corrupt(f"a foreign entry: written for key {str(entry.get('key'))[:16]}...")
    if entry.get("inputs") != inputs:
        theirs = entry.get("inputs") if isinstance(entry.get("inputs"), dict) else {}
        differ = sorted(k for k in {*inputs, *theirs} if inputs.get(k) != theirs.get(k))
        raise Corrupt(f"a foreign entry: its key inputs differ in {differ}")
    ir, fields = entry.get("ir"), entry.get("fields")
    if not isinstance(ir, dict) or not isinstance(fields, dict) or not isinstance(entry.get("sha256"), str):
        raise Corrupt("no IR, fields or checksum")
    if checksum(entry) != entry["sha256"]:
        raise Corrupt("checksum mismatch: the IR is not the IR that was stored")
    t.lap("read")
    try:
        module = decode(ir, dirs)
    except Exception as e:  # xDSL's ParseError, KeyError/IndexError/ValueError of a malformed table, ...
        raise Corrupt(f"the IR does not read back: {type(e).__name__}: {_first_line(e)}") from None
    t.lap("decode")
    try:
        verify(module)
    except Exception as e:
        raise Corrupt(f"the IR fails verification: {type(e).__name__}: {_first_line(e)}") from None
    t.lap("verify")
    return module, fields


class _Timer:
    """Laps into ``times`` as ``cache.lookup/<part>`` (the parts of the lookup's time)."""

    def __init__(self, times: dict | None):
        self.times, self.t0 = times, time.perf_counter()

    def lap(self, part: str) -> None:
        now = time.perf_counter()
        if self.times is not None:
            self.times[f"cache.lookup/{part}"] = now - self.t0
        self.t0 = now


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else ""


# ----------------------------------------------------------------------------
# the pipeline's side


def _restore_spec(c, looked: "Lookup") -> None:
    c.spec = looked.spec


def _keep_remat(c, dirs: list[str]) -> list:
    return [{**dataclasses.asdict(ch), "loc": None if ch.loc is None else normalise_location(ch.loc, dirs, fixed=True)}
            for ch in c.remat]  # fmt: skip


def _restore_remat(c, data: list, dirs: list[str], module: ModuleOp) -> None:
    from nova.transforms.remat import Choice

    c.remat = [Choice(**{**d, "loc": None if d["loc"] is None else bind_location(d["loc"], dirs)}) for d in data]


def _keep_memory(c, dirs: list[str]) -> list:
    # plan_from_offsets assembles the plan as plan_memory does: checked here, where
    # both are at hand, so that a hit can never bind to a plan a cold compile would
    # not have made (an entry is not stored then, and the log says why)
    from nova.pipeline import arena_scratch
    from nova.runtime.stored_plan import differences, plan_from_offsets, stored_offsets

    data = stored_offsets(c.module, c.memory)
    differ = differences(plan_from_offsets(c.module, arena_scratch(c.device, c.module), data), c.memory)
    if differ:
        raise NotStorable(f"the memory plan does not rebuild from its stored offsets: it differs in {differ}")
    return data


def _restore_memory(c, data: list, dirs: list[str], module: ModuleOp) -> None:
    # the plan of the cached IR with its stored offsets: storage, liveness and the
    # in-place decisions recomputed, the offsets checked to be a valid placement of
    # them (plan_from_offsets); the best-fit placement and annotate do not run again
    from nova.pipeline import arena_scratch
    from nova.runtime.stored_plan import plan_from_offsets

    c.memory = plan_from_offsets(module, arena_scratch(c.device, module), data)


# stage -> what it leaves on the Compilation besides the IR: recomputed on a hit
# (RESTORE), or kept in the entry as plain data (KEPT: (keep(c, dirs) -> data,
# restore(c, data, dirs, module))), for what a stage decided that the final IR
# does not say (the remat choices), or says only at the cost of running the stage
# again (the memory plan's offsets). A kept field that does not read back, or a
# stage's kept field that is missing, makes the entry corrupt.
RESTORE: dict[str, Callable] = {"optimizer": _restore_spec}
KEPT: dict[str, tuple[Callable, Callable]] = {"remat": (_keep_remat, _restore_remat),
                                              "plan_memory": (_keep_memory, _restore_memory)}  # fmt: skip


@dataclass
class Lookup:
    key: str
    path: Path
    inputs: dict
    dirs: list[str]  # the directories of this process's locations (normalise_location)
    spec: object | None  # the OptimizerSpec, computed for the key
    module: ModuleOp | None = None  # the cached final IR, on a hit
    fields: dict | None = None  # the kept fields (KEPT), on a hit
    status: str = "miss"  # "hit" | "miss" | "rebuilt: <reason>"


def ir_digest(module: ModuleOp) -> tuple[str, list[str]]:
    """SHA-256 of ``module``'s table (``encode``, locations normalised), and the
    directories of its locations in order of first appearance."""
    dirs: list[str] = []
    table = encode(module, dirs, fixed=False)
    text = json.dumps(table, separators=(",", ":"))  # ASCII: any string encodes
    return hashlib.sha256(text.encode("ascii")).hexdigest(), dirs


def lookup(c, stages: list[str]) -> Lookup | str:
    """After AFTER: the key and, on a hit, the cached final IR with the kept fields
    restored onto ``c``. Returns a reason string where this compile cannot be cached
    (an option without a stable form). Adds ``cache.lookup/<part>`` to ``c.times``."""
    from nova.transforms.optimizer import OptimizerSpec

    t = _Timer(c.times)
    spec = None
    if c.optimizer is not None:
        names = {id(p): n for n, p in c.captured.params.items()}
        spec = OptimizerSpec.from_torch(c.optimizer, names)
    try:
        digest, dirs = ir_digest(c.module)
    except ValueError as e:
        return f"the IR after {AFTER} has no table: {e}"
    try:
        inputs = key_inputs(c, digest, spec, stages)
    except Unhashable as e:
        return f"an option of type {e} has no stable text to hash"
    key = step_key(inputs)
    looked = Lookup(key, entry_path(key), inputs, dirs, spec)
    t.lap("key")
    try:
        with paused():
            found = load(looked.path, key, inputs, dirs, c.times)
            t = _Timer(c.times)
            if found is not None:
                module, fields = found
                unknown = sorted(set(fields) - set(KEPT))
                if unknown:
                    raise Corrupt(f"a kept field of no stage: {unknown}")
                missing = [n for n in KEPT if n in stages and n not in fields]
                if missing:
                    raise Corrupt(f"no kept field of the stages {missing}")
                for name, data in fields.items():
                    try:
                        KEPT[name][1](c, data, dirs, module)  # a miss compiles again and overwrites it
                    except Exception as e:
                        raise Corrupt(f"the kept field {name!r} does not read back: {type(e).__name__}: "
                                      f"{_first_line(e)}") from None  # fmt: skip
                    t.lap(f"kept {name}")
                looked.module, looked.fields = found
    except Corrupt as e:
        looked.status = f"rebuilt: {e}"
        log.warning("step cache entry %s is unusable, compiling it again: %s", looked.path, e)
        return looked
    if looked.module is not None:
        looked.status = "hit"
    return looked


def restore(c, looked: Lookup, later: list[str]) -> None:
    """Makes ``c`` what the ``later`` stages would have left: the cached IR as the
    module, and each stage's other fields recomputed (``RESTORE``; the ``KEPT``
    ones were set by ``lookup``)."""
    from nova.ir.module import step_func

    c.captured.module = looked.module
    c.captured.fn = step_func(looked.module)
    for name in later:
        fix = RESTORE.get(name)
        if fix is not None:
            fix(c, looked)


def save(c, looked: Lookup) -> None:
    """Stores the final IR under the key; a failure is logged, never raised (the
    compile itself succeeded)."""
    try:
        with paused():
            ir = encode(c.module, looked.dirs)
            fields = {name: keep(c, looked.dirs) for name, (keep, _) in KEPT.items() if name in looked.inputs["stages"]}
    except (ValueError, NotStorable) as e:
        log.warning("step cache: not storing %s: %s", looked.path, e)
        return
    try:
        store(looked.path, looked.key, looked.inputs, ir, looked.inputs["stages"], fields)
    except OSError as e:
        log.warning("step cache: could not store %s: %s", looked.path, e)
