"""Every matmul launch of the committed step shape files (GPT-2 124M bf16 and tf32 at
batch 8, 16 and 32; the 46M MLP LM tf32 at batch 8), configured for this GPU as the
step's configure stage configures it (``step_matmuls.configured``), on the step's
strided views with its prerounded operands: within its precision's rounding of float64,
the same bits launch after launch, and no compiled kernel writing the registers of a
wgmma still in flight (``wgmma_check``); under rule 2b's staging as shipped
(``configurator.TF32_SHARED_OPERANDS`` off, the register-A kernels settled) and under rule 9a
(the switch on: both tf32 operands from shared memory). (At e1ea8b7 the MLP's 384x1536x8192 weight
gradient, 128x256x32 split 7 with B staged, was 2.5e-2 off on an H100: ``nova bench
matmul`` printed it and nothing failed.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from nova.codegen.triton import matmul as mm
from nova.codegen.triton import wgmma_check
from nova.schedule.config import LoweringConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

BENCH = Path(__file__).resolve().parents[2] / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))
import step_matmuls as sm  # noqa: E402

# relative Frobenius error against float64: tf32 rounds each operand (2^-11, ~2e-4 measured); a 16-bit C
# rounds once more (bf16 2^-9: ~1.1e-3 measured); 10x headroom, far under a wrong tile or K range (~1e-2)
BOUND = {"float32": 2e-3, "bfloat16": 5e-3}


LAUNCHES = sm.committed_launches()


def _id(r: dict) -> str:
    return f"{ {'float32': 'f32', 'bfloat16': 'bf16'}[r['dtype']]}-{r['batch']}x{r['M']}x{r['N']}x{r['K']}-{''.join(x[0] for x in r['layouts'])}"


# configurator.TF32_SHARED_OPERANDS on (rule 9a) and off (rule 2b's staging, as shipped since f875fed: tf32
# kernels with A through registers, their wgmmas settled by matmul.SETTLE_REGISTER_A)
RULES = pytest.mark.parametrize("shared", [True, False], ids=["rule9a", "rule2b"])


@pytest.fixture
def rule(monkeypatch, shared):
    from nova.schedule import configurator

    monkeypatch.setattr(configurator, "TF32_SHARED_OPERANDS", shared)


@RULES
@pytest.mark.parametrize("launch", LAUNCHES, ids=[_id(r) for r in LAUNCHES])
def test_step_launch_as_configured_here_matches_float64(launch, rule):
    dtype, out_dtype = getattr(torch, launch["dtype"]), getattr(torch, launch["out_dtype"])
    cfg: LoweringConfig = sm.configured(launch["configure"], mm.device_spec(torch.device("cuda")))
    torch.manual_seed(launch["M"] * 7 + launch["N"] * 3 + launch["K"])
    a, b = sm.strided(launch["a"], dtype, "cuda"), sm.strided(launch["b"], dtype, "cuda")
    pre = tuple(launch.get("prerounded", ()))
    for name, t in (("a", a), ("b", b)):
        if name in pre:
            t.copy_(mm.round_to_tf32(t))
    bias = torch.randn(launch["N"], device="cuda", dtype=dtype) if launch["bias"] else None
    run = lambda: mm.matmul(a, b, bias=bias, cfg=cfg, precision=launch["precision"], out_dtype=out_dtype,  # noqa: E731
                            prerounded=pre)
    got, again = run(), run()
    ref = a.double() @ b.double() + (bias.double() if bias is not None else 0)
    err = ((got.double() - ref).norm() / ref.norm()).item()
    assert err < BOUND[launch["dtype"]], f"{_id(launch)} under {cfg}: relative error {err:.2e}"
    assert torch.equal(got, again), f"{_id(launch)} under {cfg}: two launches differ"


@RULES
@pytest.mark.parametrize("launch", LAUNCHES, ids=[_id(r) for r in LAUNCHES])
def test_step_launch_kernels_keep_pending_wgmma_registers(launch, rule):
    cfg: LoweringConfig = sm.configured(launch["configure"], mm.device_spec(torch.device("cuda")))
    kernels = sm.precompile_launch(launch, cfg)
    found = [h for k in kernels for h in wgmma_check.hazards(wgmma_check.sass_of(k.asm["cubin"]), _id(launch))]
    assert not found, f"{_id(launch)} under {cfg}: {len(found)} writes into pending wgmma registers: {found[:2]}"
