"""configure: schedules that depend on how the fuse stage grouped the ops (the
elementwise model's stream count for a multi-tensor kernel)."""

from __future__ import annotations

import torch
from xdsl.dialects.builtin import bf16, f32

from nova.backends.triton import config_of
from nova.ir import dialect as nv
from nova.ir.builder import OpBuilder
from nova.ir.module import Slot, context, new_step, set_results
from nova.ir.types import tensor
from nova.schedule import configurator as cf
from nova.schedule.devices import DEVICES
from nova.transforms.configure import Configure
from nova.transforms.fuse import fuse

H200 = DEVICES["H200"]


def test_a_multi_tensor_kernel_is_scheduled_by_one_parts_streams():
    """Three weights' bf16 casts batched into one kernel of three parts (six streams in
    all, two a part): a program loads one part's, so the elementwise model counts two
    (two 16-byte vectors a thread, as one cast alone), not six (one vector); a group
    of one part with the same six streams keeps the six."""
    n = (512, 256)  # 131,072 elements: past the small-tensor rule's halving on 132 SMs
    slots = [Slot("param", "x", tensor([4, 512], bf16))]
    slots += [Slot("param", f"w{k}", tensor(list(n), f32)) for k in range(3)]
    slots += [Slot("param", f"v{k}", tensor(list(n), f32)) for k in range(3)]
    module, fn = new_step(slots)
    b = OpBuilder(fn.body.block)
    x, *args = fn.body.block.args
    ws, vs = args[:3], args[3:]
    results = [("loss", f"y{k}", b.matmul(x, b.cast(w, bf16))) for k, w in enumerate(ws)]
    # one straight-line group reading three other tensors: exp of each, summed, cast
    e = [b.one(nv.ExpOp, [v]) for v in vs]
    results.append(("loss", "s", b.cast(b.add(b.add(e[0], e[1]), e[2]), bf16)))
    set_results(fn, results)
    fuse(module)
    Configure(H200, "bf16").apply(context(), module)
    groups = [op for op in fn.body.block.ops if isinstance(op, nv.FusedOp)]
    (multi,) = [g for g in groups if len(g.results) == 3]
    (single,) = [g for g in groups if len(g.results) == 1 and len(g.operands) == 3]
    numel = n[0] * n[1]
    per_part = cf.configure_elementwise(numel, torch.float32, 1, H200)
    all_parts = cf.configure_elementwise(numel, torch.float32, 5, H200)
    assert per_part.block > all_parts.block  # the case this test is about: the count matters
    assert config_of(multi).block == per_part.block and config_of(multi).num_warps == per_part.num_warps
    assert config_of(single).block == cf.configure_elementwise(numel, torch.float32, 3, H200).block
