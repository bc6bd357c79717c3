"""Matmul epilogues (``nova.fused "contraction"``) through the Triton interpreter:
each group's one launch against the unfused launches of the same IR (the matmul
kernel with the same config, then the elementwise kernels), bit for bit, and
against the reference executor; bf16, f32 and tf32 operands, with and without
split-K, batched, ragged, strided operands, several outputs, a dropout mask;
then a small GPT's whole bf16 and tf32 steps with and without epilogues."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from xdsl.dialects.builtin import bf16, f32, i1, i64

from nova.backends.reference import run_function
from nova.backends.triton import TritonProgram
from nova.codegen.triton import matmul as mm
from nova.ir import dialect as nv
from nova.ir.module import Slot, set_results, step_func
from nova.ir.types import elem_of, shape_of, tensor, to_torch_dtype
from nova.schedule.config import LoweringConfig
from nova.transforms import fuse as fz
from nova.transforms.configure import config_attr

from step_inputs import policy_step, run_program

pytestmark = [
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning"),  # tanh of large inputs, as unfused
    pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter suite (tests/gpu runs the device)"),
]


def cfg(bm=16, bn=16, bk=16, split_k=1, persistent=False, group_m=1, tma=False, instruction=None):
    return LoweringConfig(kind="matmul", block_m=bm, block_n=bn, block_k=bk, group_m=group_m, split_k=split_k,
                          persistent=persistent, num_warps=4, num_stages=2,
                          instruction=instruction or ("wgmma+tma" if tma else "mma"))  # fmt: skip


_step = policy_step


def _args(fn, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for a in fn.body.block.args:
        dt = to_torch_dtype(elem_of(a.type))
        if dt == torch.bool:
            out.append(torch.rand(shape_of(a.type), generator=g) > 0.3)
        elif dt == torch.int64:
            out.append(torch.tensor(1234))
        else:
            out.append(torch.randn(shape_of(a.type), generator=g, dtype=torch.float64).to(dt))
    return out


def _check(module, config, precision, tol, **expect):
    """Fuses ``module`` (``config`` on the matmul and on its group), runs both on the
    Triton backend and the reference; returns the contraction group."""
    fn = step_func(module)
    unfused = module.clone()
    for op in step_func(unfused).body.block.ops:
        if isinstance(op, nv.MatmulOp):
            op.attributes["nova.lowering_config"] = config_attr(config)
    fz.fuse(module)
    module.verify()
    (group,) = [op for op in fn.body.block.ops if isinstance(op, nv.FusedOp) and op.contraction() is not None]
    group.attributes["nova.lowering_config"] = config_attr(config)
    args = _args(fn)
    fused_prog = TritonProgram(fn, precision)
    assert sum(isinstance(st.op, nv.MatmulOp) for st in fused_prog.steps) == expect.get("plain_matmuls", 0)
    got = run_program(fused_prog, args)
    want = run_program(TritonProgram(step_func(unfused), precision), args)
    ref = run_function(fn, args, precision)
    for g, w, r in zip(got, want, ref, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g, w), (g - w).abs().max()  # the unfused kernels' rounding, bit for bit
        if g.is_floating_point():
            torch.testing.assert_close(g.double(), r.double(), rtol=tol, atol=tol)
    return group, fused_prog


def _fc(policy, M=16, K=32, N=48, rows=(2, 8), dtype=bf16):
    """A GPT fc layer: x @ w read as [*rows, N], bias, GELU, bf16; the pre-activation kept."""
    module, fn, b = _step(policy, Slot("batch", "x", tensor([M, K], dtype)), Slot("param", "w", tensor([K, N], dtype)),
                          Slot("param", "bias", tensor([N], f32)))  # fmt: skip
    x, w, bias = fn.body.block.args
    h = b.matmul(x, w)
    h = b.cast(b.reshape(h, [*rows, N]), f32) if dtype == bf16 else b.reshape(h, [*rows, N])
    pre = b.add(h, bias)
    out = b.cast(b.one(nv.GeluOp, [pre], {"approximate": "tanh"}), bf16)
    set_results(fn, [("loss", "pre", pre), ("loss", "out", out)])
    return module


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
@pytest.mark.parametrize("split", [1, 2], ids=["one-pass", "split-k"])
@pytest.mark.parametrize("shape", [(16, 32, 48, (2, 8)), (20, 40, 40, (4, 5))], ids=["even", "ragged"])
def test_bf16_bias_gelu_with_two_outputs(shape, split, tma):
    M, K, N, rows = shape
    group, prog = _check(_fc("bf16", M, K, N, rows), cfg(split_k=split, tma=tma), "bf16", 2e-2)
    (st,) = [s for s in prog.steps if s.op is group]
    text = "\n".join(st.sources.values())
    assert "e_acc = (e_tile).to(tl.bfloat16)" in text  # the matmul's bf16 rounding, as unfused
    assert ("def matmul_kernel_reduce" in text) == (split > 1)
    assert ("a_desc" in text) == tma
    # the one-pass TMA kernel stores its epilogue outputs through descriptors, masks left to the copy engine
    assert ("o0.store([pid_m * BLOCK_M" in text and "tl.store(o0" not in text.split("def matmul_kernel_reduce")[0]) \
        == (tma and split == 1)


@pytest.mark.parametrize("instruction,persistent", [("mma", False), ("wgmma+tma+stage_a+stage_b", False),
                                                    ("wgmma+tma+stage_a+stage_b", True)],
                         ids=["rounded-in-registers", "staged", "staged-persistent"])  # fmt: skip
@pytest.mark.parametrize("split", [1, 3], ids=["one-pass", "split-k"])
def test_tf32_bias_and_residual_from_a_transposed_view(split, instruction, persistent):
    """f32 operands under the tf32 policy (tf32-rn: rounded in the kernel, or staged
    K-major copies through TMA); the residual is a transposed view read through its
    strides, the output f32. Staged-persistent: rule 8d's loop with the epilogue
    (``configurator.PERSISTENT_STAGED_EPILOGUES``), bit for bit the unfused persistent
    matmul, itself the tile grid's bits (test_matmul.py)."""
    module, fn, b = _step("tf32", Slot("batch", "x", tensor([24, 40], f32)), Slot("param", "w", tensor([40, 24], f32)),
                          Slot("param", "bias", tensor([24], f32)), Slot("param", "res", tensor([2, 24, 12], f32)))  # fmt: skip
    x, w, bias, res = fn.body.block.args
    y = b.add(b.transpose(res, [0, 2, 1]), b.add(b.reshape(b.matmul(x, w), [2, 12, 24]), bias))
    set_results(fn, [("loss", "y", y)])
    config = cfg(bk=16, split_k=split, persistent=persistent, instruction=instruction)
    group, prog = _check(module, config, "tf32", 5e-3)
    assert len(group.operands) == 4 and group.iteration_shape() == (2, 12, 24)
    (st,) = [s for s in prog.steps if s.op is group]
    assert ("flatten=True" in "\n".join(st.sources.values())) == persistent  # the persistent loop ran


