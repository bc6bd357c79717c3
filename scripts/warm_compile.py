"""Warm compile in a second process: the GPT-2 step with the step cache already on disk.

    python scripts/warm_compile.py --device cuda [--batch 8] [--out DIR]
    python scripts/warm_compile.py --device cpu  [--backend triton|reference] [--layers 12] [--no-step]
    python scripts/warm_compile.py --device cpu --backend reference --layers 1 --vocab 256 --batch 1 --seq 32
        (a small model whose step the reference executor runs in seconds)

Process 1 (this one) compiles the step into an empty cache directory (``NOVA_CACHE_DIR``
and ``TRITON_CACHE_DIR`` under a fresh temporary directory unless ``--cache-dir``;
the step cache on) and, unless ``--no-step``, runs one step, so that both Nova's step
cache and Triton's kernel cache are filled. Then it spawns process 2 (the same script
with ``--phase warm``, the same cache directories), which times, from its own start:

  import          import torch and nova (not part of the target)
  compile         ``nova.compile(...)`` itself (it binds; programs compile at the first call)
  first call      the first ``step(*batch)``, broken down into the pipeline's stages
                  (capture, fold, fuse_loss, autodiff: ``Compilation.times``), the step
                  cache (``cache.lookup/*``: hashing the IR for the key, reading the entry,
                  decoding and verifying the IR, restoring the kept fields: the remat
                  choices and the memory plan), the Triton
                  backend's lowering (``TritonProgram``: kernel sources generated and
                  loaded from the kernel-source cache), the executable's construction,
                  and the first run of the launch list (binding the arena, every
                  kernel's Triton JIT load from its cache, the step itself), synchronised;
                  on CUDA with its parts ``first_run/triton_compile`` (Triton's compile() of
                  each kernel: a load from its disk cache; ``calls`` counts them) and
                  ``first_run/triton_key`` (Triton hashing its own compiler, once a process)
  target_s        compile + first call: the warm compile (issue 8: under 5 s on the H200
                  for GPT-2 124M bf16)

and the second and third calls (the graph capture, then a steady step) for comparison.
``--no-step`` (CPU: the reference executor or the Triton interpreter would take minutes
for one GPT-2 step; the interpreter, for one step at 768 wide at all) compiles the program as the first call would (``step._program``)
without running it, in both processes; the first-run phase is then absent.

The result is one JSON object on stdout (and, with ``--out DIR``,
``DIR/warm_compile_<device>_<backend>_b<batch>_l<layers>.json``): the options, process
1's cold compile and process 2's phases (``target_cpu_s``: its CPU time over the same
span, a check on the wall time when other work shares the machine; ``gc``: the cyclic
garbage collector's runs over the span, by generation, and their seconds).
``--profile FILE`` writes a cProfile of process 2's compile + first call (in CPU seconds);
``--profile-phase cold`` records process 1's instead (every kernel compiled by Triton).
"""

from __future__ import annotations

import time

T_START = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def options(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], required=True)
    p.add_argument("--backend", choices=["triton", "reference"], default="triton",
                   help="triton (on the CPU: the Triton interpreter, kernels scheduled for the H200) or reference")
    p.add_argument("--precision", default="bf16")
    p.add_argument("--layers", type=int, default=12, help="GPT-2 124M has 12")
    p.add_argument("--vocab", type=int, default=50304, help="GPT-2's (padded); smaller to run a step on the CPU")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--no-step", action="store_true", help="compile without running a step (see the docstring)")
    p.add_argument("--cache-dir", default=None, help="default: a fresh temporary directory (removed after)")
    p.add_argument("--out", default=None, help="a directory for the JSON (warm_compile_<device>_<backend>_b<batch>_l<layers>.json)")
    p.add_argument("--profile", default=None, help="a cProfile output file for one process's compile + first call")
    p.add_argument("--profile-phase", choices=["cold", "warm"], default="warm",
                   help="which process --profile records: process 1 (cold caches) or process 2 (default)")
    p.add_argument("--phase", choices=["cold", "warm"], default="cold", help=argparse.SUPPRESS)
    o = p.parse_args(argv)
    if o.device == "cpu" and o.backend == "triton":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    return o


