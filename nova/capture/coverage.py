"""Prints docs/ops.md, the coverage table: `python -m nova.capture.coverage > docs/ops.md`.

A test checks the committed file against this output, so the table cannot drift
from the op-mapping table and the VJP registry.
"""

from __future__ import annotations

from nova.autodiff.rules import NON_DIFFERENTIABLE, VJP_RULES
from nova.capture.aten import CONVERTERS, IGNORED
from nova.ir.dialect import NOVA_OPS


MODELS = """\
## Model code that is tested

Each of these trains 6+ AdamW steps through Nova and through eager PyTorch from the
same weights and batches, loss and every parameter within 1e-9 relative in float64
and 1e-4 in float32 (`tests/numerics/test_hf_models.py`), and on the Triton backend
against the reference executor (`tests/kernels/test_triton_step_interpreted.py` in
the interpreter, `tests/gpu/test_hf_models_gpu.py` on the H200):

| model | what it exercises |
|---|---|
| transformers `GPT2LMHeadModel` (eager, sdpa) | learned positions, tied head, fused qkv `Conv1D`, label shifting with `pad` |
| transformers `LlamaForCausalLM` (eager, sdpa) | RMSNorm in float32, rotary embeddings (`cat`, `cos`, `sin`), grouped-query heads (`repeat_kv`), gated SiLU MLP, untied head |
| transformers `GPTNeoXForCausalLM` (eager, sdpa) | partial rotary, interleaved qkv, parallel residual |
| transformers `Qwen2ForCausalLM` (eager, sdpa) | qkv biases, one key/value head, tied head |
| transformers `BertForMaskedLM` (eager, sdpa) | `token_type_ids` gathers, `padding_idx`, masked-LM labels |
| transformers `RobertaForMaskedLM` (eager, sdpa; against eager only) | int32 position ids from `input_ids.ne(pad).int()` and `cumsum` (computed in int64, proved in int32's range) |
| transformers `BloomForCausalLM` (eager, sdpa; against eager only) | ALiBi (an int32 `arange` of exponents, `pow`), `baddbmm` scores |
| transformers `MptForCausalLM` (eager, sdpa; against eager only, not sdpa in float64: eager's own loss is NaN there) | ALiBi from a Python base to a tensor power (`pow.Scalar`), `reciprocal` |
| transformers `T5ForConditionalGeneration` (eager, sdpa; against eager only) | an encoder-decoder with cross-attention, relative position buckets, labels shifted right by writes into a fresh tensor (`copy`, `slice_scatter`, `select_scatter`) |
| a nanoGPT-style GPT | `masked_fill(~mask, -inf)`, tied head, `ignore_index` |
| transformers `WhisperForConditionalGeneration` (float64, against eager only) | log-mel features through 1-D convolutions (one strided), an encoder-decoder |
| transformers `ViTForImageClassification`, `CLIPVisionModelWithProjection` (against eager only) | the patch embedding, a convolution with kernel == stride, as a reshape and a matmul of the patches (pixels past the last whole patch left out, as torch does), class token |
| transformers `ResNetForImageClassification` (basic and bottleneck), `ConvNextForImageClassification` (float64, 2 SGD steps, against eager only: `tests/numerics/test_hf_vision.py`) | convolutions, batch norm in training (the running statistics written into the buffers), max pooling, adaptive average pooling; depthwise 7x7 convolutions, channels-last LayerNorm, layer scale |

All of them with a padding `attention_mask` (boolean masks, SDPA `attn_mask`,
`__and__`, `index.Tensor`, `new_ones`) and labels at -100. `tests/test_capture_errors.py`
covers SDPA with `enable_gqa`, boolean and additive masks and `scale`, `cumsum`
position ids, `gather`, `flip`, `clamp`, `minimum`; `tests/numerics/test_loss_edge_cases.py`
covers `label_smoothing`, `reduction="none"` and a batch whose targets are all ignored.

Convolutions (1-, 2-, 3-D, stride, zero padding, dilation, groups) are a matmul over
their patches (`tests/numerics/test_convolution.py`); a transposed convolution is the plain
convolution of its input spread `stride` apart and padded (cropped where its padding passes
the kernel), with its weight swapped per group and flipped.

Batch norm is built from plain ops as PyTorch's own decomposition computes it (per channel,
in f32 for a 16-bit input): in training from the batch's statistics, and the running mean,
the running (unbiased) variance and `num_batches_tracked` are the step's `buffer` results,
written into the model's buffers in place like the parameters (and, like them, not written by
a step that fails); in eval mode from the running statistics; `track_running_stats=False`
and no affine weights too (`tests/numerics/test_batch_norm.py`). Not with data parallelism
(each rank's statistics would drift apart: refused), nor with `momentum=None` (its
cumulative average reads the batch count on the host: torch.export refuses it).

`cross_entropy` with class weights is built from plain ops as ATen computes it (log_softmax,
the targets' weighted log-probabilities, "mean" over the targets' weights, label smoothing),
not the fused kernel (`tests/numerics/test_loss_edge_cases.py`); so is `cross_entropy` with
class-probability targets [N, C] (ATen's `cross_entropy_loss_prob_target`: "mean" over N,
label smoothing, class weights, targets that carry gradients).

Pooling is built from the window's taps, one strided slice each, as the convolutions are
(`tests/numerics/test_vision_layers.py`): max pooling 1-, 2- and 3-D (stride, padding, dilation,
ceil mode; a tap replaces the running maximum where it is greater or NaN, so equal maxima give
the gradient to the first, as eager; its indices too), average pooling (eager's divisors:
padding counted or not, ceil mode, `divisor_override`), adaptive average pooling (eager's
windows, of unequal lengths too), nearest and (bi-, tri-)linear upsampling (eager's source
indices and weights, `align_corners` or not), group norm;
a small ResNet (conv, batch norm, max pool, residual blocks, global pooling) trains like eager.

`log1p` and `expm1` are ops of their own (`nova.log1p`, `nova.expm1`: accurate near 0, as
torch's), so binary cross-entropy (with logits and `pos_weight` too), softplus, logsigmoid,
Mish, ELU, SELU and CELU are captured; so are `isnan` / `isinf` / `isfinite` (compares; KL
divergence's), and the 1- and 2-norm (`F.normalize`, cosine similarity; the 2-norm's gradient
at a zero vector is 0, as torch's) (`tests/numerics/test_losses_activations.py`).

In-place dropout (`nn.Dropout(inplace=True)`), which PyTorch draws on the CPU as
`bernoulli(1 - p)`, scales and multiplies in, is captured as that: `bernoulli` is Nova's
dropout mask's draw (torch's distribution, not its bit stream).

Any buffer the forward writes in place (`add_`, `copy_`, `mul_` on a registered buffer, batch
norm's statistics) is written the same way: torch.export turns the write into the buffer's new
value, which the step returns and writes back.

Not covered (a clear `nova.UnsupportedError`): bicubic and area upsampling, adaptive max
pooling, vector norms other than the 1- and 2-norm, `cumprod`, a forward that writes
a parameter or a batch tensor in place, `sort`/`topk`, `erfinv`, integer `bitwise`
ops other than on booleans, data-dependent shapes (boolean-mask indexing), `ignore_index`
with class-probability targets (eager refuses it too), `dropout_p >= 1` in SDPA, int32 / int16 /
int8 / uint8 parameters and buffers, and values of those dtypes whose range Nova cannot bound
(`nova/capture/int_range.py`: they are computed in int64, exact only where eager would not wrap). A
batch of those dtypes (token ids, pixels) is the step's int64 argument, copied in widened.
"""


