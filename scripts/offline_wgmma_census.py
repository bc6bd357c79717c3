"""The wgmma register race (``nova.codegen.triton.wgmma_check``) looked for without a GPU:
every kernel with a ``tl.dot`` that Nova launches is recorded through the Triton
interpreter (its source, its arguments' types, its constexprs and launch options),
then compiled for sm_90a in a second process by Triton's own ptxas and read back by
its nvdisasm.

    python scripts/offline_wgmma_census.py [--what tiny|shapes|both] [--device H200|H100] [--rule-9a] [--out DIR]

``tiny``: one training step of small GPT and MLP LMs (tf32 and bf16; every kernel kind the
step launches, epilogue kernels and the fused LM head included, at the small shapes'
configs); ``shapes``: every launch of the committed step shape files as ``configure_matmul``
configures it for ``--device`` (``matmul.precompile`` on meta tensors; without their
epilogues). One line a distinct kernel: its PTX has a register-A wgmma or not, the
writes into a pending wgmma's A registers its SASS has, and its registers and spilled
bytes a thread (``ptxas -v``; a spill fails nothing, it is reported). The offline binary follows
Triton's specialization as far as the recorded arguments tell (16-byte divisibility of
pointers and integers, integers equal to 1); the GPU test
(tests/gpu/test_step_matmuls_gpu.py) reads the binaries the GPU runs."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

_ELT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "int64": "i64", "int32": "i32", "bool": "u8",
        "uint8": "u8", "int8": "i8", "float64": "fp64"}


# --------------------------------------------------------------------------- phase 1: record (interpreter)


def _spec(value) -> dict:
    import torch
    from triton.tools.tensor_descriptor import TensorDescriptor

    if isinstance(value, TensorDescriptor):
        return {"desc": _ELT[str(value.base.dtype).removeprefix("torch.")], "box": list(value.block_shape)}
    if isinstance(value, torch.Tensor):
        aligned = value.device.type == "meta" or value.data_ptr() % 16 == 0
        return {"ptr": _ELT[str(value.dtype).removeprefix("torch.")], "aligned": aligned}
    if isinstance(value, bool):
        return {"bool": value}
    if isinstance(value, int):
        return {"int": value}
    if isinstance(value, float):
        return {"float": value}
    if value is None:
        return {"none": True}
    return {"const": repr(value)}


class Recorder:
    """Patches the interpreter's launch to note each Nova kernel with a tl.dot (and run it as before)."""

    def __init__(self):
        self.kernels: dict[str, dict] = {}

    def __enter__(self):
        from triton.runtime.interpreter import InterpretedFunction

        from nova.codegen.triton.source import kernel_source

        real = InterpretedFunction.run
        recorder = self

        def run(fn, *args, grid, warmup, **kwargs):
            try:
                src = kernel_source(fn)
            except KeyError:
                src = None
            if src is not None and "tl.dot" in src:
                names = fn.arg_names
                bound = dict(zip(names, args))
                options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "enable_fp_fusion") if k in kwargs}
                bound.update(kwargs)
                entry = {"name": fn.fn.__name__, "source": src, "options": options,
                         "args": {n: _spec(bound[n]) for n in names if n in bound}}
                recorder.kernels.setdefault(json.dumps(entry, sort_keys=True), entry)
                kwargs.update(options)
            return real(fn, *args, grid=grid, warmup=warmup, **kwargs)

        self._real, InterpretedFunction.run = real, run
        return self

    def __exit__(self, *exc):
        from triton.runtime.interpreter import InterpretedFunction

        InterpretedFunction.run = self._real


def record_tiny(rec: Recorder) -> None:
    import torch

    import nova
    from nova.models import GPT, MLPLM, GPTConfig, MLPLMConfig

    for precision in ("tf32", "bf16"):
        # 256 tokens, widths of 128 and more: wgmma tiles (a 64-row multiple) for the H200
        for make in (lambda: GPT(GPTConfig(vocab_size=512, block_size=64, n_layer=1, n_head=2, n_embd=128)),
                     lambda: MLPLM(MLPLMConfig(vocab_size=512, block_size=64, n_layer=1, n_embd=128, hidden=512))):
            torch.manual_seed(0)
            model = make()
            step = nova.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-3), precision=precision,
                                backend="triton")
            x = torch.randint(0, 512, (4, 64))
            step(x, x)


