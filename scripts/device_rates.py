"""The live GPU's effective rates, as the configurator's device table takes them.

``nova/schedule/devices.py`` marks a rate [M] where it was measured on the project's
device rather than read off a datasheet: the device-to-device copy bandwidth and
cuBLAS's bf16 and tf32 GEMM throughput at large square shapes. This script measures
those three on whatever GPU it runs on, the same way each time, so another part (an
H100 lent in place of the H200) gets its own measured row:

    python scripts/device_rates.py [--out DIR]

Copy: one 2 GiB fp32 buffer copied into another, 2 x 2 GiB moved a copy. GEMM: torch.mm
on random operands at n = 4096, 8192 and 16384 (bf16; fp32 with tf32 allowed), the best
n reported as the path's rate (the datasheet's peak is what no shape reaches). Each
figure is the median of 20 timed repetitions after 5 untimed ones, timed with CUDA
events (``bench.timing.time_events``). Prints the DeviceSpec fields and writes device_rates.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.timing import time_events  # noqa: E402  (the repo's shared CUDA-event timing)

WARMUP, REPS = 5, 20


def _median_ms(fn) -> float:
    return time_events(fn, REPS, warmup=WARMUP)


def copy_bandwidth(gib: float = 2.0) -> dict:
    n = int(gib * 2**30) // 4
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src))
    return {"bytes_per_copy": 2 * n * 4, "median_ms": ms, "bytes_per_s": 2 * n * 4 / (ms * 1e-3)}


def gemm_rate(dtype: torch.dtype, sizes=(4096, 8192, 16384)) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = dtype == torch.float32
    rows = []
    for n in sizes:
        a = torch.randn(n, n, device="cuda", dtype=dtype)
        b = torch.randn(n, n, device="cuda", dtype=dtype)
        c = torch.empty(n, n, device="cuda", dtype=dtype)
        ms = _median_ms(lambda: torch.mm(a, b, out=c))
        rows.append({"n": n, "median_ms": ms, "flops_per_s": 2 * n**3 / (ms * 1e-3)})
        del a, b, c
    torch.backends.cuda.matmul.allow_tf32 = False
    best = max(rows, key=lambda r: r["flops_per_s"])
    return {"sizes": rows, "best_n": best["n"], "flops_per_s": best["flops_per_s"]}


def _smi() -> str:
    try:
        q = "name,driver_version,clocks.sm,clocks.max.sm,power.limit"
        return subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        return f"nvidia-smi failed: {e}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("."))
    opts = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("device_rates: no CUDA device", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    doc = {
        "device": torch.cuda.get_device_name(), "sm_count": props.multi_processor_count,
        "torch": torch.__version__, "nvidia_smi": _smi(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "copy": copy_bandwidth(), "bf16": gemm_rate(torch.bfloat16), "tf32": gemm_rate(torch.float32),
    }
    doc["nvidia_smi_after"] = _smi()
    print(doc["device"], doc["nvidia_smi"])
    print(f"  mem_bandwidth = {doc['copy']['bytes_per_s'] / 1e12:.2f}e12  # copy, {doc['copy']['median_ms']:.3f} ms")
    for path in ("bf16", "tf32"):
        r = doc[path]
        sizes = ", ".join(f"n={s['n']}: {s['flops_per_s'] / 1e12:.0f}" for s in r["sizes"])
        print(f"  {path}_flops = {r['flops_per_s'] / 1e12:.0f} * TFLOP  # cuBLAS ({sizes})")
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / "device_rates.json").write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
