"""Every matmul launch of a compiled training step, as the Triton backend makes it.

``step_matmuls(module, precision)`` walks the final IR of a step (after
``plan_memory``) the way ``nova.backends.triton`` lowers it, with meta tensors in
place of the arena: a step argument or an op's result is a contiguous tensor of its
type (the executable binds every buffer as a contiguous arena view), a layout op
(transpose, broadcast, slice, reshape) is the same strided view the backend makes
(``nova.backends.triton._view``). So each launch's operands have exactly the
shapes, strides and storage offsets the step gives ``nova.codegen.triton.matmul``:

* ``nova.matmul``, alone or heading a ``nova.fused "contraction"`` group (the fuse
  stage's epilogue: ``epilogue`` is true, the launch's template applies the group's
  other ops to the accumulator instead of storing C; a bias is one of them, so
  ``bias`` is false; which ops depends on remat's choices, which vary with the
  depth, so the record says only whether): the config the configure stage wrote,
  and the arguments it called ``configure_matmul`` with (``configure.matmul_arguments``,
  the stage's own function; its layouts: ``configure.operand_layout``, the view chain above
  the operand replayed, so they equal the strides' ``layouts``);
* the fused LM head (``nova.linear_cross_entropy[_backward|_with_grad]``, ``linear_ce.py``):
  per chunk of ``chunk`` token rows, the logits h[r0:r1] @ w^T (forward, and again in
  the backward; once in the merged op) with the op's config, then (backward and
  merged op) dh[r0:r1] = d @ w and dw (+)= d^T @ h[r0:r1]
  (fp32 output; after the first chunk the add is the launch's epilogue), which the
  launcher configures from the operands' strides.

Equal launches are counted (``count`` per step). ``python bench/step_matmuls.py``
regenerates ``bench/gpt2_matmul_shapes.json`` (GPT-2 124M, AdamW, batch 8 and 32,
bf16 and tf32, compiled for the H200 with the step cache off; ~20 s a compile on
the development CPU): ``nova bench matmul --shapes gpt2`` reads it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SHAPES_JSON = Path(__file__).resolve().parent / "gpt2_matmul_shapes.json"
# every committed step shape file (the default, GPT-2 tf32 at batch 16, the 46M MLP LM)
SHAPE_FILES = ("gpt2_matmul_shapes.json", "gpt2_tf32_b16_matmul_shapes.json", "mlp46m_matmul_shapes.json")
GPT2 = dict(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768)
MLP46M = dict(vocab_size=50304, block_size=1024, n_layer=6, n_embd=384)  # the Nova paper's MLP LM (no n_head)
BATCHES = (8, 32)
PRECISIONS = ("bf16", "tf32")
REGENERATE = "python bench/step_matmuls.py"  # writes SHAPES_JSON


def _meta(t) -> torch.Tensor:
    from nova.ir.types import elem_of, shape_of, to_torch_dtype

    return torch.empty(shape_of(t), dtype=to_torch_dtype(elem_of(t)), device="meta")


def _operand(t: torch.Tensor) -> dict:
    return {"shape": list(t.shape), "strides": list(t.stride()), "offset": t.storage_offset()}


def _dname(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _launch(source, a, b, out_dtype, bias, precision_arg, cfg, cfg_args, extra=None, epilogue=False) -> dict:
    """One launch record: the operands as ``matmul`` gets them, and how its config is made."""
    from nova.codegen.triton import matmul as mm

    batched = a.dim() == 3 or b.dim() == 3
    batch = max(a.shape[0] if a.dim() == 3 else 1, b.shape[0] if b.dim() == 3 else 1)
    row = {
        "source": source,
        "M": a.shape[-2], "N": b.shape[-1], "K": a.shape[-1], "batch": batch, "batched": batched,
        "dtype": _dname(a.dtype), "out_dtype": _dname(out_dtype), "bias": bias, "epilogue": epilogue,
        "a": _operand(a), "b": _operand(b),
        "layouts": [mm.layout(a), mm.layout(b)],  # what the strides are (matmul.layout)
        "precision": precision_arg,  # the precision the launch passes to matmul
        "configure": cfg_args,  # configure_matmul's arguments (the configure stage's or the launcher's)
        "config": cfg.to_dict() if cfg is not None else None,
    }  # fmt: skip
    row.update(extra or {})
    return row


def configure_args(M, N, K, batch, dtype, out_dtype, path, a_layout, b_layout, has_bias=False, epilogue=False,
                   prerounded=(), epilogue_sums=False) -> dict:
    args = {"M": M, "N": N, "K": K, "batch": batch, "dtype": dtype, "out_dtype": out_dtype, "precision": path,
            "a_layout": a_layout, "b_layout": b_layout, "has_bias": has_bias}
    if epilogue:  # an epilogue kernel (a fused group's matmul, the LM head's dw +=)
        args["epilogue"] = True
    if epilogue_sums:  # its epilogue sums columns (a bias gradient)
        args["epilogue_sums"] = True
    if prerounded:  # the operands the call declares stored rounded (the configure stage's, dh's)
        args["prerounded"] = list(prerounded)
    return args


def configured(args: dict, device=None):
    """``configure_matmul`` called with a record's ``configure`` arguments (the H200 by default)."""
    from nova.schedule import configurator as cf
    from nova.schedule.devices import DEVICES

    return cf.configure_matmul(
        args["M"], args["N"], args["K"], args["batch"], args["dtype"], args["dtype"], args["out_dtype"],
        args["precision"], args["a_layout"], args["b_layout"], args["has_bias"], device or DEVICES["H200"],
        args.get("epilogue", False), args.get("epilogue_sums", False), prerounded=tuple(args.get("prerounded", ())),
    )  # fmt: skip


