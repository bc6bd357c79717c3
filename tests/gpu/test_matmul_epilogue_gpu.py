"""Matmul epilogues on the GPU: each ``nova.fused "contraction"`` launch of GPT-2
layer shapes (configured for the device, TMA and wgmma where the configurator
picks them, split-K forced once) against the unfused launches of the same IR, bit
for bit; then a small GPT's bf16 and tf32 steps with and without epilogues, bit
for bit. The compiled kernels contract nothing in an epilogue (no fma the
unfused kernels could not form), which only a GPU build can show."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from xdsl.dialects.builtin import StringAttr, bf16, f32

from nova.backends.triton import TritonProgram, config_of
from nova.ir import dialect as nv
from nova.ir.builder import OpBuilder
from nova.ir.module import Slot, context, new_step, return_op, set_results, step_func
from nova.ir.types import elem_of, shape_of, tensor, to_torch_dtype
from nova.schedule.devices import from_torch_device
from nova.transforms import fuse as fz
from nova.transforms.configure import Configure, config_attr

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _run(prog, args):
    env = dict(zip(prog.fn.body.block.args, args, strict=True))
    for st in prog.steps:
        env.update(zip(st.outputs, st.run([env[v] for v in st.inputs]), strict=True))
    torch.cuda.synchronize()
    return [env[v] for v in return_op(prog.fn).operands]


def _split(cfg, split, itemsize):
    """``cfg`` split ``split`` ways, as the configurator would launch a split: one program a
    work item (no persistent loop, no warp specialization), the ring as deep as fits beside
    the fp32 partial tile's conversion (the configured ring of a persistent 128x256 tile
    with 4 stages asked 320 KiB of shared memory split)."""
    stage = (cfg.block_m + cfg.block_n) * cfg.block_k * itemsize
    room = torch.cuda.get_device_properties(0).shared_memory_per_block_optin - 1024 - 128
    stages = max(2, min(cfg.num_stages, (room - cfg.block_m * cfg.block_n * 4) // stage))
    inst = "+".join(t for t in cfg.instruction.split("+") if t != "ws")
    return dataclasses.replace(cfg, split_k=split, persistent=False, num_stages=stages, instruction=inst)


def _same_both_ways(module, precision, split=None):
    """Configures ``module`` for the device (``split``: force that split count on the
    matmul), runs it unfused and fused on the Triton backend, compares bit for bit."""
    device = from_torch_device(torch.device("cuda"))
    fn = step_func(module)
    unfused = module.clone()
    for m in (unfused, module):
        if m is module:
            fz.fuse(m)
        Configure(device, precision).apply(context(), m)
        if split is not None:
            for op in step_func(m).body.block.ops:
                if isinstance(op, (nv.MatmulOp, nv.FusedOp)) and "nova.lowering_config" in op.attributes:
                    cfg = config_of(op)
                    if cfg.kind == "matmul":
                        itemsize = 2 if precision == "bf16" else 4
                        op.attributes["nova.lowering_config"] = config_attr(_split(cfg, split, itemsize))
    assert any(isinstance(op, nv.FusedOp) and op.contraction() is not None for op in fn.body.block.ops)
    g = torch.Generator(device="cuda").manual_seed(0)
    args = [torch.randn(shape_of(a.type), generator=g, device="cuda").to(to_torch_dtype(elem_of(a.type)))
            for a in fn.body.block.args]  # fmt: skip
    got = _run(TritonProgram(fn, precision), args)
    want = _run(TritonProgram(step_func(unfused), precision), args)
    for x, y in zip(got, want, strict=True):
        assert torch.equal(x, y), (x.double() - y.double()).abs().max().item()


def _layer(policy, dtype, M, K, N, rows, residual):
    module, fn = new_step([Slot("batch", "x", tensor([M, K], dtype)), Slot("param", "w", tensor([N, K], dtype)),
                           Slot("param", "bias", tensor([N], f32)), Slot("batch", "res", tensor([*rows, N], f32))])
    module.attributes["nova.precision"] = StringAttr(policy)
    b = OpBuilder(fn.body.block, location="test.py:1")
    x, w, bias, res = fn.body.block.args
    h = b.reshape(b.matmul(x, b.transpose(w, [1, 0])), [*rows, N])
    pre = b.add(b.cast(h, f32) if dtype == bf16 else h, bias)
    if residual:
        set_results(fn, [("loss", "y", b.add(res, pre))])
    else:
        out = b.one(nv.GeluOp, [pre], {"approximate": "tanh"})
        set_results(fn, [("loss", "pre", pre), ("loss", "out", b.cast(out, bf16))])
    return module


@pytest.mark.parametrize("split", [None, 3], ids=["configured", "split3"])
@pytest.mark.parametrize("policy,dtype", [("bf16", bf16), ("tf32", f32)], ids=["bf16", "tf32"])
@pytest.mark.parametrize("residual", [False, True], ids=["fc-gelu", "proj-residual"])
def test_layer_epilogues_are_the_unfused_kernels_bit_for_bit(policy, dtype, residual, split, monkeypatch):
    """The forced split compares the split kernel's epilogue with its own reduction pass:
    unfused, a split grid of more than a wave runs as stream-K (``STREAM_K_SPLIT``), whose
    sums follow its lockstep bands, not the split's K ranges (tests/gpu/test_matmul_split_gpu.py
    holds stream-K to the split within rounding), so stream-K is off for it here."""
    from nova.codegen.triton import matmul as mm

    monkeypatch.setattr(mm, "STREAM_K_SPLIT", False)
    N = 768 if residual else 3072
    _same_both_ways(_layer(policy, dtype, 4096, 768, N, (4, 1024), residual), policy, split)


@pytest.mark.parametrize("precision", ["bf16", "tf32"])
def test_a_gpt_step_with_epilogues_is_the_step_without_them(precision, monkeypatch):
    """Epilogue fusion changes no bit of a GPT step. The column-sum rule is off in both
    steps: it changes the bias gradient's summation order (tile partials, then their
    ordered sum), so with it the parameters differ by rounding (on the H200 at fcf4169,
    with the rule on, the bf16 losses were bit-identical over 3 steps and a parameter
    was not); its own tests are tests/kernels/test_matmul_column_sum.py."""
    import nova
    from nova.models import GPT, GPTConfig

    monkeypatch.setattr(fz._Grouping, "join_column_sums", lambda self: None)  # steps compile at their first call

    torch.manual_seed(0)
    ref = GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=128, bias=True)).cuda()
    plain, fused = copy.deepcopy(ref), copy.deepcopy(ref)
    step = nova.compile(fused, torch.optim.AdamW(fused.parameters(), lr=1e-3), backend="triton", precision=precision)
    g = torch.Generator(device="cuda").manual_seed(1)
    batches = [(torch.randint(0, 256, (4, 64), generator=g, device="cuda"),
                torch.randint(0, 256, (4, 64), generator=g, device="cuda")) for _ in range(3)]  # fmt: skip
    with monkeypatch.context() as m:
        m.setattr(fz, "epilogue_head", lambda op: False)  # (tests run with the step cache off: conftest)
        unfused = nova.compile(plain, torch.optim.AdamW(plain.parameters(), lr=1e-3), backend="triton",
                               precision=precision)  # fmt: skip
        want = [unfused(x, y).item() for x, y in batches]
    got = [step(x, y).item() for x, y in batches]
    assert got == want
    for p, q in zip(fused.parameters(), plain.parameters(), strict=True):
        assert torch.equal(p, q)
