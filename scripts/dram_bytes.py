"""Bytes through DRAM and L2, kernel by kernel, for one training step of Nova and of
torch.compile side by side, read from the H200's hardware counters with Nsight Compute:
``python scripts/dram_bytes.py [--model 124m|mlp46m] [--precision bf16|tf32] [--batch 32]
[--out DIR]`` (CUDA and Nsight Compute's ``ncu``; ``bash scripts/gpu_check.sh dram``).

Why: under the power cap a step's energy sets the SM clock (bf16 b32 at ce5586c: Nova 45.3 J
a step at 1650 MHz, torch.compile 42.0 J at 1725). Both do the same tensor-core work, so the
difference lies in what else a step costs: bytes through DRAM and L2 and instructions issued.
The cost model predicts each kernel's bytes; this measures them, and the instructions.

Each engine runs in a child process under ``ncu --profile-from-start off --clock-control
none`` (the clocks are left as found, METHOD.md): three warm-up steps, then one step between
``cudaProfilerStart`` and ``cudaProfilerStop``. Nova runs its launch list (``cuda_graph=False``,
so every kernel is its own launch, as ``scripts/kernel_profile.py`` does). ncu replays each
kernel to read ``dram__bytes_read.sum``, ``dram__bytes_write.sum``, ``lts__t_bytes.sum`` (every
byte through L2), ``sm__inst_executed.sum`` (warp instructions: the SMs' share of the energy)
and ``gpu__time_duration.sum``; the kernels' own state is saved and restored between
replays. Prints per engine the totals and the kernels by DRAM bytes, and writes
``dram_bytes_<model>_<precision>_b<batch>.json`` (per kernel name: launches, DRAM read and
written, L2 bytes, warp instructions, ncu's time) to ``--out``.

An engine ``matmul:M,N,K,PRECISION,A_LAYOUT,B_LAYOUT[,PREROUNDED]`` (with ``--stalls``) is one
matmul instead of a step: Nova's configured launch and cuBLAS's (``matmul_child``); engines are
separated by ``;`` then.

``--stalls REGEX``: instead, why the kernels whose names match REGEX take their time: ncu's
SpeedOfLight, Occupancy, LaunchStats, WarpStateStats and SchedulerStats sections for the first
``--launches`` matching launches of one step (each engine in ``--engines``), every metric
written raw to ``stalls_<model>_<precision>_b<batch>_<engine>.csv`` and, per launch, the
throughputs, the occupancy, the issue rate and the warp stall reasons (cycles a warp spends
stalled per issued instruction, by reason, largest first) printed."""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import re
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum", "lts__t_bytes.sum", "gpu__time_duration.sum",
           "sm__inst_executed.sum")
KEYS = ("dram_read", "dram_write", "l2", "ns", "inst")  # METRICS' names in the output
UNITS = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "nsecond": 1, "usecond": 1e3, "msecond": 1e6}


