"""A column sum in a matmul's epilogue (the fuse stage's column-sum rule) through
the Triton interpreter: every path of the template (the tile grid, the persistent
kernel, split-K's reduction kernel, batched, ragged M and N, the column-sliced
epilogue), against the same IR without the rule (the sum its own reduce kernel)
and the reference executor. The tiles' other outputs stay bit-identical to the
unfused kernels'; the sum changes its order (tile partials, then their ordered
sum), so it matches within fp32 (fp64) accumulation error, and bit for bit from
one run to the next."""

from __future__ import annotations

import copy

import pytest
import torch
from xdsl.dialects.builtin import bf16, f32, f64

from nova.backends.reference import run_function
from nova.backends.triton import TritonProgram
from nova.codegen.triton import matmul as mm
from nova.codegen.triton.fused import epilogue_of
from nova.ir import dialect as nv
from nova.ir.module import Slot, set_results, step_func
from nova.ir.types import elem_of, shape_of, tensor, to_torch_dtype
from nova.schedule import cost
from nova.schedule.config import LoweringConfig
from nova.transforms import fuse as fz
from nova.transforms.configure import config_attr

from step_inputs import policy_step, run_program

pytestmark = [
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter suite (tests/gpu runs the device)"),
]


@pytest.fixture(autouse=True)
def _gelu_backward_in_epilogues(monkeypatch):
    """GELU's backward (12 FLOPs an element) is past the shipped epilogue budget (it
    goes to the bias gradient's reduction, test_fused_reduction.py); these tests give
    the budget room for it, the costliest epilogue value there is, so that every path
    of the template's column sum runs on a real one."""
    monkeypatch.setattr(fz, "EPILOGUE_MAX_FLOPS", 13)


def cfg(bm=16, bn=16, bk=16, split_k=1, persistent=False, tma=False):
    return LoweringConfig(kind="matmul", block_m=bm, block_n=bn, block_k=bk, group_m=2, split_k=split_k,
                          persistent=persistent, num_warps=4, num_stages=2, instruction="wgmma+tma" if tma else "mma")  # fmt: skip


_step = policy_step


def _args(fn, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape_of(a.type), generator=g, dtype=torch.float64).to(to_torch_dtype(elem_of(a.type)))
            for a in fn.body.block.args]  # fmt: skip


def _gelu_backward(M=20, K=24, N=40, rows=(4, 5), batch=None):
    """The c_fc layer's backward, small: dy @ w^T (bf16) widened, GELU's backward with
    the saved f32 pre-activation, its bf16 cast, and the bias gradient's column sum
    of the f32 value; ``batch``: dy [batch, M, K] @ w^T per batch."""
    lead = (batch,) if batch else ()
    module, fn, b = _step("bf16", Slot("batch", "dy", tensor([*lead, M, K], bf16)),
                          Slot("param", "w", tensor([*lead, N, K], bf16)),
                          Slot("batch", "pre", tensor([*lead, *rows, N] if not batch else [batch, M, N], f32)))  # fmt: skip
    dy, w, pre = fn.body.block.args
    h = b.matmul(dy, b.transpose(w, [0, 2, 1] if batch else [1, 0]))
    g = b.cast(h if batch or len(rows) == 1 else b.reshape(h, [*rows, N]), f32)
    d = b.one(nv.GeluBackwardOp, [g, pre], {"approximate": "tanh"})
    sdims = [0, 1] if batch or len(rows) == 2 else [0]
    set_results(fn, [("grad", "bias", b.reduce_sum(d, sdims)), ("loss", "d", b.cast(d, bf16))])
    return module


