#!/usr/bin/env python3
"""An experiment on the matmul epilogues of a GPT-2 step (batch 32, T 1024, bf16, few
layers): every launch of the list timed (``step.profile()``) under variants of how
epilogue kernels are scheduled and what joins them, each variant in its own process:

  tile-grid     the configurator as shipped (PERSISTENT_EPILOGUES off)
  persistent    epilogue kernels in the persistent flattened loop too
  *-light       elementwise ops costing more than 4 FLOPs an element (the cost model's
                table: GELU 8, its backward 12) kept out of epilogues
  *-nobackward  more than 8 (GELU's backward kept out, the forward's GELU in)
  *-noresidual  the residual adds (f32, both operands full-size, neither a broadcast
                bias) kept out: the projections store their f32 biased output (the
                bias add is in f32), the residual add is its own kernel or joins its
                reader
  tile:FIELDS   the shipped configurator, every epilogue kernel's schedule overridden
                by FIELDS (colon-separated: BMxBN, sS stages, wW warps, gG group_m, p the
                persistent flattened loop, np one program a tile, nows the kernel without warp
                specialization), e.g. tile:128x256:s3 or tile:128x128:s4:p or tile:128x128:s3:w4:nows:np
                (a schedule that does not compile fails its row)
  splitk:N      the shipped configurator, every split-K matmul (the weight gradients, the LM
                head's dh) split N ways instead (N >= 2)
  colsplit:N    the shipped configurator, every column reduction (bias gradients, and
                GELU's backward computed in the c_fc one's prologue) split N ways
  colblock:B[:N]  every column reduction B contiguous kept elements a program (the
                configurator's: a warp's row of 16-byte loads of the reduced value,
                128 at f32, though a fused one may load bf16), split as the
                configurator says (or N ways)
  colregs:R     every column reduction split for one wave of programs at R registers a
                thread (configurator.COLUMN_PROGRAM_REGS; 72, the GELU backward's, shipped
                since a6abd7d; 0: registers unmodelled, the split by threads, as before)
  ln-bwd-stages:S  LayerNorm backwards' row loops pipelined S stages (rowwise.LN_BWD_ROW_STAGES,
                3 as shipped; the hoisted loads left 28.7 KB of shared memory a program at 3)
  ln-fwd-rows:P LayerNorm forwards (a row in registers) as P programs an SM walking rows,
                loading the row-invariant vectors once a program (rowwise.LN_FWD_PROGRAMS_PER_SM;
                the same bits)
  recasts:N     remat's weight recasts for the backward N of one shape a launch
                (fuse.RECAST_BATCH; 1: one launch each, as before 2026-12-05's fourth session)
  colstages:S   every column reduction's chunk loop software-pipelined S stages
                (reduce.COLUMN_STAGES; the same chunks in the same order: bit-identical)
  coltile:B:W   every column reduction B kept elements a program at W warps, 16 reduced
                rows a chunk and the split as shipped (reduce.TILE = 16 B): the same chunks,
                but Triton may lay the [B, 16] accumulator's final row sums out otherwise
                (at 256:8 the losses were not bit-identical to the shipped step's, 92bcf2f)
  ws-off        no warp-specialized kernel (configurator.WS_TILES all None: step 8's kernels)
  ws-plain      warp specialization for the matmuls that store C only
  ws-epi128     warp specialization with epilogue kernels at 128x128 too
  ws-epi256     warp specialization with epilogue kernels at 128x256 too
  two-pass-split  split-K in two kernels (partials, then their reduction) instead of adding
                the splits up in the kernel (matmul.SERIAL_SPLIT off)
  casts-unbatched the forward's weight casts one launch each (fuse.BATCH_OPERAND_CASTS off)
  last-split-sums split-K's partials added up by the last split of each tile to finish
                (matmul.LAST_SPLIT_SUMS), no reduction kernel
  split-gain:X  the configurator's one-wave split taken where the model gains more than X
                (configurator.ONE_WAVE_SPLIT_MIN_GAIN; 0: every gain, as before 2026-12-05)
  row-stores-off  the residual stream's sums in the projections' epilogues, not computed
                and stored by the next LayerNorm's prologue (fuse.ROW_PROLOGUE_STORES off),
                and remat's LayerNorm recomputes kernels of their own (no norm_recompute
                stage): the step before 2026-12-05's second session
  norm-recompute-off  remat's LayerNorm recomputes kernels of their own (no norm_recompute
                stage), the row stores on
  ln-pair-sums  a LayerNorm backward row's two sums as one two-operand reduction
                (rowwise.LN_BWD_PAIR_SUMS: one cross-warp exchange a row, not two; the
                same combine tree, so the losses should be bit-identical)
  ln-hoist      a fused LayerNorm backward's row-invariant prologue operands (a bias, the
                LayerNorm's weight and bias) loaded once before its rows
                (rowwise.LN_BWD_HOIST_INVARIANTS; the same values: bit-identical; shipped
                since a6abd7d, so now the same as tile-grid)
  ln-hoist-pair both of the above
  ln-hoist-off  those operands loaded every row (the step before a6abd7d)
  stream-k      split-K weight gradients as stream-K in lockstep bands (matmul.STREAM_K_SPLIT,
                STREAM_K_LOCKSTEP: groups of programs walk the same K range, as a split's waves do;
                shipped since 0b44727, so now the same as tile-grid)
  stream-k-off  the split kernel and its reduction instead (the step before 0b44727)
  stream-k-all  the same, and the one-wave splits the model gains little on (768x2304) too
                (configurator.ONE_WAVE_SPLIT_MIN_GAIN 0)
  stream-k-contiguous  stream-K's first form: contiguous shares of the tile-major iterations
                (measured slower at 4c64f5c)
  transpose-matmul-on  the transpose_matmul stage on: the weight gradients as products in their
                parameters' layout, not transposed ones the optimizer reads across rows
  lce-stats     the LM head's row statistics from the logits matmul's epilogue: the row kernel
                reads each chunk's logits once (linear_ce.ROW_STATS_FROM_LOGITS; shipped for 16-bit
                heads since 0b44727, so now the same as tile-grid at bf16)
  lce-stats-off the two-pass row kernel instead (the step before 0b44727)
  lce-stats-nows  the same, the logits in the 8-warp persistent kernel, not the warp-specialized one
  lce-d-prologue  the LM head's d formed by dh's and dw's operand prologues from the logits, not
                written by the row kernel (linear_ce.D_PROLOGUE; built 2026-12-06, ninth session, off)

    python scripts/epilogue_variants.py [--layers 2] [--batch 32] [--variants a,b] [--graph] [--out DIR]

Prints, per variant, the step's measured kernel time and the matmul launches grouped
by (result type, schedule, ops in the kernel), and whether the losses of every variant
are bit-identical to the first's. Needs CUDA. The run at d5443cd (2 layers):
bench/results/runs/epilogue_variants_d5443cd.json."""
from __future__ import annotations

