"""step.explain(): the summary (stages, fusion groups, the most expensive kernels,
the memory plan), the IR per stage in the short form, the roofline, and
step.profile()'s measured times through an injected clock."""

from __future__ import annotations

import re
import time

import pytest
import torch

import nova
from nova import pipeline
from nova.ir.module import parse_module
from nova.models import GPT, gpt_tiny
from nova.runtime import profile as pf


def _gpt_step(backend: str = "triton", n_layer: int = 1):
    torch.manual_seed(0)
    model = GPT(gpt_tiny(n_layer=n_layer, block_size=8))
    step = nova.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-3), backend=backend)
    ids = torch.randint(0, 256, (2, 9))
    batch = (ids[:, :-1].contiguous(), ids[:, 1:].contiguous())
    step(*batch)
    return step, batch


class _Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.fc2(torch.relu(self.fc1(x))), y)


@pytest.fixture(scope="module")
def gpt():
    return _gpt_step()


def test_summary_of_a_small_gpt_step(gpt):
    step, _ = gpt
    text = step.explain()
    lines = text.splitlines()
    assert all(line.startswith("// ") for line in lines)  # MLIR comments: the summary may head an .mlir file
    assert lines[0].startswith("// program: GPT, batch [2, 8] int64, [2, 8] int64, precision fp32, backend triton")
    # every stage in pipeline order, with its op count; kernels once configured
    rows = {m.group(1): m for m in re.finditer(r"^//   (\w+) +(\d+) ops +(?:(\d+) kernels)?", text, re.MULTILINE)}
    assert list(rows) == [name for name, _ in pipeline.STAGES]
    final = step._last.fn.body.block
    assert int(rows["plan_memory"].group(2)) == len(list(final.ops)) - 1  # without the return
    assert rows["capture"].group(3) is None and int(rows["configure"].group(3)) > 0
    from nova.schedule.cost import kernel_costs

    c = step._last.compilation
    kernels = kernel_costs(step._last.fn, c.device, "fp32", c.memory.placements)
    assert int(rows["plan_memory"].group(3)) == len(kernels) == len(step._last.executable.launches)
    # the top kernels, most expensive first, predicted by the cost model
    assert "// the 10 most expensive kernels (predicted):" in text
    top = sorted(kernels, key=lambda k: -k.predicted_s)[:10]
    listed = re.findall(r"^//\s+(\d+)  (\S+) ", text, re.MULTILINE)
    assert [int(i) for i, _ in listed] == [k.index for k in top]
    assert [name for _, name in listed] == [k.op.removeprefix("nova.") for k in top]
    assert "linear_cross_entropy_with_grad" in listed[0][1]  # the LM head's loss and gradients: the most work
    assert re.search(r"// kernels on NVIDIA H200: \d+ \(\d+ launches\), .* predicted [\d.]+ (us|ms) a step", text)
    assert "// fusion groups: " in text and "// memory plan:" in text and "// predicted peak " in text
    assert "measured: not yet" in text and "site-packages" not in text


def test_profile_without_cuda_is_a_clear_error_and_runs_nothing(gpt):
    step, batch = gpt
    before = [p.detach().clone() for p in step.model.parameters()]
    with pytest.raises(pf.MeasureError, match="measuring needs a CUDA device, and nothing was run or measured"):
        step.profile(*batch)
    assert all(torch.equal(a, p) for a, p in zip(before, step.model.parameters()))
    ref, rbatch = _gpt_step("reference")
    with pytest.raises(pf.MeasureError, match="reference backend on cpu"):
        ref.profile(*rbatch)
    with pytest.raises(pf.MeasureError, match="reference backend"):
        ref.explain(measure=True)


class _FakeEvent:
    def __init__(self, clock):
        self.clock, self.at = clock, None

    def record(self):
        self.at = self.clock.now


class _FakeClock:
    """A device whose time advances only as the fake launches say."""

    asynchronous = True

    def __init__(self):
        self.now, self.holds, self.syncs = 0.0, [], 0

    def event(self):
        return _FakeEvent(self)

    def elapsed_s(self, a, b):
        return b.at - a.at

    def hold(self, seconds):
        self.holds.append(seconds)
        self.now += seconds

    def synchronize(self):
        self.syncs += 1


