"""The cyclic garbage collector paused over a compile's allocation-heavy parts.

A full (generation 2) collection walks every tracked object of the process:
torch's, xDSL's and the model's, about 350k objects after ``import nova`` and a
GPT-2 model, which takes 0.35 s on a 2-core CI machine (more on the H200 host's
slower CPU). CPython starts one when the objects that survived young collections
since the last full one exceed a quarter of the old generation, and a compile
makes that many: torch.export's graph and fake tensors in capture, the ~100k
objects of a decoded step-cache entry. Measured in a second process compiling
GPT-2 from the step cache (``scripts/warm_compile.py``, CI): two full collections
and 200 young ones took 0.6-0.9 s of a 1.7 s warm compile.

``paused()`` keeps the collector off while such a part runs, and at its end
moves the objects made meanwhile into the old generation without walking them
(``gc.freeze()`` then ``gc.unfreeze()``: two list splices, no traversal): they
are the compile's long-lived results (the IR, the captured program), so neither a
young collection nor the count that starts a full one spends time on them. The
cost: cyclic garbage made inside (torch.export's, a few MB) waits for the next
full collection instead of the next young one. Where the process froze objects
itself (``gc.get_freeze_count()`` not 0: a pre-fork server keeping pages
shared), the move is skipped, so its frozen objects stay frozen, and the young
collection after the pause walks the new objects as usual.
"""

from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def paused():
    """The collector off inside; on again afterwards as it was (off stays off),
    with what was made inside moved to the old generation. Nests: only the
    outermost pause turns the collector on again."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            if gc.get_freeze_count() == 0:  # nothing frozen by the process: unfreeze returns only ours
                gc.freeze()
                gc.unfreeze()
            gc.enable()