def record_shapes(rec: Recorder, device: str) -> None:
    import step_matmuls as sm

    from nova.schedule.devices import DEVICES

    for r in sm.committed_launches():
        sm.precompile_launch(r, sm.configured(r["configure"], DEVICES[device]))


def record_launches(rec: Recorder, launches: list[dict]) -> None:
    """Launches given as {M, N, K, dtype, layouts, prerounded, precision, device, config (None: configured),
    stream_k (false: a split's two-pass kernel, not stream-K, which precompile's meta tensors choose),
    settle (false: ``matmul.SETTLE_REGISTER_A`` off, the register-A kernel as it raced)}."""
    import torch

    from nova.codegen.triton import matmul as mm
    from nova.schedule.config import LoweringConfig
    from nova.schedule.devices import DEVICES

    def meta(rows, cols, layout, dtype):
        t = torch.empty((cols, rows) if layout == "col" else (rows, cols), dtype=dtype, device="meta")
        return t.t() if layout == "col" else t

    for L in launches:
        dtype = getattr(torch, L.get("dtype", "float32"))
        la, lb = L["layouts"]
        a, b = meta(L["M"], L["K"], la, dtype), meta(L["K"], L["N"], lb, dtype)
        pre = tuple(L.get("prerounded", ()))
        cfg = (LoweringConfig.from_dict(L["config"]) if L.get("config") else
               mm.configure(L["M"], L["N"], L["K"], 1, dtype, dtype, L["precision"], la, lb, False,
                            DEVICES[L.get("device", "H200")], prerounded=pre))
        keep = mm.STREAM_K_SPLIT, mm.SETTLE_REGISTER_A
        mm.STREAM_K_SPLIT = L.get("stream_k", keep[0])
        mm.SETTLE_REGISTER_A = L.get("settle", keep[1])
        mm.streamk_kernels.cache_clear()  # their sources depend on the two switches, their caches do not
        mm.matmul_kernels.cache_clear()
        try:
            mm.precompile(a, b, cfg=cfg, precision=L["precision"], prerounded=pre)
        finally:
            mm.STREAM_K_SPLIT, mm.SETTLE_REGISTER_A = keep


# --------------------------------------------------------------------------- phase 2: compile for sm_90a


def compile_entry(entry: dict):
    """The recorded kernel compiled for sm_90a: the CompiledKernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from nova.codegen.triton.source import load_kernel

    fn, _ = load_kernel(entry["source"], entry["name"])
    sig, consts, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        spec = entry["args"].get(p.name)
        if spec is None:  # a parameter with its default
            if p.is_constexpr:
                sig[p.name], consts[p.name] = "constexpr", p.default
            continue
        value = next(iter(spec.values()))
        if p.is_constexpr or "none" in spec or "const" in spec:
            sig[p.name] = "constexpr"
            consts[p.name] = None if "none" in spec else value
        elif "desc" in spec:
            sig[p.name] = f"tensordesc<{spec['desc']}{spec['box']}>"
        elif "ptr" in spec:
            sig[p.name] = "*" + spec["ptr"]
            if spec["aligned"]:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif "bool" in spec:
            sig[p.name] = "i1"
        elif "int" in spec:
            v = spec["int"]
            if v == 1 and not p.do_not_specialize:
                sig[p.name], consts[p.name] = "constexpr", 1
            else:
                sig[p.name] = "i64" if abs(v) >= 2**31 else "i32"
                if v % 16 == 0 and not p.do_not_specialize:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[p.name] = "fp32"
    options = dict(entry["options"])
    return triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32), options=options)


def resources(ptx: str) -> dict:
    """{registers, spill_bytes} of a kernel's PTX as Triton's ptxas reports them for sm_90a (``-v``):
    a thread's registers and the bytes it spills to local memory (stores), as the GPU build has them."""
    import re

    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(90).path  # the ptxas compile_entry's sm_90a build ran
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "kernel.ptx"
        src.write_text(ptx)
        info = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", str(src), "-o", str(Path(d) / "kernel.cubin")],
                              capture_output=True, text=True, check=True).stderr
    regs = re.findall(r"Used (\d+) registers", info)
    spills = re.findall(r"(\d+) bytes spill stores", info)
    return {"registers": max(map(int, regs)) if regs else None, "spill_bytes": sum(map(int, spills))}


