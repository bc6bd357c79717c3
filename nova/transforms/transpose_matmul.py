"""The transpose_matmul stage (off by default: ``ENABLED``): a transposed product is computed transposed,
``transpose(a @ b)`` as ``transpose(b) @ transpose(a)``, so that a weight gradient
is written in its parameter's layout.

autodiff's backward of ``y = x @ transpose(w)`` (``nn.Linear``: every GPT-2 weight)
gives ``dw = transpose(transpose(x) @ dy)``: the product [in, out] and a transpose
(a strided view). Everything that reads ``dw`` then reads it across its rows, and
ddp's bucket cannot take the gradient as a window of its flat buffer, only as a
copy (a reshape, then the bucket's cat). Eager PyTorch computes the gradient the
other way round already (``grad_output^T @ input``). (The optimizer's update reads
the transposed gradient at the same speed as a plain one, as far as measured: see
``ENABLED``.)

Rule: ``transpose(m, perm)`` with perm swapping the last two dims and ``m`` the
result of a ``nova.matmul`` (or a ``nova.cast`` of one), each read by the next op
alone, becomes ``matmul(swap(b), swap(a))`` (cast as before), where swap undoes
an operand's own last-two-dims transpose instead of adding one. Exact in real
arithmetic (each element is the same K products); in floating point the sum over K
is the kernel's for the other shape, so results match the transposed product within
rounding, not bit for bit. Nothing else changes: a product read by anything besides
the transpose, a batched product whose operands broadcast (the swap keeps the batch
dims, which must then match), a transpose of other dims.

Under the tf32 policy the stage also runs with the switch off, on f32 products alone,
and rewrites a match only where that stages fewer bytes (``TF32_STAGE_SMALLER``).
A tf32 wgmma reads B from shared memory K-major only; a B stored otherwise is
copied (rounded, K-major) by the matmul launcher before the kernel runs, while an
A of any layout reaches the MMA through registers. In a weight gradient
``x^T @ dy`` both x [T, in] and dy [T, out] are stored row-major, so B (dy) is
copied; the rewritten ``dy^T @ x`` copies x instead. The rewrite is taken where
the B it would stage has fewer elements than the B staged now (a B already K-major,
"col", stages none): the MLP's up projection (in 384, out 1536) and GPT-2's qkv and
fc weights; not the down projections, whose dy is the narrower.
"""

from __future__ import annotations

from xdsl.dialects.builtin import ModuleOp, f32
from xdsl.ir import SSAValue

from nova.ir import dialect as nv
from nova.ir.builder import OpBuilder
from nova.ir.module import step_func
from nova.ir.types import elem_of, numel, shape_of
from nova.transforms.configure import operand_layout  # the configure stage's layouts: what the kernel reads
from nova.transforms.simplify import dce

# the pipeline's switch. Off: built 2026-12-05 (sixth session) and verified on the CPU, not measured
# on a device. Its first reason did not hold: the 4c64f5c launch table's 1.436 and 1.314 ms for the
# c_fc and c_proj weights' updates were the host's launch time inside the timer's events (nova/
# runtime/profile.py, mended the next session); at 1c57010 the same kernels took 0.32 ms each against
# c_attn's 0.245, in proportion to their bytes, so the transposed gradient costs the update nothing
# we can see. What is left: ddp's buckets take the gradients as windows (the offline plan loses 48
# reshape copies and the bucket's cat copy: 43.070 -> 42.675 ms predicted on the H200). The GPT-2 124M bf16
# step's plan is the same with it (8.654 GiB predicted), its kernels the same but for 768x2304's
# product computed as 2304x768 at the same config; scripts/epilogue_variants.py "transpose-matmul-on"
# measures it against the shipped step
ENABLED = False
# Under the tf32 policy, f32 products rewritten where the rewrite stages fewer B elements (above).
# Measured on an H100 at f875fed (bench/results/runs/matmul_mlp46m_tf32_b8_search6_h100_f875fed.json):
# the 46M MLP's up-projection weight gradient 384x1536x8192 ran 0.085 ms plus its B copy (dy, 50 MB:
# ~0.033 ms); the same product the other way round, 1536x384x8192, is the down projection's shape,
# 0.076 ms plus a copy of x (12.6 MB). The step at 0a75207 with it (runs/*_h100_0a75207.json): the
# MLP 949,606 tok/s against torch.compile's 942,445; GPT-2 tf32 b16 184,441 against 163,112
TF32_STAGE_SMALLER = True


