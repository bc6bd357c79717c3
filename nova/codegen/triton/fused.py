"""The lowering of ``nova.fused`` (kind elementwise): one kernel per group; and
the epilogue of a kind "contraction" group for the matmul template
(``epilogue_of``: the same composition, starting from the accumulator).

The kernel is ``elementwise.pointwise_source``'s loop over the group's iteration
shape; its body is the composition, in block order, of the inner ops'
expressions (``elementwise.EXPRESSIONS``, the same ones the single-op kernels are
made of), so an elementwise op with an expression fuses without code here.

Bit-identical to the unfused kernels, by construction:

* every inner value is converted to its IR dtype exactly where the unfused
  kernel would have stored it (``convert(y, expression type, stored type)``: a
  bf16 intermediate is rounded to bf16), and each reader converts that stored
  form as its own kernel would have loaded it (bf16 -> fp32, bools -> int1);
* floating-point contraction is off in every pointwise kernel (``Pointwise``
  launches with ``enable_fp_fusion=False``): a mul of one op and an add of the
  next are never merged into an fma the unfused kernels could not form.

Operands are the group's inputs, each loaded once in its stored form through its
own strides, as in any pointwise kernel (broadcast operands, transposed and
sliced views are read in place; contiguous ones of the iteration shape at the
flat index, ``DENSE<k>``). One-element operands are 0-d loads, and the scalar
ops computed from them (the optimizer's bias corrections) run once per thread,
not per element. Outputs are written contiguously at the flat index after every
load, so an output may be an input of the iteration shape itself (the in-place
parameter and state update; ``plan_memory`` allows exactly that).

A matmul's epilogue keeps the same guarantees: the matmul's result enters as the
unfused matmul kernel stores it (the fp32 accumulator converted to the matmul's
dtype: a bf16 matmul's readers see bf16 values, then widen them), and the kernel
is compiled without contraction. A column sum in the epilogue (the fuse stage's
column-sum rule) is the exception: it sums the tiles' rows and then their
partials (matmul.py's ``ColumnSum``), not in the reduce kernel's order, so it
matches the unfused sum within fp32 (fp64) rounding, deterministically. Where eager PyTorch differs: cuBLAS adds a
linear's bias to the fp32 accumulator before its one rounding (autocast's
``addmm``: bf16 result of acc + bf16(bias)), while Nova's bf16 policy (the
precision stage) rounds the matmul to bf16 and adds the f32 bias to that, as
Nova's unfused kernels do; both within one bf16 rounding of the exact value. The
epilogue does not change which one Nova computes (the IR says where it rounds).
"""

from __future__ import annotations

import functools
import hashlib
import inspect

from nova.codegen.triton.elementwise import (
    Chain, Fusion, Operand, Pointwise, UnsupportedError, block_and_warps, convert, expression_of, load, merge_helpers,
    numel, pointwise_source, sanitize, shape_name, tag,
)  # fmt: skip
from nova.codegen.triton.lowering import Kernel, lowering_for, lowers
from nova.codegen.triton.matmul import ColumnSum, Epilogue
from nova.ir import dialect as nv
from nova.ir.types import elem_of, shape_of, to_torch_dtype
from nova.schedule.config import LoweringConfig


def _dtype(v):
    return to_torch_dtype(elem_of(v.type))


def compose(ops, var: dict, prefix: str = "") -> tuple[list[str], list[str]]:
    """(lines, helpers) computing ``ops`` in order, each from its expression;
    ``var`` maps a value to (the variable holding its stored form, its stored
    type) and receives every result: inner op n computes ``<prefix>y<n>`` and its
    stored form ``<prefix>v<n>``. A reshape (in a contraction group, the tile's
    rows relabelled) is its operand's variable."""
    lines: list[str] = []
    helpers: list[str] = []
    for n, inner in enumerate(ops):
        if isinstance(inner, nv.ReshapeOp):
            var[inner.results[0]] = var[inner.operands[0]]
            continue
        e = expression_of(inner)
        args = []
        for j, v in enumerate(inner.operands):
            name, stored = var[v]
            want = Operand((), _dtype(v), load=e.loads[j]).loaded_tag()
            if want == stored:
                args.append(name)
            else:  # as the unfused kernel would load it
                lines.append(f"{prefix}a{n}_{j} = {convert(name, stored, want)}")
                args.append(f"{prefix}a{n}_{j}")
        lines += e.code(args, f"{prefix}y{n}").splitlines()
        stored = tag(_dtype(inner.results[0]))
        lines.append(f"{prefix}v{n} = {convert(f'{prefix}y{n}', e.tag, stored)}")  # as the unfused kernel would store it
        var[inner.results[0]] = (f"{prefix}v{n}", stored)
        helpers += e.helpers
    return lines, helpers


