"""scripts/dram_bytes.py reads Nsight Compute's raw CSV (no GPU here): per kernel name the
launches and the summed counters, in base units, with or without a row of units after
the header, thousands separators and "n/a" cells."""

from __future__ import annotations

import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))
from dram_bytes import parse  # noqa: E402

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Device","CC",'
          '"dram__bytes_read.sum","dram__bytes_write.sum","gpu__time_duration.sum","lts__t_bytes.sum"')


def _row(i: int, name: str, read: str, write: str, ns: str, l2: str) -> str:
    return f'"{i}","7","python3","h","{name}","1","7","0","9.0","{read}","{write}","{ns}","{l2}"'


def test_kernels_sum_over_their_launches_in_base_units():
    text = "\n".join([
        "==PROF== Connected to process 7 (/usr/bin/python3)",
        HEADER,
        '"","","","","","","","","","byte","Kbyte","nsecond","byte"',
        _row(0, "matmul_kernel", "1,048,576", "512", "12000", "3000000"),
        _row(1, "matmul_kernel", "1048576", "512", "12500", "3000000"),
        _row(2, "nova_cast_768x768_f32_to_bf16", "2359296", "1179.648", "1600", "n/a"),
        "==PROF== Disconnected from process 7",
    ])  # fmt: skip
    got = parse(text)
    assert set(got) == {"matmul_kernel", "nova_cast_768x768_f32_to_bf16"}
    mm = got["matmul_kernel"]
    assert mm == {"launches": 2, "dram_read": 2097152.0, "dram_write": 1024000.0, "l2": 6e6, "ns": 24500.0,
                  "inst": 0.0}  # a metric the CSV lacks counts 0
    cast = got["nova_cast_768x768_f32_to_bf16"]
    assert cast["launches"] == 1 and cast["l2"] == 0.0 and abs(cast["dram_write"] - 1179648.0) < 1e-6


def test_no_units_row_and_no_kernels():
    text = "\n".join([HEADER, _row(0, "k", "10", "20", "30", "40")])
    assert parse(text) == {"k": {"launches": 1, "dram_read": 10.0, "dram_write": 20.0, "l2": 40.0, "ns": 30.0, "inst": 0.0}}
    with_inst = "\n".join([HEADER + ',"sm__inst_executed.sum"', _row(0, "k", "1", "2", "3", "4") + ',"5,000"'])
    assert parse(with_inst)["k"]["inst"] == 5000.0
    assert parse("==PROF== no kernels were profiled") == {}


def test_stall_report_reads_each_launch_its_context_and_its_stall_reasons_largest_first():
    from dram_bytes import stall_report

    stalled = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
    header = ('"ID","Kernel Name","gpu__time_duration.sum","sm__warps_active.avg.pct_of_peak_sustained_active",'
              + ",".join(f'"{stalled.format(r)}"' for r in ("barrier", "long_scoreboard", "math_pipe_throttle")))
    text = "\n".join([
        "==PROF== Connected to process 7 (/usr/bin/python3)",
        header,
        '"","","nsecond","%","inst","inst","inst"',
        '"0","layer_norm_backward_kernel","196,000","24.5","1.25","9.5","0"',
        '"1","nova_fused_reduce_sum_gelu","261000","n/a","0.5","3.0","4.25"',
    ])  # fmt: skip
    first, second = stall_report(text)
    assert first["name"] == "layer_norm_backward_kernel"
    assert first["context"] == {"time us": 196.0, "occupancy %": 24.5}
    assert first["reasons"] == [("long_scoreboard", 9.5), ("barrier", 1.25)]  # zeros left out
    assert second["context"] == {"time us": 261.0}  # "n/a" left out
    assert [n for n, _ in second["reasons"]] == ["math_pipe_throttle", "long_scoreboard", "barrier"]
    assert stall_report("==PROF== no kernels were profiled") == []