def test_event_timer_times_each_call_in_windows():
    clock = _FakeClock()
    durations = [1e-6 * (i + 1) for i in range(300)]

    def call(d):
        def run():
            clock.now += d
            clock.now += 0.5e-6  # the device's gap to the next launch

        return run

    times, gap = pf.EventTimer(clock, window=128).time([call(d) for d in durations])
    assert times == pytest.approx([d + 0.5e-6 for d in durations])
    assert gap == pytest.approx(0.0)  # the end event is recorded after the gap, the next start right away
    assert clock.syncs == 3 and len(clock.holds) == 3  # 128 + 128 + 44: each window behind a device wait
    assert clock.holds[0] == pytest.approx(max(pf.MIN_HOLD_S, 2 * pf.FIRST_HOST_GUESS_S * 128))
    assert all(h >= pf.MIN_HOLD_S for h in clock.holds)


class _HostClock:
    """The host's clock, advanced only by the fake launches' host costs."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_a_window_the_host_fell_behind_on_is_timed_again_with_a_longer_hold():
    """A launch whose host cost outlasts its window's device wait would be timed with the
    host's time in it (the device waits inside its events): the pass is thrown away and
    the list timed again, each window's hold twice the host's time for it."""
    clock, host = _FakeClock(), _HostClock()
    slow = {5: 30e-3}  # launch 5 costs the host 30 ms (a fused update with hundreds of arguments)

    def call(i):
        def run():
            host.now += slow.get(i, 20e-6)
            clock.now += 1e-6 * (i + 1)

        return run

    timer = pf.EventTimer(clock, window=4, host_clock=host)
    times, _ = timer.time([call(i) for i in range(10)])
    assert times == pytest.approx([1e-6 * (i + 1) for i in range(10)])
    assert timer.passes == 2
    # pass 1: 1 ms each (MIN_HOLD_S); pass 2: twice each window's host time, at least MIN_HOLD_S
    assert clock.holds == pytest.approx([1e-3] * 3 + [1e-3, 2 * (30e-3 + 3 * 20e-6), 1e-3])
    # the timer keeps what it learnt: the next call (measure's next repeat) needs one pass
    timer.time([call(i) for i in range(10)])
    assert timer.passes == 3


def test_a_host_that_never_keeps_ahead_is_an_error_not_a_time():
    clock, host = _FakeClock(), _HostClock()
    cost = [2e-3]

    def run():
        cost[0] *= 3  # each pass the launch costs the host three times more: no hold is ever enough
        host.now += cost[0]
        clock.now += 1e-6

    timer = pf.EventTimer(clock, window=4, host_clock=host)
    with pytest.raises(pf.MeasureError, match="could not keep ahead"):
        timer.time([run])
    assert timer.passes == pf.MAX_PASSES


def test_a_host_clock_is_not_checked_against_its_holds():
    """Where the host runs the launches itself (asynchronous False) there is no device to keep
    ahead of: one pass, whatever the host took."""
    clock, host = _CpuClock(), _HostClock()

    def run():
        host.now += 1.0

    timer = pf.EventTimer(clock, window=4, host_clock=host)
    timer.time([run] * 6)
    assert timer.passes == 1 and clock.holds == 2


class _CpuClock:
    """Host time: under Triton's interpreter a launch runs on the host, so the host's
    clock between two events is that launch's time (for this test only)."""

    asynchronous = False

    def __init__(self):
        self.holds = 0

    def event(self):
        clock = self

        class E:
            def record(self):
                self.at = time.perf_counter()

        return E()

    def elapsed_s(self, a, b):
        return b.at - a.at

    def hold(self, seconds):
        self.holds += 1

    def synchronize(self):
        pass