def test_gelu_backward_reads_the_saved_pre_activation(monkeypatch):
    """The template with the costliest epilogue op there is (GELU's backward, past the
    shipped budget: given room here) reading a second full tensor at the tile's offsets."""
    monkeypatch.setattr(fz, "EPILOGUE_MAX_FLOPS", 13)
    module, fn, b = _step("bf16", Slot("batch", "dy", tensor([16, 24], bf16)), Slot("param", "w", tensor([40, 24], bf16)),
                          Slot("batch", "pre", tensor([2, 8, 40], f32)))  # fmt: skip
    dy, w, pre = fn.body.block.args
    g = b.cast(b.reshape(b.matmul(dy, b.transpose(w, [1, 0])), [2, 8, 40]), f32)
    d = b.one(nv.GeluBackwardOp, [g, pre], {"approximate": "tanh"})
    set_results(fn, [("loss", "d", d), ("loss", "db", b.cast(d, bf16))])
    _check(module, cfg(bn=32), "bf16", 2e-2)


def test_batched_scores_with_a_broadcast_mask_scale_and_a_bool_output():
    """q k^T per (batch, head), scaled, masked by a [T, T] condition broadcast over
    both: the mask's index comes from the row's (t) and the column (s); a compare
    gives a bool output (stored as bytes). Persistent programs, ragged T."""
    module, fn, b = _step("bf16", Slot("batch", "q", tensor([2, 3, 10, 16], bf16)),
                          Slot("batch", "k", tensor([2, 3, 10, 16], bf16)), Slot("param", "keep", tensor([10, 10], i1)))  # fmt: skip
    q, k, keep = fn.body.block.args
    s = b.scale(b.cast(b.matmul(q, b.transpose(k, [0, 1, 3, 2])), f32), 0.25)
    y = b.where(keep, s, b.full(-1e4, [], f32))
    set_results(fn, [("loss", "y", y), ("loss", "pos", b.one(nv.GtOp, [y, b.full(0.0, [], f32)]))])
    for tma in (False, True):
        group, _ = _check(module.clone(), cfg(persistent=True, tma=tma), "bf16", 2e-2)
        assert len(group.operands) == 3


