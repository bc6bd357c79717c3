#!/usr/bin/env python3
"""Tiles 192 wide from two dots (an experiment before any change to the template).

On an H100, cuBLAS runs the GPT-2 step's 768-wide outputs (8192x768xK, batch 8) with
192x128 tiles (``nvjet_sm90_tst_192x128_64x5_1x2``: 43 x 6 = 258 tiles, 1.95 waves of
132 SMs) and reaches 1.2x Nova's 128x128 / 128x256 kernels (192 tiles of 128x256 are
1.45 waves; 384 of 128x128 are 2.9 waves of a smaller tile). ``tl.dot`` takes only
power-of-two tiles, so a 192-wide tile is two dots on one operand tile:

* ``n192``: 128x192, B's tile loaded as a 128-wide and a 64-wide box, A's tile shared by
  the dots (accumulators 128x128 and 128x64);
* ``m192``: 192x128, A's tile loaded as 128 and 64 rows, B's shared.

Every kernel here is the template's persistent loop (group-M swizzle, one software
pipeline flattened over tiles and their K loops, host-built TMA descriptors, C stored
through pointers), also at 128x128 and 128x256 (``one``) for a like-for-like base. Beside
them: Nova's own launch as the Analytic Configurator sets it, and Nova's template at the
plain kernel's 128x128 config, each also with C through pointers (``matmul.C_TMA`` off).
Timed in CUDA graphs (bench.timing.time_graph) beside cuBLAS (torch.matmul on the same
layouts), rotating through input sets that cover twice the L2 as ``nova bench matmul``
does; tf32 operands rounded to nearest first (Nova's launches take them as prerounded, as
the step's do); every result checked against a float64 product.
At 8a95c94 on an H100 (``--kernels all``, one input set: bench/results/runs/
matmul_wide_twodot_one_set_h100_8a95c94.json) the two-dot tiles ran at 0.61-0.70x cuBLAS on
every bf16 shape, slower than 128x128 and 128x256: not a way forward.

    python scripts/matmul_wide.py [--out DIR] [--shapes bf16b8|tf32b8|mlp|all] [--kernels one|all|NAMES]
    python scripts/matmul_wide.py --offline   # compile for sm_90a here (no GPU): shared memory

Writes matmul_wide_<commit>.json to --out (commit from NOVA_COMMIT)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (M, N, K, B layout: col = a weight [N, K] read transposed, row = [K, N]), uses per step
SHAPES = {
    "bf16b8": [(8192, 768, 768, "col", 12), (8192, 768, 3072, "col", 12), (8192, 768, 3072, "row", 12),
               (8192, 768, 2304, "row", 12), (8192, 768, 768, "row", 12), (8192, 2304, 768, "col", 12),
               (8192, 3072, 768, "col", 12)],
    "mlp": [(8192, 1536, 384, "col", 6), (8192, 384, 1536, "col", 6), (8192, 1536, 384, "row", 6),
            (8192, 384, 1536, "row", 6)],
}
SHAPES["tf32b8"] = SHAPES["bf16b8"]
# (name, kind, BM, BN, BK, stages, warps)
KERNELS = {
    "bf16": [("one 128x256 s4 w8", "one", 128, 256, 64, 4, 8), ("one 128x128 s4 w8", "one", 128, 128, 64, 4, 8),
             ("n192 s3 w8", "n192", 128, 192, 64, 3, 8), ("n192 s4 w8", "n192", 128, 192, 64, 4, 8),
             ("m192 s4 w8", "m192", 192, 128, 64, 4, 8), ("n192 s4 w4", "n192", 128, 192, 64, 4, 4)],
    "tf32": [("one 128x256 s2 w8", "one", 128, 256, 32, 2, 8), ("one 128x128 s4 w8", "one", 128, 128, 32, 4, 8),
             ("n192 s3 w8", "n192", 128, 192, 32, 3, 8), ("n192 s4 w8", "n192", 128, 192, 32, 4, 8),
             ("m192 s4 w8", "m192", 192, 128, 32, 4, 8)],
}


@triton.jit
def _place(work, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Work item -> (pid_m, pid_n) under the group-M swizzle (the template's)."""
    tiles_per_group = GROUP_M * num_pid_n
    first_m = (work // tiles_per_group) * GROUP_M
    rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (work % rows), (work % tiles_per_group) // rows


@triton.jit
def _load_b(desc, n, k, B_T: tl.constexpr):
    if B_T:
        b = desc.load([n, k]).T
    else:
        b = desc.load([k, n])
    return b


@triton.jit
def _store(c_ptr, acc, rows, cols, M, N):
    tl.store(c_ptr + rows[:, None] * N + cols[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=(rows < M)[:, None] & (cols < N)[None, :])


@triton.jit(do_not_specialize=["NUM_PROGS"])
def one(a_desc, b_desc, b1_desc, a1_desc, c_ptr, M, N, K, NUM_PROGS, BM: tl.constexpr, BN: tl.constexpr,
        BK: tl.constexpr, GROUP_M: tl.constexpr, B_T: tl.constexpr, PREC: tl.constexpr):
    """One dot a tile (the template's kernel, C through pointers)."""
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    for work in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_PROGS, flatten=True):
        pid_m, pid_n = _place(work, num_pid_m, num_pid_n, GROUP_M)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, K, BK):
            a = a_desc.load([pid_m * BM, k])
            acc = tl.dot(a, _load_b(b_desc, pid_n * BN, k, B_T), acc, input_precision=PREC)
        _store(c_ptr, acc, pid_m * BM + tl.arange(0, BM), pid_n * BN + tl.arange(0, BN), M, N)