def matmul_child(spec: str) -> None:
    """``matmul:M,N,K,PRECISION,A_LAYOUT,B_LAYOUT[,PREROUNDED]`` (PRECISION bf16 or tf32; a layout
    row or col, col = the transposed view of a dense matrix; PREROUNDED a, b or ab under tf32:
    the operands the step's producers store rounded): Nova's configured launch, then cuBLAS's
    (torch.matmul), once each between cudaProfilerStart and cudaProfilerStop, after 3 warm-ups."""
    import torch

    from nova.codegen.triton import matmul as mm

    M, N, K, prec, la, lb, *rest = spec.removeprefix("matmul:").split(",")
    M, N, K = int(M), int(N), int(K)
    pre = tuple(rest[0]) if rest and rest[0] else ()
    dtype = torch.bfloat16 if prec == "bf16" else torch.float32
    torch.manual_seed(0)
    a = torch.randn(M, K, device="cuda", dtype=dtype) if la == "row" else torch.randn(K, M, device="cuda", dtype=dtype).t()
    b = torch.randn(K, N, device="cuda", dtype=dtype) if lb == "row" else torch.randn(N, K, device="cuda", dtype=dtype).t()
    if prec == "tf32":
        torch.backends.cuda.matmul.allow_tf32 = True
        a = mm.round_to_tf32(a) if "a" in pre else a
        b = mm.round_to_tf32(b) if "b" in pre else b
    c = torch.empty(M, N, device="cuda", dtype=dtype)
    precision = "tf32-rn" if prec == "tf32" else "ieee"
    # configured as the step configures it: with the operands it takes as rounded (a launch without
    # cfg configures without them)
    cfg = mm.configure(M, N, K, 1, dtype, dtype, precision, la, lb, False, mm.device_spec(a.device), prerounded=pre)

    def nova():
        mm.matmul(a, b, cfg=cfg, precision=precision, out=c, prerounded=pre)

    for _ in range(3):
        nova()
        torch.matmul(a, b)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    nova()
    torch.matmul(a, b)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def child(engine: str, model: str, precision: str, batch: int) -> None:
    """One step of ``engine`` between cudaProfilerStart and cudaProfilerStop (under ncu)."""
    import torch

    if engine.startswith("matmul:"):
        return matmul_child(engine)

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from kernel_profile import model_config, step_runner

    torch.manual_seed(0)
    cfg = model_config(model)
    x = torch.randint(0, 50304, (batch, 1024), device="cuda")
    y = torch.randint(0, 50304, (batch, 1024), device="cuda")
    _, _, run = step_runner(engine, cfg, precision, x, y, cuda_graph=False)
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def parse(text: str) -> dict:
    """ncu's ``--csv --page raw`` output -> kernel name -> totals over its launches."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    if len(rows) < 2:
        return {}
    header = rows[0]
    col = {h: i for i, h in enumerate(header)}
    # with --page raw a row of units may follow the header (its ID cell empty)
    if rows[1][col.get("ID", 0)] == "":
        units, data = rows[1], rows[2:]
    else:
        units, data = [""] * len(header), rows[1:]
    out: dict = defaultdict(lambda: {"launches": 0, **{key: 0.0 for key in KEYS}})
    for r in data:
        k = out[r[col["Kernel Name"]]]
        k["launches"] += 1
        for key, metric in zip(KEYS, METRICS, strict=True):
            v = r[col[metric]].replace(",", "") if metric in col else ""
            k[key] += float(v) * UNITS.get(units[col[metric]], 1) if v not in ("", "n/a") else 0.0
    return dict(out)


def _under_ncu(ncu: str, engine: str, opts, what: list[str]) -> subprocess.CompletedProcess:
    """One step of ``engine`` (this script's ``--child``) under ncu collecting ``what``, its
    output as a raw CSV in base units; the clocks left as found."""
    cmd = [ncu, "--profile-from-start", "off", "--clock-control", "none", *what, "--csv", "--page", "raw",
           "--print-units", "base", sys.executable, __file__, "--child", engine, "--model", opts.model,
           "--precision", opts.precision, "--batch", str(opts.batch)]  # fmt: skip
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=opts.timeout, env=dict(os.environ))


# what --stalls prints of each launch besides the stall reasons (ncu's raw metric names)
STALL_CONTEXT = (
    ("time us", "gpu__time_duration.sum", 1e-3),
    ("DRAM % peak", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed", 1),
    ("SM % peak", "sm__throughput.avg.pct_of_peak_sustained_elapsed", 1),
    ("occupancy %", "sm__warps_active.avg.pct_of_peak_sustained_active", 1),
    ("issue %", "smsp__issue_active.avg.pct_of_peak_sustained_active", 1),
    ("registers", "launch__registers_per_thread", 1),
    ("blocks/SM by registers", "launch__occupancy_limit_registers", 1),
)


_STALLED = ("smsp__average_warps_issue_stalled_", "_per_issue_active.ratio")


def stall_report(text: str) -> list[dict]:
    """ncu's raw CSV of a --stalls run -> per launch, in order: ``name``, ``context`` (STALL_CONTEXT's
    labels -> values, where the CSV has them) and ``reasons`` ((reason, stalled cycles per issued
    instruction), largest first, zeros left out)."""
    rows = list(csv.reader(io.StringIO("\n".join(ln for ln in text.splitlines() if ln.startswith('"')))))
    if len(rows) < 2:
        return []
    col = {h: i for i, h in enumerate(rows[0])}
    data = rows[2:] if rows[1][col.get("ID", 0)] == "" else rows[1:]  # (a row of units after the header)

    def value(r, name):
        try:
            return float(r[col[name]].replace(",", "")) if name in col else None
        except ValueError:  # "n/a"
            return None

    out = []
    for r in data:
        reasons = [(h[len(_STALLED[0]):-len(_STALLED[1])], value(r, h)) for h in col
                   if h.startswith(_STALLED[0]) and h.endswith(_STALLED[1])]  # fmt: skip
        out.append({"name": r[col["Kernel Name"]],
                    "context": {label: v * scale for label, name, scale in STALL_CONTEXT
                                if (v := value(r, name)) is not None},
                    "reasons": sorted(((n, v) for n, v in reasons if v), key=lambda t: -t[1])})  # fmt: skip
    return out


def stalls(engine: str, opts, ncu: str) -> None:
    """--stalls: the sections of the matching launches, raw to a CSV, the stall reasons printed."""
    done = _under_ncu(ncu, engine, opts, ["--kernel-name", f"regex:{opts.stalls}", "--launch-count", str(opts.launches),
                                          *(a for s in ("SpeedOfLight", "Occupancy", "LaunchStats", "WarpStateStats",
                                                        "SchedulerStats") for a in ("--section", s))])  # fmt: skip
    opts.out.mkdir(parents=True, exist_ok=True)
    tag = re.sub(r"[^A-Za-z0-9_-]", "_", engine)
    path = opts.out / (f"stalls_{tag}.csv" if engine.startswith("matmul:") else
                       f"stalls_{opts.model}_{opts.precision}_b{opts.batch}_{tag}.csv")
    path.write_text("\n".join(ln for ln in done.stdout.splitlines() if ln.startswith('"')) + "\n")
    launches = stall_report(done.stdout)
    if done.returncode != 0 or not launches:
        print(f"== {engine}: ncu exited {done.returncode}, {len(launches)} launches\n{done.stderr[-3000:]}\n"
              f"{done.stdout[-2000:]}")
        return
    print(f"== {engine}: {len(launches)} launches matching {opts.stalls!r} (every metric: {path.name})")
    for k in launches:
        print(f"- {k['name'][:110]}\n    " + ", ".join(f"{label} {v:.1f}" for label, v in k["context"].items()))
        print("    stalled cycles per issue: " + ", ".join(f"{n} {v:.2f}" for n, v in k["reasons"][:8]))


def run_engine(engine: str, opts, ncu: str) -> dict:
    done = _under_ncu(ncu, engine, opts, ["--metrics", ",".join(METRICS)])
    kernels = parse(done.stdout)
    if done.returncode != 0 or not kernels:
        print(f"== {engine}: ncu exited {done.returncode}, {len(kernels)} kernels\n{done.stderr[-3000:]}\n{done.stdout[-2000:]}")
    return kernels


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["124m", "355m", "mlp46m"], default="124m")
    ap.add_argument("--precision", choices=["bf16", "tf32"], default="bf16")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--engines", default="nova,torch.compile")
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--timeout", type=int, default=260, help="seconds for each engine's ncu run")
    ap.add_argument("--stalls", metavar="REGEX", help="instead: the warp stall reasons of the launches whose kernel "
                    "names match REGEX (ncu's sections; see the module docstring)")
    ap.add_argument("--launches", type=int, default=4, help="with --stalls: how many matching launches")
    ap.add_argument("--child")
    opts = ap.parse_args()
    if opts.child:
        child(opts.child, opts.model, opts.precision, opts.batch)
        return
    found = [Path("/usr/local/cuda/bin/ncu"), *sorted(Path("/opt/nvidia").glob("nsight-compute/*/ncu"))]
    ncu = shutil.which("ncu") or next((str(p) for p in found if p.exists()), None)
    if ncu is None:
        raise SystemExit("dram_bytes: ncu (Nsight Compute) not found on the PATH, in /usr/local/cuda/bin "
                         "or /opt/nvidia/nsight-compute/*/")
    if opts.stalls:
        for engine in opts.engines.split(";" if "matmul:" in opts.engines else ","):
            stalls(engine, opts, ncu)
        return
    from importlib.metadata import version

    smi = shutil.which("nvidia-smi")
    gpu = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True) if smi else None
    doc = {"model": opts.model, "precision": opts.precision, "batch": opts.batch, "metrics": list(METRICS),
           "device": gpu.stdout.strip().splitlines()[0] if gpu and gpu.returncode == 0 and gpu.stdout.strip() else None,
           "versions": {p: version(p) for p in ("torch", "triton")},
           "commit": os.environ.get("NOVA_COMMIT", "unknown"), "engines": {}}  # fmt: skip
    for engine in opts.engines.split(","):
        kernels = run_engine(engine, opts, ncu)
        tot = {k: sum(v[k] for v in kernels.values()) for k in ("launches", *KEYS)}
        doc["engines"][engine] = {"totals": tot, "kernels": kernels}
        print(f"== {engine}: {tot['launches']} launches, DRAM read {tot['dram_read'] / 1e9:.2f} GB, written "
              f"{tot['dram_write'] / 1e9:.2f} GB, L2 {tot['l2'] / 1e9:.2f} GB, {tot['inst'] / 1e9:.2f} G warp "
              f"instructions, {tot['ns'] / 1e6:.2f} ms under ncu")
        for name, v in sorted(kernels.items(), key=lambda kv: -(kv[1]["dram_read"] + kv[1]["dram_write"]))[:opts.top]:
            print(f"  {(v['dram_read'] + v['dram_write']) / 1e9:8.3f} GB DRAM {v['l2'] / 1e9:8.3f} GB L2 "
                  f"{v['inst'] / 1e6:9.1f} M inst {v['ns'] / 1e6:7.3f} ms {v['launches']:4d}x  {name[:100]}")
    opts.out.mkdir(parents=True, exist_ok=True)
    path = opts.out / f"dram_bytes_{opts.model}_{opts.precision}_b{opts.batch}.json"
    path.write_text(json.dumps(doc, indent=1))
    print("wrote", path)


if __name__ == "__main__":
    main()
