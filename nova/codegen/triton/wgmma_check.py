"""A check of a compiled sm_90 kernel's machine code (SASS) for a race Triton 3.6 can
emit: a wgmma (``HGMMA``) that reads its A operand from registers, still in flight
(``WARPGROUP.DEPBAR.LE gsb0, N`` with N > 0 leaves it pending), while a later
instruction writes one of those registers. PTX calls that undefined; on the GPU it
reads the new values for part of the tile. Triton splits a register-A ``tl.dot`` into
one wgmma per 8 (tf32) or 16 (16-bit) K and pipelines them with N = 3 pending across
the loop's back edge, and ptxas may give the next iteration's A values the same
registers (found on an H100 at e1ea8b7: the 46M MLP's 384x1536x8192 tf32 weight
gradient, 128x256x32 split 7 with only B staged, 2.5e-2 off and different launch to
launch; the unsplit kernel of the same tile was safe because ptxas serialized its
wgmmas itself, C7515).

``hazards(sass)`` simulates each loop body twice (the back edge's pending wgmmas
into the next iteration) and the whole listing once in order, and returns one line
per write into a pending wgmma's A registers. ``check_kernel(kernel, what)`` runs it
on a compiled Triton kernel's cubin through the nvdisasm Triton ships, and raises
``WgmmaRegisterRace`` naming the kernel and the first hazards.

Unless ``NOVA_WGMMA_CHECK=0``, ``install()`` (called when ``source.load_kernel`` first
loads a compiled kernel) chains Triton's ``jit_post_compile_hook`` so that every kernel
Nova generates (``nova_generated_*`` modules) is checked when Triton compiles it or takes
it from its cache, before its first launch: only kernels whose PTX has a register-A
wgmma are disassembled (the rest pass on a text search), and a cubin found safe is
remembered under the Nova cache directory (``wgmma_checked/<sha256>``). A racing kernel
is dropped from Triton's in-memory cache and the launch raises. On by default since
4e0b99b's measurement on an H100 (``bash scripts/gpu_check.sh wgmma-cost``: GPT-2 tf32, 2
layers, batch 8, in a second process with the step cache on disk, 2.62 s without it and 2.43
with; the cold compile 8.79 and 8.67 s): a silent wrong result is what it stops, and it costs
no measurable compile time. (At 7098a36 the 46M MLP's warm compile took 6.4 s with it against
0.5 without; a warm process profiled at 435d455 spent 0.02 s of its 7.5 s in the check
itself.) Every configured register-A kernel is settled besides (``matmul.SETTLE_REGISTER_A``:
tests/gpu/test_step_matmuls_gpu.py reads every step launch's SASS)."""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from collections import deque

_INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_TARGET = re.compile(r"`\((\.L_x_\d+)\)")
_DEPBAR = re.compile(r"gsb0,\s*(0x[0-9a-f]+|\d+)")
# a PTX wgmma whose A is a register list: "{d...}, {a...}, b-desc" (A from shared memory: "{d...}, a-desc")
_PTX_REGISTER_A = re.compile(r"wgmma\.mma_async[^;]*?\}\s*,\s*\{")
# opcodes whose first operand is not a register they write
_NO_DEST = ("ST", "STS", "STG", "STL", "RED", "REDG", "BAR", "BRA", "EXIT", "RET", "CALL", "SYNCS", "WARPGROUP",
            "DEPBAR", "UTMALDG", "UTMASTG", "UTMACMDFLUSH", "UTMAPF", "MEMBAR", "FENCE", "NOP", "CCTL", "ERRBAR",
            "WARPSYNC", "BSSY", "BSYNC", "ELECT", "HGMMA", "YIELD", "STSM", "UBLKCP", "ACQBULK", "BMOV", "R2P")
A_REGS = 4  # an m64 x k8 tf32 (or k16 16-bit) A fragment: four 32-bit registers a thread


class WgmmaRegisterRace(RuntimeError):
    """A compiled kernel writes registers a pending wgmma still reads."""


def _parse(sass: str) -> tuple[list[tuple[str, str, str]], dict[str, int]]:
    insns, labels = [], {}
    for line in sass.splitlines():
        m = _LABEL.match(line)
        if m:
            labels[m.group(1)] = len(insns)
            continue
        m = _INSN.search(line)
        if m:
            insns.append((m.group(1), m.group(3), m.group(4).strip()))
    return insns, labels


def _written(op: str, args: str) -> set[int]:
    """The registers an instruction writes: its destination, the first of its first two operands
    that is a general register (a predicate may come first, as in SHFL's), widened by .64 / .128."""
    if op.split(".")[0] in _NO_DEST or not args:
        return set()
    m = next((m for x in args.split(",")[:2] if (m := re.fullmatch(r"R(\d+)", x.strip()))), None)
    if m is None:  # a predicate, uniform register or RZ: no general register written
        return set()
    r = int(m.group(1))
    width = 4 if ".128" in op or op.endswith(".4") else 2 if ".64" in op or ".WIDE" in op or op.endswith(".2") else 1
    return set(range(r, r + width))


