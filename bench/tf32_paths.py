"""Which way should fp32 operands reach the tf32 tensor cores? A measurement that
informs the Analytic Configurator (docs/configurator.md, "tf32 operands"), not a
benchmark of record.

    python bench/tf32_paths.py --out DIR [--shapes M,N,K ...]

For row-major A[M, K] @ B[K, N] (B is N-major, which tf32 wgmma cannot read from
shared memory) it times, with CUDA graphs, medians of repeated replays:

* ``cublas``: torch.matmul with allow_tf32 (rounds operands to nearest);
* ``register``: the configurator's config on the register path (B tiles pass
  through registers to be re-stored K-major; the tensor core truncates);
* ``register-rn``: the same config, both tiles rounded to nearest in registers;
* ``stage-rn``: B staged by a rounding, transposing copy into a K-major buffer
  (``+stage_b``), A straight from TMA and rounded to nearest in registers;
* ``stage-both``: A staged (rounded) too (``+stage_a+stage_b``).

bench/results/tf32_paths.json was measured at commit 3764d87, whose staging also had
a ``stage`` variant (B staged, A truncated by the tensor core: 4.7e-4 error); the
launcher now stages only with rounding (precision ``tf32-rn``), so it is gone.

The staged variants take the best of a few K-major tile configs; their time
includes the staging copies. Each variant's relative error against float64 is
reported alongside.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.matmul import SEARCH_TIMING, GpuTimer, ShapeBench, _cublas_precision, _tflops, describe  # noqa: E402
from nova.codegen.triton import matmul as mm  # noqa: E402
from nova.schedule.config import LoweringConfig  # noqa: E402

SHAPES = [(128, 8192, 8192), (512, 2048, 2048), (2048, 2048, 2048), (8192, 8192, 2048), (8192, 128, 8192),
          (128, 128, 8192), (2048, 512, 512), (512, 8192, 512), (8192, 8192, 8192)]  # fmt: skip


def _c(bm, bn, bk, w, s, sk=1):
    return LoweringConfig(kind="matmul", block_m=bm, block_n=bn, block_k=bk, group_m=8, split_k=sk,
                          num_warps=w, num_stages=s, instruction="wgmma+tma+stage_b")  # fmt: skip


STAGED = [_c(128, 256, 32, 8, 3), _c(256, 128, 32, 8, 3), _c(128, 128, 32, 8, 4), _c(128, 128, 64, 8, 3),
          _c(128, 64, 32, 4, 4), _c(64, 128, 32, 4, 4), _c(64, 64, 32, 4, 4), _c(64, 64, 64, 4, 3),
          _c(64, 64, 32, 4, 4, sk=4), _c(64, 128, 32, 4, 4, sk=2)]  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--shapes", nargs="*", default=None, help="M,N,K triples")
    opts = p.parse_args(argv)
    shapes = [tuple(int(x) for x in s.split(",")) for s in opts.shapes] if opts.shapes else SHAPES
    dev = torch.device("cuda")
    timer = GpuTimer()
    rows = []
    for M, N, K in shapes:
        sb = ShapeBench(M, N, K, "tf32", dev, timer)
        base = mm.configure(M, N, K, 1, torch.float32, torch.float32, "tf32", "row", "row", False, mm.device_spec(dev))
        row = {"M": M, "N": N, "K": K, "variants": {}}

        def record(name, cfg, launch):
            try:
                ms = sb.time(launch, final=False)
                err = sb.error(launch)
            except Exception as e:  # a config the compiler rejects: reported, not fatal
                print(f"  {name} {describe(cfg)}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                return
            best = row["variants"].get(name)
            if best is None or ms < best["ms"]:
                row["variants"][name] = {"config": describe(cfg), "ms": ms, "tflops": _tflops(M, N, K, ms),
                                         "rel_err": err}  # fmt: skip

        with _cublas_precision("tf32"):
            record("cublas", None, sb.cublas_launcher())
        record("register", base, sb.nova_launcher(base, "tf32"))
        record("register-rn", base, sb.nova_launcher(base, "tf32-rn"))
        for cfg in STAGED:
            if cfg.split_k > 1 and M * N > 2048 * 2048:
                continue
            both = dataclasses.replace(cfg, instruction="wgmma+tma+stage_a+stage_b")
            record("stage-rn", cfg, sb.nova_launcher(cfg, "tf32-rn"))
            record("stage-both", both, sb.nova_launcher(both, "tf32-rn"))
        rows.append(row)
        line = " | ".join(f"{k} {v['tflops']:.0f} ({v['rel_err']:.1e}, {v['config']})" for k, v in row["variants"].items())
        print(f"{M}x{N}x{K}: {line}", flush=True)
        del sb
        torch.cuda.empty_cache()
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "timing": SEARCH_TIMING, "rows": rows}
    (out / "tf32_paths.json").write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
