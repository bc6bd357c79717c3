"""The cyclic garbage collector paused over a compile's allocation-heavy parts.

A full (generation 2) collection walks every tracked object of the process:
torch's, xDSL's and the model's, about 350k objects after ``import nova`` and a
GPT-2 model, which takes 0.35 s on a 2-core CI machine (0.8 s on the H200 host's
slower CPU). CPython starts one when the objects that survived younger
collections since the last full one exceed a quarter of the old generation, and
a compile makes that many: torch.export's graph and fake tensors in capture, the
~100k objects of a decoded step-cache entry. ``paused()`` keeps the collector off
while such a part runs; the garbage it leaves is collected by the next young
collection after it (it is not lost), and nothing it keeps alive changes.
"""

from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def paused():
    """The collector off inside; on again afterwards as it was (off stays off).
    Nests: an inner pause leaves the collector off for the outer one."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