def step_matmuls(module, precision: str, device=None) -> list[dict]:
    """Every matmul launch of the step in launch order (see the module docstring);
    ``device`` (a DeviceSpec, default the H200) configures the LM head's launch-time
    matmuls as the launcher would."""
    from xdsl.dialects import func

    from nova.backends.triton import VIEW_OPS, _view, config_of
    from nova.codegen.triton import matmul as mm
    from nova.codegen.triton import linear_ce as lce
    from nova.ir import dialect as nv
    from nova.ir.module import step_func
    from nova.ir.types import elem_of, numel, shape_of, to_torch_dtype
    from nova.schedule.configurator import STEP_MATMUL_PRECISION
    from nova.schedule.devices import DEVICES
    from nova.transforms.configure import group_matmul_arguments, matmul_arguments

    spec = device or DEVICES["H200"]
    prec = STEP_MATMUL_PRECISION[precision]
    fn = step_func(module)
    env = {a: _meta(a.type) for a in fn.body.block.args}
    out: list[dict] = []

    def path_of(dt: torch.dtype) -> str:
        return "bf16" if dt.itemsize == 2 else prec

    for op in fn.body.block.ops:
        if isinstance(op, func.ReturnOp):
            break
        if isinstance(op, VIEW_OPS):
            env[op.results[0]] = _view(op, lambda t: t.contiguous())([env[v] for v in op.operands])[0]
            continue
        for r in op.results:
            env[r] = _meta(r.type)
        group = None
        if isinstance(op, nv.FusedOp) and isinstance(op.contraction(), nv.MatmulOp):
            group, op = op, op.contraction()
            args_of = dict(zip(group.body.block.args, group.operands, strict=True))
            for v in op.operands:
                env[v] = env[args_of[v]]
        if isinstance(op, nv.MatmulOp):
            lhs, rhs = (args_of[v] for v in op.operands) if group else op.operands  # what the layouts look at
            a, b = env[op.operands[0]], env[op.operands[1]]
            res = shape_of(op.results[0].type)
            batch = res[:-2]
            if batch:  # _matmul_run's flat3
                def flat3(t):
                    if t.dim() == 2:
                        return t
                    t = t.expand(*batch, *t.shape[-2:])
                    try:
                        return t.view(-1, *t.shape[-2:])
                    except RuntimeError:
                        return t.contiguous().view(-1, *t.shape[-2:])

                a, b = flat3(a), flat3(b)
            out_dt = to_torch_dtype(elem_of(op.results[0].type))
            # operands their producer stored rounded to tf32 (the tf32_operands stage), as _matmul_run passes them
            pre = nv.prerounded_operands(lhs, rhs, prec)
            # the configure stage's own arguments (a group's matmul with its epilogue and column sums)
            kw = group_matmul_arguments(group, precision) if group else matmul_arguments(op, lhs, rhs, precision)
            args = configure_args(
                kw["M"], kw["N"], kw["K"], kw["batch"], _dname(kw["dtype_a"]), _dname(kw["out_dtype"]),
                kw["precision"], kw["a_layout"], kw["b_layout"], prerounded=kw["prerounded"],
                epilogue=kw["epilogue"], epilogue_sums=kw["epilogue_sums"],
            )  # fmt: skip
            out.append(_launch("nova.matmul", a, b, out_dt, False, prec, config_of(group or op), args,
                               {"prerounded": list(pre)} if pre else None, epilogue=group is not None))  # fmt: skip
        elif isinstance(op, (nv.LinearCrossEntropyOp, nv.LinearCrossEntropyBackwardOp, nv.LinearCrossEntropyWithGradOp)):
            backward = not isinstance(op, nv.LinearCrossEntropyOp)  # the gradients' matmuls
            g_in = 1 if backward else 0
            h, w = env[op.operands[g_in]], env[op.operands[g_in + 1]]
            N, D = h.shape
            V = w.shape[0]
            head = h.dtype
            chunk = min(op.props()["chunk"], max(N, 1))
            cfg = config_of(op)
            # the configure stage's call for the op (configure.py): a full chunk's logits, w read transposed
            op_args = configure_args(min(op.props()["chunk"], max(N, 1)), V, D, 1, _dname(head), _dname(head),
                                     path_of(head), "row", "col")  # fmt: skip
            name = op.name
            buf = torch.empty((chunk, V), dtype=head, device="meta")
            dh = torch.empty((N, D), dtype=head, device="meta")
            acc = torch.empty((V, D), dtype=torch.float32, device="meta")  # dw's f32 accumulator
            # under tf32 the launch rounds w once into a dense w (the logits' B: w^T) and a dense
            # w^T (dh's B: its [V, D] view, K contiguous), linear_ce.HOIST_WEIGHT_TF32
            hoist = lce.hoists_weight(head, prec)
            wl = torch.empty((V, D), dtype=head, device="meta") if hoist else w
            wd = torch.empty((D, V), dtype=head, device="meta").t() if hoist else w

            # the operands the lowering passes as prerounded (linear_ce._lower): h stored rounded by its
            # producer (the logits' A, dw's B), the hoisted weight (the logits' and dh's B), d written
            # rounded by the row kernel (dh's A; not with a bias, whose column sum reads d unrounded)
            tf32_head = head == torch.float32 and prec == "tf32-rn"
            h_pre = ["a"] if tf32_head and nv.tf32_rounded(op.operands[g_in]) else []
            w_pre = ["b"] if hoist else []
            d_pre = ["a"] if tf32_head and lce.PREROUND_TF32 and len(op.operands) == g_in + 3 else []

            def pre(*parts):
                names = sorted({x for p in parts for x in p})
                return {"prerounded": names} if names else {}

            def at_launch(src, a, b, o, extra, epilogue=False, configure_prerounded=()):
                # matmul(cfg=None): the launcher's configure call from the operands' strides (dw's +=:
                # linear_ce.accumulate_into's, the same call as an epilogue kernel); dh's is configured
                # with the operands it passes prerounded (linear_ce's Configs call), dw's without
                args = configure_args(a.shape[-2], b.shape[-1], a.shape[-1], 1, _dname(a.dtype), _dname(o.dtype),
                                      path_of(a.dtype), mm.layout(a), mm.layout(b), epilogue=epilogue,
                                      prerounded=configure_prerounded)  # fmt: skip
                return _launch(src, a, b, o.dtype, False, prec, configured(args, spec), args, extra, epilogue)

            for r0 in range(0, N, chunk):
                r1 = min(N, r0 + chunk)
                z = buf[: r1 - r0]
                extra = {"chunk_rows": r1 - r0}
                out.append(_launch(f"{name}:logits", h[r0:r1], wl.t(), head, False, prec, cfg, op_args,
                                   {**extra, **pre(h_pre, w_pre)}))  # fmt: skip
                if backward:
                    dh_pre = pre(d_pre, w_pre)
                    out.append(at_launch(f"{name}:dh", z, wd, dh[r0:r1], {**extra, **dh_pre},
                                         configure_prerounded=dh_pre.get("prerounded", ())))
                    out.append(at_launch(f"{name}:dw", z.t(), h[r0:r1], acc, {**extra, **pre(["b"] if h_pre else [])},
                                         epilogue=r0 > 0))  # acc += in it  # fmt: skip
    return out


