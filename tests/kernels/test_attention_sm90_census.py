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

import torch
from test_rowwise import build, build_for_sm90, run_sm90_build

from nova.ir import dialect as nv


def _row(compiled, log: str) -> dict:
    ttgir = compiled.asm["ttgir"]
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", log)]
    return {"dots": ttgir.count("tt.dot ") + ttgir.count("ttng.warp_group_dot "),
            "wgmma": ttgir.count("ttng.warp_group_dot "), "spill_bytes": max(spills, default=0)}


def census() -> list[dict]:
    """Every distinct kernel of the two precisions on the two devices, built as a launch
    specializes its arguments (``build_for_sm90(specialize=True)``)."""
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
            tiles = {"attention_fwd": (kf.source, kf.config), "attention_bwd_dkdv": (kb.source, kb.config),
                     "attention_bwd_dq": (kb.source, kb.extra["dq_config"])}
            keys = {name: (src, name, cfg.num_warps, cfg.num_stages) for name, (src, cfg) in tiles.items()}
            if all(k in seen for k in keys.values()):
                continue
            kernels: dict = {}
            build_for_sm90([(lambda kf=kf: kf, [x, x, x]), (lambda kb=kb: kb, [x, x, x, x, x, lse])], kernels,
                           specialize=True)
            assert set(tiles) <= set(kernels), sorted(kernels)  # and the backward's delta pass, no dot in it
            for name, (_, cfg) in tiles.items():
                if keys[name] in seen:
                    continue
                seen.add(keys[name])
                row = {"precision": precision, "device": device, "kernel": name,
                       "tile": f"{cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}"}
                rows.append(row | _row(*kernels[name]))
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