def fused_body(op: nv.FusedOp) -> tuple[list[Operand], str, list[tuple[str, str, object]], str]:
    """(operands, body, stores, helpers) of the group's kernel: operand k is loaded
    into ``x<k>``, inner op n computes ``y<n>`` and its stored form ``v<n>``."""
    block = op.body.block
    operands: list[Operand] = []
    var: dict = {}  # value -> (variable holding its stored form, stored type)
    for k, a in enumerate(block.args):
        operands.append(Operand(shape_of(a.type), _dtype(a), load="raw"))
        var[a] = (f"x{k}", tag(_dtype(a)))
    lines, helpers = compose(op.inner_ops(), var)
    stores = [(*var[v], _dtype(v)) for v in block.last_op.operands]
    return operands, "\n".join(lines), stores, merge_helpers(helpers)


def segments_of(op: nv.FusedOp) -> list[tuple[list[int], list, list[int]]] | None:
    """The independent parts of an elementwise group, or None where it is one: its ops
    of more than one element joined where one reads another's value or two read one
    operand of more than one element (so no operand is loaded by two parts), each part
    (its operands' indices, its ops in block order, its results' indices). A group of
    update chains of one shape (the fuse stage's multi-tensor updates, ``batch_small``)
    has one part a parameter; the one-element ops (their scalars) are every part's.
    None also where a result is of one element or an operand passed through. An output
    written over its own input (the in-place update, ``plan_memory``) stays safe: that
    input is read by its own part only, whose lanes load it before they store."""
    block = op.body.block
    args = list(block.args)
    if numel(op.iteration_shape()) <= 1:
        return None

    def one(v) -> bool:
        return numel(shape_of(v.type)) == 1

    tile = [o for o in op.inner_ops() if not one(o.results[0])]
    parent = {o: o for o in tile}

    def root(o):
        while parent[o] is not o:
            parent[o] = parent[parent[o]]
            o = parent[o]
        return o

    reader: dict = {}  # operand -> an op reading it
    for o in tile:
        for v in o.operands:
            if one(v):
                continue
            other = reader.setdefault(v, o) if v in args else v.owner
            parent[root(o)] = root(other)
    parts: dict = {}
    for o in tile:
        parts.setdefault(root(o), []).append(o)
    if len(parts) < 2:
        return None
    yields = list(block.last_op.operands)
    part_of = {o: j for j, ops in enumerate(parts.values()) for o in ops}
    if any(one(v) or v.owner not in part_of for v in yields):
        return None
    # a one-element op that only one part reads (a parameter's own step count and bias
    # corrections) is that part's, computed in its branch: the shared ones stay before
    inner = op.inner_ops()
    readers: dict = {}  # one-element op -> the parts reading it, directly or through others
    for o in reversed(inner):
        if o in part_of:
            continue
        readers[o] = set().union(*({part_of[u.operation]} if u.operation in part_of else readers.get(u.operation, set())
                                   for r in o.results for u in r.uses))
    for o, js in readers.items():
        if len(js) == 1:
            part_of[o] = next(iter(js))
    if any(v.owner in part_of for o in inner if o not in part_of for v in o.operands if v not in args):
        return None  # (a shared op reading a part's value: not one kernel of parts)
    order = {o: i for i, o in enumerate(inner)}
    out = []
    for j in range(len(parts)):
        ops = sorted((o for o, p in part_of.items() if p == j), key=order.__getitem__)
        mine = {v for o in ops for v in o.operands if v in args}
        elsewhere = {v for o in inner if part_of.get(o) != j for v in o.operands if v in args}
        ks = sorted(args.index(v) for v in mine if not one(v) or v not in elsewhere)
        out.append((ks, ops, [i for i, v in enumerate(yields) if part_of[v.owner] == j]))
    return out


def _segmented_body(op: nv.FusedOp, parts):
    """``fused_body`` of a group of independent parts (``segments_of``): (operands, the
    one-element ops' lines every part reads, stores, helpers, and per part (its operands,
    its lines, its stores) for ``pointwise_source``'s ``segments``); part j's variables
    are prefixed ``s<j>_``, the shared ones ``c_``."""
    block = op.body.block
    operands: list[Operand] = []
    var: dict = {}
    for k, a in enumerate(block.args):
        operands.append(Operand(shape_of(a.type), _dtype(a), load="raw"))
        var[a] = (f"x{k}", tag(_dtype(a)))
    in_parts = {o for _, ops, _ in parts for o in ops}
    lines, helpers = compose([o for o in op.inner_ops() if o not in in_parts], var, prefix="c_")
    segments = []
    for j, (ks, ops, js) in enumerate(parts):
        part, more = compose(ops, var, prefix=f"s{j}_")
        helpers += more
        segments.append((ks, "\n".join(part), js))
    stores = [(*var[v], _dtype(v)) for v in block.last_op.operands]
    return operands, "\n".join(lines), stores, merge_helpers(helpers), segments


