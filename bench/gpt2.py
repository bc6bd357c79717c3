"""``nova bench gpt2``: GPT-2 training steps in PyTorch eager, torch.compile and Nova,
side by side in one process.

    nova bench gpt2 --model 124m --precision bf16 --batch 32

Every engine trains the same ``nova.models.GPT`` (same code, same initial weights,
copied from one CPU state dict) on the same random token batches (a seeded
generator, re-seeded per engine), one step = forward + backward + AdamW update:

* eager:          model(x, y).backward(); opt.step()  (bf16: torch.autocast; tf32:
                  torch.backends.cuda.matmul.allow_tf32; AdamW fused=True on CUDA)
* torch.compile:  the same with torch.compile(model) (default mode)
* nova:           nova.compile(model, opt, precision=..., backend="triton")
                  (--dry-run: backend="reference")

Engines run one after another; before each, the previous engine's model, optimizer
state and compiled step are freed and the CUDA cache emptied, so each engine's peak
(torch.cuda.max_memory_allocated after reset_peak_memory_stats) is its own. The first
``--warmup`` steps are excluded from timing; the first step's wall time is the cold
compile time (torch.compile, nova), with Nova's, Triton's and Inductor's on-disk
caches in a new empty directory (--no-fresh-caches keeps the environment's). Warm
compile time: the first step of a fresh copy compiled again in the same process
(torch.compile after torch._dynamo.reset(), so only the caches below dynamo, filled
by the cold compile, are warm). Each timed step is
bracketed by CUDA events, the stream is synchronized once after the timed window,
and tok/s = batch * seq / median step time. Losses are read after the window too;
``max_rel_loss_diff`` is the largest |loss - eager loss| / |eager loss| over the
timed steps. With ``--cap-gib N`` the process is capped by
torch.cuda.set_per_process_memory_fraction; an engine that runs out of memory is a
row with oom=true and the next engine still runs (if eager is the one, its reference
losses are recomputed without the cap, and the document says so).

--dry-run: a tiny GPT on the CPU, eager and Nova's reference backend (torch.compile
only if named in --engines: its CPU compile takes ~20 s), wall-clock timing; the
numbers are no claims, the outputs are complete.

--nproc N: data parallelism over N processes, launched through torchrun
(``torch.distributed.run --standalone``: a free port, one host; under torchrun
already, the ranks come from its environment, so multi-node launches work too).
Each rank trains on its own batches (the generator seeded with seed + 1 + 1000 *
rank), eager and torch.compile inside DistributedDataParallel (defaults: 25 MB
buckets), Nova with ``data_parallel=--data-parallel`` (ddp or zero1); NCCL on
GPUs (one per rank, cuda:LOCAL_RANK), gloo for --dry-run. tok/s counts every
rank's tokens (N * batch * seq per step), the losses and peaks are rank 0's, and
rank 0 writes the results. Under ``torchrun --nproc-per-node 1`` (not --nproc 1, which is one plain
process) the same over one rank: every engine's cost of data parallelism where no link is crossed.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import importlib.metadata
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python bench/gpt2.py` from a checkout without an install
    sys.path.insert(0, str(REPO))

import nova  # noqa: E402
from bench.timing import median_or_none, reason_shares, sampled  # noqa: E402
from nova.cli.bench import apply_switches  # noqa: E402
from nova.cli.errors import RunFailed, UsageError  # noqa: E402
from nova.models import GPT, MLPLM, GPTConfig, MLPLMConfig  # noqa: E402

ENGINES = ("eager", "torch.compile", "nova")
SHORT = {"eager": "eager", "torch.compile": "compile", "nova": "nova"}
COLORS = {"eager": "#888888", "torch.compile": "#4c72b0", "nova": "#dd8452"}
PRECISIONS = ("fp32", "tf32", "bf16")
# (layers, heads, width): GPT-2 small and medium
PRESETS = {"124m": (12, 12, 768), "355m": (24, 16, 1024)}
# the Nova paper's MLP-only LM (nova.models.mlp_lm): 6 x (LN, 384->1536, GELU, 1536->384), vocab 50304, untied
MLP_PRESETS = {"mlp46m": (6, 384)}
DRY = dict(layers=2, heads=4, width=64, vocab=256, seq=32, batch=2, steps=3, warmup=1)
DEFAULTS = dict(vocab=50304, seq=1024, batch=8, steps=20, warmup=3)
ADAMW = dict(lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)
DIST = {"world": 1, "rank": 0, "dp": False}  # under torchrun: this process's place in the job (_init_distributed)
GIB = 2**30
_OOM = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError


# --------------------------------------------------------------------------- config


def resolve(opts) -> dict:
    """The run's configuration: explicit options win, then --dry-run's tiny sizes,
    then the --model preset (default 124m)."""
    model = opts.model or (None if opts.dry_run else "124m")
    arch = "mlp" if model in MLP_PRESETS else "gpt"
    if arch == "mlp":
        (layers, width), heads = MLP_PRESETS[model], 1  # no attention: heads only keeps the checks below uniform
    else:
        layers, heads, width = PRESETS[model] if model else (None, None, None)
    base = dict(DEFAULTS, layers=layers, heads=heads, width=width)
    if opts.dry_run and not opts.model:
        base.update(DRY)
    cfg = {k: getattr(opts, k) if getattr(opts, k) is not None else base[k] for k in base}
    if cfg["warmup"] < 1:
        raise UsageError("--warmup must be at least 1 (the first step compiles and is never timed)")
    if cfg["steps"] < 1:
        raise UsageError("--steps must be at least 1")
    if cfg["width"] % cfg["heads"]:
        raise UsageError(f"--width {cfg['width']} is not divisible by --heads {cfg['heads']}")
    if arch == "mlp":
        preset = model if (cfg["layers"], cfg["width"]) == MLP_PRESETS[model] else None
        label = preset or f"mlp_l{cfg['layers']}w{cfg['width']}"
    else:
        preset = next((n for n, p in PRESETS.items() if p == (cfg["layers"], cfg["heads"], cfg["width"])), None)
        label = preset or f"l{cfg['layers']}w{cfg['width']}h{cfg['heads']}"
    cfg["arch"] = arch
    if cfg["vocab"] != DEFAULTS["vocab"]:
        label += f"_v{cfg['vocab']}"
    cfg.update(nproc=DIST["world"], data_parallel=getattr(opts, "data_parallel", "ddp") if DIST["dp"] else None)
    cfg.update(model=label, precision=opts.precision, cap_gib=opts.cap_gib, seed=opts.seed,
               engines=list(opts.engines or (("eager", "nova") if opts.dry_run else ENGINES)))
    return cfg


def result_stem(cfg: dict, dry_run: bool) -> str:
    family = "mlp_lm" if cfg.get("arch") == "mlp" else "gpt2"
    stem = f"{family}_{'dry_' if dry_run else ''}{cfg['model']}_{cfg['precision']}_b{cfg['batch']}"
    if cfg["seq"] != DEFAULTS["seq"]:
        stem += f"_t{cfg['seq']}"
    if cfg["cap_gib"]:
        stem += f"_cap{cfg['cap_gib']:g}"
    if list(cfg["engines"]) != list(ENGINES) and not dry_run:
        stem += "_" + "-".join(SHORT[e] for e in cfg["engines"])
    if cfg.get("data_parallel"):
        stem += f"_np{cfg['nproc']}_{cfg['data_parallel']}"
    if cfg.get("switches"):  # a variant (--set): its own file, never the shipped step's
        stem += "_sw" + hashlib.sha256(json.dumps(cfg["switches"], sort_keys=True).encode()).hexdigest()[:8]
    return stem


def gpt_config(cfg: dict) -> GPTConfig:
    return GPTConfig(vocab_size=cfg["vocab"], block_size=cfg["seq"], n_layer=cfg["layers"],
                     n_head=cfg["heads"], n_embd=cfg["width"])


def new_model(cfg: dict) -> torch.nn.Module:
    """The run's model: a GPT, or with --model mlp46m the paper's MLP LM (hidden 4 x width)."""
    if cfg.get("arch") == "mlp":
        return MLPLM(MLPLMConfig(vocab_size=cfg["vocab"], block_size=cfg["seq"], n_layer=cfg["layers"],
                                 n_embd=cfg["width"]))
    return GPT(gpt_config(cfg))


# --------------------------------------------------------------------------- engines


class Batches:
    """Random token ids (never zeros), the same sequence for every engine: x is a
    random sequence, y the same sequence shifted by one (next-token targets)."""

    def __init__(self, cfg: dict, device: torch.device):
        self.cfg, self.device = cfg, device
        self.gen = torch.Generator(device=device)

    def reset(self) -> None:
        self.gen.manual_seed(self.cfg["seed"] + 1 + 1000 * DIST["rank"])  # each rank its own batches

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cfg
        t = torch.randint(0, c["vocab"], (c["batch"], c["seq"] + 1), device=self.device, generator=self.gen)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def _flags(precision: str, engine: str):
    """Global matmul flags: tf32 for eager/torch.compile at tf32; Nova takes its
    precision as an argument, so it runs with the flags off."""
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32" and engine != "nova"
    torch.backends.cudnn.allow_tf32 = precision == "tf32" and engine != "nova"


def build(engine: str, cfg: dict, state: dict, device: torch.device, dry_run: bool):
    """(model, optimizer, step) for one engine, from the shared initial weights."""
    with torch.device(device):
        model = new_model(cfg)
    model.load_state_dict(state)  # copies into the existing (tied) parameters
    opt = torch.optim.AdamW(model.parameters(), **ADAMW, fused=device.type == "cuda")
    if engine == "nova":
        step = nova.compile(model, opt, precision=cfg["precision"], backend="reference" if dry_run else "triton",
                            data_parallel=cfg.get("data_parallel"))
        return model, opt, step
    fwd = model
    if DIST["dp"]:
        from torch.nn.parallel import DistributedDataParallel

        fwd = DistributedDataParallel(model, device_ids=[_index(device)] if device.type == "cuda" else None)
    fwd = torch.compile(fwd) if engine == "torch.compile" else fwd
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if cfg["precision"] == "bf16" else nullcontext())

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        with autocast:
            loss = fwd(x, y)
        loss.backward()
        opt.step()
        return loss.detach()

    return model, opt, step


def _is_oom(e: BaseException | None) -> bool:
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, _OOM) or "out of memory" in str(e).lower():
            return True
        e = e.__cause__ or e.__context__
    return False


def _index(device: torch.device) -> int:
    """The CUDA device's index (set_per_process_memory_fraction refuses a bare 'cuda')."""
    return device.index if device.index is not None else torch.cuda.current_device()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _compile_summary(report: dict) -> str:
    """One line of ``Step.compile_report``: the pipeline, its three slowest stages, the
    lowering and the kernels compiled ahead."""
    slow = sorted(report["stages"].items(), key=lambda kv: -kv[1])[:3]
    ahead = report["ahead"]
    text = (f"pipeline {report['pipeline']:.1f} s (" + ", ".join(f"{k} {v:.1f}" for k, v in slow) + f"), lower "
            f"{report['lower']:.1f} s, step cache {report['cache']}")
    if ahead:
        text += (f", {ahead['kernels']} kernels and {ahead.get('launchers', 0)} launchers compiled ahead on "
                 f"{ahead['threads']} threads in {ahead['seconds']:.1f} s")
    return text


