#!/usr/bin/env python3
"""Offline sm_90a compile of every matmul epilogue kernel of a GPT-2 124M step (the
fuse stage's ``nova.fused "contraction"`` groups at the configs the configure stage
wrote, TMA as the step's operands allow it): registers, spill bytes and compile
seconds from Triton's bundled ptxas. No GPU needed.

    python scripts/epilogue_sm90_check.py [--batch 32] [--precision bf16]
    python scripts/epilogue_sm90_check.py --lm-head-stats
    python scripts/epilogue_sm90_check.py --lm-head-prologue

Run it after a configurator or epilogue change: a spill, or more than 128
registers at a config meant for two 8-warp blocks per SM, shows here before the
GPU does (``matmul.EPILOGUE_SLICE``)."""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import tempfile
import time

import torch

_PTR = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.bool: "*u8", torch.int64: "*i64", torch.float64: "*fp64",
        torch.int32: "*i32"}
_DESC = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.bool: "u8", torch.int64: "i64"}


def build_sm90(fn, sig: dict, consts: dict, attrs: dict, warps: int, stages: int, **options):
    """(the compiled kernel, its ptxas -v log) of a ``@triton.jit`` function for sm_90a with
    Triton's own ptxas; ``sig`` / ``consts`` / ``attrs`` as ``ASTSource`` takes them. Needs a
    process that has not imported triton.language under TRITON_INTERPRET=1."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    log = io.StringIO()
    triton.knobs.nvidia.dump_ptxas_log = True
    try:
        with contextlib.redirect_stdout(log):
            k = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                               options=dict(num_warps=warps, num_stages=stages, **options))
    finally:
        triton.knobs.nvidia.dump_ptxas_log = False
    return k, log.getvalue()


def compile_sm90(src: str, ep, a_box, b_box, dtype: str, warps: int, stages: int, e_box=None,
                 consts: dict | None = None, pointers: dict | None = None) -> tuple[str, str, int, bool]:
    """(ptxas -v log, ptx, shared memory bytes) of the source's ``matmul_kernel`` compiled for sm_90a, with
    16-byte aligned pointers and strides and unit inner strides (the step's case:
    the operands' and the epilogue operands' last-dim strides are 1, which Triton
    specializes as constants at launch, so their loads are known contiguous);
    ``a_box`` / ``b_box``: the TMA boxes (None: pointer loads); ``e_box``: the
    epilogue outputs' descriptor box (None: pointer stores); ``consts``: values of the
    kernel's other constexpr parameters (the warp-specialized kernel's NUM_PROGS and
    STAGES); ``pointers``: {parameter: Triton pointer type} of other pointer arguments (a
    prologue's vectors). The last result says whether Triton partitioned the loop (warp
    specialization). Needs a process
    that has not imported triton.language under TRITON_INTERPRET=1."""
    from nova.codegen.triton.source import load_kernel

    fn, _ = load_kernel(src, "matmul_kernel")
    ptrs, unit = {}, set()
    if ep is not None:
        ptrs = {f"e{k}": _PTR[op.dtype] for k, op in enumerate(ep.operands)}
        rank = len(ep.shape)
        unit = {f"es{k}_{kd}" for k, op in enumerate(ep.operands) for kd, d, _ in op.terms(rank) if d == rank - 1}
        ptrs.update({f"o{j}": _PTR[d] if e_box is None else f"tensordesc<{_DESC[d]}{list(e_box)}>"
                     for j, (_, _, d) in enumerate(ep.stores)})
        ptrs.update({f"cs{j}": _PTR[c.acc_dtype] for j, c in enumerate(ep.sums)})  # the column sums' partials
        ptrs.update({"rm": "*fp32", "rs": "*fp32"} if ep.row_stats else {})  # the row statistics
    ptrs.update(pointers or {})
    elt = "fp32" if dtype == "float32" else "bf16"
    extra = dict(consts or {})
    sig, consts, attrs = {}, {"EVEN": True, **extra}, {}
    for i, a in enumerate(fn.arg_names):
        if a in extra:
            sig[a] = "constexpr"
            continue
        if a == "EVEN" or a in ("stride_ak", "stride_bn", "stride_cn") or a in unit:
            sig[a] = "constexpr"
            consts.setdefault(a, 1)
            continue
        if a == "a_desc":
            sig[a] = f"tensordesc<{elt}{list(a_box)}>"
        elif a == "b_desc":
            sig[a] = f"tensordesc<{elt}{list(b_box)}>"
        elif a in ptrs:
            sig[a] = ptrs[a]
        else:
            sig[a] = f"*{elt}" if a.endswith("_ptr") else "i32"
        if not a.endswith("_desc") and not sig[a].startswith("tensordesc"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    k, log = build_sm90(fn, sig, consts, attrs, warps, stages, enable_fp_fusion=False)
    return log, k.asm["ptx"], k.metadata.shared, "ttg.warp_specialize" in k.asm["ttgir"]


def _ptxas(log: str) -> tuple[list[str], list[str]]:
    """(registers, spill store bytes) of each function in a ptxas -v log."""
    return re.findall(r"Used (\d+) registers", log), re.findall(r"(\d+) bytes spill stores", log)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--ws", action="append", default=[], metavar="BMxBNxBK:wW:sS",
                    help="also compile each unsplit 16-bit epilogue as the warp-specialized kernel at this tile")
    ap.add_argument("--lm-head-stats", action="store_true",
                    help="only the LM head's logits with their row statistics (linear_ce.ROW_STATS_FROM_LOGITS), "
                         "bf16 and f32 under tf32, at the configs the configurator gives a 4096-row chunk")
    ap.add_argument("--lm-head-prologue", action="store_true",
                    help="only the LM head's dh and dw with d formed in their prologues (linear_ce.D_PROLOGUE): GPT-2 "
                         "bf16 and tf32, the 46M MLP tf32, at the configs the configurator gives a 4096-row chunk")
    args = ap.parse_args()
    # a kernel found in Triton's cache is not compiled again, and prints no ptxas log: compile afresh
    cache = tempfile.TemporaryDirectory(prefix="epilogue_sm90_check_")  # removed when main returns
    os.environ["TRITON_CACHE_DIR"] = cache.name
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ.setdefault("NOVA_STEP_CACHE", "0")
    if args.lm_head_stats:
        lm_head_stats()
        return
    if args.lm_head_prologue:
        lm_head_prologue()
        return

    from gpt2_h200 import compile_gpt2_h200
    from nova.backends.triton import config_of
    from nova.codegen.triton import matmul as mm
    from nova.codegen.triton.fused import epilogue_of
    from nova.ir import dialect as nv
    from nova.ir.module import step_func
    from nova.ir.types import elem_of, to_torch_dtype
    from nova.schedule.configurator import STEP_MATMUL_PRECISION
    from nova.transforms.configure import operand_layout

    c = compile_gpt2_h200(args.batch, args.precision)
    seen: dict = {}
    for op in step_func(c.module).body.block.ops:
        if not isinstance(op, nv.FusedOp) or not isinstance(op.contraction(), nv.MatmulOp):
            continue
        head, cfg = op.contraction(), config_of(op)
        ep, _ = epilogue_of(op)
        lhs, rhs = (op.operands[list(op.body.block.args).index(v)] for v in head.operands)
        seen.setdefault((cfg, ep, operand_layout(lhs), operand_layout(rhs), str(head.operands[0].type)), []).append(op)
    print(f"GPT-2 124M {args.precision} batch {args.batch}: {sum(map(len, seen.values()))} epilogue launches, "
          f"{len(seen)} kernels")  # fmt: skip
    compiled: set[str] = set()
    for (cfg, ep, la, lb, _), ops in seen.items():
        head = ops[0].contraction()
        dt = mm._dtype_name(to_torch_dtype(elem_of(head.operands[0].type)))
        prec = "bf16" if dt != "float32" else STEP_MATMUL_PRECISION[args.precision]
        key = dataclasses_replace(cfg)
        split = key.split_k
        staged = tuple(x for x in ("a", "b") if f"stage_{x}" in cfg.instruction.split("+"))
        tma = "tma" in cfg.instruction
        if staged:  # staged operands are dense K-major copies
            la, lb = ("row" if "a" in staged else la), ("col" if "b" in staged else lb)
        # the step's epilogue outputs are dense and 16-byte aligned: of two element sizes, stored
        # through descriptors (matmul._tma_e)
        sizes = {d.itemsize for _, _, d in ep.stores}
        ws = "ws" in cfg.instruction.split("+")  # the warp-specialized kernel: its own source (device-built descriptors)
        layout = (mm.TmaLayout(la, lb, ws=True) if ws else mm.TmaLayout(la, lb, e=split == 1 and len(sizes) > 1)
                  if tma and "strided" not in (la, lb) else None)  # fmt: skip
        w = cfg.block_n // mm.epilogue_slices(ep, cfg.block_m, cfg.block_n)
        src = mm.matmul_source(key, has_bias=False, precision=prec, out_dtype=dt, in_dtype=dt, tma=layout,
                               prerounded=staged, epilogue=ep)  # fmt: skip
        if src in compiled:  # the same text as a kernel above (Triton's cache: ptxas does not run again)
            continue
        compiled.add(src)
        a_box = (cfg.block_m, cfg.block_k) if la == "row" else (cfg.block_k, cfg.block_m)
        b_box = (cfg.block_k, cfg.block_n) if lb == "row" else (cfg.block_n, cfg.block_k)
        t0 = time.perf_counter()
        if ws:  # as the launcher runs it: one program an SM (the H200's 132), STAGES its ring
            log, ptx, smem, _ = compile_sm90(src, ep, None, None, dt, cfg.num_warps, cfg.num_stages,
                                             consts={"NUM_PROGS": 132, "STAGES": cfg.num_stages})  # fmt: skip
        else:
            log, ptx, smem, _ = compile_sm90(src, ep, a_box if layout else None, b_box if layout else None, dt,
                                             cfg.num_warps, cfg.num_stages,
                                             (cfg.block_m, w) if layout and layout.e else None)  # fmt: skip
        regs, spills = _ptxas(log)
        inner = " ".join(o.name.removeprefix("nova.") for o in ops[0].inner_ops()[1:])
        print(f"{len(ops):4d}x {cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages} "
              f"sk{cfg.split_k} {cfg.instruction} {la}/{lb}: {mm.epilogue_slices(ep, cfg.block_m, cfg.block_n)} slices, "
              f"registers {','.join(regs)}, spill stores {','.join(spills)} B, shared {smem // 1024} KiB, "
              f"{time.perf_counter() - t0:.1f} s  [{inner}]")
        if split > 1 or dt == "float32" or layout is None:
            continue
        for spec in args.ws:  # the same epilogue in the warp-specialized persistent kernel
            tile, w_, s_ = spec.split(":")
            bm, bn, bk = map(int, tile.split("x"))
            wcfg = mm.LoweringConfig(kind="matmul", block_m=bm, block_n=bn, block_k=bk, group_m=cfg.group_m,
                                     persistent=True)  # fmt: skip
            wsrc = mm.matmul_source(wcfg, has_bias=False, precision=prec, out_dtype=dt, in_dtype=dt,
                                    tma=mm.TmaLayout(la, lb, ws=True), epilogue=ep)  # fmt: skip
            t0 = time.perf_counter()
            try:
                log, _, smem, part = compile_sm90(wsrc, ep, None, None, dt, int(w_[1:]), int(s_[1:]),
                                                  consts={"NUM_PROGS": 132, "STAGES": int(s_[1:])})  # fmt: skip
            except Exception as e:  # noqa: BLE001 - reported, the next tile still compiles
                print(f"      ws {spec}: does not compile ({str(e).splitlines()[0][:200]})")
                continue
            regs, spills = _ptxas(log)
            print(f"      ws {spec}: partitioned {part}, registers {','.join(regs)}, spill stores "
                  f"{','.join(spills)} B, shared {smem // 1024} KiB, {time.perf_counter() - t0:.1f} s")


def lm_head_stats(rows: int = 4096, vocab: int = 50304, dim: int = 768) -> None:
    """The logits matmul with the row statistics' epilogue (``mm.Epilogue.row_stats``) at
    ``linear_ce.stats_config`` of the configurator's config for a GPT-2 chunk, with
    ``ROW_STATS_WS`` on and off: a bf16 head, and an f32 head under tf32 (the weight
    rounded once, ``prerounded`` B)."""
    from nova.codegen.triton import linear_ce
    from nova.codegen.triton import matmul as mm
    from nova.schedule.configurator import configure_matmul
    from nova.schedule.devices import DEVICES

    for dtype, prec, pre in ((torch.bfloat16, "ieee", ()), (torch.float32, "tf32-rn", ("b",))):
        head = configure_matmul(rows, vocab, dim, 1, dtype, dtype, dtype, prec, "row", "col", False, DEVICES["H200"],
                                prerounded=pre)  # fmt: skip
        for ws_on in (True, False):
            saved, linear_ce.ROW_STATS_WS = linear_ce.ROW_STATS_WS, ws_on
            try:
                cfg = linear_ce.stats_config(head)
            finally:
                linear_ce.ROW_STATS_WS = saved
            ws = "ws" in cfg.instruction.split("+")
            if ws_on and not ws and "ws" not in head.instruction:
                continue  # the same config as below
            dt = "bfloat16" if dtype == torch.bfloat16 else "float32"
            body = "e_z = e_tile" + (".to(tl.bfloat16).to(tl.float32)" if dtype == torch.bfloat16 else "")
            ep = mm.Epilogue(shape=(rows, vocab), operands=(), body=body, stores=(("e_z", "f32", dtype),),
                             out_shapes=((rows, vocab),), row_stats="e_z", row_stats_cols=cfg.block_n)  # fmt: skip
            staged = tuple(x for x in ("a", "b") if f"stage_{x}" in cfg.instruction.split("+"))
            layout = mm.TmaLayout("row", "row" if "b" in staged else "col", ws=ws)
            src = mm.matmul_source(dataclasses_replace(cfg), has_bias=False, out_dtype=dt, in_dtype=dt, tma=layout,
                                   precision="bf16" if dt == "bfloat16" else prec, prerounded=staged, epilogue=ep)
            b_box = (cfg.block_k, cfg.block_n) if "b" in staged else (cfg.block_n, cfg.block_k)
            t0 = time.perf_counter()
            if ws:
                log, _, smem, part = compile_sm90(src, ep, None, None, dt, cfg.num_warps, cfg.num_stages,
                                                  consts={"NUM_PROGS": 132, "STAGES": cfg.num_stages})  # fmt: skip
            else:
                log, _, smem, part = compile_sm90(src, ep, (cfg.block_m, cfg.block_k), b_box, dt, cfg.num_warps,
                                                  cfg.num_stages)  # fmt: skip
            regs, spills = _ptxas(log)
            print(f"LM head {dt} logits with row statistics (ROW_STATS_WS {ws_on}): {head.block_m}x{head.block_n}x"
                  f"{head.block_k} w{head.num_warps} s{head.num_stages} {head.instruction} -> w{cfg.num_warps} "
                  f"s{cfg.num_stages} {cfg.instruction}{' (partitioned)' if part else ''}: "
                  f"{mm.epilogue_slices(ep, cfg.block_m, cfg.block_n)} slices, registers {','.join(regs)}, spill "
                  f"stores {','.join(spills)} B, shared {smem // 1024} KiB, {time.perf_counter() - t0:.1f} s")


def lm_head_prologue(rows: int = 4096, vocab: int = 50304) -> None:
    """dh = d @ w and dw = d^T @ h with d formed from the logits in their prologues
    (``linear_ce.d_prologues``) at the configurator's configs for a 4096-row chunk on the
    H200 (as the lowering's ``Configs`` asks them), with and without the prologue: registers,
    spills, shared memory, and whether the loop's wgmma waits for the previous one
    (``wgmma.wait_group 0`` in the loop) or overlaps it (``wait_group 1``)."""
    from nova.codegen.triton import linear_ce
    from nova.codegen.triton import matmul as mm
    from nova.schedule.configurator import configure_matmul
    from nova.schedule.devices import DEVICES

    dev = DEVICES["H200"]
    for name, dtype, prec, dim in (("GPT-2 bf16", torch.bfloat16, "bf16", 768), ("GPT-2 tf32", torch.float32, "tf32-rn", 768),
                                   ("MLP 46M tf32", torch.float32, "tf32-rn", 384)):
        f32 = dtype == torch.float32
        dt = "float32" if f32 else "bfloat16"
        tl_ty = "tl.float32" if f32 else "tl.bfloat16"
        pro_dh, pro_dw = linear_ce.d_prologues(tl_ty, tl_ty, f32)
        # dh: A = d [rows, V] (K contiguous), B = w [V, D] (the rounded dense w^T's view under tf32: K contiguous);
        # dw: A = d^T [V, rows] (M contiguous), B = h [rows, D]
        for what, (M, N, K), la, lb, out, pre, pro in (
                ("dh", (rows, dim, vocab), "row", "col" if f32 else "row", dt, ("a", "b") if f32 else (), pro_dh),
                ("dw", (vocab, dim, rows), "col", "row", "float32", (), pro_dw)):
            cfg = configure_matmul(M, N, K, 1, dtype, dtype, getattr(torch, out), prec, la, lb, False, dev,
                                   prerounded=pre)  # fmt: skip
            tokens = cfg.instruction.split("+")
            b_staged = "stage_b" in tokens or "b" in pre
            lb_k = "col" if b_staged else lb
            layout = mm.TmaLayout(la, lb_k)
            a_box = (cfg.block_m, cfg.block_k) if la == "row" else (cfg.block_k, cfg.block_m)
            b_box = (cfg.block_k, cfg.block_n) if lb_k == "row" else (cfg.block_n, cfg.block_k)
            for with_pro in (False, True):
                a_pre = () if with_pro else tuple(x for x in ("a",) if "stage_a" in tokens or "a" in pre)
                b_pre = ("b",) if b_staged else ()
                src = mm.matmul_source(dataclasses_replace(cfg), has_bias=False, out_dtype=out, in_dtype=dt,
                                       precision="bf16" if not f32 else prec, tma=layout, prerounded=a_pre + b_pre,
                                       prologue=pro if with_pro else None)  # fmt: skip
                t0 = time.perf_counter()
                pointers = {"pv_lse": "*fp32", "pv_w": "*fp32", "pv_t": "*i64"} if with_pro else None
                log, ptx, smem, _ = compile_sm90(src, None, a_box, b_box, dt, cfg.num_warps, cfg.num_stages,
                                                 pointers=pointers)  # fmt: skip
                regs, spills = _ptxas(log)
                waits = {n: len(re.findall(rf"wgmma.wait_group.sync.aligned {n};", ptx)) for n in (0, 1)}
                print(f"{name} {what} {M}x{N}x{K}: {cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} "
                      f"s{cfg.num_stages} sk{cfg.split_k} {'persistent ' if cfg.persistent else ''}{cfg.instruction}"
                      f"{' + prologue' if with_pro else ''}: registers {','.join(regs)}, spill stores "
                      f"{','.join(spills)} B, shared {smem // 1024} KiB, wgmma {ptx.count('wgmma.mma_async')}, "
                      f"wait_group 0/1: {waits[0]}/{waits[1]}, {time.perf_counter() - t0:.1f} s")


def dataclasses_replace(cfg):
    """The config as the kernel text is keyed (``matmul_kernels``): launch-time fields dropped."""
    from nova.schedule.config import LoweringConfig

    return LoweringConfig(kind="matmul", block_m=cfg.block_m, block_n=cfg.block_n, block_k=cfg.block_k,
                          group_m=cfg.group_m, split_k=2 if cfg.split_k > 1 else 1, persistent=cfg.persistent)  # fmt: skip


if __name__ == "__main__":
    main()