def _key(row: dict) -> str:
    """Launches differ where they may compile or run differently: not in the chunk's
    row offset into h, only in whether each base is 16-byte aligned (TMA's condition)."""
    skip = ("count", "chunk_rows", "a", "b")
    elt = torch.empty((), dtype=getattr(torch, row["dtype"])).element_size()
    ops = {x: dict(row[x], offset=row[x]["offset"] * elt % 16 == 0) for x in ("a", "b")}
    return json.dumps({**{k: v for k, v in row.items() if k not in skip}, **ops}, sort_keys=True)


def signature(row: dict) -> str:
    """What makes two launches the same benchmark (wherever in which step they occur)."""
    return _key({k: v for k, v in row.items() if k != "source"})


def strided(spec: dict, dtype: torch.dtype, device, fill=True) -> torch.Tensor:
    """A tensor with a record's operand shape, strides and storage offset, over fresh
    storage just large enough (random normal values unless ``fill`` is false)."""
    extent = spec["offset"] + 1 + sum((n - 1) * st for n, st in zip(spec["shape"], spec["strides"]) if n)
    make = torch.randn if fill and device != "meta" else torch.empty
    return make(extent, dtype=dtype, device=device).as_strided(spec["shape"], spec["strides"], spec["offset"])


def precompile_launch(launch: dict, cfg, precision: str | None = None) -> list:
    """``matmul.precompile`` of a launch record under ``cfg``: meta tensors with its strides and
    offsets, its bias, output dtype and prerounded operands (the kernels the launch runs)."""
    from nova.codegen.triton import matmul as mm

    dtype = getattr(torch, launch["dtype"])
    a, b = strided(launch["a"], dtype, "meta"), strided(launch["b"], dtype, "meta")
    bias = torch.empty(launch["N"], dtype=dtype, device="meta") if launch["bias"] else None
    return mm.precompile(a, b, bias, cfg=cfg, precision=precision or launch["precision"],
                         out_dtype=getattr(torch, launch["out_dtype"]), prerounded=tuple(launch.get("prerounded", ())))


