#!/usr/bin/env python3
"""Launches per step of a GPT-2 124M training step, from the compile alone (no GPU):
the Triton program's kernel steps (less the cats assembled from windows, which
launch nothing) plus the reshapes whose strides allow no view (the executable's
``_reshape_copy`` launches), grouped by kernel family.

    python scripts/launch_count.py [--batch 32] [--precision bf16]

Kernels are scheduled for the H200 (as under the interpreter); nothing runs."""
from __future__ import annotations

import argparse
import collections
import os
import re
import time

os.environ.setdefault("TRITON_INTERPRET", "1")  # load kernels without a GPU
os.environ.setdefault("NOVA_STEP_CACHE", "0")

from gpt2_h200 import compile_gpt2_h200  # noqa: E402
from nova.backends.triton import TritonProgram  # noqa: E402
from nova.ir.module import step_func  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--precision", default="bf16")
    args = ap.parse_args()
    t0 = time.time()
    c = compile_gpt2_h200(args.batch, args.precision)
    prog = TritonProgram(step_func(c.module), args.precision)
    kinds: collections.Counter = collections.Counter()
    for st in prog.steps:
        if st.is_view:
            if c.memory.placements[st.outputs[0]].kind != "view":
                kinds[f"reshape copy ({st.outputs[0].type})"] += 1
            continue
        if c.memory.placements[st.outputs[0]].assembled:  # a cat of windows its pieces' kernels wrote
            continue
        name = st.kernel.name if st.kernel is not None else st.op.name
        kinds[re.sub(r"(_\d+(x\d+)*)(_.*)?$", "", name)] += 1
    print(f"GPT-2 124M {args.precision} batch {args.batch}: {sum(kinds.values())} launches per step "
          f"(kernel steps + reshape copies; compile {time.time() - t0:.0f} s)")
    for k, v in kinds.most_common():
        print(f"{v:6d} {k}")


if __name__ == "__main__":
    main()
