"""The models Nova trains: shapes, weight tying, init, and attention variants."""

import math

import pytest
import torch

from nova.models import GPT, MLPLM, GPTConfig, gpt2_124m, gpt_tiny, mlp_46m


def batch(cfg, B=3, T=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = T or cfg.block_size
    x = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    y = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    return x, y


def test_gpt_shapes_and_loss():
    torch.manual_seed(0)
    cfg = gpt_tiny()
    model = GPT(cfg)
    x, y = batch(cfg, T=20)
    assert model.logits(x).shape == (3, 20, cfg.vocab_size)
    loss = model(x, y)
    assert loss.shape == ()
    # Freshly initialised logits are near zero, so the loss is near ln(vocab).
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.1


def test_gpt_rejects_too_long_sequence():
    cfg = gpt_tiny()
    x, y = batch(cfg, T=cfg.block_size + 1)
    with pytest.raises(ValueError, match="block_size"):
        GPT(cfg)(x, y)


def test_ignore_index_targets_do_not_count():
    torch.manual_seed(0)
    cfg = gpt_tiny()
    model = GPT(cfg)
    x, y = batch(cfg, T=8)
    y_masked = y.clone()
    y_masked[:, 4:] = -1
    ref = model(x[:, :4].contiguous(), y[:, :4].contiguous())  # causal: the first 4 positions ignore the rest
    assert torch.allclose(model(x, y_masked), ref, atol=1e-6)


def test_tied_weights_are_one_parameter():
    model = GPT(gpt_tiny())
    assert model.lm_head.weight is model.transformer.wte.weight
    names = [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" not in names  # counted (and optimised) once
    untied = GPT(gpt_tiny(tie_weights=False))
    assert untied.lm_head.weight is not untied.transformer.wte.weight


def test_gpt2_init():
    torch.manual_seed(0)
    cfg = gpt_tiny(n_embd=128)
    model = GPT(cfg)
    for name, p in model.named_parameters():
        if name.endswith(".bias") and "ln_" not in name:
            assert torch.all(p == 0), name
    std = model.transformer.h[0].attn.c_proj.weight.std().item()
    assert abs(std - 0.02 / math.sqrt(2 * cfg.n_layer)) < 0.002
    assert abs(model.transformer.h[0].mlp.c_fc.weight.std().item() - 0.02) < 0.002


def test_manual_and_sdpa_attention_agree_float64():
    torch.manual_seed(0)
    sdpa = GPT(gpt_tiny(attention="sdpa")).double()
    manual = GPT(gpt_tiny(attention="manual")).double()
    manual.load_state_dict(sdpa.state_dict())  # the mask buffer is not in the state_dict
    x, y = batch(sdpa.config, T=24)
    loss_s, loss_m = sdpa(x, y), manual(x, y)
    assert torch.allclose(loss_s, loss_m, rtol=0, atol=1e-12)
    loss_s.backward()
    loss_m.backward()
    for (name, ps), pm in zip(sdpa.named_parameters(), manual.parameters()):
        assert torch.allclose(ps.grad, pm.grad, rtol=1e-9, atol=1e-12), name


def test_manual_mask_buffer():
    model = GPT(gpt_tiny(attention="manual"))
    mask = model.transformer.h[0].attn.bias
    assert mask.shape == (1, 1, 32, 32)
    assert torch.equal(mask[0, 0], torch.tril(torch.ones(32, 32)))


def test_generate_appends_tokens():
    torch.manual_seed(0)
    model = GPT(gpt_tiny())
    idx = torch.zeros(2, 5, dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    out = model.generate(idx, 40, temperature=0.9, top_k=10, generator=g)  # runs past block_size
    assert out.shape == (2, 45)
    assert torch.equal(out[:, :5], idx)


def test_mlp_lm_shapes_and_untied_head():
    torch.manual_seed(0)
    cfg = mlp_46m(vocab_size=256, block_size=16, n_layer=2, n_embd=32, hidden=None)
    assert cfg.hidden == 128
    model = MLPLM(cfg)
    x, y = batch(cfg, T=16)
    assert model.logits(x).shape == (3, 16, 256)
    assert model(x, y).shape == ()
    assert model.head.weight is not model.wte.weight
    assert model.head.bias is None


def test_preset_sizes():
    with torch.device("meta"):  # sizes only: no memory, no init cost
        assert round(GPT(gpt2_124m()).num_params() / 1e6) == 124
        assert round(MLPLM(mlp_46m()).num_params() / 1e6) == 46
    tiny = gpt_tiny()
    assert (tiny.n_layer, tiny.n_head, tiny.n_embd, tiny.vocab_size, tiny.block_size) == (2, 4, 64, 256, 32)


def test_config_validation():
    with pytest.raises(ValueError):
        GPTConfig(vocab_size=256, block_size=8, n_layer=1, n_head=3, n_embd=64)
    with pytest.raises(ValueError):
        gpt_tiny(attention="flash")