def committed_launches() -> list[dict]:
    """The distinct launches (by ``signature``) of every committed step shape file, first record each."""
    seen: dict[str, dict] = {}
    for name in SHAPE_FILES:
        for step in json.loads((Path(__file__).resolve().parent / name).read_text())["steps"]:
            for r in step["shapes"]:
                seen.setdefault(signature(r), r)
    return list(seen.values())


def precompile_launch_specs(specs: list[tuple]) -> list[tuple]:
    """``precompile_launch`` of (key, config dict, launch record, precision) (picklable in and
    out, for worker processes): (key, max shared memory in bytes or None, error or None)."""
    from nova.schedule.config import LoweringConfig

    done = []
    for key, cfg_dict, launch, precision in specs:
        try:
            kernels = precompile_launch(launch, LoweringConfig.from_dict(cfg_dict), precision)
            done.append((key, max((k.metadata.shared for k in kernels), default=0), None))
        except Exception as e:  # reported to the caller: a config the compiler rejects
            done.append((key, None, f"{type(e).__name__}: {str(e)[:300]}"))
    return done


def distinct(launches: list[dict]) -> list[dict]:
    """Equal launches merged, with ``count`` (per step), in first-launch order."""
    seen: dict[str, dict] = {}
    for row in launches:
        k = _key(row)
        if k in seen:
            seen[k]["count"] += 1
        else:
            seen[k] = dict(row, count=1)
    return list(seen.values())