def test_a_dropout_mask_reads_the_flat_index_of_the_tile():
    module, fn, b = _step("bf16", Slot("batch", "x", tensor([20, 16], bf16)), Slot("param", "w", tensor([16, 24], bf16)),
                          Slot("seed", "seed", tensor([], i64)))  # fmt: skip
    x, w, seed = fn.body.block.args
    y = b.cast(b.matmul(x, w), f32)
    mask = b.one(nv.DropoutMaskOp, [seed], {"p": 0.25, "salt": 7}, tensor([20, 24], f32))
    set_results(fn, [("loss", "y", b.cast(b.mul(y, mask), bf16))])
    group, _ = _check(module, cfg(split_k=2, bk=16), "bf16", 2e-2)
    assert any(isinstance(o, nv.DropoutMaskOp) for o in group.inner_ops())


def test_an_output_may_replace_its_epilogue_operand_in_place():
    """p - x @ w written over p (a param update in the epilogue): each element is
    read by the lane that writes it, one-pass and split; an output overlapping an
    operand any other way is refused."""
    from nova.codegen.triton.elementwise import Operand

    ep = mm.Epilogue(shape=(16, 48), operands=(Operand((16, 48), torch.float32, load="raw"),),
                     body="e_y = ex0 - e_tile.to(tl.bfloat16).to(tl.float32)", stores=(("e_y", "f32", torch.float32),),
                     out_shapes=((16, 48),))  # fmt: skip
    for split in (1, 2):
        torch.manual_seed(split)
        x, w, p = torch.randn(16, 32).bfloat16(), torch.randn(32, 48).bfloat16(), torch.randn(16, 48)
        want = p - (x.float() @ w.float()).bfloat16().float()
        (out,) = mm.matmul_epilogue(x, w, ep, [p], torch.bfloat16, cfg=cfg(split_k=split), outs=[p])
        assert out is p
        torch.testing.assert_close(p, want, rtol=1e-2, atol=1e-2)
    big = torch.randn(17, 48)
    with pytest.raises(ValueError, match="does not replace element for element"):
        mm.matmul_epilogue(x, w, ep, [big[1:]], torch.bfloat16, cfg=cfg(), outs=[big[:16]])
    buf = torch.zeros(3072, dtype=torch.uint8)
    x_in = buf[:1024].view(torch.bfloat16).view(16, 32)  # the matmul's A and the output share bytes
    with pytest.raises(ValueError, match="overlaps an operand or another output"):
        mm.matmul_epilogue(x_in, w, ep, [p], torch.bfloat16, cfg=cfg(), outs=[buf.view(torch.float32).view(16, 48)])


def test_epilogue_outputs_through_descriptors_only_where_the_copy_engine_can_address_them():
    """TMA one-pass kernels store epilogue outputs of two element sizes (f32 and bf16)
    through descriptors; outputs of one element size, an output whose rows are not
    16-byte aligned, or a batched matmul whose M is no multiple of BLOCK_M (a box
    would reach the next matrix's rows) are stored through pointers. Every case
    writes exactly the rows it owns: the bytes around the outputs stay."""
    from nova.codegen.triton.elementwise import Operand

    def run(x, w, rows, n, offset, two_sizes=True):
        stores = (("e_y", "f32", torch.float32),) + ((("e_y", "f32", torch.bfloat16),) if two_sizes else ())
        ep = mm.Epilogue(shape=(rows, n), operands=(Operand((rows, n), torch.float32, load="raw"),),
                         body="e_y = ex0 + e_tile", stores=stores, out_shapes=((rows, n),) * len(stores))  # fmt: skip
        p = torch.randn(rows, n)
        base = torch.full((rows * n + 8,), 7.0)
        outs = [base[offset:offset + rows * n].view(rows, n)] + ([torch.empty(rows, n).bfloat16()] if two_sizes else [])
        record: dict = {}
        mm.matmul_epilogue(x, w, ep, [p], torch.float32, cfg=cfg(tma=True), outs=outs, record=record)
        want = p + (x.float() @ w.float()).reshape(rows, n)
        for o in outs:
            torch.testing.assert_close(o.float(), want, rtol=1e-2, atol=1e-2)
        assert torch.all(base[:offset] == 7.0) and torch.all(base[offset + rows * n:] == 7.0)
        return "\n".join(v for k, v in record.items() if k != "tf32_stage")

    torch.manual_seed(0)
    x, w = torch.randn(24, 32), torch.randn(32, 48)
    assert "o0.store(" in run(x, w, 24, 48, 0) and "tl.store(o" not in run(x, w, 24, 48, 0)
    assert "tl.store(o0" in run(x, w, 24, 48, 0, two_sizes=False)  # one element size: one store layout
    assert "tl.store(o0" in run(x, w, 24, 48, 1)  # a base 4 bytes past 16-byte alignment
    xb, wb = torch.randn(3, 20, 32), torch.randn(3, 32, 48)  # M = 20: no multiple of 16
    assert "tl.store(o0" in run(xb, wb, 60, 48, 0)


