#!/usr/bin/env python3
"""A grid's last partial wave as other work (an experiment before any change to the launcher).

Issue 9's point 3 misses on GPT-2's batch-8 bf16 shapes whose grid ends in a partial
wave (H100, 83712ff): the 768-wide outputs 8192x768xK (128x256: 192 tiles, 1.45 waves of
132 SMs; run at 128x128, 384 tiles, 0.82-0.85x cuBLAS), 8192x2304x768 (576 tiles of
128x256, 4.36 waves: 0.89x) and the weight gradients 3072x768x8192 / 768x3072x8192
(72 tiles of 128x256 run as stream-K: 0.76-0.78x) and 768x768x8192 (split 7: 0.79x).

Here each shape runs as two launches of Nova's own kernels (``matmul`` with an explicit
config), one after the other in the same CUDA graph: a *head* of whole row (or column)
blocks whose tiles fill whole waves at the big tile, and the *tail*, the rest of C,
at a smaller tile or split along K, so that the last wave's SMs share the tail instead
of idling. Also the tail on a second stream of the graph (``par``), so that its
programs start as the head's finish. Beside them: Nova's configured launch and cuBLAS
(torch.matmul on the same layouts), input sets rotated past the L2 as ``nova bench
matmul`` does, every result checked against a float64 product.

    python scripts/matmul_tail.py [--out DIR] [--reps N]

Writes matmul_tail_<commit>.json to --out (commit from NOVA_COMMIT)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (M, N, K, A layout, B layout, head axis): A "col" is a [K, M] tensor read transposed
# (the weight gradient's dY^T), B "col" a weight [N, K] read transposed
SHAPES = [(8192, 768, 768, "row", "col", "m"), (8192, 768, 3072, "row", "col", "m"),
          (8192, 768, 3072, "row", "row", "m"), (8192, 768, 2304, "row", "row", "m"),
          (8192, 2304, 768, "row", "col", "m"),
          (3072, 768, 8192, "col", "row", "m"), (768, 3072, 8192, "col", "row", "n"),
          (768, 768, 8192, "col", "row", "-")]


def cfg_of(bm, bn, warps, stages, *, split=1, persistent=False, ws=False, group=8):
    from nova.schedule.config import LoweringConfig

    return LoweringConfig(kind="matmul", block_m=bm, block_n=bn, block_k=64, group_m=group, split_k=split,
                          persistent=persistent or ws, num_warps=warps, num_stages=stages,
                          instruction="wgmma+tma" + ("+ws" if ws else ""), regime="experiment")


WS256 = dict(bm=128, bn=256, warps=4, stages=4, ws=True, group=16)
WS128 = dict(bm=128, bn=128, warps=4, stages=4, ws=True)
P128 = dict(bm=128, bn=128, warps=8, stages=5)  # 768x2304x8192's configured kernel (0.98x cuBLAS)


def head_rows(extent: int, other: int, b_here: int, b_other: int, sms: int) -> int:
    """Whole blocks along the head axis whose tiles fill the most whole waves."""
    per_block = triton.cdiv(other, b_other)
    tiles = triton.cdiv(extent, b_here) * per_block
    waves = tiles // sms
    return (waves * sms // per_block) * b_here


def variants(M, N, K, axis, sms):
    """(name, head config, tail config, head extent) for a shape; head extent 0: one launch."""
    out = [("nova configured", None, None, 0)]
    if axis == "-":  # no head: 36 tiles of 128x128 at most
        for s in (2, 3):
            out.append((f"128x128 w8 s5 split {s}", cfg_of(**P128, split=s), None, 0))
        out.append(("128x256 w8 s4 split 7", cfg_of(128, 256, 8, 4, split=7), None, 0))
        return out
    if K <= 3072:  # forward / dX shapes: a head at 128x256 warp-specialized
        h = head_rows(M, N, 128, 256, sms)
        out.append(("all 128x256 ws", cfg_of(**WS256), None, 0))
        out.append(("head 128x256 ws | tail 128x128 ws", cfg_of(**WS256), cfg_of(**WS128), h))
        out.append(("head 128x256 ws | tail 128x128 w8", cfg_of(**WS256), cfg_of(**P128), h))
        out.append(("head 128x256 ws | tail configured", cfg_of(**WS256), "auto", h))
        return out
    # weight gradients: the head at 128x128 unsplit, the tail split along K
    extent, other = (M, N) if axis == "m" else (N, M)
    h = head_rows(extent, other, 128, 128, sms)
    tail_tiles = triton.cdiv(extent - h, 128) * triton.cdiv(other, 128)
    out.append(("all 128x128 w8", cfg_of(**P128), None, 0))
    for s in sorted({max(2, sms // max(1, tail_tiles)), 4, 8}):
        out.append((f"head 128x128 w8 | tail split {s}", cfg_of(**P128), cfg_of(**P128, split=s), h))
    out.append(("head 128x128 w8 | tail configured", cfg_of(**P128), "auto", h))
    return out


def run(reps: int) -> list[dict]:
    from bench.matmul import describe
    from bench.timing import time_graph
    from nova.codegen.triton.matmul import configure, device_spec, matmul

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    dt = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(0)
    side = torch.cuda.Stream()
    rows = []
    for M, N, K, la, lb, axis in SHAPES:
        n = max(1, min(16, -(-2 * l2 // ((M * K + N * K + M * N) * 2))))
        A = [torch.randn((K, M) if la == "col" else (M, K), device="cuda", generator=g).to(dt) for _ in range(n)]
        A = [a.t() if la == "col" else a for a in A]
        B = [torch.randn((N, K) if lb == "col" else (K, N), device="cuda", generator=g).to(dt) for _ in range(n)]
        B = [b.t() if lb == "col" else b for b in B]
        C = [torch.empty(M, N, device="cuda", dtype=dt) for _ in range(n)]
        want = A[0].double() @ B[0].double()
        turn = [0]

        def nxt() -> int:
            turn[0] = (turn[0] + 1) % n
            return turn[0]

        def timed(launch) -> tuple[float, float]:
            C[0].zero_()
            turn[0] = n - 1
            launch()
            torch.cuda.synchronize()
            e = ((C[0].double() - want).abs().max() / want.abs().max()).item()
            return time_graph(launch, 2 * n if n > 10 else 20, reps), e

        def cublas():
            i = nxt()
            torch.matmul(A[i], B[i], out=C[i])

        ms_cublas, _ = timed(cublas)
        flops = 2 * M * N * K
        row = {"M": M, "N": N, "K": K, "a": la, "b": lb, "sets": n, "cublas_ms": ms_cublas, "kernels": {}}
        print(f"bf16 {M}x{N}x{K} A {la} B {lb}: cuBLAS {ms_cublas * 1e3:.1f} us ({flops / ms_cublas / 1e9:.0f} "
              f"TFLOP/s), {n} input sets")
        for name, hc, tc, h in variants(M, N, K, axis, sms):
            for par in ((False, True) if h else (False,)):
                label = name + (" (par)" if par else "")

                def parts(i):
                    a, b, c = A[i], B[i], C[i]
                    if axis == "n":  # head and tail are column blocks
                        return (a, b[:, :h], c[:, :h]), (a, b[:, h:], c[:, h:])
                    return (a[:h], b, c[:h]), (a[h:], b, c[h:])

                def launch(hc=hc, tc=tc, h=h, par=par):
                    i = nxt()
                    if not h:
                        matmul(A[i], B[i], cfg=hc, out=C[i])
                        return
                    (ha, hb, hcc), (ta, tb, tcc) = parts(i)
                    if par:
                        side.wait_stream(torch.cuda.current_stream())
                    matmul(ha, hb, cfg=hc, out=hcc)
                    if par:
                        with torch.cuda.stream(side):
                            matmul(ta, tb, cfg=None if tc == "auto" else tc, out=tcc)
                        torch.cuda.current_stream().wait_stream(side)
                    else:
                        matmul(ta, tb, cfg=None if tc == "auto" else tc, out=tcc)

                try:
                    ms, e = timed(launch)
                except Exception as ex:  # noqa: BLE001 - a variant that does not run is a row
                    print(f"  {label:44s} failed: {type(ex).__name__}: {str(ex)[:200]}")
                    row["kernels"][label] = {"error": f"{type(ex).__name__}: {str(ex)[:400]}"}
                    continue
                ratio = ms_cublas / ms
                tail_cfg = None
                if h and tc == "auto":
                    (ha, hb, hcc), (ta, tb, tcc) = parts(0)
                    tail_cfg = configure(ta.shape[0], tb.shape[1], K, 1, dt, dt, "bf16", "row" if la == "row" else
                                         "col", lb, False, device_spec(torch.device("cuda")))
                print(f"  {label:44s} {ms * 1e3:7.1f} us  {flops / ms / 1e9:5.0f} TFLOP/s  {ratio:.3f}x cuBLAS  "
                      f"head {h}  err {e:.1e}" + (f"  tail {describe(tail_cfg)}" if tail_cfg else ""))
                row["kernels"][label] = {"ms": ms, "vs_cublas": ratio, "err": e, "head": h,
                                         "head_cfg": describe(hc) if hc else None,
                                         "tail_cfg": describe(tail_cfg if tail_cfg else (tc if tc != "auto" else None))}
        cfg = configure(M, N, K, 1, dt, dt, "bf16", la, lb, False, device_spec(torch.device("cuda")))
        row["nova_config"] = describe(cfg)
        print(f"  (nova configured: {describe(cfg)})")
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    rows = run(args.reps)
    from bench.timing import write_rows

    write_rows(args.out, "matmul_tail", rows)


if __name__ == "__main__":
    main()