def render() -> str:
    lines = [
        "# Op coverage",
        "",
        "Generated by `python -m nova.capture.coverage > docs/ops.md`; a test keeps it current.",
        "",
        MODELS,
        "## How an op is captured",
        "",
        "`torch.export` records ATen ops. An op with a converter below becomes nova ops;",
        "an op without one is first decomposed through PyTorch's own decomposition table",
        "(`torch.export.default_decompositions()`, towards core ATen; ops Nova converts are",
        "never decomposed, so `linear`, `layer_norm`, `scaled_dot_product_attention`,",
        "`cross_entropy` and `gelu` stay whole for fusion). Tested this way: `pad`,",
        "`where.ScalarOther`, `diff`, `tril`, `triu`, `stack`, `rms_norm`, `einsum`,",
        "`repeat_interleave`, `mse_loss`. What is still left is reported, all at once, by",
        "`nova.UnsupportedError` at compile time with each op's source line; so are arguments",
        "a converter does not take (e.g. class-probability targets in `cross_entropy`). SDPA's",
        "`dropout_p` runs inside the attention kernels, with Nova's own random bits",
        "(`nova.rng`: torch's distribution, not its bit stream).",
        "",
        "Integer and boolean tensors are first-class: i64 arithmetic, compares, logic on",
        "booleans (as `where`), `cumsum`, indexing (`gather`, `index`, `index_select` as",
        "row reads of `embedding`, with out-of-range indices raising `IndexError`). Values",
        "computed from static shapes alone (position ids, causal masks) are folded at",
        "compile time by the `fold` stage.",
        "",
        "## PyTorch ops Nova converts",
        "",
        "| ATen op | converter |",
        "|---|---|",
    ]
    for target, fn in sorted(CONVERTERS.items(), key=lambda kv: str(kv[0])):
        lines.append(f"| `{target}` | `{fn.__module__.rsplit('.', 1)[-1]}.{fn.__name__}` |")
    for target in sorted(IGNORED, key=str):
        lines.append(f"| `{target}` | ignored (metadata assertion) |")
    lines += ["", "## nova dialect ops and their reverse-mode rules", "", "| op | VJP |", "|---|---|"]
    for op in NOVA_OPS:
        if op in NON_DIFFERENTIABLE:
            kind = "no gradient / second order unsupported"
        elif op in VJP_RULES:
            kind = f"`{VJP_RULES[op].__name__}`"
        else:
            kind = "**missing**"
        lines.append(f"| `{op.name}` | {kind} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render(), end="")