def _first_step_s(engine, cfg, state, device, batches, dry_run) -> tuple[float, float]:
    """A fresh copy compiled again in this process: (seconds of its first step, its loss)."""
    if engine == "torch.compile":
        torch._dynamo.reset()
    model, opt, step = build(engine, cfg, state, device, dry_run)
    batches.reset()
    x, y = batches.next()
    _sync(device)
    t0 = time.perf_counter()
    loss = step(x, y)
    _sync(device)
    return time.perf_counter() - t0, float(loss)


def _host_ms(step, batches: Batches, device: torch.device, n: int = 10) -> float:
    """The CPU wall time of one call with the batch already on the device and the
    device idle before it (median of ``n`` calls after the timed window): what the
    host spends per step, whatever the GPU does."""
    walls = []
    for _ in range(n):
        x, y = batches.next()
        _sync(device)
        t0 = time.perf_counter()
        step(x, y)
        walls.append((time.perf_counter() - t0) * 1e3)
    _sync(device)
    return statistics.median(walls)


def measure(engine: str, cfg: dict, state: dict, device: torch.device, batches: Batches, dry_run: bool,
            log, warm_compile: bool = True) -> dict:
    """One engine's row: every step's loss and (after warm-up) time, peak memory,
    compile times. Out of memory is a result (oom=true), another error is recorded."""
    row = dict(engine=engine, precision=cfg["precision"], batch=cfg["batch"], seq=cfg["seq"], layers=cfg["layers"],
               width=cfg["width"], heads=cfg["heads"], tok_s=None, step_ms_median=None, host_ms=None, peak_gib=None,
               peak_timed_gib=None, baseline_gib=None, compile_s=None, compile_warm_s=None, first_step_s=None,
               oom=False, error=None, max_rel_loss_diff=None, losses=[], step_ms=[], sm_clock_mhz_median=None,
               power_w_median=None, clock_event_reasons={}, joules_per_step=None)
    cuda = device.type == "cuda"
    _flags(cfg["precision"], engine)
    _free(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        row["baseline_gib"] = torch.cuda.memory_allocated(device) / GIB
    n_steps = cfg["warmup"] + cfg["steps"]
    losses, peak_before = [], None
    try:
        model, opt, step = build(engine, cfg, state, device, dry_run)
        batches.reset()
        for i in range(cfg["warmup"]):
            x, y = batches.next()
            _sync(device)
            t0 = time.perf_counter()
            losses.append(step(x, y))
            _sync(device)
            if i == 0:
                row["first_step_s"] = time.perf_counter() - t0
                log(f"  {engine}: first step {row['first_step_s']:.2f} s")
                if engine == "nova":  # where the cold compile went: stages, lowering, kernels compiled ahead
                    row["compile_report"] = step.compile_report
                    log(f"  nova: compile report {_compile_summary(step.compile_report)}")
        if cuda:
            peak_before = torch.cuda.max_memory_allocated(device)  # compile and warm-up
            torch.cuda.reset_peak_memory_stats(device)  # the timed window's own peak, below
            starts = [torch.cuda.Event(enable_timing=True) for _ in range(cfg["steps"])]
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(cfg["steps"])]
        walls = []

        def window():
            for i in range(cfg["steps"]):
                x, y = batches.next()
                if cuda:
                    starts[i].record()
                else:
                    t0 = time.perf_counter()
                losses.append(step(x, y))
                if cuda:
                    ends[i].record()
                else:
                    walls.append((time.perf_counter() - t0) * 1e3)
            _sync(device)  # once per timed window

        masks: list[int] = []
        energy: dict = {}
        clocks, power = sampled(window, reasons=masks, energy=energy)  # the SM clock and power meanwhile (NVML)
        row["clock_event_reasons"] = reason_shares(masks)  # why the clock was below its maximum: sample shares
        # the device's energy a timed step (its counter over the window): what a power cap rations
        row["joules_per_step"] = energy["joules"] / cfg["steps"] if energy.get("joules") is not None else None
        row["sm_clock_mhz_median"], row["power_w_median"] = median_or_none(clocks), median_or_none(power)
        row["step_ms"] = [s.elapsed_time(e) for s, e in zip(starts, ends)] if cuda else walls
        row["losses"] = [float(v) for v in losses]
        assert len(row["losses"]) == n_steps
        row["host_ms"] = _host_ms(step, batches, device)
        if engine == "nova":
            row["predicted_peak_gib"] = step.memory_plan.peak_bytes / GIB
            row["mode"] = step.mode
    except Exception as e:  # noqa: BLE001 - an engine's failure is a result; the next engine runs
        row["oom"] = _is_oom(e)
        row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:400] if str(e).strip() else ''}"
        log(f"  {engine}: {'OUT OF MEMORY' if row['oom'] else 'FAILED'}: {row['error']}")
        if not row["oom"]:
            log(traceback.format_exc())
    finally:
        if cuda:
            # the whole run's peak (compile included) is the larger of the two periods
            last = torch.cuda.max_memory_allocated(device)
            row["peak_gib"] = max(peak_before if peak_before is not None else 0, last) / GIB
            if peak_before is not None and row["error"] is None:
                row["peak_timed_gib"] = last / GIB
        model = opt = step = losses = None  # noqa: F841 - free before the next engine
        if engine == "torch.compile":
            torch._dynamo.reset()
        _free(device)
    if row["error"] is None:
        # every rank's tokens: the ranks step together
        row["tok_s"] = DIST["world"] * cfg["batch"] * cfg["seq"] / (statistics.median(row["step_ms"]) / 1e3)
        row["step_ms_median"] = statistics.median(row["step_ms"])
        if engine != "eager":
            row["compile_s"] = row["first_step_s"]
            if warm_compile:
                try:
                    row["compile_warm_s"], warm_loss = _first_step_s(engine, cfg, state, device, batches, dry_run)
                    row["warm_first_loss"] = warm_loss
                except Exception as e:  # noqa: BLE001
                    row["compile_warm_error"] = f"{type(e).__name__}: {str(e)[:400]}"
                    log(f"  {engine}: warm compile failed: {row['compile_warm_error']}")
                finally:
                    if engine == "torch.compile":
                        torch._dynamo.reset()
                    _free(device)
    return row


