"""The step cache (nova/runtime/cache.py): hits, misses, corrupt entries, races."""

import dataclasses
import hashlib
import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from xdsl.dialects.builtin import ArrayAttr
from xdsl.irdl import IRDLOperation, irdl_op_definition, region_def, traits_def, var_operand_def, var_result_def
from xdsl.traits import IsTerminator

import nova
from nova import pipeline
from nova.config import SETTINGS, Settings
from nova.ir.module import print_module
from nova.models import GPT, gpt_tiny
from nova.runtime import cache
from nova.schedule.devices import DEVICES

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("NOVA_CACHE_DIR", str(root))
    monkeypatch.setattr(pipeline, "SETTINGS", dataclasses.replace(SETTINGS, step_cache=True))
    return root


def tiny(seed=0, opt="adamw", **cfg):
    torch.manual_seed(seed)
    model = GPT(gpt_tiny(n_layer=1, **cfg))
    if opt == "adamw":
        o = torch.optim.AdamW(model.parameters(), lr=1e-2)
    elif opt == "amsgrad":
        o = torch.optim.AdamW(model.parameters(), lr=1e-2, amsgrad=True)
    else:
        o = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    T = 16
    batch = (torch.randint(0, 256, (2, T), generator=g), torch.randint(0, 256, (2, T), generator=g))
    return model, o, batch


def compile_(model, opt, batch, precision="fp32", device=None, dump=False):
    c = pipeline.Compilation(model, batch, opt, precision, torch.float32)
    c.device = device
    return pipeline.run(c, dump=dump)


def entries(root: Path) -> list[Path]:
    return sorted((root / "steps").rglob("*")) if (root / "steps").exists() else []


def entry_files(root: Path) -> list[Path]:
    return [p for p in entries(root) if p.is_file()]


def plan_summary(plan) -> tuple:
    """A MemoryPlan without its SSA value objects (those differ between modules)."""
    return (plan.arena_bytes, plan.sum_bytes, plan.lower_bound_bytes, plan.peak_time, plan.peak_what, plan.peak_loc,
            plan.peak_bytes, dict(plan.external), [(b.offset, b.size, b.start, b.end, b.what, b.loc) for b in plan.buffers],
            plan.inplace, plan.live_bytes, plan.steps, sorted(q.kind for q in plan.placements.values()))  # fmt: skip


# ----------------------------------------------------------------------------
# hits


@pytest.mark.parametrize("target", ["reference", "h200"])
def test_second_compile_hits_with_the_same_ir_and_memory_plan(cache_dir, target):
    device = DEVICES["H200"] if target == "h200" else None
    cold = compile_(*tiny(), device=device)
    assert cold.cache == "miss" and len(entry_files(cache_dir)) == 1
    warm = compile_(*tiny(), device=device)  # a fresh model object of the same structure
    assert warm.cache == "hit"
    assert "optimizer" not in warm.times and "plan_memory" not in warm.times  # the stages did not run
    assert print_module(warm.module) == print_module(cold.module)
    assert plan_summary(warm.memory) == plan_summary(cold.memory)
    assert warm.spec == cold.spec and warm.remat == cold.remat and cold.remat  # the default remat recomputes GELUs
    assert warm.captured.fn is warm.module.body.block.first_op  # Captured.fn follows the new module


def test_a_hit_trains_bit_identically(cache_dir):
    results = []
    for expect in ("miss", "hit"):
        model, opt, batch = tiny()
        step = nova.compile(model, opt, backend="reference")
        losses = [step(*batch) for _ in range(2)]
        assert step._last.compilation.cache == expect
        results.append((losses, [p.detach().clone() for p in model.parameters()],
                        [v.clone() for s in opt.state.values() for v in s.values()]))  # fmt: skip
    (l0, p0, s0), (l1, p1, s1) = results
    for a, b in zip([*l0, *p0, *s0], [*l1, *p1, *s1], strict=True):
        assert torch.equal(a, b)


def test_hyper_parameter_values_are_not_part_of_the_key(cache_dir):
    model, opt, batch = tiny()
    compile_(model, opt, batch)
    model, opt, batch = tiny(seed=3)  # other weights
    for g in opt.param_groups:
        g["lr"], g["betas"], g["weight_decay"] = 0.5, (0.8, 0.9), 0.3
    assert compile_(model, opt, batch).cache == "hit"


SCRIPT = textwrap.dedent("""
    import hashlib, json, sys
    import torch
    torch.set_num_threads(1)
    import nova
    from nova.ir.module import print_module
    from nova.models import GPT, gpt_tiny
    torch.manual_seed(0)
    model = GPT(gpt_tiny(n_layer=1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    batch = (torch.randint(0, 256, (2, 16), generator=g), torch.randint(0, 256, (2, 16), generator=g))
    step = nova.compile(model, opt, backend="reference")
    loss = step(*batch)
    c = step._last.compilation
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    plan = c.memory
    print(json.dumps({"cache": c.cache, "ir": hashlib.sha256(print_module(c.module).encode()).hexdigest(),
                      "plan": [plan.arena_bytes, plan.peak_bytes, [(b.offset, b.size, b.start, b.end) for b in plan.buffers]],
                      "loss": loss.item().hex(), "params": h.hexdigest()}))
""")