class Phases:
    """Wall seconds of the phases the API does not time itself, by wrapping the
    functions it calls (module attributes: api.py imports them at call time)."""

    def __init__(self, device):
        self.t: dict[str, float] = {}
        self.n: dict[str, int] = {}  # calls timed, by phase
        self.device = device

    def wrap(self, owner, attr: str, name: str, sync: bool = False, first_only: bool = True) -> None:
        orig = getattr(owner, attr)
        phases = self

        def timed(*a, **k):
            if first_only and name in phases.t:
                return orig(*a, **k)
            t0 = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                if sync:
                    phases.sync()
                phases.t[name] = phases.t.get(name, 0.0) + time.perf_counter() - t0
                phases.n[name] = phases.n.get(name, 0) + 1

        setattr(owner, attr, timed)

    def sync(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class Collections:
    """The cyclic garbage collector's runs while it is installed (``gc.callbacks``):
    their number and wall seconds by generation. A full (generation 2) collection
    walks every tracked object of the process (torch's, xDSL's, the model's): about
    0.35 s here for ~350k objects, so a compile that triggers some pays for them."""

    def __init__(self):
        import gc

        self.runs, self.seconds, self.t = [0, 0, 0], [0.0, 0.0, 0.0], 0.0
        gc.callbacks.append(self._tick)

    def _tick(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.t = time.perf_counter()
        else:
            self.runs[info["generation"]] += 1
            self.seconds[info["generation"]] += time.perf_counter() - self.t

    def stop(self) -> None:
        import gc

        gc.callbacks.remove(self._tick)

    def summary(self) -> dict:
        return {"runs": self.runs, "seconds": [round(s, 4) for s in self.seconds], "total_s": round(sum(self.seconds), 4)}


def build(o, device):
    import torch

    from nova.models import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=o.vocab, block_size=1024, n_layer=o.layers, n_head=12, n_embd=768)
    with torch.device(device):
        model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, weight_decay=0.1, fused=device.type == "cuda")
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (o.batch, o.seq), generator=g).to(device)
    y = torch.randint(0, cfg.vocab_size, (o.batch, o.seq), generator=g).to(device)
    return model, opt, (x, y)


def one_process(o) -> dict:
    """Compiles (and unless --no-step runs) the step in this process, timed by phase."""
    t_imp = time.perf_counter()
    import torch

    import nova
    from nova import api, pipeline

    out: dict = {"import_s": time.perf_counter() - t_imp, "since_process_start_s": None}
    device = torch.device(o.device)
    phases = Phases(device)
    times: list[dict] = []
    caches: list[str] = []
    run = pipeline.run

    def recorded_run(c, *a, **k):
        try:
            return run(c, *a, **k)
        finally:
            times.append(dict(c.times))
            caches.append(c.cache)

    pipeline.run = recorded_run
    phases.wrap(pipeline, "run", "pipeline")
    # the first run of the program: on the Triton backend the executable binding the arena,
    # every kernel's first launch (Triton's JIT loading it from its cache) and the step itself
    phases.wrap(api.Program, "run", "first_run", sync=True)
    if o.backend == "triton":
        from nova.backends import triton as triton_backend
        from nova.runtime import executable

        phases.wrap(triton_backend, "TritonProgram", "lowering")  # the kernels' sources, generated and loaded
        # the first run of the launch list (the program's first call on this backend)
        phases.wrap(executable.Executable, "launch", "first_run", sync=True)
        phases.wrap(executable, "Executable", "executable")
        if o.device == "cuda":
            # parts of the first run: Triton's compile() of each kernel at its first launch (a
            # load from Triton's disk cache on a warm one; JITFunction binds it when it builds its
            # binder, at the first launch), and the hash of Triton's own compiler it computes once
            import triton.compiler
            import triton.runtime.cache

            phases.wrap(triton.compiler, "compile", "first_run/triton_compile", first_only=False)
            phases.wrap(triton.runtime.cache, "triton_key", "first_run/triton_key")

    model, opt, batch = build(o, device)
    phases.sync()
    profile = None
    if o.profile and o.phase == o.profile_phase:
        import cProfile

        profile = cProfile.Profile(time.process_time)  # CPU seconds: other work may share the machine
        profile.enable()
    collections = Collections()
    c0 = time.process_time()
    t0 = time.perf_counter()
    step = nova.compile(model, opt, precision=o.precision, backend=o.backend)
    t1 = time.perf_counter()
    if o.no_step:
        prog = step._program(batch)  # what the first call compiles, without running it
    else:
        loss = step(*batch)
        phases.sync()
        prog = step._last
    t2 = time.perf_counter()
    c2 = time.process_time()
    collections.stop()
    if profile is not None:
        profile.disable()
        profile.dump_stats(o.profile)
    # target_cpu_s: this process's CPU time over the same span (every thread): a check on
    # target_s when other work shares the machine
    out.update(compile_s=t1 - t0, first_call_s=t2 - t1, target_s=t2 - t0, target_cpu_s=c2 - c0,
               since_process_start_s=t2 - T_START, gc=collections.summary())  # fmt: skip
    if not o.no_step:
        out["first_loss"] = float(loss)
        for name in ("second_call_s", "third_call_s"):
            ta = time.perf_counter()
            step(*batch)
            phases.sync()
            out[name] = time.perf_counter() - ta
    stage_times = times[0] if times else {}
    out["cache"] = caches[0] if caches else None
    out["stages"] = {k: round(v, 4) for k, v in stage_times.items()}
    out["phases"] = {k: round(v, 4) for k, v in phases.t.items()}
    out["calls"] = dict(phases.n)
    accounted = phases.t.get("pipeline", 0.0) + phases.t.get("lowering", 0.0) + phases.t.get("executable", 0.0)
    if "first_run" in phases.t:
        accounted += phases.t["first_run"]
    out["phases"]["other_in_first_call"] = round(out["first_call_s"] - accounted, 4)
    # the stages and cache.lookup / cache.restore / cache.store; "cache.lookup/..." are parts of cache.lookup
    timed = sum(v for k, v in stage_times.items() if "/" not in k)
    out["phases"]["pipeline_untimed"] = round(phases.t.get("pipeline", 0.0) - timed, 4)
    c = prog.compilation
    out["ops"] = sum(1 for _ in c.module.walk())
    if c.memory is not None:
        out["predicted_peak_gib"] = round(c.memory.peak_bytes / 2**30, 3)
    return out


