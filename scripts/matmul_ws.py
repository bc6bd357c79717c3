#!/usr/bin/env python3
"""Does Triton 3.6's warp specialization of a persistent Hopper matmul reach cuBLAS on
the GPT-2 124M bf16 step's big shapes (batch 32)? An experiment before any change to the
template. For each shape: cuBLAS (torch.matmul on the step's layouts) and a persistent
TMA kernel whose tile loop is ``tl.range(..., warp_specialize=True)`` (Triton partitions
it: a producer warp group issuing the loads, two consumer groups of ``num_warps`` for the
MMAs and the store), over tiles, stages, how C is stored (pointers, or a device-built descriptor) and whether the grid
size is a constant.

Each kernel runs in its own child process (every shape) under a time limit: a warp-specialized
persistent kernel built from Nova's template did not finish in 200 s on the H200 at
db6f021 (a hang, not diagnosed), and a hang must cost one kernel's rows, not the run. A row's
result is checked against torch.matmul (fp32 accumulate, bf16 out: max |diff| printed).

    python scripts/matmul_ws.py [--reps 20] [--limit 90] [--out DIR]
    python scripts/matmul_ws.py --offline    # compile for sm_90a only (no GPU)
    python scripts/matmul_ws.py --epilogues  # the template's partitioned epilogues against the unpartitioned

Writes matmul_ws.json to --out (commit from NOVA_COMMIT). Needs CUDA (Hopper)."""
from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.timing import time_events  # noqa: E402

# (M, N, K, B layout: col = the weight [N, K] read transposed, row = [K, N]), uses per step
SHAPES = [(32768, 2304, 768, "col", 12), (32768, 3072, 768, "col", 12), (32768, 768, 3072, "col", 12),
          (32768, 768, 768, "col", 12), (32768, 3072, 768, "row", 12), (32768, 768, 3072, "row", 12)]
# (BM, BN, BK, stages, warps per consumer group, C store, stages given to tl.range)
# C store: ptr (host-built A and B descriptors, C through pointers), dev (every descriptor built on the
# device, C through one), rt (as ptr, the grid size a runtime argument as in Nova's template). A
# host-built C descriptor is not among them: Triton 3.6's partitioning fails on its store (offline, sm_90a).
# devp: the descriptors of A and B built on the device, C through pointers (as an epilogue stores).
# nova: Nova's own template as the Analytic Configurator sets it (the tile fields unused), its
# launch replayed in a CUDA graph (at 49aaf89 the rows timed Python calls of matmul(): host-bound,
# 0.43-0.51 ms for any shape, not the kernel).
# At 49aaf89 on the H200 the ptr and rt kernels did not finish in 90 s (a hang), dev ran at
# 0.93-0.97x cuBLAS: the host-built descriptors are what hangs, so they come last.
KERNELS = [(0, 0, 0, 0, 0, "nova", False), (128, 256, 64, 3, 4, "dev", True), (128, 256, 64, 3, 4, "devp", True),
           (128, 128, 64, 4, 4, "dev", True), (128, 256, 64, 4, 4, "devp", True), (128, 128, 64, 4, 4, "devp", True),
           (128, 256, 64, 3, 4, "ptr", True), (128, 256, 64, 3, 4, "rt", True)]