def compile_step(model_config: dict, batch: int, precision: str, device=None):
    """pipeline.run of the model's AdamW step (step cache off) for ``device`` (a
    DeviceSpec, default the H200); returns the Compilation. A config without
    ``n_head`` is an MLP LM's (``nova.models.MLPLM``), one with it a GPT's."""
    from nova import pipeline
    from nova.models import GPT, MLPLM, GPTConfig, MLPLMConfig
    from nova.schedule.devices import DEVICES

    torch.manual_seed(0)
    if "n_head" in model_config:
        cfg = GPTConfig(**model_config)
        model = GPT(cfg)
    else:
        cfg = MLPLMConfig(**model_config)
        model = MLPLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size))
    c = pipeline.Compilation(model, (x, x), opt, precision, torch.float32)
    c.device = device or DEVICES["H200"]
    saved = pipeline.SETTINGS  # the step cache off for this compile (NOVA_STEP_CACHE=0)
    pipeline.SETTINGS = dataclasses.replace(saved, step_cache=False)
    try:
        return pipeline.run(c)
    finally:
        pipeline.SETTINGS = saved


def extract(model_config: dict, batch: int, precision: str) -> dict:
    t0 = time.perf_counter()
    c = compile_step(model_config, batch, precision)
    launches = step_matmuls(c.module, precision, c.device)
    return {
        "batch": batch, "precision": precision, "tokens": batch * model_config["block_size"],
        "launches": len(launches), "compile_seconds": round(time.perf_counter() - t0, 1),
        "shapes": distinct(launches),
    }  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=SHAPES_JSON)
    ap.add_argument("--batch", default=",".join(map(str, BATCHES)))
    ap.add_argument("--precisions", default=",".join(PRECISIONS))
    ap.add_argument("--layers", type=int, default=None, help="default: the model's (12 for gpt2, 6 for mlp46m)")
    ap.add_argument("--model", choices=("gpt2", "mlp46m"), default="gpt2",
                    help="gpt2: GPT-2 124M; mlp46m: the Nova paper's MLP LM (issue 9's third target)")
    opts = ap.parse_args(argv)
    os.environ["NOVA_STEP_CACHE"] = "0"
    base = GPT2 if opts.model == "gpt2" else MLP46M
    model = dict(base, n_layer=opts.layers or base["n_layer"])
    steps = []
    for p in opts.precisions.split(","):
        for b in (int(x) for x in opts.batch.split(",")):
            steps.append(extract(model, b, p))
            print(f"{p} batch {b}: {steps[-1]['launches']} matmul launches, {len(steps[-1]['shapes'])} distinct "
                  f"({steps[-1]['compile_seconds']} s)", flush=True)  # fmt: skip
    name = {"gpt2": "GPT-2 124M", "mlp46m": "MLP LM 46M"}[opts.model] if model == base else opts.model
    doc = {"model": name, "config": model, "optimizer": "AdamW",
           "device": "H200", "regenerate": " ".join(["python bench/step_matmuls.py", *(argv if argv is not None else sys.argv[1:])]),
           "steps": steps}
    opts.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {opts.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