def main(argv=None) -> int:
    o = options(argv)
    if o.phase == "warm":
        print(json.dumps(one_process(o)))
        return 0
    tmp = None
    if o.cache_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="nova-warm-")
        root = Path(tmp.name)
    else:
        root = Path(o.cache_dir)
    os.environ.update(NOVA_CACHE_DIR=str(root / "nova"), TRITON_CACHE_DIR=str(root / "triton"), NOVA_STEP_CACHE="1")
    try:
        cold = one_process(o)
        import gc

        import torch

        gc.collect()  # process 1's step, arena and model are gone before process 2 starts
        if o.device == "cuda":
            torch.cuda.empty_cache()
        if cold["cache"] not in ("miss", "hit"):
            raise SystemExit(f"process 1: the step cache said {cold['cache']!r}, not a miss")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
        args = [a for a in (argv if argv is not None else sys.argv[1:])] + ["--phase", "warm"]
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), *args], env=env, capture_output=True,
                              text=True, timeout=1200)  # fmt: skip
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr)
            raise SystemExit(f"process 2 failed with status {proc.returncode}")
        warm = json.loads(proc.stdout.strip().splitlines()[-1])
        if warm["cache"] != "hit":
            raise SystemExit(f"process 2: the step cache said {warm['cache']!r}, not a hit{_why_missed(root)}")
    finally:
        if tmp is not None:
            tmp.cleanup()
    result = {
        "what": "GPT-2 step compiled in a second process with the step cache on disk",
        "options": {k: v for k, v in vars(o).items() if k not in ("phase",)},
        "model": f"GPT(vocab {o.vocab}, block 1024, {o.layers} layers, 12 heads, 768 wide), AdamW",
        "torch": torch.__version__,
        "device_name": torch.cuda.get_device_name() if o.device == "cuda" else "cpu",
        "cpu_threads": torch.get_num_threads(),
        "nova_commit": os.environ.get("NOVA_COMMIT") or _git_head(),
        "cold": cold,
        "warm": warm,
        "target_s": warm["target_s"],
    }
    text = json.dumps(result, indent=1)
    print(text)
    if o.out:
        Path(o.out).mkdir(parents=True, exist_ok=True)
        (Path(o.out) / f"warm_compile_{o.device}_{o.backend}_b{o.batch}_l{o.layers}.json").write_text(text + "\n")
    return 0


def _why_missed(root: Path) -> str:
    """The key inputs in which the two processes' entries differ (a file of nova/
    edited between them changes nova_source_sha256)."""
    inputs = [json.loads(p.read_bytes()).get("inputs", {}) for p in sorted((root / "nova" / "steps").rglob("*.json"))]
    if len(inputs) != 2:
        return f" ({len(inputs)} entries)"
    a, b = inputs
    return f": the two entries' key inputs differ in {sorted(k for k in {*a, *b} if a.get(k) != b.get(k))}"


def _git_head() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None


if __name__ == "__main__":
    sys.exit(main())