def run_script(root: Path, wait=True):
    env = {**os.environ, "NOVA_CACHE_DIR": str(root), "NOVA_STEP_CACHE": "1", "PYTHONPATH": str(REPO)}
    p = subprocess.Popen([sys.executable, "-c", SCRIPT], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)  # fmt: skip
    return finish(p) if wait else p


def finish(p) -> dict:
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def source_edited_meanwhile(root: Path) -> bool:
    """Whether the processes' entries differ only in Nova's source hash: a file of
    nova/ was edited between them (a working tree others edit), which must miss."""
    inputs = [json.loads(p.read_bytes())["inputs"] for p in entry_files(root)]
    differ = {k for a in inputs for b in inputs for k in a if a[k] != b[k]}
    return len(inputs) > 1 and differ == {"nova_source_sha256"}


def test_a_new_process_hits_and_trains_the_same(tmp_path):
    for attempt in range(3):
        root = tmp_path / f"cache{attempt}"
        cold = run_script(root)
        warm = run_script(root)
        if not source_edited_meanwhile(root):
            break
    assert (cold["cache"], warm["cache"]) == ("miss", "hit")
    assert {k: v for k, v in cold.items() if k != "cache"} == {k: v for k, v in warm.items() if k != "cache"}


def test_two_processes_compiling_the_same_key_at_once(tmp_path):
    for attempt in range(3):
        root = tmp_path / f"cache{attempt}"
        procs = [run_script(root, wait=False) for _ in range(2)]
        outs = [finish(p) for p in procs]
        if not source_edited_meanwhile(root):
            break
    assert {o["ir"] for o in outs} == {outs[0]["ir"]} and {o["params"] for o in outs} == {outs[0]["params"]}
    files = entry_files(root)
    assert len(files) == 1 and files[0].suffix == ".json"  # one entry, no temporary file left
    assert run_script(root)["cache"] == "hit"  # and it is whole


# ----------------------------------------------------------------------------
# locations: the directory of a model's source file is not part of the key

MODEL_FILE = textwrap.dedent("""
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 4)

        def forward(self, x, y):
            h = torch.tanh(self.fc(x))
            return torch.nn.functional.cross_entropy(h, y)
""")