import argparse
import importlib
import collections
import json
import os
import subprocess
import sys
from pathlib import Path

VARIANTS = ("tile-grid", "persistent", "tile-grid-light", "persistent-light", "tile-grid-nobackward",
            "tile-grid-noresidual", "ws-off", "ws-plain", "ws-epi128", "ws-epi256", "two-pass-split",
            "casts-unbatched", "last-split-sums", "row-stores-off", "norm-recompute-off", "ln-pair-sums",
            "ln-hoist", "ln-hoist-pair", "ln-hoist-off", "attention-sums-off", "attn-sums-dq-dot", "stream-k",
            "stream-k-all", "stream-k-contiguous", "stream-k-off", "transpose-matmul-on", "lce-stats", "lce-stats-nows",
            "lce-stats-off", "lce-d-prologue")
# each ws variant's changes to configurator.WS_TILES
WS_VARIANTS = {"ws-off": {"plain": None, "epilogue": None}, "ws-plain": {"epilogue": None},
               "ws-epi128": {"epilogue": (128, 128, 4)}, "ws-epi256": {"epilogue": (128, 256, 4)}}
# NAME:VALUE variants that set one module switch: NAME -> (module, attribute, the value's type)
NUMBER_SWITCHES = {
    "split-gain": ("nova.schedule.configurator", "ONE_WAVE_SPLIT_MIN_GAIN", float),
    "recasts": ("nova.transforms.fuse", "RECAST_BATCH", int),
    "colregs": ("nova.schedule.configurator", "COLUMN_PROGRAM_REGS", int),
    "colstages": ("nova.codegen.triton.reduce", "COLUMN_STAGES", int),
    "ln-bwd-stages": ("nova.codegen.triton.rowwise", "LN_BWD_ROW_STAGES", int),
    "ln-fwd-rows": ("nova.codegen.triton.rowwise", "LN_FWD_PROGRAMS_PER_SM", int),
}
KEPT_OUT_ABOVE = {"light": 4, "nobackward": 8}  # variant suffix -> FLOPs an element an epilogue op may cost