def _simulate(insns, start: int, stop: int, passes: int, what: str) -> list[str]:
    pending: deque[tuple[str, set[int]]] = deque()
    found = []
    for _ in range(passes):
        for addr, op, args in insns[start:stop]:
            if op.startswith("HGMMA"):
                parts = [p.strip() for p in args.split(",")]
                a = re.fullmatch(r"R(\d+)", parts[1]) if len(parts) > 1 else None
                pending.append((addr, set(range(int(a.group(1)), int(a.group(1)) + A_REGS)) if a else set()))
                continue
            if op.startswith("WARPGROUP.DEPBAR"):
                m = _DEPBAR.search(args)
                keep = int(m.group(1), 0) if m else 0
                while len(pending) > keep:
                    pending.popleft()
                continue
            hit = _written(op, args) & set().union(*(regs for _, regs in pending)) if pending else set()
            if hit:
                src = next(a for a, regs in pending if regs & hit)
                found.append(f"{what}: /*{addr}*/ {op} {args} writes R{min(hit)} of the wgmma at /*{src}*/, still pending")
    return found


def hazards(sass: str, what: str = "kernel") -> list[str]:
    """Writes into the A registers of a wgmma still in flight, one line each (none: safe)."""
    insns, labels = _parse(sass)
    found = _simulate(insns, 0, len(insns), 1, what)
    for i, (_, op, args) in enumerate(insns):
        m = _TARGET.search(args) if op.startswith("BRA") else None
        if m and m.group(1) in labels and labels[m.group(1)] <= i:  # a back edge: the loop body twice
            found += _simulate(insns, labels[m.group(1)], i + 1, 2, f"{what} (loop at {m.group(1)})")
    return list(dict.fromkeys(found))


@functools.lru_cache(maxsize=1)
def nvdisasm() -> str | None:
    """The nvdisasm Triton ships (or one on PATH); None if neither."""
    try:
        import triton

        path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
        if os.path.exists(path):
            return path
    except ImportError:  # pragma: no cover - triton is a dependency
        pass
    return shutil.which("nvdisasm")


def sass_of(cubin: bytes) -> str:
    tool = nvdisasm()
    if tool is None:
        raise WgmmaRegisterRace("wgmma_check: no nvdisasm (Triton's backends/nvidia/bin or PATH) to read the kernel's "
                                "machine code (NOVA_WGMMA_CHECK=0 launches unchecked)")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, "-c", f.name], check=True, capture_output=True, text=True).stdout


def check_kernel(kernel, what: str) -> None:
    """Raise ``WgmmaRegisterRace`` if a compiled Triton kernel (``kernel.asm["cubin"]``)
    for sm_90 writes a pending wgmma's A registers. Kernels without HGMMA pass at once."""
    asm = getattr(kernel, "asm", {}) or {}
    if "wgmma" not in asm.get("ptx", "wgmma") or "cubin" not in asm:
        return
    found = hazards(sass_of(asm["cubin"]), what)
    if found:
        raise WgmmaRegisterRace(
            f"{what}: the compiled kernel races with its own wgmmas ({len(found)} writes into the registers of an "
            f"A operand still in flight; Triton's register-A wgmma pipelining): " + "; ".join(found[:3])
            + ". Choose a config whose A reaches the MMA through shared memory (stage A) or fewer stages.")


def has_register_a(ptx: str) -> bool:
    """Whether the PTX has a wgmma reading A from registers (the only kind that can race)."""
    return bool(_PTX_REGISTER_A.search(ptx))


def _marker(cubin: bytes):
    from nova.config import cache_dir

    return cache_dir() / "wgmma_checked" / hashlib.sha256(cubin).hexdigest()


def check_compiled(kernel, what: str) -> None:
    """``check_kernel`` for a kernel with a register-A wgmma, once per cubin (remembered on disk)."""
    asm = getattr(kernel, "asm", {}) or {}
    if not has_register_a(asm.get("ptx", "")) or "cubin" not in asm:
        return
    marker = _marker(asm["cubin"])
    if marker.exists():
        return
    check_kernel(kernel, what)
    from nova.atomic import atomic_write

    marker.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(marker, lambda f: f.write(b"no wgmma register race\n"), durable=False)


_INSTALLED = False


def install() -> None:
    """Chain Triton's post-compile hook with the check of Nova's generated kernels (once)."""
    global _INSTALLED
    if _INSTALLED or os.environ.get("NOVA_WGMMA_CHECK", "1") == "0":
        return
    from triton import knobs

    previous = knobs.runtime.jit_post_compile_hook

    def hook(*args, key=None, repr=None, fn=None, compile=None, **kw):
        result = previous(*args, key=key, repr=repr, fn=fn, compile=compile, **kw) if previous else None
        if fn is not None and str(fn.module).startswith("nova_generated_") and compile is not None:
            cache = fn.jit_function.device_caches[compile["device"]][0]
            kernel = cache.get(compile["key"])
            if kernel is not None:
                try:
                    check_compiled(kernel, f"{fn.name} ({fn.module})")
                except WgmmaRegisterRace:
                    cache.pop(compile["key"], None)  # never launched from the cache either
                    raise
        return result

    knobs.runtime.jit_post_compile_hook = hook
    _INSTALLED = True