@triton.jit(do_not_specialize=["NUM_PROGS"])
def n192(a_desc, b_desc, b1_desc, a1_desc, c_ptr, M, N, K, NUM_PROGS, BM: tl.constexpr, BN: tl.constexpr,
         BK: tl.constexpr, GROUP_M: tl.constexpr, B_T: tl.constexpr, PREC: tl.constexpr):
    """BM x (128 + 64): B's tile as two boxes, two dots on A's one tile."""
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, 192)
    for work in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_PROGS, flatten=True):
        pid_m, pid_n = _place(work, num_pid_m, num_pid_n, GROUP_M)
        lo = tl.zeros((BM, 128), dtype=tl.float32)
        hi = tl.zeros((BM, 64), dtype=tl.float32)
        for k in range(0, K, BK):
            a = a_desc.load([pid_m * BM, k])
            lo = tl.dot(a, _load_b(b_desc, pid_n * 192, k, B_T), lo, input_precision=PREC)
            hi = tl.dot(a, _load_b(b1_desc, pid_n * 192 + 128, k, B_T), hi, input_precision=PREC)
        rows = pid_m * BM + tl.arange(0, BM)
        _store(c_ptr, lo, rows, pid_n * 192 + tl.arange(0, 128), M, N)
        _store(c_ptr, hi, rows, pid_n * 192 + 128 + tl.arange(0, 64), M, N)


@triton.jit(do_not_specialize=["NUM_PROGS"])
def m192(a_desc, b_desc, b1_desc, a1_desc, c_ptr, M, N, K, NUM_PROGS, BM: tl.constexpr, BN: tl.constexpr,
         BK: tl.constexpr, GROUP_M: tl.constexpr, B_T: tl.constexpr, PREC: tl.constexpr):
    """(128 + 64) x BN: A's tile as two boxes, two dots on B's one tile."""
    num_pid_m = tl.cdiv(M, 192)
    num_pid_n = tl.cdiv(N, BN)
    for work in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_PROGS, flatten=True):
        pid_m, pid_n = _place(work, num_pid_m, num_pid_n, GROUP_M)
        top = tl.zeros((128, BN), dtype=tl.float32)
        bot = tl.zeros((64, BN), dtype=tl.float32)
        for k in range(0, K, BK):
            b = _load_b(b_desc, pid_n * BN, k, B_T)
            top = tl.dot(a_desc.load([pid_m * 192, k]), b, top, input_precision=PREC)
            bot = tl.dot(a1_desc.load([pid_m * 192 + 128, k]), b, bot, input_precision=PREC)
        cols = pid_n * BN + tl.arange(0, BN)
        _store(c_ptr, top, pid_m * 192 + tl.arange(0, 128), cols, M, N)
        _store(c_ptr, bot, pid_m * 192 + 128 + tl.arange(0, 64), cols, M, N)


FNS = {"one": one, "n192": n192, "m192": m192}


def boxes(kind: str, BM: int, BN: int, BK: int, b_t: bool):
    """The block shapes of A's, B's, B's second and A's second descriptors."""
    bbox = (lambda n: [n, BK]) if b_t else (lambda n: [BK, n])
    if kind == "one":
        return [BM, BK], bbox(BN), bbox(BN), [BM, BK]
    if kind == "n192":
        return [BM, BK], bbox(128), bbox(64), [BM, BK]
    return [128, BK], bbox(BN), bbox(BN), [64, BK]


