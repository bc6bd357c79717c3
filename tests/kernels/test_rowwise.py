"""The row-wise lowerings (softmax, log_softmax, their backwards, layer_norm and its
backward, cross_entropy and its backward) against the reference executor, through
the Triton interpreter on the CPU (the real compiler on a GPU). Shapes are tiny and
ragged; ``max_row_block`` forces the column-loop path on short rows."""

from __future__ import annotations

import pytest
import torch
from xdsl.dialects.builtin import i64

from nova.backends.reference import IMPLS
from nova.ir import dialect as nv
from nova.ir.builder import OpBuilder
from nova.ir.module import Slot, new_step
from nova.ir.types import from_torch_dtype, tensor
from nova.schedule.config import LoweringConfig

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

RTOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float64: 1e-12}
REGISTERS, LOOP = 16384, 4  # max_row_block: whole row in registers / column blocks of 4
PATHS = pytest.mark.parametrize("limit", [REGISTERS, LOOP], ids=["registers", "loop"])
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])


def lowering(op):
    from nova.codegen.triton import rowwise  # noqa: F401  (registers the lowerings)
    from nova.codegen.triton.lowering import lowering_for

    return lowering_for(op)


def build(op_cls, inputs: list[torch.Tensor], props: dict | None = None):
    """``op_cls`` over one batch argument per input (shape and dtype taken from it)."""
    _, fn = new_step([Slot("batch", f"x{i}", tensor(t.shape, from_torch_dtype(t.dtype))) for i, t in enumerate(inputs)])
    return OpBuilder(fn.body.block).create(op_cls, list(fn.body.block.args), props or {})


def rand(*shape, dtype=torch.float32, device="cpu", gen=None) -> torch.Tensor:
    """|x| in [0.5, 1.5) with a random sign: never zero."""
    u = torch.rand(shape, generator=gen, dtype=torch.float64)
    sign = torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0).double()
    return (sign * (0.5 + u)).to(dtype).to(device)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def run_and_compare(op, inputs, rtol=None, cfg=None, **kw) -> list[torch.Tensor]:
    kernel = lowering(op)(op, cfg, **kw)
    outs = kernel.launch(inputs)
    refs = IMPLS[type(op)](op, inputs)
    assert len(outs) == len(refs)
    for i, (o, r) in enumerate(zip(outs, refs)):
        assert o.shape == r.shape and o.dtype == r.dtype, (i, o.shape, r.shape, o.dtype, r.dtype)
        assert o.is_contiguous()
        tol = rtol or RTOL[inputs[-1].dtype if inputs[-1].is_floating_point() else inputs[-2].dtype]
        assert rel_err(o, r) < tol, (op.name, i, rel_err(o, r))
    return outs


# --------------------------------------------------------------------------- softmax family


@pytest.mark.parametrize("op_cls", [nv.SoftmaxOp, nv.LogSoftmaxOp], ids=["softmax", "log_softmax"])
@DTYPES
@PATHS
def test_softmax_any_dim_and_strides(device, op_cls, dtype, limit):
    gen = torch.Generator().manual_seed(0)
    x = rand(3, 7, 5, dtype=dtype, device=device, gen=gen) * 3
    for dim in (-1, 1, 0):  # last dim, then dims read through their (non-unit) strides
        run_and_compare(build(op_cls, [x], {"dim": dim}), [x], max_row_block=limit)
    xt = rand(5, 7, 3, dtype=dtype, device=device, gen=gen).permute(2, 1, 0)  # no unit stride anywhere
    run_and_compare(build(op_cls, [xt], {"dim": -1}), [xt], max_row_block=limit)