def _run(module, config, precision, tol, sum_tol=None):
    """Fuses ``module`` with and without the column-sum rule (``config`` on the
    contraction group), runs both on the Triton backend and the fused IR on the
    reference executor; checks that the sum joined, the tiles' outputs are
    bit-identical to the unfused kernels', the sums close to both, and the fused
    step bit-identical to itself run again. Returns (the group, its step)."""
    unfused = module.clone()
    fz.fuse(module)
    module.verify()
    fn = step_func(module)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(fz._Grouping, "join_column_sums", lambda self: None)
        fz.fuse(unfused)
    for f in (fn, step_func(unfused)):
        for op in f.body.block.ops:
            if isinstance(op, nv.FusedOp) and op.contraction() is not None:
                op.attributes["nova.lowering_config"] = config_attr(config)
    (group,) = [op for op in fn.body.block.ops if isinstance(op, nv.FusedOp) and op.contraction() is not None]
    assert any(nv.column_sum(o) for o in group.inner_ops())
    assert not any(isinstance(op, nv.ReduceSumOp) or isinstance(op, nv.FusedOp) and op.reduction() is not None
                   for op in fn.body.block.ops)  # fmt: skip
    args = _args(fn)
    prog = TritonProgram(fn, precision)
    got = run_program(prog, args)
    assert all(torch.equal(x, y) for x, y in zip(got, run_program(prog, args), strict=True))  # deterministic
    want = run_program(TritonProgram(step_func(unfused), precision), args)
    ref = run_function(fn, args, precision)
    sums = {i for i, v in enumerate(group.body.block.last_op.operands) if nv.column_sum(v.owner)}
    outputs = [fn.body.block.last_op.operands.index(r) if r in fn.body.block.last_op.operands else None
               for r in group.results]  # fmt: skip
    sum_results = {outputs[i] for i in sums}
    for k, (g, w, r) in enumerate(zip(got, want, ref, strict=True)):
        assert g.dtype == w.dtype == r.dtype and g.shape == w.shape == r.shape
        if k in sum_results:
            t = sum_tol if sum_tol is not None else tol
            torch.testing.assert_close(g.double(), w.double(), rtol=t, atol=t)
        else:
            assert torch.equal(g, w), (g.double() - w.double()).abs().max()
        torch.testing.assert_close(g.double(), r.double(), rtol=tol, atol=tol)
    (st,) = [s for s in prog.steps if s.op is group]
    return group, st


@pytest.mark.parametrize("path", ["one-pass", "one-pass-tma", "split-k", "persistent", "persistent-tma", "split-k-tma"])
@pytest.mark.parametrize("shape", [(32, 24, 48, (2, 16)), (20, 40, 40, (4, 5)), (37, 24, 33, (37,))],
                         ids=["even", "ragged", "ragged-2d"])  # fmt: skip
def test_bf16_gelu_backward_and_its_bias_gradient(shape, path):
    """bf16 operands, the f32 epilogue value summed (GPT-2's c_fc backward), on each
    path; ragged M and N mask the tails (masked rows add 0)."""
    M, K, N, rows = shape
    config = cfg(split_k=2 if "split" in path else 1, persistent="persistent" in path, tma="tma" in path)
    group, st = _run(_gelu_backward(M, K, N, rows), config, "bf16", 2e-2, 1e-5)
    text = "\n".join(st.sources.values())
    assert "def matmul_kernel_colsum0" in text and "tl.store(cs0 + e_prow" in text
    assert ("def matmul_kernel_reduce" in text) == ("split" in path)
    assert ("tl.range(" in text) == ("persistent" in path)
    # the launch's scratch: the partials [P, N] in fp32 (and split-K's workspace)
    P = mm.cdiv(M, mm.REDUCE_ROWS) if "split" in path else mm.cdiv(M, 16)
    ws = 2 * M * N * 4 if "split" in path else 0
    assert st.scratch == P * N * 4 + ws


@pytest.mark.parametrize("shape", [(32, 24, 48, (2, 16)), (20, 40, 40, (4, 5))], ids=["even", "ragged"])
def test_descriptor_stores_beside_the_partials(shape):
    """The one-pass TMA kernel stores outputs of two element sizes through descriptors
    (here GELU's bf16 gradient and its f32 incoming gradient, also returned): the
    column sum's partials still go out through pointers, masked rows 0."""
    M, K, N, rows = shape
    module = _gelu_backward(M, K, N, rows)
    fn = step_func(module)
    ret = fn.body.block.last_op
    g = next(o for o in fn.body.block.ops if isinstance(o, nv.GeluBackwardOp)).operands[0]
    set_results(fn, [("grad", "bias", ret.operands[0]), ("loss", "d", ret.operands[1]), ("loss", "g", g)])
    group, st = _run(module, cfg(tma=True), "bf16", 2e-2, 1e-5)
    main = "\n".join(st.sources.values())
    assert "o0.store([" in main and "o1.store([" in main and "tl.store(cs0 + e_prow" in main


