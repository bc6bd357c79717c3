"""Tiny random-initialised configs of Hugging Face transformers' causal and
masked LMs (no downloads), wrapped as Nova's contract wants them (the batch
in, the loss out), with batches that carry what real training feeds: a
padding ``attention_mask``, labels with -100 at padded positions and BERT's
``token_type_ids``. Shared by tests/numerics/test_hf_models.py (against eager
PyTorch) and tests/kernels/test_triton_step_interpreted.py (the Triton backend
against the reference executor)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers

V, T, B, STEPS = 48, 12, 2, 6
MASKED = ("bert", "roberta")  # masked LMs: token_type_ids in the batch


def configs():
    tf = transformers
    small = dict(vocab_size=V, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=32)
    return {
        "gpt2": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=V, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
        "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**small, hidden_size=32, intermediate_size=48,
                                                            num_key_value_heads=2)),  # grouped-query heads, untied head
        "neox": lambda: tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**small, hidden_size=32, intermediate_size=48,
                                                               hidden_dropout=0.0, attention_dropout=0.0)),
        "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**small, hidden_size=32, intermediate_size=48,
                                                            num_key_value_heads=1, tie_word_embeddings=True)),
        "bert": lambda: tf.BertForMaskedLM(tf.BertConfig(**small, hidden_size=32, intermediate_size=48,
                                                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
        # int32 position ids from input_ids.ne(pad).int() (captured in int64, proved in range)
        "roberta": lambda: tf.RobertaForMaskedLM(tf.RobertaConfig(**small, hidden_size=32, intermediate_size=48,
                                                                  type_vocab_size=2, hidden_dropout_prob=0.0,
                                                                  attention_probs_dropout_prob=0.0)),
        # relative position buckets, an encoder-decoder with cross-attention, labels shifted right in place
        # (copy, slice_scatter), RMS-style T5LayerNorm
        "t5": lambda: tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=V, d_model=32, d_kv=8, d_ff=48, num_layers=2,
                                                                 num_heads=4, decoder_start_token_id=0,
                                                                 dropout_rate=0.0)),
        # ALiBi from a Python base to the power of a tensor (pow.Scalar), reciprocal
        "mpt": lambda: tf.MptForCausalLM(tf.MptConfig(vocab_size=V, n_layers=2, n_heads=4, d_model=32, max_seq_len=32)),
        # ALiBi: its slopes' exponents an int32 arange
        "bloom": lambda: tf.BloomForCausalLM(tf.BloomConfig(vocab_size=V, n_layer=2, n_head=4, hidden_size=32,
                                                            hidden_dropout=0.0, attention_dropout=0.0)),
    }  # fmt: skip


class CausalLM(nn.Module):
    """What a training loop calls: ids, padding mask and labels in, the loss out.

    In float32 the loss is transformers' own (``labels=``: its label shifting
    with ``pad`` and slicing). That code upcasts the logits with ``.float()``,
    which in a float64 model computes the loss in float32 on both sides, so
    their gradients agree only to float32 rounding (5e-8): in float64 this
    wrapper applies the same shift without the upcast."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, ids, mask, labels):
        if next(self.parameters()).dtype != torch.float64:
            return self.m(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
        logits = self.m(input_ids=ids, attention_mask=mask, use_cache=False).logits
        shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), shifted.reshape(-1), ignore_index=-100)


class Seq2SeqLM(nn.Module):
    """An encoder-decoder as its training loop calls it: the decoder's inputs are
    the labels shifted right inside the model (-100 becomes the pad id there)."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, ids, mask, labels):
        return self.m(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss


class MaskedLM(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, ids, mask, token_types, labels):
        return self.m(input_ids=ids, attention_mask=mask, token_type_ids=token_types, labels=labels).loss


def make_batches(family: str, n: int):
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(n):
        ids = torch.randint(0, V, (B, T), generator=g)
        mask = torch.ones(B, T, dtype=torch.long)
        mask[1, T - 3 :] = 0  # right padding in the second sequence
        if family in MASKED:
            labels = torch.full((B, T), -100)
            pick = torch.rand(B, T, generator=g) < 0.3
            pick[0, 0] = True
            labels[pick] = ids[pick]
            labels[mask == 0] = -100
            types = (torch.arange(T) >= T // 2).long().expand(B, T).contiguous()
            out.append((ids, mask, types, labels))
        else:
            labels = ids.masked_fill(mask == 0, -100)
            out.append((ids, mask, labels))
    return out


def build(family: str, attn: str, dtype: torch.dtype):
    torch.manual_seed(0)
    with default_dtype(dtype):
        m = configs()[family]()
    m.config._attn_implementation = attn
    m = m.to(dtype).train()
    return MaskedLM(m) if family in MASKED else Seq2SeqLM(m) if family == "t5" else CausalLM(m)


class default_dtype:
    def __init__(self, dtype):
        self.dtype = dtype

    def __enter__(self):
        self.saved = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)

    def __exit__(self, *exc):
        torch.set_default_dtype(self.saved)



def key_bias_mask(name: str, p: torch.Tensor, heads: int = 4) -> torch.Tensor:
    """The elements of ``p`` that are a key projection's bias."""
    mask = torch.zeros_like(p, dtype=torch.bool)
    if name.endswith(("k_proj.bias", "attention.self.key.bias")):
        mask[:] = True
    elif name.endswith(("attn.c_attn.bias", "qkv.bias")):  # [q | k | v]
        d = p.shape[0] // 3
        mask[d : 2 * d] = True
    elif name.endswith("attention.query_key_value.bias"):  # GPT-NeoX: per head [q, k, v]
        mask.view(heads, 3, -1)[:, 1] = True
    return mask