@pytest.mark.parametrize("op_cls", [nv.SoftmaxBackwardOp, nv.LogSoftmaxBackwardOp], ids=["softmax", "log_softmax"])
@DTYPES
@PATHS
def test_softmax_backward(device, op_cls, dtype, limit):
    gen = torch.Generator().manual_seed(1)
    x = rand(4, 9, dtype=torch.float32, gen=gen)
    fwd = torch.softmax if op_cls is nv.SoftmaxBackwardOp else torch.log_softmax
    for dim in (1, 0):
        y = fwd(x, dim).to(dtype).to(device)
        g = rand(4, 9, dtype=dtype, device=device, gen=gen)
        run_and_compare(build(op_cls, [y, g], {"dim": dim}), [y, g], max_row_block=limit)
    # grad as a broadcast view (stride 0 along the rows)
    y = fwd(x, 1).to(dtype).to(device)
    g = rand(9, dtype=dtype, device=device, gen=gen).expand(4, 9)
    run_and_compare(build(op_cls, [y, g], {"dim": 1}), [y, g], max_row_block=limit)


def test_softmax_vocab_row_loops(device):
    """A 50304-wide row is past the in-register limit: the default plan loops."""
    x = rand(2, 50304, device=device, gen=torch.Generator().manual_seed(2)) * 4
    op = build(nv.SoftmaxOp, [x], {"dim": -1})
    kernel = lowering(op)(op, None)
    assert kernel.extra["looping"] and kernel.needs_contiguous == ()
    assert rel_err(kernel.launch([x])[0], IMPLS[nv.SoftmaxOp](op, [x])[0]) < 1e-5


def test_config_block_and_errors(device):
    x = rand(3, 40, device=device)
    op = build(nv.LogSoftmaxOp, [x], {"dim": 1})
    cfg = LoweringConfig(kind="reduction", block=16, num_warps=2)
    kernel = lowering(op)(op, cfg)
    assert kernel.extra["looping"] and kernel.config == cfg and "BLOCK = tl.constexpr(16)" in kernel.source
    run_and_compare(op, [x], cfg=cfg)
    # layer_norm_backward takes a configurator block as an upper bound (its rows hold
    # three times the forward's tensors): 8192 becomes column blocks of 4096
    x, w = torch.empty(4, 8192), torch.empty(8192)
    ins = [x, x, w, w[:4], w[:4]]
    op_bwd = build(nv.LayerNormBackwardOp, ins)
    big = LoweringConfig(kind="reduction", block=8192, num_warps=16)
    ln_bwd = lowering(op_bwd)(op_bwd, big)
    assert ln_bwd.extra["looping"] and ln_bwd.config.block == 4096
    with pytest.raises(ValueError, match="power of two"):
        lowering(op)(op, LoweringConfig(kind="reduction", block=24))
    with pytest.raises(ValueError, match="input 0"):
        kernel.launch([x.double()])


def test_f64(device):
    gen = torch.Generator().manual_seed(3)
    x = rand(4, 6, dtype=torch.float64, device=device, gen=gen)
    run_and_compare(build(nv.SoftmaxOp, [x], {"dim": 0}), [x])
    w, b = rand(6, dtype=torch.float64, device=device, gen=gen), rand(6, dtype=torch.float64, device=device, gen=gen)
    _, mean, rstd = run_and_compare(build(nv.LayerNormOp, [x, w, b], {"eps": 1e-5}), [x, w, b], max_row_block=LOOP)
    g = rand(4, 6, dtype=torch.float64, device=device, gen=gen)
    ins = [g, x, w, mean, rstd]
    run_and_compare(build(nv.LayerNormBackwardOp, ins), ins, partial_programs=3)


# --------------------------------------------------------------------------- layer_norm


@DTYPES
@PATHS
def test_layer_norm(device, dtype, limit):
    gen = torch.Generator().manual_seed(4)
    x = (rand(2, 5, 11, dtype=torch.float32, gen=gen) + 0.3).to(dtype).to(device)
    w, b = rand(11, dtype=dtype, device=device, gen=gen), rand(11, dtype=dtype, device=device, gen=gen)
    run_and_compare(build(nv.LayerNormOp, [x, w, b], {"eps": 1e-5}), [x, w, b], max_row_block=limit)
    xt = rand(11, 2, 5, dtype=dtype, device=device, gen=gen).permute(1, 2, 0)  # the normalized dim strided
    run_and_compare(build(nv.LayerNormOp, [xt, w, b], {"eps": 1e-3}), [xt, w, b], max_row_block=limit)