@pytest.mark.parametrize("split", [1, 3], ids=["one-pass", "split-k"])
def test_batched_the_sum_runs_over_batch_and_rows(split):
    """A batched matmul ([3, 20, 48] @ [3, 48, 40]) with a ragged M: the sum adds up
    every batch's rows (the partials' rows are batch-major)."""
    group, st = _run(_gelu_backward(20, 48, 40, batch=3), cfg(split_k=split, bk=16), "bf16", 2e-2, 1e-5)
    assert group.iteration_shape() == (3, 20, 40)
    P = mm.cdiv(3 * 20, mm.REDUCE_ROWS) if split > 1 else 3 * mm.cdiv(20, 16)
    assert st.scratch - (3 * 3 * 20 * 40 * 4 if split > 1 else 0) == P * 40 * 4


@pytest.mark.parametrize("split", [1, 2], ids=["one-pass", "split-k"])
def test_f64_values_sum_in_fp64_partials(split):
    """An f32 matmul (the FMA dot) widened to f64 (also returned) times an f64
    operand, summed over its rows: fp64 partials, the same f64 values as the unfused
    kernels summed in another order, so within a few fp64 roundings."""
    module, fn, b = _step("fp32", Slot("batch", "x", tensor([36, 24], f32)), Slot("param", "w", tensor([24, 40], f32)),
                          Slot("param", "z", tensor([36, 40], f64)))  # fmt: skip
    x, w, z = fn.body.block.args
    y = b.cast(b.matmul(x, w), f64)
    set_results(fn, [("loss", "y", y), ("loss", "s", b.reduce_sum(b.mul(y, z), [0]))])
    group, st = _run(module, cfg(split_k=split), "fp32", 1e-5, 1e-12)
    (c,) = epilogue_of(group)[0].sums
    assert c.acc == "f64" and c.dtype == torch.float64
    P = mm.cdiv(36, mm.REDUCE_ROWS) if split > 1 else mm.cdiv(36, 16)
    assert st.scratch - (2 * 36 * 40 * 4 if split > 1 else 0) == P * 40 * 8


def test_a_bf16_value_sums_in_fp32_and_rounds_once():
    """A narrowed (bf16) epilogue value's sum: fp32 partials, one rounding to bf16 at
    the end (as the unfused reduction rounds its fp32 sum)."""
    module, fn, b = _step("fp32", Slot("batch", "a", tensor([40, 16], f32)), Slot("param", "w", tensor([16, 24], f32)))
    narrow = b.cast(b.matmul(*fn.body.block.args), bf16)
    set_results(fn, [("loss", "s", b.reduce_sum(narrow, [0]))])
    group, _ = _run(module, cfg(), "fp32", 5e-2, 1e-2)
    assert [str(r.type) for r in group.results] == ["tensor<24xbf16>"]
    assert epilogue_of(group)[0].sums[0].acc == "f32"


@pytest.mark.parametrize("tile,slices", [((64, 64), 4), ((64, 128), 8)], ids=["4-slices", "8-slices"])
def test_the_sliced_epilogue_sums_each_slice(tile, slices):
    """A large tile's epilogue in column slices (EPILOGUE_SLICE): each slice stores its
    columns' partials; N ragged (the last slices masked), M ragged."""
    bm, bn = tile
    group, st = _run(_gelu_backward(bm + 8, 32, 200, (bm + 8,)), cfg(bm=bm, bn=bn, bk=32), "bf16", 2e-2, 1e-5)
    ep = epilogue_of(group)[0]
    # the f32 pre-activation read, the bf16 output, the f32 sum: 5 halves of a register an element
    assert mm.epilogue_streams(ep) == 5 and mm.epilogue_slices(ep, bm, bn) == slices
    text = "\n".join(st.sources.values())
    assert "tl.split(e_split" in text and f"e_n{slices - 1} =" in text


