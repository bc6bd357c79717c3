"""plan_memory's layouts: permuted placements and cat windows (plan_layouts).

  permuted  attention's o [B, H, T, D], read through transpose(0, 2, 1, 3) and a
            [B, T, C] reshape, is placed as [B, T, H, D] memory: the transpose is
            dense and the reshape a view (no copy kernel).
  window    attention_backward's dq, dk, dv, read only by one nova.cat (through
            transposes), are placed at their windows of the cat's buffer: the cat
            launches nothing.

Each rule and its no-match cases on hand-built IR, every plan checked by
test_plan_memory's independent checks (a replay of the backend's launch order
over the IR's offsets and layouts, and an arena executor on a poisoned arena
that leaves an assembled cat unrun: its windows must hold the pieces)."""

from __future__ import annotations

import pytest
import torch
from xdsl.dialects.builtin import bf16, f32

from nova import pipeline
from nova.ir import dialect as nv
from nova.ir.module import Slot, set_results, step_func
from nova.ir.types import tensor
from nova.models import GPT, gpt_tiny
from nova.runtime import stored_plan
from nova.transforms import plan_memory as pm
from test_plan_memory import _check, _layout, _step, _storage

B, H, T, D = 2, 2, 8, 16
C = H * D
BHTD = [B, H, T, D]


def _qkv(*extra):
    module, fn, b = _step(*(Slot("batch", n, tensor(BHTD, f32)) for n in ("q", "k", "v")), *extra)
    return module, fn, b, fn.body.block.args


def _attention(b, q, k, v):
    op = b.create(nv.AttentionOp, [q, k, v], {"causal": True, "scale": D**-0.5})
    return op.results[0], op.results[1]


def _btc(b, o):
    return b.reshape(b.transpose(o, [0, 2, 1, 3]), [B, T, C])


def _loss(b, *vs):
    total = None
    for v in vs:
        s = b.reduce_sum(b.mul(v, v), list(range(len(v.type.get_shape()))))
        total = s if total is None else b.add(total, s)
    return total


def _inputs(n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(BHTD, generator=g) for _ in range(n)]


def _bytes(v):
    return pm.nbytes(v)


# ---------------------------------------------------------------------------
# permuted placements


def test_attention_output_read_as_btc_is_placed_as_bthd_and_its_reshape_is_a_view():
    module, fn, b, (q, k, v) = _qkv()
    o, _ = _attention(b, q, k, v)
    y = _btc(b, o)
    set_results(fn, [("loss", "loss", _loss(b, b.one(nv.ExpOp, [y])))])
    plan = _check(module, _inputs())
    assert _storage(o)[0] == "arena" and _layout(o) == "perm 0,2,1,3"
    assert plan.placements[o].perm == (0, 2, 1, 3)
    assert _storage(y)[0] == "view" and plan.placements[y].root is o  # no copy kernel: a view of o's buffer
    assert "nova.reshape" not in [bf.what for bf in plan.buffers]
    assert any(line.startswith("  perm 0,2,1,3: nova.attention #0") for line in pm.report(plan))


def test_a_second_transpose_reading_the_output_later_is_a_view_too():
    """remat's clone of the transpose and reshape for the backward reads o again:
    both reshapes are views of the one permuted buffer."""
    module, fn, b, (q, k, v) = _qkv()
    o, _ = _attention(b, q, k, v)
    y1 = _btc(b, o)
    z = b.one(nv.ExpOp, [y1])
    y2 = _btc(b, o)  # as remat clones it
    set_results(fn, [("loss", "loss", _loss(b, z, b.one(nv.ExpOp, [y2])))])
    _check(module, _inputs())
    assert _layout(o) == "perm 0,2,1,3"
    assert _storage(y1)[0] == _storage(y2)[0] == "view"


def test_attention_backward_reads_the_permuted_output_through_its_strides():
    module, fn, b, (q, k, v, g) = _qkv(Slot("batch", "g", tensor(BHTD, f32)))
    o, lse = _attention(b, q, k, v)
    y = _btc(b, o)
    dq, dk, dv = b.create(nv.AttentionBackwardOp, [g, q, k, v, o, lse], {"causal": True, "scale": D**-0.5}).results
    set_results(fn, [("loss", "loss", _loss(b, b.one(nv.ExpOp, [y]), b.one(nv.ExpOp, [dq]), b.one(nv.ExpOp, [dk]),
                                            b.one(nv.ExpOp, [dv])))])  # fmt: skip
    _check(module, _inputs(4))
    assert _layout(o) == "perm 0,2,1,3" and _storage(y)[0] == "view"
    assert [_layout(r) for r in (dq, dk, dv)] == ["", "", ""]  # read by exp kernels, no transpose: dense