@DTYPES
def test_layer_norm_programs_walking_rows_are_the_per_row_kernel(device, dtype, monkeypatch):
    """LN_FWD_PROGRAMS_PER_SM: programs walking consecutive rows (w and b loaded once a
    program) compute each row as the one-program-a-row kernel does: the same bits, for
    a row count that leaves the last program short, and for a strided normalized dim."""
    from nova.codegen.triton import rowwise

    gen = torch.Generator().manual_seed(21)
    x = (rand(3, 101, 11, dtype=torch.float32, gen=gen) + 0.3).to(dtype).to(device)  # 303 rows
    w, b = rand(11, dtype=dtype, device=device, gen=gen), rand(11, dtype=dtype, device=device, gen=gen)
    xt = rand(11, 3, 101, dtype=dtype, device=device, gen=gen).permute(1, 2, 0)
    for xs in (x, xt):
        op = build(nv.LayerNormOp, [xs, w, b], {"eps": 1e-5})
        monkeypatch.setattr(rowwise, "LN_FWD_PROGRAMS_PER_SM", 0)
        per_row = lowering(op)(op, None).launch([xs, w, b])
        monkeypatch.setattr(rowwise, "LN_FWD_PROGRAMS_PER_SM", 1)  # 132 programs (the interpreter's H200): 3 rows each
        kernel = lowering(op)(op, None)
        assert "ROWS_PER_PROG" in kernel.source and "programs walking rows" in kernel.source
        walked = kernel.launch([xs, w, b])
        assert all(torch.equal(a, c) for a, c in zip(per_row, walked))
        run_and_compare(op, [xs, w, b])


@DTYPES
@PATHS
def test_layer_norm_backward_deterministic(device, dtype, limit):
    gen = torch.Generator().manual_seed(5)
    x = rand(3, 7, 13, dtype=dtype, device=device, gen=gen)
    w, b = rand(13, dtype=dtype, device=device, gen=gen), rand(13, dtype=dtype, device=device, gen=gen)
    _, mean, rstd = IMPLS[nv.LayerNormOp](build(nv.LayerNormOp, [x, w, b], {"eps": 1e-5}), [x, w, b])
    g = rand(3, 7, 13, dtype=dtype, device=device, gen=gen).transpose(0, 1).contiguous().transpose(0, 1)
    ins = [g, x, w, mean, rstd]
    op = build(nv.LayerNormBackwardOp, ins)
    # 21 rows over 4 programs (6 rows each, the last with 3): partials summed in order
    first = run_and_compare(op, ins, max_row_block=limit, partial_programs=4)
    again = lowering(op)(op, None, max_row_block=limit, partial_programs=4).launch(ins)
    assert all(torch.equal(a, b) for a, b in zip(first, again))


@PATHS
def test_layer_norm_backward_row_sums_as_one_reduction(device, limit, monkeypatch):
    """LN_BWD_PAIR_SUMS: c1 and c2 from one two-operand tl.reduce (off as shipped, for a
    device A/B): the same gradients as the reference, ragged rows and partial programs."""
    from nova.codegen.triton import rowwise

    monkeypatch.setattr(rowwise, "LN_BWD_PAIR_SUMS", True)
    gen = torch.Generator().manual_seed(15)
    x = rand(3, 7, 13, device=device, gen=gen)
    w, b = rand(13, device=device, gen=gen), rand(13, device=device, gen=gen)
    _, mean, rstd = IMPLS[nv.LayerNormOp](build(nv.LayerNormOp, [x, w, b], {"eps": 1e-5}), [x, w, b])
    g = rand(3, 7, 13, device=device, gen=gen)
    ins = [g, x, w, mean, rstd]
    op = build(nv.LayerNormBackwardOp, ins)
    assert "_pair_add" in lowering(op)(op, None, max_row_block=limit, partial_programs=4).source
    run_and_compare(op, ins, max_row_block=limit, partial_programs=4)


# --------------------------------------------------------------------------- cross_entropy


def _ce_case(dtype, device, n=9, c=23, ignore=-100, seed=6):
    gen = torch.Generator().manual_seed(seed)
    logits = (rand(n, c, dtype=torch.float32, gen=gen) * 3).to(dtype).to(device)
    target = torch.randint(0, c, (n,), generator=gen)
    target[1::3] = ignore  # every third row ignored
    return logits, target.to(device)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@DTYPES
