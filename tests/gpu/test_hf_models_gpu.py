"""transformers' models (tests/hf_models.py: GPT-2, Llama with grouped-query
heads and rotary embeddings, Qwen2, BERT with token types; padding masks and
label shifting) on the H200: the Triton backend against the reference
executor, fp32 and bf16, 5 AdamW steps. Key biases are left out of the
parameter comparison (their true gradient is exactly 0: tests/numerics/test_hf_models.py)."""

from __future__ import annotations

import copy

import pytest
import torch

import nova

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TOL = {"fp32": 1e-4, "bf16": 2e-2}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("family,attn", [("llama", "sdpa"), ("gpt2", "eager"), ("qwen2", "sdpa"), ("bert", "sdpa"),
                                         ("roberta", "sdpa"), ("bloom", "eager"), ("mpt", "eager"), ("t5", "sdpa")])
def test_triton_step_trains_transformers_models_like_the_reference(family, attn, precision):
    from hf_models import build, key_bias_mask, make_batches

    ref = build(family, attn, torch.float32).cuda()
    mine = copy.deepcopy(ref)
    oracle = nova.compile(ref, torch.optim.AdamW(ref.parameters(), lr=1e-3), precision=precision, backend="reference")
    step = nova.compile(mine, torch.optim.AdamW(mine.parameters(), lr=1e-3), precision=precision, backend="triton")
    worst = 0.0
    for i, batch in enumerate(make_batches(family, 5)):
        batch = [t.cuda() for t in batch]
        loss, ref_loss = step(*batch), oracle(*batch)
        assert abs(loss.item() - ref_loss.item()) <= TOL[precision] * abs(ref_loss.item()), i
        for (n, p), q in zip(mine.named_parameters(), ref.parameters()):
            keep = ~key_bias_mask(n, p)
            diff = ((p - q)[keep].float().norm() / q[keep].float().norm().clamp_min(1e-12)).item()
            worst = max(worst, diff)
            assert diff <= TOL[precision], (i, n, diff)
    print(f"{family} {attn} {precision}: worst parameter {worst:.2e}")