def epilogue_of(op: nv.FusedOp) -> tuple[Epilogue, list[int]]:
    """A "contraction" group's epilogue for the matmul template, and which of the
    group's operands are its operands (in order). The accumulator enters as the
    contraction's stored result (``acc`` rounded to the matmul's dtype, as the
    unfused matmul stores it: a bf16 matmul's consumers read bf16 values), then
    the inner ops compose as in ``fused_body``; every value the group yields is
    written from the tile, the contraction's own result too where it is yielded,
    but for a column sum's [N] result (``nv.column_sum``: the template's
    ``ColumnSum`` of its operand's stored form, summed as the unfused reduction
    loads it, in fp32 / fp64)."""
    block = op.body.block
    head = op.contraction()
    if head is None or not isinstance(head, nv.MatmulOp):
        raise UnsupportedError(f"{op.name}: no Triton epilogue for a group headed by "
                               f"{head.name if head is not None else 'no contraction'}")
    var: dict = {}
    operands: list[Operand] = []
    picked: list[int] = []
    for k, a in enumerate(block.args):
        if any(u.operation is not head for u in a.uses):  # read by the epilogue (maybe by the matmul too)
            var[a] = (f"ex{len(operands)}", tag(_dtype(a)))
            operands.append(Operand(shape_of(a.type), _dtype(a), load="raw"))
            picked.append(k)
    result = head.results[0]
    stored = tag(_dtype(result))
    lines = [f"e_acc = {convert('e_tile', 'f32', stored)}"]  # the matmul's result as the unfused kernel stores it
    var[result] = ("e_acc", stored)
    inner = op.inner_ops()[1:]
    sum_ops = [o for o in inner if nv.column_sum(o)]  # the verifier: read by nothing inside
    body, helpers = compose([o for o in inner if o not in sum_ops], var, prefix="e")
    yields = list(block.last_op.operands)
    sums = tuple(ColumnSum(*var[v.owner.operands[0]], _dtype(v), j) for j, v in enumerate(yields) if v.owner in sum_ops)
    tiles = [v for v in yields if v.owner not in sum_ops]
    ep = Epilogue(
        shape=tuple(op.iteration_shape()), operands=tuple(operands), body="\n".join(lines + body),
        stores=tuple((*var[v], _dtype(v)) for v in tiles), out_shapes=tuple(tuple(shape_of(v.type)) for v in tiles),
        helpers=merge_helpers(helpers), flat_index=any(o.FLAT_INDEX for o in inner), sums=sums,
    )  # fmt: skip
    return ep, picked


def _chain(ops: list, block, prefix: str, var: dict) -> tuple[list[Operand], list[int], list[str], list[str]]:
    """(operands, their group operand indices, lines, helpers) of ``ops`` composed
    over the block arguments they read, each loaded into ``<prefix>x<k>``."""
    inside = set(ops)
    operands: list[Operand] = []
    inputs: list[int] = []
    for k, a in enumerate(block.args):
        if any(u.operation in inside for u in a.uses):
            var[a] = (f"{prefix}x{len(operands)}", tag(_dtype(a)))
            operands.append(Operand(shape_of(a.type), _dtype(a), load="raw"))
            inputs.append(k)
    lines, helpers = compose(ops, var, prefix=prefix)
    return operands, inputs, lines, helpers