@PATHS
def test_cross_entropy_and_backward(device, reduction, dtype, limit):
    logits, target = _ce_case(dtype, device)
    props = {"ignore_index": -100, "reduction": reduction}
    run_and_compare(build(nv.CrossEntropyOp, [logits, target], props), [logits, target], max_row_block=limit)
    grad = torch.tensor(1.7, dtype=dtype, device=device)
    ins = [grad, logits, target]
    (d,) = run_and_compare(build(nv.CrossEntropyBackwardOp, ins, props), ins, max_row_block=limit)
    assert torch.all(d[1::3] == 0)


def test_cross_entropy_strided_logits_and_custom_ignore(device):
    logits, target = _ce_case(torch.float32, device, ignore=3, seed=7)
    lt = logits.t().contiguous().t()  # column-major logits
    props = {"ignore_index": 3, "reduction": "mean"}
    run_and_compare(build(nv.CrossEntropyOp, [lt, target], props), [lt, target])
    ins = [torch.tensor(0.5, device=device), lt, target]
    run_and_compare(build(nv.CrossEntropyBackwardOp, ins, props), ins)


def test_cross_entropy_vocab_width(device):
    logits, target = _ce_case(torch.float32, device, n=3, c=50304, seed=8)
    props = {"ignore_index": -100, "reduction": "mean"}
    op = build(nv.CrossEntropyOp, [logits, target], props)
    assert lowering(op)(op, None).extra["looping"]
    run_and_compare(op, [logits, target])
    ins = [torch.tensor(1.0, device=device), logits, target]
    run_and_compare(build(nv.CrossEntropyBackwardOp, ins, props), ins)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy under the interpreter: 0 / 0
@PATHS
def test_cross_entropy_all_ignored_mean_is_nan_gradient_zero(device, limit):
    """A batch of padding only: the mean loss is 0 / 0 = NaN (as torch), but its
    gradient is 0, not NaN (torch's; the count is clamped to 1 in the backward)."""
    logits, _ = _ce_case(torch.float32, device, n=4)
    target = torch.full((4,), -100, dtype=torch.int64, device=device)
    for ls in (0.0, 0.2):
        props = {"ignore_index": -100, "reduction": "mean", "label_smoothing": ls}
        op = build(nv.CrossEntropyOp, [logits, target], props)
        assert torch.isnan(lowering(op)(op, None, max_row_block=limit).launch([logits, target])[0])
        ins = [torch.tensor(1.0, device=device), logits, target]
        op = build(nv.CrossEntropyBackwardOp, ins, props)
        out, ref = lowering(op)(op, None, max_row_block=limit).launch(ins)[0], IMPLS[type(op)](op, ins)[0]
        assert torch.equal(ref, torch.zeros_like(ref)) and torch.equal(out, ref)
    props = {"ignore_index": -100, "reduction": "sum"}
    op = build(nv.CrossEntropyOp, [logits, target], props)
    assert lowering(op)(op, None).launch([logits, target])[0].item() == 0.0


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ls", [0.0, 0.1, 1.0], ids=["ls0", "ls0.1", "ls1"])
@DTYPES
@PATHS
def test_cross_entropy_label_smoothing_and_none(device, reduction, ls, dtype, limit):
    """label_smoothing (the per-row mean of -log p over classes mixed in) and
    reduction "none" (one loss per row, 0 where ignored; its grad is [N], one
    scale per row), in registers and looping (C = 23 over blocks of 4)."""
    logits, target = _ce_case(dtype, device)
    props = {"ignore_index": -100, "reduction": reduction, "label_smoothing": ls}
    (loss,) = run_and_compare(build(nv.CrossEntropyOp, [logits, target], props), [logits, target], max_row_block=limit)
    if reduction == "none":
        assert loss.shape == (9,) and torch.all(loss[1::3] == 0) and torch.all(loss[0::3] != 0)
    gen = torch.Generator().manual_seed(11)
    grad = rand(9, dtype=dtype, gen=gen).to(device) if reduction == "none" else torch.tensor(1.7, dtype=dtype, device=device)
    ins = [grad, logits, target]
    (d,) = run_and_compare(build(nv.CrossEntropyBackwardOp, ins, props), ins, max_row_block=limit)
    assert torch.all(d[1::3] == 0)