@pytest.mark.parametrize("case", ["a dense-only kernel reads it", "returned", "no reshape", "not a strided writer",
                                  "a reshape the dense layout allows"])  # fmt: skip
def test_no_permuted_placement(case):
    module, fn, b, (q, k, v) = _qkv()
    o, _ = _attention(b, q, k, v)
    if case == "not a strided writer":
        o = b.one(nv.ExpOp, [o])
    if case == "no reshape":
        t = b.transpose(o, [0, 2, 1, 3])
        results = [("loss", "loss", _loss(b, b.one(nv.ExpOp, [t])))]
    elif case == "a reshape the dense layout allows":
        y = b.reshape(o, [B, H * T, D])  # a view of the dense buffer: a permutation would make it a copy
        t = b.reshape(b.transpose(o, [0, 1, 3, 2]), [B, H, D * T])
        results = [("loss", "loss", _loss(b, b.one(nv.ExpOp, [y]), b.one(nv.ExpOp, [t])))]
    else:
        y = _btc(b, o)
        results = [("loss", "loss", _loss(b, b.one(nv.ExpOp, [y])))]
        if case == "a dense-only kernel reads it":
            results = [("loss", "loss", _loss(b, b.one(nv.ExpOp, [y]), b.one(nv.ExpOp, [o])))]
        if case == "returned":
            results.append(("grad", "o", o))
    set_results(fn, results)
    plan = _check(module, _inputs())
    assert _layout(o) == "" and plan.placements[o].perm is None
    assert not pm.plan_layouts(fn).permuted


# ---------------------------------------------------------------------------
# cat windows


def _backward(extra_slots=(), elem=f32):
    module, fn, b = _step(*(Slot("batch", n, tensor(BHTD, elem)) for n in ("g", "q", "k", "v", "o")),
                          Slot("batch", "lse", tensor([B, H, T], f32)), *extra_slots)  # fmt: skip
    g, q, k, v, o, lse = fn.body.block.args[:6]
    grads = b.create(nv.AttentionBackwardOp, [g, q, k, v, o, lse], {"causal": True, "scale": D**-0.5}).results
    return module, fn, b, list(grads)


def _backward_inputs(elem=torch.float32):
    xs = [x.to(elem) for x in _inputs(5)]
    q, k = xs[1].float(), xs[2].float()
    s = (q @ k.transpose(-1, -2)) * D**-0.5
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return [*xs, torch.logsumexp(s, -1)]


@pytest.mark.parametrize("elem", [f32, bf16])
def test_gradients_only_a_cat_reads_are_written_into_its_windows(elem):
    module, fn, b, grads = _backward(elem=elem)
    pieces = [b.transpose(x, [0, 2, 1, 3]) for x in grads]
    cat = b.one(nv.CatOp, pieces, {"dim": 2})
    w = b.reshape(cat, [B * T, 3 * C])
    set_results(fn, [("loss", "loss", _loss(b, b.cast(w, f32) if elem != f32 else w))])
    plan = _check(module, _backward_inputs(torch.float32 if elem == f32 else torch.bfloat16))
    assert [_storage(x)[0] for x in grads] == ["window"] * 3
    assert [_layout(x) for x in grads] == [f"window dim 2 [{i * H}:{(i + 1) * H}] perm 0,2,1,3" for i in range(3)]
    assert plan.placements[cat].assembled and _layout(cat) == "assembled from windows"
    assert all(plan.placements[x].root is cat for x in grads)
    (buf,) = [bf for bf in plan.buffers if bf.value is cat]
    assert buf.start == 1  # live from the attention_backward's write (step 1), not from the cat's
    assert {bf.value for bf in plan.buffers} & set(grads) == set()  # no buffers of their own
    assert any("1 cats assembled from 3 windows" in line for line in pm.report(plan))


def test_windows_straight_from_the_gradients_without_transposes():
    module, fn, b, grads = _backward()
    cat = b.one(nv.CatOp, grads, {"dim": 1})
    set_results(fn, [("loss", "loss", _loss(b, b.one(nv.ExpOp, [cat])))])
    plan = _check(module, _backward_inputs())
    assert [_layout(x) for x in grads] == [f"window dim 1 [{i * H}:{(i + 1) * H}] perm 0,1,2,3" for i in range(3)]
    assert plan.placements[cat].assembled