def apply_variant(variant: str) -> None:
    """Patches the configurator and the fuse stage of this process as ``variant`` says."""
    from nova.schedule import configurator as cf, cost
    from nova.transforms import fuse as fz

    cf.PERSISTENT_EPILOGUES = variant.startswith("persistent")
    cf.WS_TILES.update(WS_VARIANTS.get(variant, {}))
    if variant == "casts-unbatched":
        fz.BATCH_OPERAND_CASTS = False
    if variant == "row-stores-off":
        fz.ROW_PROLOGUE_STORES = False
    if variant in ("row-stores-off", "norm-recompute-off"):
        from nova import pipeline

        pipeline.STAGES[:] = [s for s in pipeline.STAGES if s[0] != "norm_recompute"]
    if variant == "transpose-matmul-on":  # weight gradients in their parameters' layout (built 2026-12-05, sixth)
        from nova.transforms import transpose_matmul

        transpose_matmul.ENABLED = True
    if variant in ("lce-stats", "lce-stats-nows", "lce-stats-off"):  # the LM head's row statistics from the
        from nova.codegen.triton import linear_ce  # logits' epilogue (built 2026-12-05, seventh session; on since eighth)

        linear_ce.ROW_STATS_FROM_LOGITS = variant != "lce-stats-off"
        linear_ce.ROW_STATS_WS = variant != "lce-stats-nows"
    if variant == "lce-d-prologue":  # d in dh's and dw's prologues (built 2026-12-06, ninth session, off)
        from nova.codegen.triton import linear_ce

        linear_ce.D_PROLOGUE = True
    if variant == "attention-sums-off":  # the qkv bias gradient as a reduction of its own (before 2026-12-05)
        from nova import pipeline

        pipeline.STAGES[:] = [s for s in pipeline.STAGES if s[0] != "attention_sums"]
    if variant in ("ln-pair-sums", "ln-hoist-pair"):
        from nova.codegen.triton import rowwise

        rowwise.LN_BWD_PAIR_SUMS = True
    if variant in ("ln-hoist", "ln-hoist-pair", "ln-hoist-off"):
        from nova.codegen.triton import rowwise

        rowwise.LN_BWD_HOIST_INVARIANTS = variant != "ln-hoist-off"
    if variant == "last-split-sums":
        from nova.codegen.triton import matmul as mm

        mm.LAST_SPLIT_SUMS = True
    if variant == "attn-sums-dq-dot":  # the dK/dV kernel's column sums by tl.sum (its occupancy is the same)
        from nova.codegen.triton import attention

        attention.SUMS_BY_DOT = frozenset({"dq"})
    if variant in ("stream-k", "stream-k-all", "stream-k-contiguous", "stream-k-off"):
        from nova.codegen.triton import matmul as mm

        mm.STREAM_K_SPLIT = variant != "stream-k-off"  # (on as shipped since 0b44727: matmul.STREAM_K_SPLIT)
        mm.STREAM_K_LOCKSTEP = variant != "stream-k-contiguous"
    if variant == "stream-k-all":  # and the one-wave splits the model gains little on (768x2304) as stream-K too
        cf.ONE_WAVE_SPLIT_MIN_GAIN = 0.0
    if variant == "two-pass-split":
        from nova.codegen.triton import matmul as mm

        mm.SERIAL_SPLIT = False
    if variant.startswith("ws-epi"):
        from nova.codegen.triton import matmul as mm

        mm.WS_EPILOGUES = True  # (off as shipped: NaNs on the H200, matmul.WS_EPILOGUES)
    if variant.startswith("tile:"):
        import dataclasses

        over: dict = {}
        for f in variant.split(":")[1:]:
            if "x" in f:
                over["block_m"], over["block_n"] = map(int, f.split("x"))
            elif f == "p":
                over["persistent"] = True
            elif f == "np":
                over["persistent"] = False
            elif f == "nows":
                over["nows"] = True
            else:
                over[{"s": "num_stages", "w": "num_warps", "g": "group_m"}[f[0]]] = int(f[1:])
        shipped = cf.configure_matmul

        def configure_matmul(*a, **k):
            cfg = shipped(*a, **k)
            epilogue = k.get("epilogue", a[12] if len(a) > 12 else False)  # keywords from configure.configure_op, else positional
            if not epilogue:
                return cfg
            fields = {name: value for name, value in over.items() if name != "nows"}
            if over.get("nows"):  # the unpartitioned kernel: the config without warp specialization
                fields["instruction"] = cfg.instruction.replace("+ws", "")
            return dataclasses.replace(cfg, **fields)
        cf.configure_matmul = configure_matmul
    if variant.startswith("splitk:"):
        import dataclasses

        splits = int(variant.split(":")[1])
        if splits < 2:
            raise SystemExit(f"epilogue_variants: {variant}: a split-K variant needs N >= 2")
        planned = cf.configure_matmul

        def configure_split(*a, **k):
            cfg = planned(*a, **k)
            return dataclasses.replace(cfg, split_k=splits) if cfg.split_k > 1 else cfg
        cf.configure_matmul = configure_split
    column: dict = {}  # the column reductions' configurator fields these variants replace
    fields = [int(f) for f in variant.split(":")[1:]] if variant.startswith(("colblock:", "coltile:", "colsplit:")) else []
    if variant.startswith("colblock:"):
        column = {"block": fields[0], **({"split_k": fields[1]} if len(fields) > 1 else {})}
    if variant.startswith("coltile:"):
        from nova.codegen.triton import reduce as rd

        rd.TILE = 16 * fields[0]
        column = {"block": fields[0], "num_warps": fields[1]}
    if variant.startswith("colsplit:"):
        column = {"split_k": fields[0]}
    if column:
        import dataclasses

        shipped_column = cf.configure_column_reduction
        cf.configure_column_reduction = lambda *a, **k: dataclasses.replace(shipped_column(*a, **k), **column)
    name, _, value = variant.partition(":")
    if name in NUMBER_SWITCHES:
        module, attr, kind = NUMBER_SWITCHES[name]
        setattr(importlib.import_module(module), attr, kind(value))
    limit = KEPT_OUT_ABOVE.get(variant.rsplit("-", 1)[-1])
    kept_out = None
    if limit is not None:
        def kept_out(m):
            return cost._ELEMENTWISE_FLOPS.get(type(m), 1) > limit
    if variant.endswith("-noresidual"):
        from nova.ir import dialect as nv
        from nova.ir.types import elem_of, shape_of

        def kept_out(m):  # a residual add: f32, both operands the full shape, neither a broadcast (a bias)
            full = shape_of(m.results[0].type) if isinstance(m, nv.AddOp) else None
            return (full is not None and str(elem_of(m.results[0].type)) == "f32"
                    and all(shape_of(v.type) == full and not isinstance(v.owner, nv.BroadcastToOp) for v in m.operands))
    if kept_out is not None:
        real = fz._Grouping._producer

        def producer(self, w, node):
            found = real(self, w, node)
            if found is not None and found[0].kind == "contraction" and any(kept_out(m) for m in node.members):
                return None
            if found is not None and node.kind == "contraction" and any(kept_out(m) for m in found[0].members):
                return None
            if (found is not None and found[0].kind == "contraction" and len(node.members) == 1
                    and fz._itemsize(node.members[0].results[0]) > fz._itemsize(w)
                    and all(kept_out(u.operation) for u in node.members[0].results[0].uses)):  # fmt: skip
                return None  # a widening cast only kept-out ops read: with them (the matmul stores bf16)
            return found
        fz._Grouping._producer = producer