def load_net(directory: Path, name: str):
    directory.mkdir(parents=True)
    (directory / "net.py").write_text(MODEL_FILE)
    spec = importlib.util.spec_from_file_location(name, directory / "net.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.manual_seed(0)
    net = mod.Net()
    return net, torch.optim.SGD(net.parameters(), lr=0.1), (torch.randn(5, 8), torch.tensor([0, 1, 2, 3, 0]))


def test_the_model_files_directory_is_bound_back_on_a_hit(cache_dir, tmp_path, monkeypatch):
    a = compile_(*load_net(tmp_path / "run-a" / "pkg", "net_a"))
    assert a.cache == "miss" and str(tmp_path / "run-a" / "pkg") in print_module(a.module)
    b_dir = tmp_path / "run-b-elsewhere"
    b = compile_(*load_net(b_dir, "net_b"))
    assert b.cache == "hit"
    text = print_module(b.module)
    assert str(b_dir) in text and "run-a" not in text and "<nova-dir-" not in text
    monkeypatch.setattr(pipeline, "SETTINGS", dataclasses.replace(SETTINGS, step_cache=False))
    assert print_module(compile_(*load_net(tmp_path / "run-c", "net_c")).module) == text.replace(str(b_dir), str(tmp_path / "run-c"))


def test_normalise_and_bind_locations():
    loc = 'x.y (Linear), node linear, /tmp/ipykernel_4242/123.py:7: h = f(x["a"])'
    dirs = []
    n = cache.normalise_location(loc, dirs)
    assert n == 'x.y (Linear), node linear, <nova-dir-0>/123.py:7: h = f(x["a"])' and dirs == ["/tmp/ipykernel_4242"]
    assert cache.bind_location(n, ["/tmp/ipykernel_99"]) == loc.replace("4242", "99")
    assert cache.normalise_location("<root>, node add", []) == "<root>, node add"  # no source line: unchanged
    assert cache.normalise_location(loc, ["/elsewhere"], fixed=True) == loc  # fixed: an unknown directory stays
    dirs = ["/a/b"]
    assert cache.normalise_location("o, node k, /c/d.py:1: z", dirs) == "o, node k, <nova-dir-1>/d.py:1: z"
    assert dirs == ["/a/b", "/c"]


# ----------------------------------------------------------------------------
# misses


@pytest.mark.parametrize("change", ["precision", "optimizer kind", "amsgrad", "model shape", "batch shape", "device",
                                    "skip_nonfinite", "nova source"])  # fmt: skip
def test_what_changes_the_output_misses(cache_dir, change, monkeypatch):
    base = compile_(*tiny())
    assert base.cache == "miss"
    model, opt, batch = tiny(opt={"optimizer kind": "sgd", "amsgrad": "amsgrad"}.get(change, "adamw"),
                             **({"n_embd": 32} if change == "model shape" else {}))  # fmt: skip
    if change == "batch shape":
        batch = tuple(t[:, :8].contiguous() for t in batch)
    c = pipeline.Compilation(model, batch, opt, "bf16" if change == "precision" else "fp32", torch.float32)
    c.device = DEVICES["H200"] if change == "device" else None
    c.skip_nonfinite = change == "skip_nonfinite"
    if change == "nova source":
        monkeypatch.setattr(cache, "source_digest", lambda: "0" * 64)
    assert pipeline.run(c).cache == "miss"
    assert len(entry_files(cache_dir)) == 2


def test_a_flipped_switch_misses_and_its_entry_is_its_own(cache_dir, monkeypatch):
    """A module switch set at run time (a script's variant, a test's monkeypatch) compiles
    another program from the same source: the key holds it, so neither program is read
    for the other (scripts/epilogue_variants.py's "transpose-matmul-on" got the shipped
    step from the cache before, where the cache was on)."""
    from nova.transforms import transpose_matmul

    model, opt, batch = tiny()
    assert compile_(model, opt, batch).cache == "miss"
    monkeypatch.setattr(transpose_matmul, "ENABLED", True)
    assert cache.changed_switches() == {"nova.transforms.transpose_matmul.ENABLED": "True"}
    flipped = compile_(model, opt, batch)
    assert flipped.cache == "miss" and len(entry_files(cache_dir)) == 2
    assert compile_(model, opt, batch).cache == "hit"  # the flipped program's own entry
    monkeypatch.setattr(transpose_matmul, "ENABLED", False)
    assert cache.changed_switches() == {}
    assert compile_(model, opt, batch).cache == "hit" and len(entry_files(cache_dir)) == 2


def test_changed_switches_sees_values_not_modules(monkeypatch):
    """Nothing changed: empty, whatever is imported (every module of nova imported here, the
    registries they fill at import are no switches); a container mutated in place counts;
    a changed value without a stable text turns the cache off (Unhashable)."""
    import importlib
    import pkgutil

    from nova.schedule import configurator

    for m in pkgutil.walk_packages(nova.__path__, "nova."):
        importlib.import_module(m.name)
    assert cache.changed_switches() == {}
    written = cache._written_switches(configurator.__file__)
    assert written["ONE_WAVE_SPLIT_MIN_GAIN"] == configurator.ONE_WAVE_SPLIT_MIN_GAIN
    assert written["WS_TILES"] == configurator.WS_TILES and "LAUNCH_SECONDS" in written
    monkeypatch.setitem(configurator.WS_TILES, "plain", None)
    assert list(cache.changed_switches()) == ["nova.schedule.configurator.WS_TILES"]
    monkeypatch.setattr(configurator, "ONE_WAVE_SPLIT_MIN_GAIN", object())
    with pytest.raises(cache.Unhashable):
        cache.changed_switches()


def test_set_switches_takes_only_written_switches_of_their_type(monkeypatch):
    """A benchmark's --set: a written switch of a module under nova., a literal of its type
    (an int where the switch is a float); anything else is a ValueError naming the item,
    and nothing is set by a rejected item."""
    from nova.schedule import configurator
    from nova.transforms import transpose_matmul

    # restored at teardown whatever the test sets
    monkeypatch.setattr(transpose_matmul, "ENABLED", transpose_matmul.ENABLED)
    monkeypatch.setattr(configurator, "ONE_WAVE_SPLIT_MIN_GAIN", configurator.ONE_WAVE_SPLIT_MIN_GAIN)
    done = cache.set_switches(["transforms.transpose_matmul.ENABLED=True", "schedule.configurator.ONE_WAVE_SPLIT_MIN_GAIN=0"])
    assert done == {"nova.transforms.transpose_matmul.ENABLED": "True", "nova.schedule.configurator.ONE_WAVE_SPLIT_MIN_GAIN": "0.0"}
    assert transpose_matmul.ENABLED is True and configurator.ONE_WAVE_SPLIT_MIN_GAIN == 0.0
    assert cache.changed_switches() == done
    for bad, says in [("transforms.transpose_matmul.ENABLED", "MODULE.NAME=VALUE"),
                      ("transforms.nothing_here.ENABLED=1", "no module nova.transforms.nothing_here"),
                      ("transforms.transpose_matmul.enabled=True", "has no switch enabled"),
                      ("transforms.transpose_matmul.ENABLED=yes", "not a Python literal"),
                      ("transforms.transpose_matmul.ENABLED=1", "is a bool")]:
        with pytest.raises(ValueError, match=says):
            cache.set_switches(["schedule.configurator.ONE_WAVE_SPLIT_MIN_GAIN=1", bad])
        assert configurator.ONE_WAVE_SPLIT_MIN_GAIN == 1.0  # the items before the bad one are set
    assert transpose_matmul.ENABLED is True


def test_disabled_and_dump_bypass_the_cache(cache_dir, monkeypatch):
    dumped = compile_(*tiny(), dump=True)  # explain() must see every stage
    assert dumped.cache == "off" and list(dumped.stages) == [n for n, _ in pipeline.STAGES]
    assert entry_files(cache_dir) == []
    monkeypatch.setattr(pipeline, "SETTINGS", dataclasses.replace(SETTINGS, step_cache=False))
    assert compile_(*tiny()).cache == "off" and entry_files(cache_dir) == []
    monkeypatch.setenv("NOVA_STEP_CACHE", "0")
    assert Settings.from_env().step_cache is False
    monkeypatch.setenv("NOVA_STEP_CACHE", "1")
    assert Settings.from_env().step_cache is True


def test_an_option_without_a_stable_form_turns_the_cache_off(cache_dir, caplog, monkeypatch):
    with pytest.raises(cache.Unhashable):
        cache._plain({"budget": object()})  # its repr holds an address
    key_inputs = cache.key_inputs

    def with_an_object(c, *args):
        return key_inputs(c, *args) | {"budget": cache._plain(object())}

    monkeypatch.setattr(cache, "key_inputs", with_an_object)
    with caplog.at_level(logging.INFO, logger="nova"):
        assert compile_(*tiny()).cache == "off"
    assert "no stable text" in caplog.text and entry_files(cache_dir) == []


# ----------------------------------------------------------------------------
# corrupt and foreign entries


def _edit_ir(entry: dict, edit, fix_checksum=True) -> dict:
    edit(entry["ir"])
    if fix_checksum:
        entry["sha256"] = cache.checksum(entry)
    return entry


def _break_verification(ir: dict) -> None:
    # an op whose result type disagrees with what its operands give (the nova verifier's infer)
    for op in ir["ops"]:
        if op[0] in ("nova.add", "nova.transpose", "nova.matmul"):
            ir["attrs"].append("tensor<3x5xf32>")
            op[2] = [len(ir["attrs"]) - 1]
            return
    raise AssertionError("no nova.add, nova.transpose or nova.matmul")


def _offset_row(ir: dict) -> list:
    """The JSON row of an op's nova.offset (an integer array: ["d", element type, values])."""
    for op in ir["ops"]:
        i = op[4].get("nova.offset")
        if i is not None and ir["attrs"][i][0] == "d":
            return ir["attrs"][i]
    raise AssertionError("no nova.offset row")


def _tamper_offset(ir: dict) -> None:
    row = _offset_row(ir)
    row[2][0] += 512  # still aligned: only the stored plan can tell


def _malform_row(ir: dict) -> None:
    _offset_row(ir)[2] = ["0"]  # not a list of integers


def _forward_row(ir: dict) -> None:
    row = _offset_row(ir)
    row[1] = len(ir["attrs"])  # an element type of no earlier row


def _foreign(entry: dict, path: Path) -> bytes:
    model, opt, batch = tiny()
    other = compile_(model, opt, batch, precision="bf16")  # writes another key's entry
    return next(p for p in entry_files(path.parents[2]) if p != path).read_bytes()


CORRUPTIONS = {
    "truncated": (lambda raw, e, p: raw[: len(raw) // 2], "not valid JSON"),
    "empty": (lambda raw, e, p: b"", "not valid JSON"),
    "not an object": (lambda raw, e, p: b"[1, 2]", "not an entry"),
    "format": (lambda raw, e, p: json.dumps({**e, "format": 0}).encode(), "format version 0"),
    "key": (lambda raw, e, p: json.dumps({**e, "key": "ab" * 32}).encode(), "foreign entry: written for key"),
    "inputs": (lambda raw, e, p: json.dumps({**e, "inputs": {**e["inputs"], "torch": "0.0"}}).encode(),
               "inputs differ in ['torch']"),  # fmt: skip
    "foreign file": (lambda raw, e, p: _foreign(e, p), "foreign entry"),
    "checksum": (lambda raw, e, p: json.dumps(_edit_ir(e, lambda ir: ir["attrs"].__setitem__(0, ir["attrs"][0] + " "),
                                                       fix_checksum=False)).encode(), "checksum mismatch"),  # fmt: skip
    "unparsable": (lambda raw, e, p: json.dumps(_edit_ir(e, lambda ir: ir["attrs"].__setitem__(0, "tensor<<"))).encode(),
                   "does not read back"),  # fmt: skip
    "unknown op": (lambda raw, e, p: json.dumps(_edit_ir(e, lambda ir: ir["ops"][0].__setitem__(0, "nova.nope"))).encode(),
                   "unknown op"),  # fmt: skip
    "bad operand": (lambda raw, e, p: json.dumps(_edit_ir(e, lambda ir: ir["ops"][3][1].__setitem__(0, 10**6))).encode(),
                    "does not read back"),  # fmt: skip
    "kept field": (lambda raw, e, p: json.dumps(_edit_ir({**e, "fields": {"nope": 1}}, lambda ir: None)).encode(),
                   "a kept field of no stage: ['nope']"),  # fmt: skip
    "bad kept field": (lambda raw, e, p: json.dumps(_edit_ir({**e, "fields": {**e["fields"], "remat": [{"x": 1}]}}, lambda ir: None)).encode(),
                       "the kept field 'remat' does not read back"),  # fmt: skip
    "fails verification": (lambda raw, e, p: json.dumps(_edit_ir(e, _break_verification)).encode(), "fails verification"),
    "tampered attribute": (lambda raw, e, p: json.dumps(_edit_ir(e, lambda ir: _tamper_offset(ir), fix_checksum=False)).encode(),
                           "checksum mismatch"),  # fmt: skip
    "malformed attribute row": (lambda raw, e, p: json.dumps(_edit_ir(e, _malform_row)).encode(), "does not read back"),
    "later attribute row": (lambda raw, e, p: json.dumps(_edit_ir(e, _forward_row)).encode(), "does not read back"),
    "offset off the plan": (lambda raw, e, p: json.dumps(_edit_ir(e, _tamper_offset)).encode(),
                            "the kept field 'plan_memory' does not read back"),  # fmt: skip
}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_a_corrupt_entry_is_logged_and_rebuilt(cache_dir, kind, caplog):
    cold = compile_(*tiny())
    (path,) = entry_files(cache_dir)
    raw = path.read_bytes()
    corrupt, reason = CORRUPTIONS[kind]
    path.write_bytes(corrupt(raw, json.loads(raw), path))
    with caplog.at_level(logging.WARNING, logger="nova"):
        again = compile_(*tiny())
    assert again.cache.startswith("rebuilt: ") and reason in again.cache, again.cache
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "unusable" in r.getMessage()]
    assert len(warnings) == 1 and reason in warnings[0].getMessage()
    assert print_module(again.module) == print_module(cold.module)
    assert path.read_bytes() == raw  # rewritten by the fresh compile
    assert compile_(*tiny()).cache == "hit"


# ----------------------------------------------------------------------------
# atomic writes


def test_a_failed_write_leaves_no_entry(cache_dir, monkeypatch, caplog):
    def fail(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    with caplog.at_level(logging.WARNING, logger="nova"):
        c = compile_(*tiny())
    assert c.cache == "miss" and "could not store" in caplog.text
    assert [p for p in entries(cache_dir) if p.is_file()] == []  # neither the entry nor its temporary file
    monkeypatch.undo()
    monkeypatch.setenv("NOVA_CACHE_DIR", str(cache_dir))
    monkeypatch.setattr(pipeline, "SETTINGS", dataclasses.replace(SETTINGS, step_cache=True))
    assert compile_(*tiny()).cache == "miss" and compile_(*tiny()).cache == "hit"


def test_an_interrupted_write_leaves_the_old_entry_whole(cache_dir, monkeypatch):
    compile_(*tiny())
    (path,) = entry_files(cache_dir)
    before = path.read_bytes()

    def fsync(fd):
        raise KeyboardInterrupt  # as if the process died mid-write

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(KeyboardInterrupt):
        cache.store(path, "k", {}, {"attrs": [], "func": [{}, {}, []], "module": {}, "ops": []}, [])
    assert entry_files(cache_dir) == [path] and path.read_bytes() == before


def test_the_key_hashes_its_inputs_and_the_source(cache_dir):
    c = compile_(*tiny())
    (path,) = entry_files(cache_dir)
    entry = json.loads(path.read_bytes())
    assert entry["key"] == path.stem == cache.step_key(entry["inputs"])
    inputs = entry["inputs"]
    assert inputs["precision"] == "fp32" and inputs["device"] is None and inputs["step_dtype"] == "torch.float32"
    assert inputs["optimizer"]["groups"][0]["kind"] == "adamw" and inputs["stages"] == [n for n, _ in pipeline.STAGES]
    assert inputs["nova"] == nova.__version__ and inputs["torch"] == torch.__version__
    assert len(inputs["nova_source_sha256"]) == 64
    assert c.cache == "miss"


# ----------------------------------------------------------------------------
# the memory plan is kept in the entry (nova/runtime/stored_plan.py)


@pytest.mark.parametrize("target", ["reference", "h200"])
def test_a_hit_uses_the_stored_plan_and_it_equals_a_fresh_one(cache_dir, target, monkeypatch):
    from nova.runtime import stored_plan
    from nova.transforms import plan_memory as pm

    device = DEVICES["H200"] if target == "h200" else None
    cold = compile_(*tiny(), device=device)
    (path,) = entry_files(cache_dir)
    kept = json.loads(path.read_bytes())["fields"]["plan_memory"]
    assert [[b.size, b.offset] for b in cold.memory.buffers] == [k[1:] for k in kept]
    if target == "h200":
        assert cold.memory.scratch_at  # the fused LM head's arena scratch is in the stored plan too

    def not_again(*a, **k):
        raise AssertionError("a hit placed the buffers again")

    with monkeypatch.context() as m:
        m.setattr(pm, "plan_memory", not_again)
        m.setattr(pm, "assign_offsets", not_again)
        m.setattr(pm, "annotate", not_again)
        warm = compile_(*tiny(), device=device)
    assert warm.cache == "hit"
    assert plan_summary(warm.memory) == plan_summary(cold.memory)
    assert len(warm.memory.scratch_at) == len(cold.memory.scratch_at)
    text = print_module(warm.module)
    # a fresh plan of the restored module itself: the same plan, value for value
    fresh = pm.plan_memory(warm.module, pipeline.arena_scratch(device, warm.module))
    assert stored_plan.differences(warm.memory, fresh) == []
    assert print_module(warm.module) == text  # and the IR's annotations were already its own
    assert {"cache.lookup/key", "cache.lookup/read", "cache.lookup/decode", "cache.lookup/verify",
            "cache.lookup/kept plan_memory"} <= set(warm.times)  # fmt: skip


def _plan_field(entry: dict, edit) -> dict:
    edit(entry["fields"]["plan_memory"])
    entry["sha256"] = cache.checksum(entry)  # a consistent checksum: the plan itself must be checked
    return entry


def _all_at_zero(plan: list) -> None:
    for b in plan:
        b[2] = 0


PLAN_CORRUPTIONS = {
    "overlapping offsets": (lambda e: _plan_field(e, _all_at_zero), "overlaps"),
    "no plan": (lambda e: _edit_ir({**e, "fields": {"remat": e["fields"]["remat"]}}, lambda ir: None),
                "no kept field of the stages ['plan_memory']"),  # fmt: skip
}


@pytest.mark.parametrize("kind", list(PLAN_CORRUPTIONS))
def test_a_tampered_plan_is_detected_and_rebuilt(cache_dir, kind, caplog):
    cold = compile_(*tiny())
    (path,) = entry_files(cache_dir)
    raw = path.read_bytes()
    corrupt, reason = PLAN_CORRUPTIONS[kind]
    path.write_bytes(json.dumps(corrupt(json.loads(raw))).encode())
    with caplog.at_level(logging.WARNING, logger="nova"):
        again = compile_(*tiny())
    assert again.cache.startswith("rebuilt: ") and reason in again.cache, again.cache
    assert plan_summary(again.memory) == plan_summary(cold.memory)  # planned again by the stage
    assert path.read_bytes() == raw and compile_(*tiny()).cache == "hit"


def test_stored_offsets_that_are_not_this_plan_are_refused():
    from xdsl.dialects.builtin import IntegerAttr, i64

    from nova.runtime.stored_plan import StoredPlanError, plan_from_offsets, stored_offsets

    c = compile_(*tiny(), device=DEVICES["H200"])
    scratch = pipeline.arena_scratch(c.device, c.module)
    good = stored_offsets(c.module, c.memory)
    assert plan_summary(plan_from_offsets(c.module, scratch, good)) == plan_summary(c.memory)

    def edited(edit):
        data = json.loads(json.dumps(good))
        edit(data)
        return data

    for data, reason in [
        (edited(_all_at_zero), "overlaps"),
        (edited(lambda p: p[0].__setitem__(2, p[0][2] + 8)), "not a multiple of 256"),
        (edited(lambda p: p[0].__setitem__(2, -256)), "has offset -256"),
        (edited(lambda p: p[0].__setitem__(1, p[0][1] + 256)), "bytes in the stored plan"),
        (edited(lambda p: p[0].__setitem__(0, p[0][0] + 1)), "bytes in the stored plan"),
        (edited(lambda p: p.pop()), "stored buffers, the IR has"),
        (edited(lambda p: p[0].append(1)), "is not [value, size, offset]"),
        (edited(lambda p: p[0].__setitem__(2, 256.0)), "is not [value, size, offset]"),
        ({"buffers": good}, "no stored buffers"),
    ]:
        with pytest.raises(StoredPlanError, match=re.escape(reason)):
            plan_from_offsets(c.module, scratch, data)
    with pytest.raises(StoredPlanError, match="stored buffers, the IR has"):
        plan_from_offsets(c.module, None, good)  # planned with the arena scratch, read without it
    # offsets valid on their own but not the ones the IR's annotations were written for
    moved = edited(lambda p: p.__setitem__(0, [p[0][0], p[0][1], c.memory.arena_bytes + 1024 * 256]))
    with pytest.raises(StoredPlanError, match="disagree with the plan|nova.memory_plan"):
        plan_from_offsets(c.module, scratch, moved)
    attrs = c.module.attributes["nova.memory_plan"].data
    c.module.attributes["nova.memory_plan"] = type(c.module.attributes["nova.memory_plan"])(
        {**attrs, "arena_bytes": IntegerAttr(attrs["arena_bytes"].value.data + 256, i64)})
    with pytest.raises(StoredPlanError, match="nova.memory_plan"):
        plan_from_offsets(c.module, scratch, good)


def test_check_disjoint_finds_buffers_sharing_bytes_while_both_live():
    from nova.runtime.stored_plan import StoredPlanError, check_disjoint
    from nova.transforms.plan_memory import Buffer

    def buf(offset, size, start, end, what):
        return Buffer(None, offset, size, start, end, what, None)

    ok = [buf(0, 512, 0, 3, "a"), buf(512, 256, 1, 2, "b"), buf(0, 512, 4, 5, "c"),  # c reuses a after it died
          buf(768, 256, 2, 4, "d"), buf(512, 256, 4, 4, "e")]  # fmt: skip
    check_disjoint(ok)
    for bad, names in [([buf(0, 512, 0, 3, "a"), buf(256, 512, 3, 5, "b")], ("b", "a")),  # closed intervals: step 3
                       ([buf(1024, 256, 0, 9, "a"), buf(0, 256, 1, 2, "b"), buf(768, 512, 5, 6, "c")], ("c", "a")),
                       ([buf(0, 256, 0, 9, "a"), buf(512, 256, 1, 9, "b"), buf(0, 1024, 2, 2, "c")], ("c",))]:
        with pytest.raises(StoredPlanError, match="overlaps") as e:
            check_disjoint(bad)
        assert str(e.value).startswith(names[0])


def test_a_plan_that_does_not_rebuild_from_its_offsets_is_not_stored(cache_dir, monkeypatch, caplog):
    from nova.runtime import stored_plan

    monkeypatch.setattr(stored_plan, "differences", lambda a, b: ["peak_time"])  # as if the two assemblies drifted
    with caplog.at_level(logging.WARNING, logger="nova"):
        c = compile_(*tiny())
    assert c.cache == "miss" and entry_files(cache_dir) == []
    assert "does not rebuild from its stored offsets: it differs in ['peak_time']" in caplog.text


# ----------------------------------------------------------------------------
# the IR table: ops with regions


@irdl_op_definition
class Wrap(IRDLOperation):
    """A test op holding a region of any number of blocks."""

    name = "test.wrap"
    inputs = var_operand_def()
    outputs = var_result_def()
    body = region_def()


@irdl_op_definition
class Give(IRDLOperation):
    name = "test.give"
    values = var_operand_def()
    traits = traits_def(IsTerminator())


def region_module():
    """@train_step with a test.wrap whose region has two blocks with arguments, nova
    ops with locations in two directories, and a nested test.wrap reading values
    of the enclosing blocks."""
    from xdsl.dialects import func
    from xdsl.dialects.builtin import StringAttr, TensorType, f32
    from xdsl.ir import Block, Region

    from nova.ir import dialect as nv
    from nova.ir.module import Slot, new_step

    t = TensorType(f32, [2, 3])
    module, fn = new_step([Slot("param", "w", t), Slot("batch", "x", t)])
    w, x = fn.body.block.args

    def add(a, b, where):
        op = nv.AddOp.create(operands=[a, b], result_types=[t])
        op.attributes["nova.loc"] = StringAttr(f"m (Net), node add, {where}:3: y = a + b")
        return op

    inner_block = Block(arg_types=[t])
    (q,) = inner_block.args
    first = Block(arg_types=[t, t])
    a, b = first.args
    s1 = add(a, b, "/src/one/net.py")
    first.add_op(s1)
    inner_block.add_ops([s2 := add(q, s1.results[0], "/src/two/layer.py"), Give.create(operands=[s2.results[0]])])
    nested = Wrap.create(operands=[s1.results[0]], result_types=[t], regions=[Region(inner_block)])
    first.add_ops([nested, Give.create(operands=[nested.results[0]])])
    second = Block(arg_types=[t])
    second.add_op(Give.create(operands=[second.args[0]]))
    wrap = Wrap.create(operands=[w, x], result_types=[t], regions=[Region([first, second])])
    after = add(wrap.results[0], x, "/src/one/net.py")
    fn.body.block.add_ops([wrap, after, func.ReturnOp(after.results[0])])
    fn.function_type = func.FunctionType.from_lists([t, t], [t])
    fn.res_attrs = ArrayAttr([Slot("loss", "loss", t).attrs()])
    return module


def test_ops_with_regions_round_trip_through_the_table():
    from nova.ir.module import context

    module = region_module()
    ctx = context()
    ctx.load_op(Wrap)
    ctx.load_op(Give)
    module.verify()
    text = print_module(module)
    digest, dirs = cache.ir_digest(module)
    assert dirs == ["/src/one", "/src/two"]  # nested locations too, in order of first appearance
    table = json.loads(json.dumps(cache.encode(module, dirs)))
    assert "/src/" not in json.dumps(table) and "<nova-dir-1>/layer.py" in json.dumps(table)
    back = cache.decode(table, dirs, ctx)
    back.verify()
    cache.verify(back)  # blocks with arguments, nested regions, ops of a test dialect
    assert print_module(back) == text
    moved = print_module(cache.decode(table, ["/elsewhere", "/src/two"], ctx))
    assert moved == text.replace("/src/one/", "/elsewhere/")
    assert cache.ir_digest(back) == (digest, dirs)
    wrap = list(back.body.block.first_op.body.block.ops)[0]
    (first, second) = wrap.body.blocks
    assert [len(b.args) for b in wrap.body.blocks] == [2, 1] and first.args[0].uses  # block arguments are used
    nested = list(first.ops)[1]
    assert isinstance(nested, Wrap) and list(nested.body.block.ops)[0].operands[1] is list(first.ops)[0].results[0]
    with pytest.raises(ValueError, match="unknown op 'test.wrap'"):
        cache.decode(table, dirs)  # Nova's own context does not know the test op


@pytest.mark.parametrize("target", ["reference", "h200"])
def test_the_common_attribute_kinds_are_json_rows_and_read_back_equal(target):
    model, opt, batch = tiny()
    c = compile_(model, opt, batch, precision="bf16", device=DEVICES["H200"] if target == "h200" else None)
    dirs: list[str] = []
    table = json.loads(json.dumps(cache.encode(c.module, dirs, fixed=False)))
    rows = table["attrs"]
    kinds = {r[0] for r in rows if isinstance(r, list)}
    assert {"s", "i", "d", "a", "m", "t", "f"} <= kinds, kinds
    texts = [r for r in rows if isinstance(r, str)]
    assert len(texts) < len(rows) // 5 and not any(t.startswith(("[", "{", "array<", "tensor<", '"')) for t in texts)
    fn = c.module.body.block.first_op
    arg_attrs = rows[table["func"][1]["arg_attrs"] if "arg_attrs" in table["func"][1] else table["func"][0]["arg_attrs"]]
    assert arg_attrs[0] == "a" and all(rows[i][0] == "m" for i in arg_attrs[1])  # nova.storage / nova.offset: rows
    back = cache.decode(table, dirs)
    back.verify()
    assert print_module(back) == print_module(c.module)
    assert back.body.block.first_op.arg_attrs == fn.arg_attrs and back.attributes == c.module.attributes
    for a, b in zip(c.module.walk(), back.walk(), strict=True):
        assert a.attributes == b.attributes and a.properties == b.properties
        assert [r.type for r in a.results] == [r.type for r in b.results]
    assert cache.ir_digest(back) == cache.ir_digest(c.module)


def test_a_region_table_with_a_bad_index_does_not_read_back():
    from nova.ir.module import context

    module = region_module()
    ctx = context()
    ctx.load_op(Wrap)
    ctx.load_op(Give)
    table = cache.encode(module, [])
    table["ops"][0][6][0][0][0] = [-1, 0]  # a negative type index (would count from the end)
    with pytest.raises(ValueError, match="an index -1"):
        cache.decode(table, [], ctx)


def test_a_fused_step_caches_and_hits(cache_dir, monkeypatch):
    """nova.fused groups (a region of one block with arguments, ending in
    nova.yield) through the whole cache: stored, read back, the same IR and plan."""
    from nova.transforms.fuse import fuse

    names = [n for n, _ in pipeline.STAGES]
    if "fuse" not in names:  # until the pipeline runs the stage itself
        stages = list(pipeline.STAGES)
        stages.insert(names.index("configure"), ("fuse", lambda c: fuse(c.module)))
        monkeypatch.setattr(pipeline, "STAGES", stages)
    cold = compile_(*tiny())
    text = print_module(cold.module)
    assert cold.cache == "miss" and '"nova.fused"' in text and '"nova.yield"' in text
    warm = compile_(*tiny())
    assert warm.cache == "hit" and print_module(warm.module) == text
    assert plan_summary(warm.memory) == plan_summary(cold.memory)


# ----------------------------------------------------------------------------
# verifying a decoded module: cache.verify agrees with xDSL's module.verify()


@pytest.fixture(scope="module")
def fused_table():
    """The table of a tiny GPT step for the H200 (fused groups, lowering configs, a plan)."""
    model, opt, batch = tiny()
    c = compile_(model, opt, batch, precision="bf16", device=DEVICES["H200"])
    dirs: list[str] = []
    table = cache.encode(c.module, dirs, fixed=False)
    assert any(op[0] == "nova.fused" for op in table["ops"])
    return json.dumps(table), dirs


def _rows(ir: dict, name: str) -> list:
    def walk(rows):
        for row in rows:
            yield row
            for region in row[6] if len(row) == 7 else []:
                for _, inner in region:
                    yield from walk(inner)

    return [r for r in walk(ir["ops"]) if r[0] == name]


def _last_add_wrong_type(ir):
    ir["attrs"].append("tensor<3x5xf32>")
    _rows(ir, "nova.add")[-1][2] = [len(ir["attrs"]) - 1]  # the class was verified before: not by this op


def _inner_reads_outside(ir):
    group = _rows(ir, "nova.fused")[-1]
    group[6][0][0][1][0][1][0] = 0  # its first inner op reads the step's first argument


def _no_yield(ir):
    group = _rows(ir, "nova.fused")[5]
    group[6][0][0][1].pop()


def _property_of_another_kind(ir):
    ir["attrs"].append(["s", "elementwise"])
    _rows(ir, "nova.transpose")[-1][3]["perm"] = len(ir["attrs"]) - 1


def _wrong_fused_result(ir):
    ir["attrs"].append("tensor<7xf32>")
    _rows(ir, "nova.fused")[-1][2][0] = len(ir["attrs"]) - 1  # not what its nova.yield gives


@pytest.mark.parametrize("edit", [None, _last_add_wrong_type, _inner_reads_outside, _no_yield,
                                  _property_of_another_kind, _wrong_fused_result])  # fmt: skip
def test_verify_fails_where_xdsl_fails_with_the_same_error(fused_table, edit):
    text, dirs = fused_table
    ir = json.loads(text)
    if edit is not None:
        edit(ir)
    module = cache.decode(ir, dirs)
    try:
        module.verify()
    except Exception as e:  # noqa: BLE001
        want = (type(e), str(e))
    else:
        want = None
    assert (want is None) == (edit is None), want
    if want is None:
        cache.verify(module)
        return
    with pytest.raises(want[0]) as got:
        cache.verify(module)
    assert str(got.value) == want[1]


def test_ops_of_equal_inputs_run_their_verifier_once(monkeypatch):
    """A local verifier (NovaOp's type inference) runs once per distinct (class,
    operand types, result types, properties); every op still gets its structural checks."""
    from xdsl.dialects import func
    from xdsl.dialects.builtin import TensorType, f32

    from nova.ir import dialect as nv
    from nova.ir.module import Slot, new_step

    t = TensorType(f32, [2, 3])
    module, fn = new_step([Slot("param", "w", t)])
    (w,) = fn.body.block.args
    v = w
    for _ in range(5):
        op = nv.AddOp.create(operands=[v, w], result_types=[t])
        fn.body.block.add_op(op)
        v = op.results[0]
    fn.body.block.add_op(func.ReturnOp(v))
    fn.function_type = func.FunctionType.from_lists([t], [t])
    fn.res_attrs = ArrayAttr([Slot("loss", "loss", t).attrs()])
    module.verify()
    calls = []
    infer = nv.AddOp.infer.__func__
    monkeypatch.setattr(nv.AddOp, "infer", classmethod(lambda cls, *a: calls.append(1) or infer(cls, *a)))
    cache.verify(module)
    assert len(calls) == 1
    module.verify()
    assert len(calls) == 6


class Checked(IRDLOperation):
    name = "test.checked"
    values = var_operand_def()

    def verify_(self):
        pass


def test_only_verifiers_that_read_the_op_alone_are_shared():
    from xdsl.dialects import builtin, func

    from nova.ir import dialect as nv

    Checked_ = irdl_op_definition(Checked)
    assert cache._local_verifier(nv.AddOp) and cache._local_verifier(nv.MatmulOp)
    for cls in (nv.FusedOp, nv.YieldOp, func.ReturnOp, func.FuncOp, builtin.ModuleOp, Checked_, Give):
        assert not cache._local_verifier(cls), cls.name
