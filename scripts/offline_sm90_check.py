#!/usr/bin/env python3
"""Offline sm_90 compile of every matmul config the configure stage picks for the GPU
test models and GPT-2 124M at HEAD (pointer-load variant; smem vs the H200's limit).

    NOVA_CACHE_DIR=/tmp/nova-offline python scripts/offline_sm90_check.py

No GPU needed: Triton's bundled ptxas compiles for sm_90. Run it after a configurator
change when the H200 is out of reach; a config that does not compile or fit says FAIL."""
import torch
import triton

triton.knobs.runtime.interpret = False
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from nova import pipeline
from nova.api import _step_dtype
from nova.ir import dialect as nv
from nova.ir.types import shape_of, elem_of, to_torch_dtype
from nova.schedule.devices import DEVICES
from nova.schedule.config import LoweringConfig
from nova.schedule.configurator import STEP_MATMUL_PRECISION
from nova.backends.triton import config_of
from nova.codegen.triton.matmul import matmul_source, stage_source, _TORCH_TO_NAME
from nova.codegen.triton.source import load_kernel
from nova.models import GPT, MLPLM, MLPLMConfig, gpt_tiny, gpt2_124m

def models():
    torch.manual_seed(0)
    yield "mlp", MLPLM(MLPLMConfig(vocab_size=256, block_size=32, n_layer=2, n_embd=64, hidden=128)), (4, 32), 256
    for k in ("manual", "sdpa"):
        yield k, GPT(gpt_tiny(attention=k, bias=False)), (4, 32), 256
    yield "gpt2", GPT(gpt2_124m()), (8, 1024), 50304

seen = {}
for name, m, (B, T), V in models():
    for prec in ("fp32", "tf32", "bf16"):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        x = torch.randint(0, V, (B, T))
        c = pipeline.Compilation(m, (x, x), opt, prec, _step_dtype())
        c.device = DEVICES["H200"]
        pipeline.run(c)
        for op in c.module.walk():
            if isinstance(op, nv.MatmulOp):
                cfg = config_of(op)
                dt = _TORCH_TO_NAME[to_torch_dtype(elem_of(op.operands[0].type))]
                p = STEP_MATMUL_PRECISION[prec] if dt == "float32" else "bf16"
                key = (cfg.block_m, cfg.block_n, cfg.block_k, cfg.group_m, min(cfg.split_k, 2), cfg.num_warps, cfg.num_stages, dt, p)
                seen.setdefault(key, (name, prec, shape_of(op.operands[0].type), shape_of(op.operands[1].type), cfg))
print(len(seen), "distinct matmul kernels")
limit = DEVICES["H200"].smem_per_block
worst = 0
for key, (name, prec, sa, sb, cfg) in seen.items():
    dt, p = key[-2], key[-1]
    src_cfg = LoweringConfig(kind="matmul", block_m=cfg.block_m, block_n=cfg.block_n, block_k=cfg.block_k,
                             group_m=cfg.group_m, split_k=2 if cfg.split_k > 1 else 1)
    pre = tuple(x for x in ("a", "b") if f"stage_{x}" in cfg.instruction.split("+"))
    fn, _ = load_kernel(matmul_source(src_cfg, has_bias=False, precision=p, in_dtype=dt, out_dtype=dt, prerounded=pre), "matmul_kernel")
    ptr = {"float32": "*fp32", "bfloat16": "*bf16"}[dt]
    sig, consts, attrs = {}, {"EVEN": True}, {}
    for i, a in enumerate(fn.arg_names):
        if a == "EVEN" or a in ("stride_ak", "stride_bn", "stride_cn"):
            sig[a] = "constexpr"; consts.setdefault(a, 1)
        else:
            sig[a] = (ptr if a != "c_ptr" or cfg.split_k == 1 else "*fp32") if a.endswith("_ptr") else "i32"
            if a.endswith("_ptr") or a in ("M", "N", "K") or a.startswith("stride"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    k = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    worst = max(worst, k.metadata.shared)
    ok = k.metadata.shared + 1024 <= limit
    print(("ok  " if ok else "FAIL"), name, prec, sa, sb, f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages} sk{cfg.split_k}", cfg.instruction, k.metadata.shared)
fn, _ = load_kernel(stage_source(), "stage_kernel")
sig = {a: ("*fp32" if a.endswith("_ptr") else "i32") for a in fn.arg_names}
k = triton.compile(ASTSource(fn, sig, {}, {}), target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
print("stage kernel compiled for sm_90, shared", k.metadata.shared, "| worst matmul shared", worst, "limit", limit)
