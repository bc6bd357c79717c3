#!/usr/bin/env python3
"""Random matmul shapes through the configurator's legality checks, many more than CI's
``test_any_shape_is_legal`` (300 derandomized): the same checks (``check_legal``: Triton-legal
tiles, shared memory and registers within the device; tiles no larger than the padded
dims; the split's K ranges), over shapes drawn from every size to 20,000, small dims, and
the GPT-2 and LM-head widths, on every device, precision, layout and bias. No GPU.

    python scripts/configurator_sweep.py [--seed 1] [--shapes 40000]

Prints each failing shape (the first 10) and the count; exits 1 on any. In the
twenty-second session it found two configurator faults (rule 8f's tail ring at BLOCK_K
128; rule 8b's tile wider than C), both fixed; 120,000 shapes since, none."""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "schedule")]

WIDTHS = (768, 1024, 2048, 3072, 4096, 8192, 50304)


def check(M, N, K, batch, precision, dtype, device, bias, layouts) -> None:
    from test_configurator import check_legal

    from nova.schedule.configurator import plan_matmul
    from nova.schedule.devices import DEVICES

    p = plan_matmul(M, N, K, batch, dtype, dtype, dtype, precision, *layouts, bias, DEVICES[device])
    check_legal(p, DEVICES[device])
    c = p.config
    assert c.block_m <= max(16, 1 << (M - 1).bit_length()), "block_m beyond the padded M"
    assert c.block_n <= max(16, 1 << (N - 1).bit_length()), "block_n beyond the padded N"
    assert c.block_k <= max(16, 1 << (K - 1).bit_length()), "block_k beyond the padded K"
    k_split = -(-(-(-K // c.split_k)) // c.block_k) * c.block_k  # the launcher's split_k_plan
    assert -(-K // k_split) == c.split_k and (c.split_k == 1 or k_split >= 2 * c.block_k), "split"


def main() -> int:
    from test_configurator import CASES

    from nova.schedule.devices import DEVICES

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--shapes", type=int, default=40000)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    bad = 0
    for _ in range(args.shapes):
        M, N, K = (rng.choice([rng.randint(1, 20000), rng.randint(1, 512), rng.choice(WIDTHS)]) for _ in range(3))
        precision, dtype = rng.choice(CASES)
        case = (M, N, K, rng.choice([1, 1, 1, 2, 8]), precision, dtype, rng.choice(sorted(DEVICES)), rng.random() < 0.5,
                rng.choice([("row", "row"), ("col", "row"), ("row", "col"), ("strided", "row")]))
        try:
            check(*case)
        except AssertionError as e:
            bad += 1
            if bad <= 10:
                print("FAIL", case, str(e).splitlines()[0][:200] if str(e) else "")
    print(f"{args.shapes} shapes, {bad} failing")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