def graph_steps(step, batches, steps: int = 20) -> dict:
    """The compiled step as ``nova bench gpt2`` times it: ``steps`` calls back to back (a CUDA
    graph replay each), each between CUDA events, NVML's SM clock, power and energy counter
    sampled meanwhile. Under the H200's power cap the whole step's energy sets the clock, which
    timing each kernel alone (``step.profile()``) does not see."""
    import statistics

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench.timing import median_or_none, reason_shares, sampled

    starts = [torch.cuda.Event(enable_timing=True) for _ in range(steps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(steps)]

    def window():
        for i in range(steps):
            starts[i].record()
            step(*batches[i % len(batches)])
            ends[i].record()
        torch.cuda.synchronize()

    masks: list[int] = []
    energy: dict = {}
    clocks, power = sampled(window, reasons=masks, energy=energy)
    ms = statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))
    return {"step_ms_median": ms, "sm_clock_mhz_median": median_or_none(clocks), "power_w_median": median_or_none(power),
            "joules_per_step": energy["joules"] / steps if energy.get("joules") is not None else None,
            "clock_event_reasons": reason_shares(masks)}


def child(variant: str, layers: int, batch: int, graph: bool = False) -> dict:
    os.environ["NOVA_STEP_CACHE"] = "0"
    import torch

    import nova
    from nova.models import GPT, GPTConfig

    apply_variant(variant)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=50304, block_size=1024, n_layer=layers, n_head=12, n_embd=768)
    with torch.device("cuda"):
        model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step = nova.compile(model, opt, precision="bf16")
    g = torch.Generator(device="cuda").manual_seed(1)
    batches = [(torch.randint(0, 50304, (batch, 1024), device="cuda", generator=g),
                torch.randint(0, 50304, (batch, 1024), device="cuda", generator=g)) for _ in range(4)]
    losses = [step(*b).item() for b in batches]
    timed = graph_steps(step, batches) if graph else {}
    m = step.profile(repeat=3)
    rows = collections.defaultdict(lambda: [0, 0.0])
    for k, t in zip(m.kernels, m.measured_s):
        # every launch (the LM head's, the gathers' and the executable's copies too: until 2026-12-05
        # only five kinds were kept, so the tables' sums left the LM head's ~10 ms out)
        key = f"{k.kind:11s} {k.shape:32s} {k.config:36s} ops {k.ops}"
        rows[key][0] += 1
        rows[key][1] += t * 1e3
    return {"variant": variant, "losses": losses, "total_ms": m.total_s * 1e3, **timed,
            "rows": {k: v for k, v in sorted(rows.items(), key=lambda kv: -kv[1][1])}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--child")
    ap.add_argument("--graph", action="store_true",
                    help="also time 20 steps as nova bench gpt2 does (CUDA graph replays, clock, power, energy)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of " + " ".join(VARIANTS))
    opts = ap.parse_args()
    if opts.child:
        print("RESULT " + json.dumps(child(opts.child, opts.layers, opts.batch, opts.graph)))
        return
    results = []
    for v in opts.variants.split(","):
        name, sep, _ = v.partition(":")
        if v not in VARIANTS and not (sep and name in ("tile", "colsplit", "colblock", "coltile", "splitk", *NUMBER_SWITCHES)):
            raise SystemExit(f"epilogue_variants: unknown variant {v!r} (known: {', '.join(VARIANTS)})")
        run = subprocess.run([sys.executable, __file__, "--child", v, "--layers", str(opts.layers),
                              "--batch", str(opts.batch)] + (["--graph"] if opts.graph else []),
                             capture_output=True, text=True, timeout=400)
        line = next((ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            print(f"== {v}: failed\n{run.stderr[-3000:]}")
            continue
        r = json.loads(line[7:])
        results.append(r)
        same = r["losses"] == results[0]["losses"]
        print(f"== {v}: kernels {r['total_ms']:.2f} ms; losses {r['losses']} (bit-identical to {results[0]['variant']}: {same})")
        if opts.graph:
            print(f"   graph step {r['step_ms_median']:.2f} ms median, {r['sm_clock_mhz_median']} MHz, "
                  f"{r['power_w_median']} W, {r['joules_per_step']:.2f} J a step, {r['clock_event_reasons']}")
        for k, (n, ms) in list(r["rows"].items())[:14]:
            print(f"   {ms:8.3f} ms {n:3d}x  {k}")
    opts.out.mkdir(parents=True, exist_ok=True)
    import torch
    import triton

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    doc = {"commit": os.environ.get("NOVA_COMMIT", "unknown"), "device": device, "torch": torch.__version__,
           "triton": triton.__version__, "layers": opts.layers, "batch": opts.batch, "variants": results}
    (opts.out / "epilogue_variants.json").write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