# --------------------------------------------------------------------------- the run


def _clean(x):
    """Strict JSON: a NaN or infinity (a diverged loss) becomes null."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


CACHE_VARS = ("NOVA_CACHE_DIR", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")


@contextmanager
def fresh_caches(enabled: bool):
    """Nova's, Triton's and Inductor's on-disk caches in a new empty directory for the
    run, so the first compile is cold even on a machine that compiled these kernels
    before (the warm compile then sees only what this run cached)."""
    if not enabled:
        yield None
        return
    saved = {k: os.environ.get(k) for k in CACHE_VARS}
    root = Path(tempfile.mkdtemp(prefix="nova-bench-gpt2-caches-"))
    os.environ.update({k: str(root / k.split("_")[0].lower()) for k in CACHE_VARS})
    try:
        yield str(root)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(root, ignore_errors=True)


def compare(rows: list[dict], reference: list[float] | None, warmup: int) -> None:
    """max |loss - eager| / |eager| over the timed steps, for every row that ran."""
    if not reference:
        return
    for r in rows:
        if r["error"] is None and len(r["losses"]) == len(reference):
            diffs = [abs(a - b) / abs(b) for a, b in zip(r["losses"][warmup:], reference[warmup:])]
            r["max_rel_loss_diff"] = max(diffs) if all(map(math.isfinite, diffs)) else None
            r["nonfinite_loss"] = not all(map(math.isfinite, diffs))


def run(opts, log=print) -> dict:
    cfg = resolve(opts)
    cfg["switches"] = apply_switches(list(getattr(opts, "set", None) or []))
    if cfg["switches"]:
        log("Nova's switches changed for this run: " + ", ".join(f"{k}={v}" for k, v in cfg["switches"].items()))
    device = torch.device("cpu" if opts.dry_run else "cuda")
    if DIST["dp"] and device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    started = time.perf_counter()
    torch.manual_seed(cfg["seed"])
    state = {k: v.clone() for k, v in new_model(cfg).state_dict().items()}  # on the CPU, shared by all
    n_params = sum(v.numel() for k, v in state.items() if k != "lm_head.weight")  # GPT's is tied to wte
    what = "MLP LM" if cfg["arch"] == "mlp" else "GPT"
    log(f"{what} {cfg['model']}: {cfg['layers']} layers, {cfg['heads']} heads, width {cfg['width']}, vocab {cfg['vocab']}, "
        f"{n_params / 1e6:.1f}M parameters; {cfg['precision']}, batch {cfg['batch']} x {cfg['seq']}; "
        f"{cfg['warmup']} warm-up + {cfg['steps']} timed steps; engines {', '.join(cfg['engines'])}")
    if cfg["cap_gib"] and device.type == "cuda":
        total = torch.cuda.get_device_properties(_index(device)).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cfg["cap_gib"] * GIB / total), _index(device))
        log(f"memory capped at {cfg['cap_gib']:g} GiB of {total / GIB:.1f}")
    elif cfg["cap_gib"]:
        log("--cap-gib is not applied on the CPU")
    batches = Batches(cfg, device)
    rows = []
    for engine in cfg["engines"]:
        log(f"{engine} ...")
        rows.append(measure(engine, cfg, state, device, batches, opts.dry_run, log))
        r = rows[-1]
        if r["error"] is None:
            log(f"  {engine}: {r['tok_s']:,.0f} tok/s, {r['step_ms_median']:.1f} ms/step"
                + (f", peak {r['peak_gib']:.2f} GiB" if r["peak_gib"] is not None else "")
                + (f", compile {r['compile_s']:.1f} s cold / {r['compile_warm_s']:.1f} s warm"
                   if r["compile_warm_s"] is not None else ""))
    reference, reference_note = None, None
    eager = next((r for r in rows if r["engine"] == "eager"), None)
    if eager is not None and eager["error"] is None:
        reference, reference_note = eager["losses"], "eager, this run"
    elif eager is not None and eager["oom"] and cfg["cap_gib"] and device.type == "cuda":
        log("eager ran out of memory under the cap: its reference losses again, uncapped ...")
        torch.cuda.set_per_process_memory_fraction(1.0, _index(device))
        ref = measure("eager", cfg, state, device, batches, opts.dry_run, log, warm_compile=False)
        if ref["error"] is None:
            reference, reference_note = ref["losses"], "eager without the memory cap (it ran out of memory under it)"
    compare([r for r in rows if r["engine"] != "eager"], reference, cfg["warmup"])
    if eager is not None and reference is eager["losses"]:
        eager["max_rel_loss_diff"] = 0.0
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    return {
        "benchmark": "gpt2",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda"
        else "cpu (dry run: Nova's reference backend; timings are no claims)",
        "dry_run": bool(opts.dry_run),
        "versions": {"torch": torch.__version__, "triton": _installed("triton"), "python": platform.python_version(),
                     "nova": nova.__version__},
        "commit": _commit(),
        "config": dict(cfg, n_params=n_params, optimizer=dict(ADAMW, name="AdamW", fused=device.type == "cuda"),
                       timing="CUDA events per step, one synchronize per timed window, median" if device.type == "cuda"
                       else "wall clock per step (CPU), median"),
        "loss_reference": reference_note,
        "reference_losses": _clean(reference) if reference else None,
        "seconds": time.perf_counter() - started,
        "rows": _clean(rows),
    }


def _installed(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _commit() -> str:
    if os.environ.get("NOVA_COMMIT"):  # the device machine's copy of the tree may carry a stale .git
        return os.environ["NOVA_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# --------------------------------------------------------------------------- output


def summary(doc: dict) -> str:
    lines = [f"{'engine':<14} {'tok/s':>10} {'ms/step':>9} {'peak GiB':>9} {'compile s':>10} {'warm s':>8} "
             f"{'max rel loss diff':>18} {'host ms':>8} {'predicted GiB':>13} {'SM MHz':>7} {'W':>5} {'J/step':>7}"
             "  clock held by"]
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    for r in doc["rows"]:
        tok = "OOM" if r["oom"] else "error" if r["error"] else fmt(r["tok_s"], ",.0f")
        lines.append(f"{r['engine']:<14} {tok:>10} {fmt(r['step_ms_median'], '.1f'):>9} {fmt(r['peak_gib'], '.2f'):>9} "
                     f"{fmt(r['compile_s'], '.1f'):>10} {fmt(r['compile_warm_s'], '.1f'):>8} "
                     f"{fmt(r['max_rel_loss_diff'], '.2e'):>18} {fmt(r.get('host_ms'), '.3f'):>8} "
                     f"{fmt(r.get('predicted_peak_gib'), '.2f'):>13} {fmt(r.get('sm_clock_mhz_median'), '.0f'):>7} "
                     f"{fmt(r.get('power_w_median'), '.0f'):>5} {fmt(r.get('joules_per_step'), '.2f'):>7}  "
                     + " ".join(f"{k} {v:.0%}" for k, v in (r.get("clock_event_reasons") or {}).items()))
    return "\n".join(lines)


def chart(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, c = doc["rows"], doc["config"]
    names = [r["engine"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, title in ((axes[0], "tok_s", "tokens / s (median step)"), (axes[1], "peak_gib", "peak allocated GiB")):
        values = [r[key] or 0.0 for r in rows]
        bars = ax.bar(names, values, color=[COLORS[n] for n in names])
        for bar, r in zip(bars, rows):
            text = ("OOM" if r["oom"] else "error" if r["error"] else "n/a" if r[key] is None
                    else f"{r[key]:,.0f}" if key == "tok_s" else f"{r[key]:.1f}")
            ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom")
        if key == "peak_gib" and c["cap_gib"]:
            ax.axhline(c["cap_gib"], color="red", ls="--", lw=1, label=f"cap {c['cap_gib']:g} GiB")
            ax.legend()
        ax.set_title(title)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"GPT-2 {c['model']} ({c['layers']}x{c['width']}), {c['precision']}, batch {c['batch']} x {c['seq']}"
                 f" on {doc['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(doc: dict, out_dir: Path, stem: str) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{stem}.json", out_dir / f"{stem}.png"]
    tmp = paths[0].with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1, allow_nan=False))
    os.replace(tmp, paths[0])
    chart(doc, paths[1])
    return paths


# --------------------------------------------------------------------------- command line


def _engines(text: str) -> tuple[str, ...]:
    es = tuple(e.strip() for e in text.split(",") if e.strip())
    bad = [e for e in es if e not in ENGINES]
    if bad or not es or len(set(es)) != len(es):
        raise argparse.ArgumentTypeError(f"--engines: a subset of {','.join(ENGINES)}, got {text!r}")
    return tuple(e for e in ENGINES if e in es)  # eager first: it is the loss reference


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=sorted(PRESETS) + sorted(MLP_PRESETS), default=None,
                   help="preset: 124m = 12 layers, 12 heads, width 768; 355m = 24 layers, 16 heads, width 1024 "
                        "(default 124m); mlp46m = the Nova paper's MLP LM, 6 x (LN, 384->1536, GELU, 1536->384), "
                        "vocab 50304, untied")
    p.add_argument("--layers", type=int, default=None, help="transformer blocks (overrides --model)")
    p.add_argument("--width", type=int, default=None, help="n_embd (overrides --model)")
    p.add_argument("--heads", type=int, default=None, help="attention heads (overrides --model)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size (default 50304)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 1024)")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default 8)")
    p.add_argument("--precision", choices=PRECISIONS, default="bf16",
                   help="fp32, tf32 (eager/torch.compile: allow_tf32) or bf16 (eager/torch.compile: autocast; default)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 20)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first, the compiling one included (default 3)")
    p.add_argument("--engines", type=_engines, default=None, metavar="LIST",
                   help="subset of eager,torch.compile,nova (default all three; --dry-run: eager,nova)")
    p.add_argument("--cap-gib", type=float, default=None, metavar="N",
                   help="cap this process's GPU memory at N GiB (set_per_process_memory_fraction)")
    p.add_argument("--seed", type=int, default=0, help="weights from seed, batches from seed + 1 (default 0)")
    p.add_argument("--out", type=Path, default=None, help="output directory (default bench/results; a temp dir for --dry-run)")
    p.add_argument("--fresh-caches", action=argparse.BooleanOptionalAction, default=True,
                   help="put Nova's, Triton's and Inductor's on-disk caches in an empty temp dir for the run, so "
                   "compile_s is cold (default on; --no-fresh-caches keeps the environment's)")
    p.add_argument("--nproc", type=int, default=1, metavar="N",
                   help="data parallelism over N ranks through torchrun: eager / torch.compile in DDP, Nova with "
                   "--data-parallel (default 1: one process)")
    p.add_argument("--data-parallel", choices=("ddp", "zero1"), default="ddp",
                   help="Nova's data_parallel mode with --nproc > 1 (default ddp)")
    p.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                   help="set one of Nova's module switches for the run, e.g. transforms.transpose_matmul.ENABLED=True "
                   "(repeatable; MODULE under nova.): a variant, recorded in the results and named in the file's name")
    p.add_argument("--dry-run", action="store_true",
                   help="a tiny GPT on the CPU: eager and Nova's reference backend, wall-clock timing, no claims")


def _argv(opts) -> list[str]:
    """The options again as command-line arguments (for the ranks torchrun starts)."""
    out = []
    for key in ("model", "layers", "width", "heads", "vocab", "seq", "batch", "precision", "steps", "warmup",
                "cap_gib", "seed", "data_parallel"):  # not --nproc: torchrun's parser takes it for its own
        v = getattr(opts, key)
        if v is not None:
            out += [f"--{key.replace('_', '-')}", str(v)]
    if opts.engines:
        out += ["--engines", ",".join(opts.engines)]
    out.append("--fresh-caches" if opts.fresh_caches else "--no-fresh-caches")
    for item in getattr(opts, "set", None) or []:
        out += ["--set", item]
    return out + (["--dry-run"] if opts.dry_run else [])


def _launch(opts, out_dir: Path) -> list[Path]:
    """--nproc N outside torchrun: this benchmark again under torchrun, N ranks on this host."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={opts.nproc}",
           str(Path(__file__).resolve()), *_argv(opts), "--out", str(out_dir)]
    done = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1")))
    if done.returncode != 0:
        raise RunFailed(f"torchrun of {opts.nproc} ranks failed (exit status {done.returncode}): {' '.join(cmd)}")
    return sorted(out_dir.glob(f"*_np{opts.nproc}_*"))


