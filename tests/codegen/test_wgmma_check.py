"""``wgmma_check``: a write into the A registers of a wgmma still in flight is found in
a loop's SASS (across the back edge, the pattern Triton 3.6 emitted for the split tf32
kernels), and not where the wgmmas are waited on (DEPBAR 0, as ptxas serializes them) or
read A from shared memory; the PTX test that decides which kernels get disassembled; and
the register-A guard as shipped (settled kernels, or rule 9a's shared-memory operands)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from nova.codegen.triton import wgmma_check as wc

LOOP = """
        /*1f00*/                   MOV R152, RZ ;
.L_x_3:
        /*2000*/                   LDS R152, [R9+UR11+0x20000] ;
        /*2010*/                   LDS.64 R156, [R9+UR11+0x20400] ;
        /*2020*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR10+0x2c000], R21 ;
        /*2340*/                   HGMMA.64x256x8.F32.TF32 R24, {a0}, gdesc[UR20], R24, gsb0 ;
        /*26d0*/                   WARPGROUP.DEPBAR.LE gsb0, {keep} ;
        /*26f0*/                   HGMMA.64x256x8.F32.TF32 R24, {a1}, gdesc[UR20], R24, gsb0 ;
        /*28e0*/                   WARPGROUP.DEPBAR.LE gsb0, {keep} ;
        /*2940*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*29c0*/              @!P0 BRA `(.L_x_3) ;
        /*29d0*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
"""


def test_a_write_into_a_pending_wgmmas_registers_across_the_back_edge_is_found():
    found = wc.hazards(LOOP.format(a0="R152", a1="R156", keep="0x1"), "k")
    # the second pass: R152's wgmma retired by the DEPBAR, R156's still in flight when LDS.64 writes R156-R157
    assert len(found) == 1 and "/*2010*/" in found[0] and "R156" in found[0] and "/*26f0*/" in found[0]
    assert "loop at .L_x_3" in found[0]


def test_waited_wgmmas_and_shared_memory_a_are_safe():
    assert wc.hazards(LOOP.format(a0="R152", a1="R156", keep="0x0")) == []  # serialized
    assert wc.hazards(LOOP.format(a0="gdesc[UR4]", a1="gdesc[UR8]", keep="0x1")) == []  # A from shared memory


def test_register_a_in_ptx():
    assert wc.has_register_a("wgmma.mma_async.sync.aligned.m64n256k8.f32.tf32.tf32 {%f1, %f2}, {%r1, %r2, %r3, %r4}, "
                             "%rd5, p, 1, 1;")
    assert not wc.has_register_a("wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%f1, %f2}, %rd4, %rd5, p, "
                                 "1, 1, 0, 0;")
    assert not wc.has_register_a("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%f1}, {%r1}, {%r2}, {%f3};")


BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_register_a_kernels_ship_guarded():
    """A register-A wgmma kernel races unless its wgmmas are waited on each K-step: the
    template settles them (SETTLE_REGISTER_A) or the configurator never emits one (rule 9a)."""
    from nova.codegen.triton import matmul
    from nova.schedule import configurator

    assert matmul.SETTLE_REGISTER_A or configurator.TF32_SHARED_OPERANDS


@pytest.mark.parametrize("device", ["H100", "H200"])
def test_rule_9a_leaves_no_split_tf32_step_launch_reading_a_from_registers(device, monkeypatch):
    """Configurator rule 9a (TF32_SHARED_OPERANDS on) on every tf32 launch of the committed step shape files."""
    from nova.schedule import configurator

    monkeypatch.setattr(configurator, "TF32_SHARED_OPERANDS", True)
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    import step_matmuls as sm

    from nova.schedule.devices import DEVICES

    splits = 0
    for r in sm.committed_launches():
        if r["dtype"] != "float32":
            continue
        c = sm.configured(r["configure"], DEVICES[device])
        if c.split_k > 1 and c.instruction.startswith("wgmma"):
            splits += 1
            tokens = c.instruction.split("+")
            a_in_place = "a" in r.get("prerounded", ()) and r["layouts"][0] == "row"
            assert "stage_b" in tokens and ("stage_a" in tokens or a_in_place), (r["M"], r["N"], r["K"], c)
    assert splits >= 5
