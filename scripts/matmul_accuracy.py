"""One matmul shape under many configs, each result against float64: which configs
are wrong, in which output tiles, and which K ranges the error follows.

    python scripts/matmul_accuracy.py --shape 384x1536x8192 --layouts col,row --prerounded a,b

A config is block_m x block_n [x block_k], warps, stages, split and the operands staged
(``--configs "128x256 w8 s4 sk7 b"``, several separated by ';'); the default list is the
neighbourhood of the 46M MLP weight gradient that measured 2.8e-2 on an H100 (e1ea8b7).
Prints one line a config; with --out, a JSON of the lines."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nova.codegen.triton import matmul as mm  # noqa: E402
from nova.schedule.config import LoweringConfig  # noqa: E402

DEFAULT = ("128x256 w8 s4 sk7 b; 128x256 w8 s3 sk7 b; 128x256 w8 s2 sk7 b; 128x256 w8 s4 sk4 b; 128x256 w8 s4 sk2 b; "
           "128x256 w8 s4 sk1 b; 128x256 w8 s4 sk7 ab; 128x256 w8 s4 sk7 -; 128x128 w8 s4 sk7 b; 128x128 w8 s4 sk4 b; "
           "256x128 w8 s4 sk7 b; 64x256 w4 s4 sk7 b; 128x256 w8 s4 sk7 b g8; 128x256 w8 s4 sk7 b nopre")


def parse(text: str) -> tuple[LoweringConfig, bool]:
    parts = text.split()
    dims = [int(x) for x in parts[0].split("x")]
    bm, bn, bk = (dims + [32])[:3]
    kw = dict(num_warps=8, num_stages=3, split_k=1, group_m=2)
    stage, pre = "", True
    for p in parts[1:]:
        if p.startswith("w"):
            kw["num_warps"] = int(p[1:])
        elif p.startswith("sk"):
            kw["split_k"] = int(p[2:])
        elif p.startswith("s"):
            kw["num_stages"] = int(p[1:])
        elif p.startswith("g"):
            kw["group_m"] = int(p[1:])
        elif p == "nopre":
            pre = False
        elif p != "-":
            stage = "".join(f"+stage_{x}" for x in p)
    cfg = LoweringConfig(kind="matmul", block_m=bm, block_n=bn, block_k=bk, instruction="wgmma+tma" + stage,
                         regime="sweep", **kw)
    return cfg, pre


def operand(rows: int, cols: int, layout: str, g) -> torch.Tensor:
    if layout == "col":
        return torch.randn(cols, rows, device="cuda", generator=g).t()
    return torch.randn(rows, cols, device="cuda", generator=g)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="384x1536x8192")
    p.add_argument("--layouts", default="col,row")
    p.add_argument("--prerounded", default="a,b")
    p.add_argument("--configs", default=DEFAULT)
    p.add_argument("--repeat", type=int, default=3, help="launches a config (a race shows as differing results)")
    p.add_argument("--out", default=None)
    o = p.parse_args(argv)
    M, N, K = (int(x) for x in o.shape.split("x"))
    la, lb = o.layouts.split(",")
    g = torch.Generator(device="cuda").manual_seed(0)
    a, b = operand(M, K, la, g), operand(K, N, lb, g)
    pre = tuple(x for x in o.prerounded.split(",") if x)
    if "a" in pre:
        a.copy_(mm.round_to_tf32(a))
    if "b" in pre:
        b.copy_(mm.round_to_tf32(b))
    ref = a.double() @ b.double()
    lines = []
    for text in [t.strip() for t in o.configs.split(";") if t.strip()]:
        cfg, use_pre = parse(text)
        line = {"config": text}
        try:
            outs = [mm.matmul(a, b, cfg=cfg, precision="tf32-rn", prerounded=pre if use_pre else ()) for _ in range(o.repeat)]
            torch.cuda.synchronize()
        except Exception as e:
            line["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            print(json.dumps(line), flush=True)
            lines.append(line)
            continue
        c = outs[0].double()
        d = (c - ref).abs()
        line["rel_err"] = ((c - ref).norm() / ref.norm()).item()
        line["launches_equal"] = all(torch.equal(outs[0], x) for x in outs[1:])
        tol = 1e-3 * ref.abs().max().item()
        bad = d > tol
        line["bad_fraction"] = bad.float().mean().item()
        if bad.any():
            tm, tn = cfg.block_m, cfg.block_n
            tiles = sorted({(int(i) // tm, int(j) // tn) for i, j in bad.nonzero()[:20000].tolist()})
            line["bad_tiles"] = tiles[:24]
            rows, cols = bad.any(1).nonzero().flatten(), bad.any(0).nonzero().flatten()
            line["bad_rows"] = [int(rows.min()), int(rows.max()), len(rows)]
            line["bad_cols"] = [int(cols.min()), int(cols.max()), len(cols)]
            # which K range the error follows: the difference against each split's partial product
            S = max(cfg.split_k, 1)
            ks = -(-K // S)
            ks = -(-ks // cfg.block_k) * cfg.block_k
            diff = (c - ref)[bad]
            fits = []
            for s in range(S):
                part = (a[:, s * ks:(s + 1) * ks].double() @ b[s * ks:(s + 1) * ks].double())[bad]
                fits.append(round(((diff * part).sum() / (part * part).sum()).item(), 3) if part.numel() else None)
            line["diff_over_split_partials"] = fits
        print(json.dumps(line), flush=True)
        lines.append(line)
    if o.out:
        Path(o.out).mkdir(parents=True, exist_ok=True)
        (Path(o.out) / f"matmul_accuracy_{o.shape}.json").write_text(json.dumps(
            {"device": torch.cuda.get_device_name(), "shape": o.shape, "layouts": o.layouts, "prerounded": pre,
             "lines": lines}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