@pytest.mark.parametrize("case", ["a piece read twice", "a piece no strided kernel writes", "a piece through a reshape",
                                  "the cat is returned", "a view of the cat is returned"])  # fmt: skip
def test_no_windows(case):
    module, fn, b, grads = _backward()
    pieces = [b.transpose(x, [0, 2, 1, 3]) for x in grads]
    extra = []
    if case == "a piece read twice":
        extra = [b.one(nv.ExpOp, [grads[1]])]
    if case == "a piece no strided kernel writes":
        pieces[2] = b.transpose(b.one(nv.ExpOp, [grads[2]]), [0, 2, 1, 3])
    if case == "a piece through a reshape":
        pieces = [b.reshape(p, [B, T, C]) for p in pieces]
    cat = b.one(nv.CatOp, pieces, {"dim": 2})
    results = [("loss", "loss", _loss(b, b.one(nv.ExpOp, [cat]), *extra))]
    if case == "the cat is returned":
        results.append(("grad", "w", cat))
    if case == "a view of the cat is returned":
        results.append(("grad", "w", b.reshape(cat, [B * T, 3 * C])))
    set_results(fn, results)
    plan = _check(module, _backward_inputs())
    assert not plan.placements[cat].assembled and "nova.layout" not in cat.owner.attributes
    assert all(plan.placements[x].kind != "window" for x in grads)
    assert not pm.plan_layouts(fn).windows


# ---------------------------------------------------------------------------
# a GPT step: both, in the plan, explain() and the stored plan


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def gpt(request):
    torch.manual_seed(0)
    model = GPT(gpt_tiny(n_layer=2, block_size=16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 256, (2, 17))
    c = pipeline.Compilation(model, (ids[:, :-1].contiguous(), ids[:, 1:].contiguous()), opt, request.param,
                             torch.float32)  # fmt: skip
    from nova.schedule.devices import DEVICES

    c.device = DEVICES["H200"]
    return pipeline.run(c)


def test_a_gpt_step_has_no_reshape_copy_of_attention_and_no_cat_launch(gpt):
    fn = step_func(gpt.module)
    P = gpt.memory.placements
    attn = [op for op in fn.body.block.ops if isinstance(op, nv.AttentionOp)]
    cats = [op for op in fn.body.block.ops if isinstance(op, nv.CatOp)]
    assert len(attn) == 2 and len(cats) == 2
    assert all(P[op.results[0]].perm == (0, 2, 1, 3) for op in attn)
    assert all(P[op.results[0]].assembled for op in cats)
    for op in fn.body.block.ops:
        if isinstance(op, nv.AttentionBackwardOp):
            # the gradients in their cat windows; the qkv bias gradient's sums (attention_sums) in the arena
            assert op.props()["sums"] and [P[r].kind for r in op.results] == ["window"] * 3 + ["arena"]
    copies = [op for op in fn.body.block.ops if isinstance(op, pm.VIEW_OPS) and P[op.results[0]].kind != "view"]
    assert not [op for op in copies if any(isinstance(o.owner, nv.TransposeOp) and
                                           isinstance(o.owner.operands[0].owner, nv.AttentionOp) for o in op.operands)]


def test_the_stored_plan_rebuilds_the_layouts_and_checks_them(gpt):
    c = gpt
    scratch = pipeline.arena_scratch(c.device, c.module)
    stored = stored_plan.stored_offsets(c.module, c.memory)
    again = stored_plan.plan_from_offsets(c.module, scratch, stored)
    assert stored_plan.differences(again, c.memory) == []
    assert [(q.kind, q.perm, q.window, q.assembled) for q in again.placements.values()] == \
        [(q.kind, q.perm, q.window, q.assembled) for q in c.memory.placements.values()]  # fmt: skip
    # the IR's nova.layout is checked against the recomputed layouts
    op = next(op for op in step_func(c.module).body.block.ops if isinstance(op, nv.AttentionOp))
    saved = op.attributes.pop("nova.layout")
    try:
        with pytest.raises(stored_plan.StoredPlanError, match="nova.layout"):
            stored_plan.plan_from_offsets(c.module, scratch, stored)
    finally:
        op.attributes["nova.layout"] = saved
    # and a plan differing in a layout only is a different plan
    v = op.results[0]
    again.placements[v].perm = None
    assert stored_plan.differences(again, c.memory) == ["placements"]