@triton.jit
def _tiles(a_desc, b_desc, c_desc, c_ptr, M, N, K, NUM_SMS, BM: tl.constexpr, BN: tl.constexpr,
           BK: tl.constexpr, GROUP_M: tl.constexpr, B_T: tl.constexpr, C_DESC: tl.constexpr, STAGES: tl.constexpr):
    """The persistent tile loop, warp-specialized: C = A B in bf16, through ``c_desc`` or pointers
    (``NUM_SMS`` the grid: a constexpr, or a runtime value as Nova's template passes it)."""
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    tiles = num_pid_m * num_pid_n
    for tile in tl.range(tl.program_id(0), tiles, NUM_SMS, warp_specialize=True, num_stages=STAGES):
        group = tile // (GROUP_M * num_pid_n)
        first_m = group * GROUP_M
        rows = tl.minimum(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (tile % rows)
        pid_n = (tile % (GROUP_M * num_pid_n)) // rows
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(k_tiles):
            a = a_desc.load([pid_m * BM, ki * BK])
            if B_T:
                b = b_desc.load([pid_n * BN, ki * BK]).T
            else:
                b = b_desc.load([ki * BK, pid_n * BN])
            acc = tl.dot(a, b, acc)
        c = acc.to(tl.bfloat16)
        if C_DESC:
            c_desc.store([pid_m * BM, pid_n * BN], c)
        else:
            offs_m = pid_m * BM + tl.arange(0, BM)
            offs_n = pid_n * BN + tl.arange(0, BN)
            tl.store(c_ptr + offs_m[:, None] * N + offs_n[None, :], c, mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


@triton.jit
def ws_matmul(a_desc, b_desc, c_ptr, M, N, K, NUM_SMS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
              BK: tl.constexpr, GROUP_M: tl.constexpr, B_T: tl.constexpr, STAGES: tl.constexpr):
    """Host-built descriptors for A and B (Nova's template's way), C through pointers."""
    _tiles(a_desc, b_desc, a_desc, c_ptr, M, N, K, NUM_SMS, BM, BN, BK, GROUP_M, B_T, False, STAGES)


@triton.jit(do_not_specialize=["NUM_PROGS"])
def ws_matmul_rt(a_desc, b_desc, c_ptr, M, N, K, NUM_PROGS, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 GROUP_M: tl.constexpr, B_T: tl.constexpr, STAGES: tl.constexpr):
    """ws_matmul with the grid size a runtime argument, kept out of Triton's integer
    specialization (Nova's template's ``NUM_PROGS``), C through pointers."""
    _tiles(a_desc, b_desc, a_desc, c_ptr, M, N, K, NUM_PROGS, BM, BN, BK, GROUP_M, B_T, False, STAGES)


@triton.jit
def ws_matmul_dev(a_ptr, b_ptr, c_ptr, M, N, K, NUM_SMS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr, GROUP_M: tl.constexpr, B_T: tl.constexpr, STAGES: tl.constexpr,
                  C_DESC: tl.constexpr):
    """The descriptors made on the device (``tl.make_tensor_descriptor``, as Triton's own
    warp-specialization tests do), C stored through one (``C_DESC``) or through pointers."""
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    if B_T:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
    else:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[K, N], strides=[N, 1], block_shape=[BK, BN])
    c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
    _tiles(a_desc, b_desc, c_desc, c_ptr, M, N, K, NUM_SMS, BM, BN, BK, GROUP_M, B_T, C_DESC, STAGES)


def _name(kernel: tuple) -> str:
    return "%dx%dx%d s%d w%d c_%s range_stages_%s" % kernel


def offline() -> None:
    """Each kernel compiled for sm_90a here (no GPU): partitioned or not, and its shared memory."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    for BM, BN, BK, stages, warps, store, range_stages in KERNELS:
        for b_t in (True, False):
            bbox = [BN, BK] if b_t else [BK, BN]
            if store == "nova":
                continue
            dev, rt = store in ("dev", "devp"), store == "rt"
            sig = ({"a_ptr": "*bf16", "b_ptr": "*bf16"} if dev else
                   {"a_desc": f"tensordesc<bf16[{BM}, {BK}]>", "b_desc": f"tensordesc<bf16{bbox}>"})
            sig.update({"c_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32"})
            if rt:
                sig["NUM_PROGS"] = "i32"
            consts = {} if rt else {"NUM_SMS": 132}
            consts.update({"BM": BM, "BN": BN, "BK": BK, "GROUP_M": 8, "B_T": b_t})
            consts["STAGES"] = stages if range_stages else None
            if dev:
                consts["C_DESC"] = store == "dev"
            sig.update({k: "constexpr" for k in consts})
            head = f"{_name((BM, BN, BK, stages, warps, store, range_stages))} b_t {b_t}"
            try:
                fn = ws_matmul_dev if dev else ws_matmul_rt if rt else ws_matmul
                k = triton.compile(ASTSource(fn, sig, consts, {}), target=GPUTarget("cuda", 90, 32),
                                   options=dict(num_warps=warps, num_stages=stages))
            except RuntimeError as e:
                print(f"{head}: does not compile ({e})")
                continue
            print(f"{head}: "
                  f"partitioned {'ttg.warp_specialize' in k.asm['ttgir']}, warps {k.metadata.num_warps}, "
                  f"shared {k.metadata.shared // 1024} KiB")


def child(kernel: tuple, reps: int) -> None:
    """One kernel on every shape, a JSON row printed per shape."""
    import torch
    from triton.tools.tensor_descriptor import TensorDescriptor

    BM, BN, BK, stages, warps, store, range_stages = kernel
    # device-built descriptors live in a global scratch the launcher allocates
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    st = stages if range_stages else None
    torch.manual_seed(0)
    for M, N, K, bl, uses in SHAPES:
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) if bl == "col" else \
            torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
        c = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        a_d = TensorDescriptor.from_tensor(a, [BM, BK])
        b_d = TensorDescriptor.from_tensor(w, [BN, BK] if bl == "col" else [BK, BN])

        def run():
            if store == "nova":
                from nova.codegen.triton.matmul import matmul
                return matmul(a, w.t() if bl == "col" else w, out=c, record=record)
            if store in ("dev", "devp"):
                return ws_matmul_dev[(sms,)](a, w, c, M, N, K, sms, BM, BN, BK, 8, bl == "col", st, store == "dev",
                                             num_warps=warps, num_stages=stages)
            if store == "rt":
                return ws_matmul_rt[(sms,)](a_d, b_d, c, M, N, K, sms, BM, BN, BK, 8, bl == "col", st,
                                            num_warps=warps, num_stages=stages)
            return ws_matmul[(sms,)](a_d, b_d, c, M, N, K, sms, BM, BN, BK, 8, bl == "col", st, num_warps=warps,
                                     num_stages=stages)

        record: dict = {}
        compiled = run()  # the launch returns the compiled kernel (Nova's: C)
        torch.cuda.synchronize()
        timed = run
        if store == "nova":  # a call of matmul() is host-bound (its checks, the configurator): its kernels in a graph
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run()
            timed = graph.replay
        ref = a @ (w.t() if bl == "col" else w)
        row = {"M": M, "N": N, "K": K, "b": bl, "uses": uses, "kernel": _name(kernel),
               "ms": time_events(timed, reps), "cublas_ms": time_events(lambda: a @ (w.t() if bl == "col" else w), reps),
               "max_diff": float((c.float() - ref.float()).abs().max()),
               "warp_specialized": store != "nova" and "ttg.warp_specialize" in compiled.asm["ttgir"]}
        if store == "nova":
            row["nova_kernels"] = sorted(record)
        row["vs_cublas"] = row["cublas_ms"] / row["ms"]
        print(json.dumps(row), flush=True)


# --epilogues: the template's warp-specialized kernel with an epilogue (matmul.WS_EPILOGUES on)
# beside the unpartitioned kernel of the step (128x128x64 w8 s3), to narrow down the NaNs a
# bias + GELU epilogue wrote on the H200 at 1bd18d6. Each kind: (body, operand dtypes of [N]
# rows, stores (variable, register type, dtype)).
GELU = "z = y * tl.sigmoid(1.5957691216057308 * (y + 0.044715 * y * y * y))"
EPILOGUES = {
    "none": None,  # no epilogue: C stored by the template's plain store (the partitioned form that passes)
    "cast": ("y = e_tile", (), (("y", "f32", "bfloat16"),)),
    "f32": ("y = e_tile * 2.0", (), (("y", "f32", "float32"),)),
    "bias": ("y = e_tile + ex0", ("float32",), (("y", "f32", "bfloat16"),)),
    "gelu": ("y = e_tile\n" + GELU, (), (("z", "f32", "bfloat16"),)),
    "bias-gelu": ("y = e_tile + ex0\n" + GELU, ("float32",), (("z", "f32", "bfloat16"),)),
    "bias-gelu-2out": ("y = e_tile + ex0\n" + GELU, ("float32",), (("y", "f32", "float32"), ("z", "f32", "bfloat16"))),
}
EPI_SHAPES = [(4096, 3072, 768), (32768, 3072, 768)]


def parse_tile(text: str) -> tuple[int, int, int, int, int]:
    """"128x128x64:w4:s5" -> (BM, BN, BK, warps, stages)."""
    dims, w, s = text.split(":")
    bm, bn, bk = (int(x) for x in dims.split("x"))
    return bm, bn, bk, int(w.lstrip("w")), int(s.lstrip("s"))


def where_wrong(bad, bm: int, bn: int, group_m: int, programs: int) -> dict:
    """Where the wrong elements (a bool [M, N] mask) lie: how many tiles hold one, how many
    distinct rows and columns inside a tile, and which round of its program's persistent loop
    each such tile was (the tile's place in the group-M swizzled order // programs)."""
    import torch

    idx = torch.nonzero(bad).cpu()
    if not len(idx):
        return {}
    M, N = bad.shape
    r, c = idx[:, 0], idx[:, 1]
    pm, pn = r // bm, c // bn
    num_pid_m, num_pid_n = -(-M // bm), -(-N // bn)
    group = pm // group_m
    rows = torch.clamp(num_pid_m - group * group_m, max=group_m)
    order = group * group_m * num_pid_n + pn * rows + (pm - group * group_m)
    tiles = torch.unique(order)
    rounds = torch.unique(tiles // programs, return_counts=True)
    last_round = (num_pid_m * num_pid_n - 1) // programs
    return {"tiles": len(tiles), "rows_in_tile": len(torch.unique(r % bm)), "cols_in_tile": len(torch.unique(c % bn)),
            "first_row_col": [int(r[0] % bm), int(c[0] % bn)], "rounds": dict(zip(map(int, rounds[0]), map(int, rounds[1]))),
            "last_round": int(last_round), "per_tile": len(idx) / len(tiles)}


def epilogue_child(kind: str, reps: int, device: str = "cuda", shapes=None, tile: str = "128x128x64:w4:s5") -> None:
    """One epilogue kind on every shape: the warp-specialized kernel's outputs against the
    unpartitioned kernel's (NaN counts, max |diff|, where the wrong elements lie, ms), a JSON
    row per shape and output. ``tile``: the partitioned kernel's BMxBNxBK:wW:sS."""
    import torch

    from nova.codegen.triton import matmul as mm
    from nova.codegen.triton.elementwise import Operand
    from nova.schedule.config import LoweringConfig

    mm.WS_EPILOGUES = True
    bm, bn, bk, warps, stages = parse_tile(tile)
    ws = LoweringConfig(kind="matmul", block_m=bm, block_n=bn, block_k=bk, group_m=8, persistent=True,
                        num_warps=warps, num_stages=stages, instruction="wgmma+tma+ws")
    plain = LoweringConfig(kind="matmul", block_m=128, block_n=128, block_k=64, group_m=16, num_warps=8,
                           num_stages=3, instruction="wgmma+tma")
    programs = torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else 4
    torch.manual_seed(0)
    for M, N, K in shapes or EPI_SHAPES:
        a = torch.randn(M, K, device=device).to(torch.bfloat16)
        w = torch.randn(N, K, device=device).to(torch.bfloat16)
        rec: dict = {}
        if EPILOGUES[kind] is None:
            def run(cfg, rec=None):
                return [mm.matmul(a, w.t(), cfg=cfg, record=rec)]
        else:
            body, ops, stores = EPILOGUES[kind]
            ep = mm.Epilogue(shape=(M, N), operands=tuple(Operand((N,), getattr(torch, d), load="raw") for d in ops),
                             body=body, stores=tuple((v, t, getattr(torch, d)) for v, t, d in stores),
                             out_shapes=tuple((M, N) for _ in stores))
            xs = [torch.randn(N, device=device, dtype=getattr(torch, d)) for d in ops]

            def run(cfg, rec=None):
                return mm.matmul_epilogue(a, w.t(), ep, xs, torch.bfloat16, cfg=cfg, record=rec)
        got = run(ws, rec)
        want = run(plain)
        ran_ws = any("warp-specialized" in open(p).read(400) for p in rec)
        timed = {}
        if device == "cuda":
            timed = {"ms": time_events(lambda: run(ws), reps), "plain_ms": time_events(lambda: run(plain), reps)}
        for j, (g, x) in enumerate(zip(got, want)):
            d = (g.double() - x.double()).abs()
            print(json.dumps({"epilogue": kind, "tile": tile, "M": M, "N": N, "K": K, "output": j,
                              "dtype": str(g.dtype), "warp_specialized": ran_ws, "nan": int(torch.isnan(g).sum()),
                              "nan_unpartitioned": int(torch.isnan(x).sum()),
                              "mismatched": int((d != 0).sum()), "max_diff": float(d.nan_to_num(float("inf")).max()),
                              "where": where_wrong(d != 0, bm, bn, 8, programs), **timed}), flush=True)


def _write(out: Path, rows: list, name: str = "matmul_ws.json") -> None:
    import torch

    out.mkdir(parents=True, exist_ok=True)
    doc = {"commit": os.environ.get("NOVA_COMMIT", "unknown"), "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "rows": rows}
    (out / name).write_text(json.dumps(doc, indent=1))


def _in_child(flag: str, value: str, reps: int, limit: int) -> tuple[list[dict], str]:
    """This script run again with ``flag value`` under ``limit`` seconds: (the JSON rows it
    printed, even those of a child cut short by the limit; its error, "" if none)."""
    try:
        p = subprocess.run([sys.executable, __file__, flag, value, "--reps", str(reps)],
                           capture_output=True, text=True, timeout=limit)
        out, err = p.stdout, p.stderr if p.returncode else ""
    except subprocess.TimeoutExpired as e:  # the rows printed before the limit still count
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        err = f"did not finish in {limit} s"
    return [json.loads(x) for x in out.splitlines() if x.startswith("{")], err.strip()[-300:]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--limit", type=int, default=90, help="seconds a child (one kernel on every shape) may take")
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--offline", action="store_true", help="compile each kernel for sm_90a, run nothing (no GPU needed)")
    ap.add_argument("--epilogues", action="store_true",
                    help="the template's warp-specialized kernel with epilogues against the unpartitioned one")
    ap.add_argument("--epilogue-child", help=argparse.SUPPRESS)
    ap.add_argument("--tiles", default="128x128x64:w4:s5",
                    help="--epilogues: the partitioned kernel's tiles, BMxBNxBK:wW:sS, comma-separated")
    ap.add_argument("--kinds", default=",".join(EPILOGUES), help="--epilogues: the kinds, comma-separated")
    opts = ap.parse_args()
    if opts.epilogue_child:
        kind, tile = opts.epilogue_child.split("@")
        epilogue_child(kind, opts.reps, tile=tile)
        return
    if opts.offline:
        offline()
        return
    if opts.child:
        child(tuple(json.loads(opts.child)), opts.reps)
        return
    rows = []
    if opts.epilogues:
        for tile, kind in itertools.product(opts.tiles.split(","), opts.kinds.split(",")):
            got, err = _in_child("--epilogue-child", f"{kind}@{tile}", opts.reps, opts.limit)
            for r in got:
                print(f"{kind:14s} {tile} {r['M']}x{r['N']}x{r['K']} out {r['output']} {r['dtype']}: "
                      f"ws {r['warp_specialized']}, NaN {r['nan']} (unpartitioned {r['nan_unpartitioned']}), "
                      f"mismatched {r['mismatched']}, max diff {r['max_diff']:.3g}, {r.get('ms', 0):.4f} ms vs "
                      f"{r.get('plain_ms', 0):.4f}, where {r['where']}", flush=True)
            if err:
                print(f"{kind}@{tile}: {err}", flush=True)
                got.append({"epilogue": kind, "tile": tile, "error": err})
            rows += got
            _write(opts.out, rows, "matmul_ws_epilogues.json")
        return
    for kern in KERNELS:
        name = _name(kern)
        got, err = _in_child("--child", json.dumps(kern), opts.reps, opts.limit)
        for r in got:
            print(f"{r['kernel']:44s} {r['M']}x{r['N']}x{r['K']} {r['b']}: {r['ms']:.4f} ms, cuBLAS {r['cublas_ms']:.4f} "
                  f"({r['vs_cublas']:.2f}x), partitioned {r['warp_specialized']}, max diff {r['max_diff']:.3g}", flush=True)
        if err:
            print(f"{name}: {err} (after {len(got)} of {len(SHAPES)} shapes)", flush=True)
            got.append({"kernel": name, "error": err})
        rows += got
        _write(opts.out, rows)  # after every kernel: a run cut short keeps what it measured


if __name__ == "__main__":
    main()