def test_fp32_on_the_fma_path_with_bias_and_gelu():
    """fp32 operands under the fp32 policy (precision "ieee": the FMA dot)."""
    group, _ = _check(_fc("fp32", 20, 24, 40, (4, 5), dtype=f32), cfg(split_k=2), "fp32", 1e-5)
    assert _inner_names(group) == ["nova.matmul", "nova.reshape", "nova.add", "nova.gelu", "nova.cast"]


@pytest.mark.parametrize("tile,slices", [((64, 64), 4), ((64, 128), 8), ((128, 256), 16)],
                         ids=["4-slices", "8-slices", "16-slices"])
def test_a_large_tile_is_worked_through_in_column_slices(tile, slices):
    """EPILOGUE_SLICE: the accumulator's column slices one at a time, ragged N (the
    last slices masked), the residual and the pre-activation read per slice."""
    bm, bn = tile
    module, fn, b = _step("bf16", Slot("batch", "x", tensor([bm + 8, 32], bf16)), Slot("param", "w", tensor([32, 200], bf16)),
                          Slot("param", "bias", tensor([200], f32)), Slot("param", "res", tensor([bm + 8, 200], f32)))  # fmt: skip
    x, w, bias, res = fn.body.block.args
    pre = b.add(b.cast(b.matmul(x, w), f32), bias)
    set_results(fn, [("loss", "y", b.add(res, pre)), ("loss", "g", b.cast(b.one(nv.GeluOp, [pre], {"approximate": "tanh"}), bf16))])
    group, prog = _check(module, cfg(bm=bm, bn=bn, bk=32), "bf16", 2e-2)
    (st,) = [s for s in prog.steps if s.op is group]
    text = "\n".join(st.sources.values())
    from nova.codegen.triton.fused import epilogue_of

    ep = epilogue_of(group)[0]
    n = mm.epilogue_slices(ep, bm, bn)
    # the f32 residual and output and the bf16 GELU: 5 halves of a register an element, slices of at
    # most 8192 / 5 elements, of 16 columns at least
    assert mm.epilogue_streams(ep) == 5 and n == slices
    assert "tl.split(e_split" in text and f"e_n{n - 1} =" in text and f"e_n{n} =" not in text


def _inner_names(op):
    return [o.name for o in op.inner_ops()]


# ----------------------------------------------------------------------------
# whole steps


def _gpt():
    from nova.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=32, bias=True))