def test_cross_entropy_none_strided_grad_and_f64(device):
    """A strided [N] grad (every other element of a buffer) and f64 logits, whose
    smoothing constants must be f64 (an fp32 literal would be off by ~1e-8)."""
    logits, target = _ce_case(torch.float64, device, n=6, c=11, seed=12)
    props = {"ignore_index": -100, "reduction": "none", "label_smoothing": 0.3}
    run_and_compare(build(nv.CrossEntropyOp, [logits, target], props), [logits, target])
    grad = rand(12, dtype=torch.float64, gen=torch.Generator().manual_seed(13)).to(device)[::2]
    ins = [grad, logits, target]
    run_and_compare(build(nv.CrossEntropyBackwardOp, ins, props), ins)
    for reduction in ("mean", "sum"):
        props = {"ignore_index": -100, "reduction": reduction, "label_smoothing": 0.3}
        run_and_compare(build(nv.CrossEntropyOp, [logits, target], props), [logits, target], max_row_block=4)
        ins = [torch.tensor(0.7, dtype=torch.float64, device=device), logits, target]
        run_and_compare(build(nv.CrossEntropyBackwardOp, ins, props), ins, max_row_block=4)


BAD_IDS = [23, -1, 2**40, -(2**40)]  # just past either end, and far enough that an unmasked read would fault


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@PATHS
def test_cross_entropy_out_of_range_targets_are_masked(device, reduction, limit):
    """Out-of-range ids neither raise in the launch (no host read of the device:
    the guard stage counts them) nor address memory (an unmasked read at 2**40
    faults). As in the reference: they count as rows, a bad row's loss is NaN and
    its gradient the plain softmax (no one-hot to take away)."""
    logits, target = _ce_case(torch.float32, device)  # C = 23, rows 1, 4, 7 ignored
    target[[0, 2, 3, 5]] = torch.tensor(BAD_IDS, device=device)
    props = {"ignore_index": -100, "reduction": reduction, "label_smoothing": 0.1}
    op = build(nv.CrossEntropyOp, [logits, target], props)
    (loss,) = lowering(op)(op, None, max_row_block=limit).launch([logits, target])
    (ref,) = IMPLS[nv.CrossEntropyOp](op, [logits, target])
    assert torch.isnan(loss[[0, 2, 3, 5]] if reduction == "none" else loss).all()
    torch.testing.assert_close(loss, ref, equal_nan=True)
    grad = torch.ones(9, device=device) if reduction == "none" else torch.tensor(1.7, device=device)
    ins = [grad, logits, target]
    op = build(nv.CrossEntropyBackwardOp, ins, props)
    (d,) = lowering(op)(op, None, max_row_block=limit).launch(ins)
    torch.testing.assert_close(d, IMPLS[nv.CrossEntropyBackwardOp](op, ins)[0])


# --------------------------------------------------------------------------- registry and the sm_90 build


def test_every_rowwise_op_registered():
    from nova.codegen.triton import rowwise  # noqa: F401
    from nova.codegen.triton.lowering import LOWERINGS

    ops = [nv.SoftmaxOp, nv.LogSoftmaxOp, nv.SoftmaxBackwardOp, nv.LogSoftmaxBackwardOp, nv.LayerNormOp,
           nv.LayerNormBackwardOp, nv.CrossEntropyOp, nv.CrossEntropyBackwardOp]
    assert all(op in LOWERINGS for op in ops)


