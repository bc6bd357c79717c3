"""The configure stage's operand layouts (``configure.operand_layout``) are the layouts the
matmul kernel gets (``nova.codegen.triton.matmul.layout`` of the strided views the
Triton backend hands it), for every matmul launch of a compiled GPT step and of the
cached GPT-2 124M launch list; and what the tf32 configurator does with the
difference (an N-major B is staged K-major, a K-major one read directly)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from nova.ir import dialect as nv
from nova.schedule.configurator import configure_matmul

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

BENCH = Path(__file__).resolve().parents[2] / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))
import step_matmuls as sm  # noqa: E402

TINY = dict(vocab_size=32, block_size=10, n_layer=1, n_head=1, n_embd=16)


def _seen(r: dict) -> list[str]:
    return [r["configure"]["a_layout"], r["configure"]["b_layout"]]


@pytest.mark.parametrize("precision", ["tf32", "bf16"])
def test_configure_sees_the_layouts_the_kernel_gets(precision):
    """Every nova.matmul launch of a 1-layer GPT step: the layouts the configure stage
    passed to configure_matmul equal the strides' layouts, and the backward's input
    gradients (dX = dY @ W, W reached through a transpose of a transpose) are among
    them with B row-major, the case the old immediate-producer check called "col"."""
    from nova.transforms.configure import operand_layout

    c = sm.compile_step(TINY, 2, precision)
    launches = sm.step_matmuls(c.module, precision, c.device)
    layer = [r for r in launches if r["source"] == "nova.matmul"]
    assert len(layer) == 12
    for r in layer:
        assert _seen(r) == r["layouts"], (r["M"], r["N"], r["K"], r["a"], r["b"])
    assert sum(r["layouts"] == ["row", "row"] for r in layer) == 4  # the four input gradients
    assert sum(r["layouts"] == ["row", "col"] for r in layer) == 4  # the four forward linears (W^T)
    assert sum(r["layouts"] == ["col", "row"] for r in layer) == 4  # the four weight gradients (X^T)
    # a B operand behind two transposes exists in the IR, and _layout calls it row
    doubles = []
    for op in c.module.walk():
        if isinstance(op, nv.MatmulOp):
            v = op.operands[1]
            if isinstance(v.owner, nv.TransposeOp) and isinstance(v.owner.operands[0].owner, nv.TransposeOp):
                doubles.append(operand_layout(v))
    assert doubles and set(doubles) == {"row"}


def test_cached_gpt2_launches_configure_their_layouts():
    """bench/gpt2_matmul_shapes.json (python bench/step_matmuls.py): in every step,
    every launch's configure_matmul layouts are its strides' layouts."""
    doc = json.loads(sm.SHAPES_JSON.read_text())
    rows = [r for s in doc["steps"] for r in s["shapes"]]
    assert len(rows) > 50
    bad = [(r["source"], r["M"], r["N"], r["K"], r["layouts"], _seen(r)) for r in rows if _seen(r) != r["layouts"]]
    assert not bad, f"configure layouts differ from the strides' (regenerate: {sm.REGENERATE}): {bad}"


def test_tf32_input_gradient_stages_its_row_major_b():
    """The same tf32 input-gradient shape seen K-major (the old, wrong "col") and
    N-major (row, what the kernel gets): row-major B is staged, copied K-major and
    rounded once, so its tiles reach wgmma straight from TMA."""
    args = (32768, 768, 3072, 1, torch.float32, torch.float32, torch.float32, "tf32-rn")
    row = configure_matmul(*args, "row", "row", device="H200")
    assert "stage_b" in row.instruction and "tma" in row.instruction
