"""The GPT-2 124M AdamW training step compiled for the H200 on any machine (no GPU
needed, nothing runs): the pipeline's ``Compilation`` after its last stage, for the
scripts that read the compiled step (launch_count.py, epilogue_sm90_check.py). The
caller decides ``TRITON_INTERPRET`` before it imports triton (launch_count loads
kernels through the interpreter, epilogue_sm90_check compiles them for sm_90a)."""
from __future__ import annotations


def compile_gpt2_h200(batch: int, precision: str):
    import torch

    from nova import pipeline
    from nova.api import _step_dtype
    from nova.models import GPT, gpt2_124m
    from nova.schedule.devices import DEVICES

    torch.manual_seed(0)
    model = GPT(gpt2_124m())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 50304, (batch, 1024))
    c = pipeline.Compilation(model, (x, x), opt, precision, _step_dtype())
    c.device = DEVICES["H200"]
    pipeline.run(c)
    return c
