"""Offline check of the Analytic Configurator against a recorded ``nova bench matmul``.

    python bench/configurator_vs_search.py [bench/results/matmul.json] [--verbose]

For every (precision, shape) row of the JSON, asks the *current* configurator for
its config and compares it with what the benchmark recorded:

* ``= best``: the choice equals the searched-best config, after the same
  normalisation the search uses to drop equivalent candidates (GROUP_M beyond the
  tile rows, a split K is too short for, a persistent grid no larger than the SMs);
* ``= best tile``: same BLOCK_M x BLOCK_N x BLOCK_K, split count and load path
  (TMA or pointer), warps/stages/group/persistence may differ;
* a time estimate for the choice, when the JSON has one: the recorded Nova time
  when the choice equals the recorded Nova config, else the choice's own search time
  when the run kept every candidate (``--keep-search``: ``search.all``), else none.
  Search times are short graphs (SEARCH_TIMING), comparable to each other but a
  little pessimistic against the final timings, so ratios from them are estimates.

Prints per-precision counts and, where estimates exist, the geomean of
best_ms / choice_ms ("nova/best") and the share of shapes within 3% of the best.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from nova.schedule.config import LoweringConfig  # noqa: E402

NUM_SMS = 132  # H200
WITHIN = 0.03


def _cdiv(a, b):
    return -(-a // b)


def norm_key(cfg: dict | LoweringConfig, M: int, N: int, K: int, num_sms: int = NUM_SMS) -> tuple:
    """The search's equivalence key (bench/matmul.py ``candidates``)."""
    c = cfg if isinstance(cfg, LoweringConfig) else LoweringConfig.from_dict(cfg)
    k_split = _cdiv(_cdiv(K, c.split_k), c.block_k) * c.block_k
    splits = _cdiv(K, k_split)
    pid_m = _cdiv(M, c.block_m)
    tiles = pid_m * _cdiv(N, c.block_n) * splits
    return (c.block_m, c.block_n, c.block_k, c.num_warps, c.num_stages, min(c.group_m, pid_m), splits,
            bool(c.persistent and tiles > num_sms), "tma" in c.instruction,
            tuple(t for t in c.instruction.split("+") if t.startswith("stage")))


def parse(text: str) -> LoweringConfig:
    """Inverse of ``describe`` (the keys of a kept search, ``search.all``)."""
    parts = text.split()
    bm, bn, bk = (int(x) for x in parts[0].split("x"))
    kw = dict(num_warps=int(parts[1][1:]), num_stages=int(parts[2][1:]), group_m=int(parts[3][1:]))
    split = next((int(p[2:]) for p in parts if p.startswith("sk")), 1)
    instruction = ("wgmma+tma" if "tma" in parts else "wgmma") + "".join(f"+{t}" for t in ("stage_a", "stage_b") if t in parts)
    return LoweringConfig(kind="matmul", block_m=bm, block_n=bn, block_k=bk, split_k=split, persistent="pers" in parts,
                          instruction=instruction, **kw)


def tile_key(key: tuple) -> tuple:
    return key[0], key[1], key[2], key[6], key[8], key[9]


def describe(c: LoweringConfig) -> str:
    from bench.matmul import describe as bench_describe  # the keys of search.all

    return bench_describe(c)


def configure(row) -> LoweringConfig:
    from nova.schedule.configurator import configure_matmul

    dtype = "float32" if row["precision"].startswith("tf32") else "bfloat16"
    from bench.matmul import NOVA_PRECISION

    prec = NOVA_PRECISION["tf32" if row["precision"].startswith("tf32") else "bf16"]
    return configure_matmul(row["M"], row["N"], row["K"], 1, dtype, dtype, dtype, prec, device="H200")


def _geomean(xs):
    xs = [x for x in xs if x]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def evaluate(doc: dict, verbose: bool = False, out=print) -> dict:
    report = {}
    for prec in sorted({r["precision"] for r in doc["shapes"]}, key=lambda p: (p != "tf32", p)):
        rows = [r for r in doc["shapes"] if r["precision"] == prec and r["search"].get("best")]
        exact = tile = same_as_recorded = 0
        ratios, recorded = [], []
        for r in rows:
            M, N, K = r["M"], r["N"], r["K"]
            cfg = configure(r)
            key = norm_key(cfg, M, N, K)
            best = r["search"]["best"]
            bkey = norm_key(best["config"], M, N, K)
            exact += key == bkey
            tile += tile_key(key) == tile_key(bkey)
            est = None
            if key == bkey:
                est = best["ms"]
            elif r["nova"].get("ms") and norm_key(r["nova"]["config"], M, N, K) == key:
                est, same_as_recorded = r["nova"]["ms"], same_as_recorded + 1
            else:
                all_ = {norm_key(parse(text), M, N, K): ms for text, ms in r["search"].get("all", {}).items() if ms}
                if key in all_:
                    # search-timed: scale by the best's search/final ratio so the two agree
                    bsearch = all_.get(bkey)
                    est = all_[key] * (best["ms"] / bsearch if bsearch else 1.0)
            ratio = best["ms"] / est if est else None
            ratios.append(ratio)
            if r.get("nova_vs_best"):
                recorded.append(r["nova_vs_best"])
            if verbose:
                mark = "==" if key == bkey else "~=" if tile_key(key) == tile_key(bkey) else "  "
                out(f"{prec} {M:>5}x{N:<5}x{K:<5} {mark} now [{describe(cfg)}]  best [{describe(LoweringConfig.from_dict(best['config']))}]"
                    f"  est nova/best {ratio:.2f}" if ratio else
                    f"{prec} {M:>5}x{N:<5}x{K:<5} {mark} now [{describe(cfg)}]  best [{describe(LoweringConfig.from_dict(best['config']))}]  est -")
        known = [x for x in ratios if x]
        rep = {
            "shapes": len(rows),
            "equal_to_best": exact,
            "same_tile_split_path_as_best": tile,
            "equal_to_recorded_nova": same_as_recorded,
            "estimated": len(known),
            "estimated_geomean_nova_vs_best": _geomean(known),
            "estimated_within_3pct": sum(x >= 1 / (1 + WITHIN) for x in known),
            "recorded_geomean_nova_vs_best": _geomean(recorded),
            "recorded_within_3pct": sum(bool(r.get("within_3pct_of_best")) for r in rows),
        }
        report[prec] = rep
        g = rep["estimated_geomean_nova_vs_best"]
        out(
            f"{prec}: {rep['shapes']} shapes | current configurator = searched best on {exact} "
            f"(same tile/BLOCK_K/split/path on {tile}) | time known for {len(known)} "
            f"(geomean nova/best {g:.3f}, within 3% on {rep['estimated_within_3pct']})" if g else
            f"{prec}: {rep['shapes']} shapes | current configurator = searched best on {exact} "
            f"(same tile/BLOCK_K/split/path on {tile}) | no time known for its choices"
        )
        out(f"      recorded run: nova/best geomean {rep['recorded_geomean_nova_vs_best']:.3f}, "
            f"within 3% on {rep['recorded_within_3pct']}/{len(rows)}")
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", nargs="?", type=Path, default=REPO / "bench" / "results" / "matmul.json")
    p.add_argument("--verbose", "-v", action="store_true", help="one line per shape")
    args = p.parse_args(argv)
    evaluate(json.loads(args.json.read_text()), args.verbose)
    return 0


if __name__ == "__main__":
    sys.exit(main())