def fusion_of(op: nv.FusedOp) -> tuple[nv.NovaOp, Fusion]:
    """A "reduction" group's head and what its template computes around it: the
    prologue (every inner op the head reads, directly or not) composed in registers
    where the template would load the head's operand, the epilogue (the other inner
    ops, and the one-element prologue values they read, recomputed) on the head's
    first result as the unfused op stores it (``<q>in``), the same expressions and
    roundings as ``fused_body``. Under a head that stores prologue values
    (``NovaOp.PROLOGUE_STORES``: the dialect's verifier makes every other inner op
    a prologue op), the prologue is every inner op, and each value of it the group
    yields is one more of the chain's values, stored at each element; under a
    row-wise head that stores prologue values in its first pass over a row
    (``PROLOGUE_ROW_STORES``), the prologue's values the group yields are too, and
    its side ops (``FusedOp.prologue_sides``) are part of the prologue's chain."""
    head = op.reduction()
    if head is None:
        raise UnsupportedError(f"{op.name}: not a reduction group")
    block = op.body.block
    inner = op.inner_ops()
    order = {o: i for i, o in enumerate(inner)}

    def closure(values) -> set:
        return nv.producers(values, order.keys())

    stores_mode = bool(head.PROLOGUE and head.PROLOGUE_STORES)
    row_stores = head.stores_prologue_rows()  # yielded prologue values, stored in pass 1
    prologue = {o for o in inner if o is not head} if stores_mode else closure(head.operands)
    prologue |= op.prologue_sides()  # (row stores: computed with the prologue, stored where yielded)
    sum_ops = op.epilogue_sums()  # column sums of epilogue values (the verifier: nothing inside reads them)
    epilogue = [o for o in inner if o is not head and o not in prologue and o not in sum_ops]
    epilogue = sorted(set(epilogue) | closure([v for o in epilogue for v in o.operands if v.owner in prologue]),
                      key=order.__getitem__)  # fmt: skip
    pro_chain = None
    reads: list[tuple[str, int]] = []
    yields = list(block.last_op.operands)
    pro_stores: list[tuple[int, object]] = []
    pro_stored: dict = {}  # a yielded prologue value -> its index in pro_stores
    if prologue:
        var: dict = {}
        operands, inputs, lines, helpers = _chain(sorted(prologue, key=order.__getitem__), block, "p", var)
        values = []
        for v in head.operands:
            if v.owner in prologue:
                reads.append(("prologue", len(values)))
                values.append(var[v])
            else:
                reads.append(("input", list(block.args).index(v)))
        for v in yields:
            if (stores_mode or row_stores) and v.owner in prologue and v not in pro_stored:
                pro_stored[v] = len(pro_stores)
                pro_stores.append((len(values), _dtype(v)))
                values.append(var[v])
        pro_chain = Chain("p", tuple(operands), tuple(inputs), "\n".join(lines), tuple(values), merge_helpers(helpers))
    else:
        reads = [("input", list(block.args).index(v)) for v in head.operands]
    outputs: list[tuple[str, int]] = []
    epi_chain, stores, summed = None, [], []
    stored = {}
    if epilogue:
        in_tag = tag(_dtype(head.results[0]))
        var = {head.results[0]: ("qin", in_tag)}
        operands, inputs, lines, helpers = _chain(epilogue, block, "q", var)
        values = []
        for v in yields:
            if v.owner in order and v.owner is not head and v.owner not in sum_ops and v not in pro_stored:
                stored[v] = len(values)
                values.append(var[v])
                stores.append(_dtype(v))
        for s in sum_ops:  # the summed values follow the stored ones
            summed.append((len(values), _dtype(s.results[0])))
            values.append(var[s.operands[0]])
        epi_chain = Chain("q", tuple(operands), tuple(inputs), "\n".join(lines), tuple(values),
                          merge_helpers(helpers), in_tag)  # fmt: skip
    for v in yields:
        if v.owner is head:
            outputs.append(("head", list(head.results).index(v)))
        elif v in stored:
            outputs.append(("epilogue", stored[v]))
        elif v in pro_stored:
            outputs.append(("prologue", pro_stored[v]))
        elif v.owner in sum_ops:
            outputs.append(("sum", sum_ops.index(v.owner)))
        else:
            raise UnsupportedError(f"{op.name}: yields a value its {head.name} kernel does not compute")
    if sum_ops and epi_chain is None:
        raise UnsupportedError(f"{op.name}: column sums without an epilogue")
    return head, Fusion(tuple(reads), tuple(outputs), pro_chain, epi_chain, tuple(stores), tuple(pro_stores),
                        tuple(summed))  # fmt: skip


# attributes that say where an op is (its source line) and where its results live in
# the arena (the memory plan's), not what it computes: no kernel reads them
WHERE = ("nova.loc", "nova.storage", "nova.offset")


def structure(op: nv.FusedOp, cfg: LoweringConfig | None) -> tuple | None:
    """Everything of ``op`` its kernel is made from, as a hashable value (None: an
    inner op holds regions, not keyed): the group's kind and other properties and
    attributes, its block arguments' types, and each inner op's name, operands (by
    position: block arguments, then inner results in order), result types,
    properties and attributes (every one but ``WHERE``'s), and ``cfg``. Two groups
    of the same structure (one per GPT layer) get the same source; ``lowered_once``
    generates it once."""
    from nova.codegen.triton.source import interpreting

    def what(attrs) -> tuple:
        return tuple((k, v) for k, v in attrs.items() if k not in WHERE)

    block = op.body.block
    number = {a: i for i, a in enumerate(block.args)}
    parts: list = [interpreting(), cfg, tuple(op.properties.items()), what(op.attributes),
                   tuple(a.type for a in block.args), tuple(r.type for r in op.results)]  # fmt: skip
    for inner in block.ops:
        if inner.regions:
            return None
        parts.append((inner.name, tuple(number[v] for v in inner.operands), tuple(r.type for r in inner.results),
                      tuple(inner.properties.items()), what(inner.attributes)))  # fmt: skip
        for r in inner.results:
            number[r] = len(number)
    return tuple(parts)