def _init_distributed(opts) -> None:
    """Under torchrun (WORLD_SIZE set): the process group, this rank's device."""
    import torch.distributed as dist

    world = int(os.environ["WORLD_SIZE"])
    if not opts.dry_run:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if not dist.is_initialized():
        dist.init_process_group("gloo" if opts.dry_run else "nccl")
    DIST.update(world=world, rank=dist.get_rank(), dp=True)


def _close_distributed() -> None:
    """Every rank past its last collective, then the process group torn down (NCCL warns at
    exit otherwise); the engines' DDP wrappers and their reducers collected first."""
    import gc

    import torch.distributed as dist

    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def run_args(opts, log=print) -> list[Path]:
    if not opts.dry_run and not torch.cuda.is_available():
        raise UsageError("nova bench gpt2 needs a CUDA device (or --dry-run)")
    out_dir = opts.out or (Path(tempfile.mkdtemp(prefix="nova-bench-gpt2-")) if opts.dry_run else REPO / "bench" / "results")
    if opts.nproc < 1:
        raise UsageError(f"--nproc must be at least 1, got {opts.nproc}")
    if opts.nproc > 1 and "WORLD_SIZE" not in os.environ:
        return _launch(opts, out_dir)
    # a rank torchrun started (ours, or the user's: `torchrun --nproc-per-node 1 bench/gpt2.py ...` is
    # data parallelism over one rank, every engine's overhead of it beside the others')
    if "WORLD_SIZE" in os.environ:
        _init_distributed(opts)
        if DIST["rank"] != 0:
            log = lambda s: None  # noqa: E731  (rank 0 speaks and writes)
    with fresh_caches(opts.fresh_caches) as caches:
        doc = run(opts, log)
    if DIST["dp"]:
        _close_distributed()
    if DIST["rank"] != 0:
        return []
    doc["config"]["caches"] = "fresh, empty for this run" if caches else "the environment's (not emptied)"
    paths = write(doc, out_dir, result_stem(doc["config"], opts.dry_run))
    log(summary(doc))
    log("wrote " + ", ".join(map(str, paths)))
    failed = [r for r in doc["rows"] if r["error"] and not r["oom"]]
    if failed:
        raise RunFailed("engine(s) failed: " + "; ".join(f"{r['engine']}: {r['error']}" for r in failed)
                        + f" (results written to {paths[0]})")
    return paths


def main(argv: list[str] | None = None) -> int:
    """``python bench/gpt2.py ...`` is ``nova bench gpt2 ...`` (one place handles errors and exit codes)."""
    from nova.cli.main import main as nova_main

    return nova_main(["bench", "gpt2", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
