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

import torch  # noqa: E402

from nova import pipeline  # noqa: E402
from nova.api import _step_dtype  # noqa: E402
from nova.backends.triton import TritonProgram  # noqa: E402
from nova.ir.module import step_func  # noqa: E402
from nova.models import GPT, gpt2_124m  # noqa: E402
from nova.schedule.devices import DEVICES  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--precision", default="bf16")
    args = ap.parse_args()
    t0 = time.time()
    torch.manual_seed(0)
    model = GPT(gpt2_124m())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 50304, (args.batch, 1024))
    c = pipeline.Compilation(model, (x, x), opt, args.precision, _step_dtype())
    c.device = DEVICES["H200"]
    pipeline.run(c)
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