def test_profile_with_an_injected_clock_measures_every_launch_and_changes_nothing():
    step, batch = _gpt_step()  # its own step: the others must see no profile
    params = [p.detach().clone() for p in step.model.parameters()]
    state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in step.optimizer.state.items()}
    clock = _CpuClock()
    m = step.profile(repeat=2, clock=clock)
    launches = step._last.executable.launches
    assert len(m.kernels) == len(m.measured_s) == len(launches) and m.repeat == 2
    assert [k.op for k in m.kernels] == [launch.name for launch in launches]
    assert all(t > 0 for t in m.measured_s) and clock.holds == 2 * -(-len(launches) // pf.WINDOW)
    # measuring ran the step's launches again, and put every parameter and state tensor back
    assert all(torch.equal(a, p) for a, p in zip(params, step.model.parameters()))
    for p, s in step.optimizer.state.items():
        assert all(torch.equal(v, state[id(p)][k]) for k, v in s.items())
    text = step.explain()
    assert "// the 10 most expensive kernels (measured):" in text and "measured: not yet" not in text
    head = next(line for line in text.splitlines() if "predicted" in line and "measured" in line and "#" in line)
    assert head.split()[1:10] == ["#", "op", "bytes", "FLOPs", "FLOP/B", "bound", "predicted", "measured", "x"]
    slowest = max(range(len(m.kernels)), key=lambda i: m.measured_s[i])
    assert re.search(rf"^//\s+{m.kernels[slowest].index}  {m.kernels[slowest].op.removeprefix('nova.')} ", text,
                     re.MULTILINE)  # fmt: skip
    # a profile with a batch runs that step first (a real step), then measures
    calls = step._calls
    step.profile(*batch, repeat=1, clock=_CpuClock())
    assert step._calls == calls + 1


def test_launch_list_that_does_not_line_up_is_an_error(gpt):
    step, _ = gpt
    from nova.schedule.cost import kernel_costs

    c = step._last.compilation
    kernels = kernel_costs(step._last.fn, c.device, "fp32", c.memory.placements)
    with pytest.raises(pf.MeasureError, match="do not line up"):
        pf.launch_kernels(step._last.executable, kernels[1:], c.device.mem_bandwidth)


def test_ir_dir_holds_every_stage_in_the_short_form(gpt, tmp_path):
    step, _ = gpt
    text = step.explain(ir_dir=tmp_path / "ir")
    files = sorted(p.name for p in (tmp_path / "ir").iterdir())
    assert files == [f"{i:02d}-{name}.mlir" for i, (name, _) in enumerate(pipeline.STAGES)]
    assert f"// the IR of every stage: {len(files)} files in {tmp_path / 'ir'}" in text
    capture = (tmp_path / "ir" / "00-capture.mlir").read_text()
    final = (tmp_path / "ir" / files[-1]).read_text()
    for ir in (capture, final):
        assert not re.search(r'"nova\.\w+"\(', ir) and "site-packages" not in ir  # no generic form, no long paths
        locs = re.findall(r'^#loc(\d+) = "(.*)"$', ir, re.MULTILINE)
        assert locs and len({t for _, t in locs}) == len(locs)  # each location once
        used = set(re.findall(r"loc\(#loc(\d+)\)", ir))
        assert used == {i for i, _ in locs}
    assert re.search(r"^  %\d+ = nova\.matmul %\d+, %\d+ : tensor<16x192xf32>", capture, re.MULTILINE)  # c_attn: [B T, 3 n_embd]
    assert "transformer.h.0.attn.c_attn (Linear), node linear, torch/nn/modules/linear.py:" in capture
    assert re.search(r"nova\.matmul .*  \[matmul \d+x\d+x\d+ g\d+ w\d+ s\d+ \w+, [\w-]+\] @", final)
    assert "nova.fused" in final and "nova.yield" in final
    assert re.search(r"\{param transformer\.wte\.weight @external\}", final)


def test_explain_ir_appends_every_stage(gpt):
    from nova.cli.explain import split_stages

    step, _ = gpt
    text = step.explain(ir=True)
    assert [name for name, _ in split_stages(text)] == [name for name, _ in pipeline.STAGES]


def test_explain_of_a_tiny_mlp_is_small():
    torch.manual_seed(0)
    model = _Mlp()
    step = nova.compile(model, torch.optim.AdamW(model.parameters()), backend="triton")
    step(torch.randn(8, 16), torch.randint(0, 4, (8,)))
    text = step.explain()
    # what explain() used to return: every stage's generic MLIR, each op with its full nova.loc
    c = pipeline.Compilation(model, step._last.compilation.batch, step.optimizer, "fp32", torch.float32)
    c.device = step._last.compilation.device
    pipeline.run(c, dump=True)
    generic = sum(len(t) for t in c.stages.values())
    assert generic > 150_000 and len(text) < 10_000 and len(text) * 20 < generic
    short = step.explain(ir=True)
    assert len(short) < generic * 0.6 and short.count("site-packages") == 0
    for ir in c.stages.values():  # print_module stays the round-trip form
        assert parse_module(ir) is not None
        break


def test_plots_include_the_roofline(gpt, tmp_path):
    import matplotlib.image

    step, _ = gpt
    text = step.explain(plots=tmp_path / "p")
    png = tmp_path / "p" / "roofline.png"
    assert f"// roofline: {png}" in text and (tmp_path / "p" / "memory_timeline.png").exists()
    img = matplotlib.image.imread(str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and img.shape[:2] == (650, 1000)
    assert img[..., :3].std() > 0.05


def test_roofline_places_measured_kernels_too(gpt, tmp_path):
    from nova.explain import plot_roofline
    from nova.schedule.cost import kernel_costs

    step, _ = gpt
    c = step._last.compilation
    kernels = kernel_costs(step._last.fn, c.device, "fp32", c.memory.placements)
    plot_roofline(kernels, c.device, tmp_path / "r.png", {k.index: 2 * k.predicted_s for k in kernels})
    assert (tmp_path / "r.png").stat().st_size > 10_000