@pytest.mark.parametrize("precision", ["bf16", "tf32"])
def test_a_gpt_step_with_epilogues_is_the_step_without_them(precision, monkeypatch):
    """A small GPT (with biases) on the Triton backend: with the fuse stage's
    epilogues, every loss and parameter after two AdamW steps is bit-identical to
    the same step with every matmul's epilogue ops in their own kernels, and both
    stay near the reference executor. The column-sum rule is off in both (it
    changes the bias gradient's summation order: test_matmul_column_sum.py)."""
    import nova

    ref = _gpt()
    plain, fused = copy.deepcopy(ref), copy.deepcopy(ref)
    oracle = nova.compile(ref, torch.optim.AdamW(ref.parameters(), lr=1e-3), backend="reference", precision=precision)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 64, (2, 8), generator=g), torch.randint(0, 64, (2, 8), generator=g))
               for _ in range(2)]  # fmt: skip
    monkeypatch.setattr(fz._Grouping, "join_column_sums", lambda self: None)  # steps compile at their first call
    step = nova.compile(fused, torch.optim.AdamW(fused.parameters(), lr=1e-3), backend="triton", precision=precision)
    for x, y in batches:
        loss, want = step(x, y), oracle(x, y)
        assert abs(loss.item() - want.item()) <= 1e-4 * abs(want.item())
    with monkeypatch.context() as m:
        m.setattr(fz, "epilogue_head", lambda op: False)
        unfused = nova.compile(plain, torch.optim.AdamW(plain.parameters(), lr=1e-3), backend="triton",
                               precision=precision)  # fmt: skip
        for x, y in batches:
            unfused(x, y)
    for p, q, r in zip(fused.parameters(), plain.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)
        # AdamW moves an element by about lr a step whatever its gradient's size, so a
        # tiny gradient of the other sign (a 16-bit rounding away) costs 2 lr: no more
        assert (p - r).abs().max().item() <= 2 * 2 * 1e-3 * 1.01
    final = step._last.compilation.module
    groups = [op for op in step_func(final).body.block.ops if isinstance(op, nv.FusedOp) and op.contraction()]
    # qkv, proj, fc, mlp proj forward (in bf16 the f32 casts of the two dx matmuls that feed a
    # LayerNorm backward are its prologue: the matmul writes bf16, half the bytes; and the two
    # projections' bias and residual adds are the next LayerNorms' prologues, which store the sums:
    # the fuse stage's row stores); GELU's backward is computed in the bias gradient's sum, which
    # stores it (the fuse stage's prologue rule)
    assert len(groups) == (2 if precision == "bf16" else 4)
    (gelu_bwd,) = [op for op in step_func(final).body.block.ops if isinstance(op, nv.FusedOp)
                   and op.reduction() is not None and "nova.gelu_backward" in _inner_names(op)]  # fmt: skip
    assert isinstance(gelu_bwd.reduction(), nv.ReduceSumOp)
    assert not any(isinstance(op, nv.FusedOp) and op.contraction()
                   for op in step_func(unfused._last.compilation.module).body.block.ops)


@pytest.mark.parametrize("split", [1, 3], ids=["one-pass", "split-k"])
def test_a_persistent_staged_tf32_epilogue_kernel_is_the_tile_grid_one(split):
    """``configurator.PERSISTENT_STAGED_EPILOGUES``' kernels as the step launches them: A
    prerounded and K-major (read in place), B staged, a residual add in the epilogue; the
    persistent loop over the work items bit for bit the one-program-a-tile kernel, a
    ragged M, N and last split included."""
    from nova.codegen.triton.elementwise import Operand

    torch.manual_seed(5)
    M, K, N = 70, 200, 40
    a = mm.round_to_tf32(torch.randn(M, K))  # stored rounded by its producer, K contiguous
    b, res = torch.randn(K, N), torch.randn(M, N)
    ep = mm.Epilogue(shape=(M, N), operands=(Operand((M, N), torch.float32, load="raw"),), body="e_y = ex0 + e_tile",
                     stores=(("e_y", "f32", torch.float32),), out_shapes=((M, N),))  # fmt: skip
    grid = LoweringConfig(kind="matmul", block_m=16, block_n=16, block_k=32, group_m=1, split_k=split, persistent=False,
                          num_warps=4, num_stages=3, instruction="wgmma+tma+stage_a+stage_b")  # fmt: skip
    outs = []
    for c in (grid, dataclasses.replace(grid, persistent=True)):
        rec: dict = {}
        (y,) = mm.matmul_epilogue(a, b, ep, [res], torch.float32, cfg=c, precision="tf32-rn", prerounded=("a",),
                                  num_programs=5, record=rec)  # fmt: skip
        # the kernels' source files (the staging copy is recorded by its name)
        text = "\n".join(open(p).read() for p in rec if p.endswith(".py"))
        assert ("flatten=True" in text) == c.persistent
        outs.append(y)
    assert torch.equal(outs[0], outs[1])
    want = res.double() + mm.round_to_tf32(a).double() @ mm.round_to_tf32(b).double()
    torch.testing.assert_close(outs[1].double(), want, rtol=1e-5, atol=1e-4)