def census(entries: list[dict]) -> list[dict]:
    from nova.codegen.triton import wgmma_check as wc

    lines = []
    for e in entries:
        head = [ln for ln in e["source"].splitlines() if ln.startswith("# ")][:3]
        line = {"kernel": e["name"], "header": " | ".join(h[2:] for h in head), "options": e["options"]}
        try:
            k = compile_entry(e)
            line.update(resources(k.asm["ptx"]))
            # the build's shared memory and warps (a partitioned loop: its producer and computing groups)
            line["shared_bytes"], line["warps"] = k.metadata.shared, k.metadata.num_warps
            line["register_a"] = wc.has_register_a(k.asm["ptx"])
            line["hazards"] = len(wc.hazards(wc.sass_of(k.asm["cubin"]))) if line["register_a"] else 0
        except Exception as ex:  # noqa: BLE001 (reported per kernel)
            line["error"] = f"{type(ex).__name__}: {str(ex)[:200]}"
        lines.append(line)
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--what", choices=("tiny", "shapes", "both"), default="both")
    p.add_argument("--launches", default=None, help="a JSON file of launches (record_launches) instead of --what")
    p.add_argument("--rule-9a", action="store_true",
                   help="configurator.TF32_SHARED_OPERANDS on: every tf32 kernel stages both operands (default off: "
                        "rule 2b's staging, register-A kernels settled)")
    p.add_argument("--device", default="H200")
    p.add_argument("--out", default=None)
    p.add_argument("--compile", default=None, help=argparse.SUPPRESS)  # phase 2, in its own process
    o = p.parse_args(argv)
    if o.compile:
        lines = census(json.loads(Path(o.compile).read_text()))
        Path(o.compile).with_suffix(".out.json").write_text(json.dumps(lines))
        return 0
    if os.environ.get("TRITON_INTERPRET") != "1":  # phase 1 needs the interpreter from the first import
        return subprocess.call([sys.executable, *sys.argv], env={**os.environ, "TRITON_INTERPRET": "1"})
    if o.rule_9a:
        from nova.schedule import configurator

        configurator.TF32_SHARED_OPERANDS = True
    with Recorder() as rec:
        if o.launches:
            record_launches(rec, json.loads(Path(o.launches).read_text()))
        else:
            if o.what in ("tiny", "both"):
                record_tiny(rec)
            if o.what in ("shapes", "both"):
                record_shapes(rec, o.device)
    entries = list(rec.kernels.values())
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "kernels.json"
        path.write_text(json.dumps(entries))
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        subprocess.run([sys.executable, __file__, "--compile", str(path)], env=env, check=True)
        lines = json.loads(path.with_suffix(".out.json").read_text())
    for line in lines:
        print(json.dumps(line), flush=True)
    bad = [x for x in lines if x.get("hazards")]
    print(f"{len(lines)} kernels with tl.dot: {sum(bool(x.get('register_a')) for x in lines)} with a register-A "
          f"wgmma, {len(bad)} with writes into a pending wgmma's A registers, "
          f"{sum(bool(x.get('spill_bytes')) for x in lines)} spilling registers, "
          f"{sum('error' in x for x in lines)} not compiled")
    if o.out:
        Path(o.out).mkdir(parents=True, exist_ok=True)
        (Path(o.out) / f"offline_wgmma_census_{o.what}_{o.device}.json").write_text(json.dumps(lines, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