def build_for_sm90(cases, kernels: dict | None = None, specialize: bool = False) -> list[str]:
    """Build (not run) every kernel the launches of ``cases`` ([(lower, inputs)])
    would start, for sm_90 with the real compiler and ptxas; no GPU needed. Runs in
    a process without TRITON_INTERPRET: the interpreter leaves triton.language
    patched after it runs (device-function calls are never unpatched), and it
    accepts programs the compiler rejects, which is what this build catches.
    Returns the names of the kernels built; ``kernels`` (a dict) receives each one's
    (compiled kernel, ptxas -v log) by name (scripts/attention_sass.py reads their machine
    code, test_attention_sm90_census their wgmma and spills). ``specialize``: the arguments
    as Triton's launcher specializes them (an integer 1 a constant, integers and pointers
    divisible by 16 known so), the code a launch on the device compiles; without it every
    integer and pointer is unknown (fewer vectorized accesses). The compile itself is
    scripts/epilogue_sm90_check.build_sm90's."""
    import sys
    from pathlib import Path

    from triton.runtime.jit import JITFunction

    scripts = str(Path(__file__).resolve().parents[2] / "scripts")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    from epilogue_sm90_check import _PTR as pointer
    from epilogue_sm90_check import build_sm90

    built = []

    def build_only(self, *args, grid, warmup, **kwargs):
        options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
        sig, consts, attrs, it = {}, {}, {}, iter(args)
        for i, p in enumerate(self.params):
            if p.is_constexpr:
                sig[p.name], consts[(i,)] = "constexpr", kwargs[p.name]
                continue
            a = next(it)
            if hasattr(a, "block_shape"):  # a host-built TMA descriptor (triton.tools.tensor_descriptor)
                sig[p.name] = f"tensordesc<{pointer[a.base.dtype][1:]}{list(a.block_shape)}>"
                continue
            if specialize and not isinstance(a, torch.Tensor) and a == 1:
                sig[p.name], consts[(i,)] = "constexpr", 1
                continue
            sig[p.name] = pointer[a.dtype] if isinstance(a, torch.Tensor) else "i32" if abs(a) < 2**31 else "i64"
            if specialize and (a.data_ptr() if isinstance(a, torch.Tensor) else a) % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        compiled, log = build_sm90(self, sig, consts, attrs, options.get("num_warps", 4), options.get("num_stages", 3))
        assert "cubin" in compiled.asm
        built.append(self.fn.__name__)
        if kernels is not None:
            kernels[self.fn.__name__] = (compiled, log)

    original, JITFunction.run = JITFunction.run, build_only
    try:
        for lower, inputs in cases:
            lower().launch(inputs)
    finally:
        JITFunction.run = original
    return built


def run_sm90_build(script: str) -> str:
    """Run ``script`` (a test file whose __main__ calls build_for_sm90) in a fresh
    process without the interpreter; returns its stdout."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def sm90_cases():
    """One op of each family, in-register and looping, full rows (no masks) and ragged."""
    cases = []

    def add(op, inputs, **kw):
        cases.append((lambda: lowering(op)(op, None, **kw), inputs))

    x = torch.empty(4, 256)
    add(build(nv.SoftmaxOp, [x], {"dim": 0}), [x])
    add(build(nv.LogSoftmaxBackwardOp, [x, x], {"dim": 1}), [x, x], max_row_block=64)
    xb, w = torch.empty(6, 100, dtype=torch.bfloat16), torch.empty(100, dtype=torch.bfloat16)
    add(build(nv.LayerNormOp, [xb, w, w], {"eps": 1e-5}), [xb, w, w])
    ins = [xb, xb, w, w[:6], w[:6]]
    add(build(nv.LayerNormBackwardOp, ins), ins, max_row_block=32)
    logits, t = torch.empty(4, 1000), torch.zeros(4, dtype=torch.int64)
    ins = [torch.empty(()), logits, t]
    add(build(nv.CrossEntropyBackwardOp, ins, {"ignore_index": -100, "reduction": "mean"}), ins,
        max_row_block=256)
    return cases


def test_kernels_build_for_sm90():
    """The generated text compiles to sm_90 cubins (see build_for_sm90)."""
    out = run_sm90_build(__file__)
    for name in ("softmax_kernel", "log_softmax_backward_kernel", "layer_norm_kernel", "layer_norm_backward_colsum",
                 "cross_entropy_backward_scale", "cross_entropy_backward_rows"):
        assert name in out


if __name__ == "__main__":
    print(" ".join(build_for_sm90(sm90_cases())))
