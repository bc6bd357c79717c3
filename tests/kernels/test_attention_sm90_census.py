"""The attention kernels the configure stage gives GPT-2's heads (B 16, H 12, T 1024, D 64,
causal) on the H100 and the H200, bf16 and tf32, compiled offline for sm_90a by Triton's own
ptxas (no GPU): every dot on wgmma and no register spilled. Until 7c0dbf9 the tf32 dK/dV kernel
took a 32-row tile, which compiles to mma.sync instead (the backward then ran at half its
speed on an H100, 2.05 against 0.99 ms a layer, docs/configurator.md "Attention"); a tile that
spills or leaves wgmma shows here before the GPU does. Runs in a process without
TRITON_INTERPRET (``test_rowwise.run_sm90_build``)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import torch
from test_rowwise import build, run_sm90_build

from nova.ir import dialect as nv

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))

_PTR = {torch.float32: "*fp32", torch.bfloat16: "*bf16"}
_STATS = ("lse_ptr", "delta_ptr")  # f32 whatever the inputs
_UNIT = re.compile(r"^s[a-z]+d$")  # a tensor's last-dim stride (sqd, skd, sdod, sdkd, ...): 1 in the step


def _compile(src: str, name: str, dtype: torch.dtype, warps: int, stages: int) -> dict:
    from epilogue_sm90_check import build_sm90  # scripts/: Triton's ptxas for sm_90a, with its log

    from nova.codegen.triton.source import load_kernel

    fn, _ = load_kernel(src, name)
    sig, consts, attrs = {}, {}, {}
    for i, a in enumerate(fn.arg_names):
        if a.endswith("_ptr"):
            sig[a] = "*fp32" if a in _STATS else _PTR[dtype]
        elif _UNIT.match(a):
            sig[a], consts[a] = "constexpr", 1
            continue
        else:
            sig[a] = "i32"
        attrs[(i,)] = [["tt.divisibility", 16]]
    k, log = build_sm90(fn, sig, consts, attrs, warps, stages)
    ttgir = k.asm["ttgir"]
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", log)]
    return {"dots": ttgir.count("tt.dot ") + ttgir.count("ttng.warp_group_dot "),
            "wgmma": ttgir.count("ttng.warp_group_dot "), "spill_bytes": max(spills, default=0)}


def census() -> list[dict]:
    from nova.codegen.triton import attention as A
    from nova.schedule.devices import DEVICES
    from nova.transforms.configure import configure_op

    rows, seen = [], set()
    for precision, dtype in (("bf16", torch.bfloat16), ("tf32", torch.float32)):
        x, lse = torch.empty(16, 12, 1024, 64, dtype=dtype), torch.empty(16, 12, 1024)
        props = {"causal": True, "scale": 0.125}
        fwd = build(nv.AttentionOp, [x, x, x], props)
        bwd = build(nv.AttentionBackwardOp, [x, x, x, x, x, lse], props)
        for device in ("H100", "H200"):
            spec = DEVICES[device]
            kf = A.lower_attention(fwd, configure_op(fwd, spec, precision), precision=precision)
            kb = A.lower_attention_backward(bwd, configure_op(bwd, spec, precision), precision=precision)
            for src, name, cfg in ((kf.source, "attention_fwd", kf.config), (kb.source, "attention_bwd_dkdv", kb.config),
                                   (kb.source, "attention_bwd_dq", kb.extra["dq_config"])):
                key = (src, name, cfg.num_warps, cfg.num_stages)
                if key in seen:
                    continue
                seen.add(key)
                row = {"precision": precision, "device": device, "kernel": name,
                       "tile": f"{cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}"}
                rows.append(row | _compile(src, name, dtype, cfg.num_warps, cfg.num_stages))
    return rows


def test_gpt2_attention_kernels_run_wgmma_without_spills():
    rows = [json.loads(line) for line in run_sm90_build(__file__).splitlines() if line.startswith("{")]
    assert {(r["precision"], r["kernel"]) for r in rows} == {
        (p, k) for p in ("bf16", "tf32") for k in ("attention_fwd", "attention_bwd_dkdv", "attention_bwd_dq")}
    for r in rows:
        assert r["dots"] > 0 and r["wgmma"] == r["dots"], r  # every dot a wgmma
        assert r["spill_bytes"] == 0, r


if __name__ == "__main__":
    for row in census():
        print(json.dumps(row))