def tiles_of(kind: str, M: int, N: int, BM: int, BN: int) -> int:
    return triton.cdiv(M, 192 if kind == "m192" else BM) * triton.cdiv(N, 192 if kind == "n192" else BN)


def _sets(M: int, N: int, K: int, elt: int) -> int:
    """Input sets to rotate through so that the operands come from DRAM, as ``nova bench
    matmul`` does: enough to cover twice the L2."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    return max(1, min(32, -(-2 * l2 // ((M * K + N * K + M * N) * elt))))


def run(prec: str, shapes, reps: int, names: set[str] | None) -> list[dict]:
    from triton.tools.tensor_descriptor import TensorDescriptor

    from bench.matmul import _cfg, describe
    from bench.timing import time_graph
    from nova.codegen.triton import matmul as mm
    from nova.codegen.triton.matmul import configure, device_spec, matmul, round_to_tf32

    torch.backends.cuda.matmul.allow_tf32 = prec == "tf32"
    dtype = torch.bfloat16 if prec == "bf16" else torch.float32
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for M, N, K, lay, uses in shapes:
        b_t = lay == "col"
        n = _sets(M, N, K, dtype.itemsize)
        # tf32: operands rounded to nearest first (the step's producers store them so): every
        # kernel here and cuBLAS read the same values, Nova's launch takes them as prerounded
        rnd = round_to_tf32 if prec == "tf32" else (lambda t: t)
        A = [rnd(torch.randn(M, K, device="cuda", generator=g).to(dtype)) for _ in range(n)]
        B = [rnd(torch.randn((N, K) if b_t else (K, N), device="cuda", generator=g).to(dtype)) for _ in range(n)]
        C = [torch.empty(M, N, device="cuda", dtype=dtype) for _ in range(n)]
        want = A[0].double() @ (B[0].double().t() if b_t else B[0].double())
        turn = [0]

        def nxt() -> int:  # the next input set (read while a graph is captured: each launch its own)
            turn[0] = (turn[0] + 1) % n
            return turn[0]

        def err() -> float:
            return ((C[0].double() - want).abs().max() / want.abs().max()).item()

        def timed(launch) -> tuple[float, float]:
            C[0].zero_()
            turn[0] = n - 1
            launch()  # writes C[0]
            torch.cuda.synchronize()
            e = err()
            return time_graph(launch, 2 * n if n > 10 else 20, reps), e

        def cublas():
            i = nxt()
            torch.matmul(A[i], B[i].t() if b_t else B[i], out=C[i])

        ms_cublas, _ = timed(cublas)
        flops = 2 * M * N * K
        row = {"prec": prec, "M": M, "N": N, "K": K, "b": lay, "uses": uses, "sets": n, "cublas_ms": ms_cublas,
               "kernels": {}}
        print(f"{prec} {M}x{N}x{K} {lay}: cuBLAS {ms_cublas * 1e3:.1f} us ({flops / ms_cublas / 1e9:.0f} TFLOP/s), "
              f"{n} input sets")
        variants = []
        pre = ("a", "b") if prec == "tf32" else ()
        nova_prec = "tf32-rn" if prec == "tf32" else None
        t128 = _cfg(128, 128, 64 if prec == "bf16" else 32, 8, 4, persistent=True, tma=True)  # the plain rows' BK
        for label, cfg, c_tma in (("nova configured", None, True), ("nova configured, C ptr", None, False),
                                  ("template 128x128 s4 w8", t128, True),
                                  ("template 128x128 s4 w8 C ptr", t128, False)):
            def nova(cfg=cfg, c_tma=c_tma):  # C_TMA off: C through pointers where it would take a descriptor
                i = nxt()
                was, mm.C_TMA = mm.C_TMA, c_tma
                try:
                    matmul(A[i], B[i].t() if b_t else B[i], cfg=cfg, precision=nova_prec, out=C[i], prerounded=pre)
                finally:
                    mm.C_TMA = was

            variants.append((label, nova, None))
        for name, kind, BM, BN, BK, stages, warps in KERNELS[prec]:
            if names is not None and name not in names and kind not in names:
                continue
            ab, bb, bb1, ab1 = boxes(kind, BM, BN, BK, b_t)
            descs = [(TensorDescriptor.from_tensor(a, ab), TensorDescriptor.from_tensor(b, bb),
                      TensorDescriptor.from_tensor(b, bb1), TensorDescriptor.from_tensor(a, ab1))
                     for a, b in zip(A, B)]
            progs = min(sms, tiles_of(kind, M, N, BM, BN))

            def launch(fn=FNS[kind], descs=descs, progs=progs, BM=BM, BN=BN, BK=BK, stages=stages, warps=warps):
                i = nxt()
                fn[(progs,)](*descs[i], C[i], M, N, K, progs, BM=BM, BN=BN, BK=BK, GROUP_M=8, B_T=b_t,
                             PREC="tf32" if prec == "tf32" else "ieee", num_warps=warps, num_stages=stages)

            variants.append((name, launch, tiles_of(kind, M, N, BM, BN)))
        for name, launch, tiles in variants:
            try:
                ms, e = timed(launch)
            except Exception as ex:  # noqa: BLE001 - a variant that does not build is a row, not the end of the run
                print(f"  {name:24s} failed: {type(ex).__name__}: {str(ex)[:200]}")
                row["kernels"][name] = {"error": f"{type(ex).__name__}: {str(ex)[:400]}"}
                continue
            ratio = ms_cublas / ms
            print(f"  {name:24s} {ms * 1e3:7.1f} us  {flops / ms / 1e9:5.0f} TFLOP/s  {ratio:.3f}x cuBLAS  "
                  f"tiles {tiles}  err {e:.1e}")
            row["kernels"][name] = {"ms": ms, "vs_cublas": ratio, "err": e, "tiles": tiles}
        cfg = configure(M, N, K, 1, dtype, dtype, nova_prec or "bf16", "row", lay, False,
                        device_spec(torch.device("cuda")), prerounded=pre)
        row["nova_config"] = describe(cfg)
        print(f"  (nova configured: {describe(cfg)})")
        rows.append(row)
    return rows


def offline() -> None:
    """Each kernel compiled for sm_90a here, and its shared memory (no GPU)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)
    for prec, kernels in KERNELS.items():
        ty = "bf16" if prec == "bf16" else "fp32"
        for name, kind, BM, BN, BK, stages, warps in kernels:
            for b_t in (True, False):
                ab, bb, bb1, ab1 = boxes(kind, BM, BN, BK, b_t)
                sig = {"a_desc": f"tensordesc<{ty}{ab}>", "b_desc": f"tensordesc<{ty}{bb}>",
                       "b1_desc": f"tensordesc<{ty}{bb1}>", "a1_desc": f"tensordesc<{ty}{ab1}>",
                       "c_ptr": f"*{ty}", "M": "i32", "N": "i32", "K": "i32", "NUM_PROGS": "i32"}
                consts = {"BM": BM, "BN": BN, "BK": BK, "GROUP_M": 8, "B_T": b_t,
                          "PREC": "tf32" if prec == "tf32" else "ieee"}
                try:
                    k = triton.compile(ASTSource(FNS[kind], sig, consts), target=target,
                                       options={"num_warps": warps, "num_stages": stages})
                    md = k.metadata
                    print(f"{prec} {name:22s} b_t={b_t!s:5s} smem {md.shared // 1024} KiB")
                except Exception as e:  # noqa: BLE001
                    print(f"{prec} {name:22s} b_t={b_t!s:5s} failed: {type(e).__name__}: {str(e)[:300]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--shapes", default="all", choices=["bf16b8", "tf32b8", "mlp", "all"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--offline", action="store_true")
    ap.add_argument("--kernels", default="one", help="comma-separated names or kinds (one, n192, m192), or all")
    args = ap.parse_args()
    if args.offline:
        offline()
        return
    plan = {"bf16b8": [("bf16", SHAPES["bf16b8"])], "tf32b8": [("tf32", SHAPES["tf32b8"])],
            "mlp": [("tf32", SHAPES["mlp"])]}
    plan["all"] = plan["bf16b8"] + plan["tf32b8"] + plan["mlp"]
    names = None if args.kernels == "all" else set(args.kernels.split(","))
    rows = [r for prec, shapes in plan[args.shapes] for r in run(prec, shapes, args.reps, names)]
    from bench.timing import write_rows

    write_rows(args.out, "matmul_wide", rows)


if __name__ == "__main__":
    main()