def _staged_elements(v: SSAValue, layout: str) -> int:
    """Elements of a tf32 kernel's B operand ``v`` the launcher copies: none if K-major ("col")."""
    return 0 if layout == "col" else numel(shape_of(v.type))


_FLIP = {"row": "col", "col": "row", "strided": "strided"}


def _stages_less(a: SSAValue, w: SSAValue) -> bool:
    """Whether ``swap(w) @ swap(a)`` stages fewer B elements than ``a @ w`` (f32 operands)."""
    if elem_of(a.type) != f32 or elem_of(w.type) != f32:
        return False
    now = _staged_elements(w, operand_layout(w))
    then = _staged_elements(a, _FLIP[operand_layout(a)])  # swap(a): a with its last two dims swapped
    return then < now


def _swaps_last_two(perm: tuple[int, ...]) -> bool:
    n = len(perm)
    return n >= 2 and tuple(perm) == (*range(n - 2), n - 1, n - 2)


def _swapped(b: OpBuilder, v: SSAValue) -> SSAValue:
    """``v`` with its last two dims swapped: the operand of ``v``'s own swap when it is one."""
    op = v.owner
    if isinstance(op, nv.TransposeOp) and _swaps_last_two(op.props()["perm"]):
        return op.operands[0]
    return b.swap_last(v)


def _product_under(t: nv.TransposeOp) -> tuple[nv.MatmulOp, nv.CastOp | None] | None:
    if not _swaps_last_two(t.props()["perm"]):
        return None
    v = t.operands[0]
    cast = None
    if isinstance(v.owner, nv.CastOp) and v.has_one_use():
        cast = v.owner
        v = cast.operands[0]
    if not isinstance(v.owner, nv.MatmulOp) or not v.has_one_use():
        return None
    mm = v.owner
    a, b = mm.operands
    if shape_of(a.type)[:-2] != shape_of(b.type)[:-2]:
        return None  # broadcast batch dims
    return mm, cast


def transpose_matmul(module: ModuleOp, enabled: bool | None = None, precision: str = "fp32") -> int:
    """Rewrites every match in @train_step (see the module docstring); returns how many.
    ``enabled`` None: as ``ENABLED`` says; off, under ``precision`` "tf32" the f32 matches
    that stage fewer bytes rewritten (``TF32_STAGE_SMALLER``)."""
    every = ENABLED if enabled is None else enabled
    fewer = not every and precision == "tf32" and TF32_STAGE_SMALLER
    if not (every or fewer):
        return 0
    block = step_func(module).body.block
    done = 0
    for t in [op for op in block.ops if isinstance(op, nv.TransposeOp)]:
        found = _product_under(t)
        if found is None:
            continue
        mm, cast = found
        a, w = mm.operands
        if fewer and not _stages_less(a, w):
            continue
        loc = mm.attributes.get("nova.loc")
        # where the product was: the transpose may sit later (by its reader), and computing
        # the product there would keep its operands (activations) alive until then
        b = OpBuilder(block, before=mm, location=loc.data if loc is not None else None)
        out = b.matmul(_swapped(b, w), _swapped(b, a))
        if cast is not None:
            out = b.cast(out, elem_of(cast.results[0].type))
        assert out.type == t.results[0].type, (out.type, t.results[0].type)
        t.results[0].replace_all_uses_with(out)
        done += 1
    if done:
        dce(block)
    return done


__all__ = ["ENABLED", "TF32_STAGE_SMALLER", "transpose_matmul"]