_ONCE_LIMIT = 4096  # structures kept per process (a GPT-2 step has 21 distinct of 270 groups); bounds a long-lived one


def lowered_once(lower):
    """``lower`` (a ``nova.fused`` lowering) run once per distinct ``structure``: a
    group of a structure lowered before gets that Kernel (its launch holds no state
    of the op), so 12 layers' identical groups are generated and loaded once."""
    kernels: dict = {}

    @functools.wraps(lower)
    def once(op: nv.FusedOp, cfg: LoweringConfig | None = None) -> Kernel:
        key = structure(op, cfg)
        if key is None:
            return lower(op, cfg)
        kernel = kernels.get(key)
        if kernel is None:
            if len(kernels) >= _ONCE_LIMIT:
                kernels.clear()
            kernel = kernels[key] = lower(op, cfg)
        return kernel

    once.cache = kernels  # structure -> Kernel, to inspect
    return once


@lowers(nv.FusedOp)
@lowered_once
def lower_fused(op: nv.FusedOp, cfg: LoweringConfig | None = None) -> Kernel:
    """``launch(inputs, outs=None)``: one output per result (``outs`` may hold an
    input of the iteration shape itself: see the module docstring)."""
    kind = op.props()["kind"]
    if kind == "reduction":
        return lower_reduction_group(op, cfg)
    if kind != "elementwise":  # a contraction group is its template's launch (backends/triton.py)
        raise UnsupportedError(f"{op.name}: no Triton lowering for kind {kind!r}")
    shape = op.iteration_shape()
    parts = segments_of(op)
    if parts is None:
        operands, body, stores, helpers = fused_body(op)
        segments = None
    else:
        operands, body, stores, helpers, segments = _segmented_body(op, parts)
    ops = [o.name.removeprefix("nova.") for o in op.inner_ops()]
    digest = hashlib.sha256((body + repr(operands) + repr(stores) + repr(segments)).encode()).hexdigest()[:10]
    multi = f"_x{len(parts)}" if parts else ""  # a multi-tensor kernel: its parts
    name = f"nova_fused_{shape_name(shape)}{multi}_{len(ops)}ops_{'_'.join(dict.fromkeys(ops[-3:]))}_{digest}"
    fname = sanitize(name)
    block, warps = block_and_warps(numel(shape), cfg)
    src = pointwise_source(fname, shape, operands, body, "", None, block, helpers, stores=stores, segments=segments)
    out_dtypes = tuple(d for _, _, d in stores)
    pw = Pointwise(load(src, fname), name, src, shape, tuple(operands), out_dtypes[0], block, warps, out_dtypes,
                   segments=len(parts) if parts else 1)

    def launch(xs, outs=None, device=None):
        return pw.run(xs, device, outs)

    return Kernel(name=name, source=src, launch=launch, config=cfg)


def lower_reduction_group(op: nv.FusedOp, cfg: LoweringConfig | None = None) -> Kernel:
    """A "reduction" group: one launch of its head's template (reduce.py, rowwise.py)
    with the prologue and epilogue of ``fusion_of``, under the head's own schedule
    (the configure stage gives the group the head's: the same summation order as
    the unfused kernel). ``launch(inputs, outs)`` takes the group's operands and
    writes its results."""
    head, fusion = fusion_of(op)
    lower = lowering_for(head)
    if "fusion" not in inspect.signature(lower).parameters:
        raise UnsupportedError(f"{op.name}: the Triton lowering of {head.name} takes no prologue or epilogue")
    ops = [o.name.removeprefix("nova.") for o in op.inner_ops()]
    digest = hashlib.sha256(repr(fusion).encode()).hexdigest()[:10]
    name = (f"nova_fused_{head.name.removeprefix('nova.')}_{shape_name(op.iteration_shape())}_{len(ops)}ops_"
            f"{'_'.join(dict.fromkeys(o for o in ops if o != head.name.removeprefix('nova.')))}_{digest}")
    return lower(head, cfg, fusion=fusion, name=name)