def test_the_cost_model_counts_the_partials_not_the_f32_value():
    """The group's bytes: dy, w, the pre-activation read, the bf16 output and the [N]
    sum written, the partials written and read (not the f32 value it sums); FLOPs:
    the matmul, GELU's backward (12) and one add an element; one more launch."""
    M, K, N = 64, 32, 96
    module = _gelu_backward(M, K, N, (M,))
    fz.fuse(module)
    fn = step_func(module)
    (group,) = [op for op in fn.body.block.ops if isinstance(op, nv.FusedOp)]
    config = cfg(bm=32, bn=32, bk=32)
    group.attributes["nova.lowering_config"] = config_attr(config)
    c = cost.cost_of(group, group.operands, group.results, "bf16")
    P = M // 32
    assert c.kind == "matmul" and c.launches == 2
    assert c.bytes == (M * K + N * K) * 2 + M * N * 4 + M * N * 2 + N * 4 + 2 * P * N * 4
    assert c.flops == 2 * M * N * K + 12 * M * N + M * N
    group.attributes["nova.lowering_config"] = config_attr(cfg(bm=32, bn=32, bk=16, split_k=2))
    c2 = cost.cost_of(group, group.operands, group.results, "bf16")
    Ps = mm.cdiv(M, mm.REDUCE_ROWS)
    assert c2.bytes == (M * K + N * K) * 2 + M * N * 4 + M * N * 2 + N * 4 + 2 * 2 * M * N * 4 + 2 * Ps * N * 4
    assert c2.launches == 3


# ----------------------------------------------------------------------------
# a whole step


def test_a_gpt_step_with_the_bias_gradient_in_the_epilogue_matches_the_reference():
    """A small GPT (with biases) in bf16 on the Triton backend: the c_fc bias
    gradient's column sum joins GELU's backward in the matmul's epilogue (no reduce
    kernel of its own, no f32 value written), and two AdamW steps stay within the
    tolerances of the epilogue tests against the reference executor."""
    import nova
    from nova.models import GPT, GPTConfig

    torch.manual_seed(0)
    ref = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=32, bias=True))
    mine = copy.deepcopy(ref)
    oracle = nova.compile(ref, torch.optim.AdamW(ref.parameters(), lr=1e-3), backend="reference", precision="bf16")
    step = nova.compile(mine, torch.optim.AdamW(mine.parameters(), lr=1e-3), backend="triton", precision="bf16")
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        x, y = torch.randint(0, 64, (2, 8), generator=g), torch.randint(0, 64, (2, 8), generator=g)
        loss, want = step(x, y), oracle(x, y)
        assert abs(loss.item() - want.item()) <= 1e-4 * abs(want.item())
    for p, r in zip(mine.parameters(), ref.parameters(), strict=True):
        assert (p - r).abs().max().item() <= 2 * 2 * 1e-3 * 1.01  # as test_matmul_epilogue's GPT step
    ops = step_func(step._last.compilation.module).body.block.ops
    groups = [op for op in ops if isinstance(op, nv.FusedOp) and op.contraction() is not None]
    (with_sum,) = [op for op in groups if any(nv.column_sum(o) for o in op.inner_ops())]
    assert any(isinstance(o, nv.GeluBackwardOp) for o in with_sum.inner_ops())
    assert all(str(r.type) != "tensor<2x8x128xf32>" for r in with_sum.results)  # the f32 value is not written


def test_a_group_with_a_column_sum_is_not_configured_warp_specialized():
    """Rule 8b keeps an epilogue with column sums on the flattened persistent kernel (Triton
    3.6's partitioner fails on the tile's row reduction): at the GPT-2 c_fc backward's size
    the group with the bias gradient's sum gets no ``ws``; the same group without the sum
    (the rule off: the sum its own reduce kernel) does."""
    from nova.schedule.devices import DEVICES
    from nova.transforms.configure import configure_op

    def group_config(join: bool):
        module = _gelu_backward(M=32768, K=768, N=3072, rows=(32, 1024))
        with pytest.MonkeyPatch.context() as m:
            if not join:
                m.setattr(fz._Grouping, "join_column_sums", lambda self: None)
            fz.fuse(module)
        (group,) = [op for op in step_func(module).body.block.ops
                    if isinstance(op, nv.FusedOp) and op.contraction() is not None]  # fmt: skip
        assert any(nv.column_sum(o) for o in group.inner_ops()) == join
        return configure_op(group, DEVICES["H200"], "bf16")

    assert "ws" not in group_config(True).instruction.split("+")
    assert group_config(False).instruction == "wgmma+tma+ws"
