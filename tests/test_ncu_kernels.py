"""scripts/ncu_kernels.py (Nsight Compute over the kernel table's ops) and the benchmark's
--launch-only / --cases / --ops that it drives. ncu itself runs only on the GPU machine: here
its command, the ops its patterns select (on the CPU kernels) and its report are checked."""
from __future__ import annotations

import re

import pytest

from conftest import load_script


@pytest.fixture(scope="module")
def ncu_kernels():
    return load_script("ncu_kernels")


@pytest.fixture(autouse=True)
def no_grid_policy(monkeypatch):
    """The benchmark refuses a grid policy on the CPU: none from the environment here."""
    monkeypatch.delenv("MESA_CUDA_GRID", raising=False)


def test_default_patterns_select_the_slow_ops_and_nothing_else(ncu_kernels):
    """The default --ops / --cases, run on the CPU kernels (the quick cases' names start as the
    GPU cases' do): each op family of the H200 profile's Mesa time is called, and none of the
    'before' comparisons or clone."""
    from mesa_train.quant import benchmark
    import torch

    cases = [c for c in benchmark.QUICK_CASES if re.search(ncu_kernels.CASES, c[0])]
    assert [c[0].split()[0] for c in cases] == ["tokens", "attn"]  # (q of qkv left out)
    called = benchmark.launch_once(torch.device("cpu"), cases, ["bf16"], ncu_kernels.OPS)
    ops = [c.split(" | ")[2] for c in called]
    for wanted in ("observe_rows", "observe", "quantize (stochastic)", "backward: dequantize",
                   "backward softmax: softmax_backward", "backward LayerNorm: layer_norm_backward",
                   "backward GELU + Linear: gelu_value_and_grad (row scales)",
                   "backward LayerNorm + Linear rebuild: dequantize with col_scale / col_shift"):
        assert wanted in ops, (wanted, ops)
    assert not [o for o in ops if "before" in o or o.startswith("clone")], ops
    # the token layout's ops and the attention map's: observe, quantize and dequantize on both
    assert sum(o == "quantize (stochastic)" for o in ops) == 2


def test_launch_only_calls_once_and_writes_nothing(tmp_path, capsys):
    from mesa_train.quant import benchmark

    out = benchmark.main(["--device", "cpu", "--quick", "--launch-only", "--cases", "^tokens", "--ops", "^observe$",
                          "--out-dir", str(tmp_path)])
    assert out == "" and not list(tmp_path.iterdir())
    printed = capsys.readouterr().out.splitlines()
    assert printed == ["launched tokens (2,65,96) C-groups dim -1 | bf16 | observe"]


def test_subset_table_is_printed_not_written(tmp_path, capsys):
    from mesa_train.quant import benchmark

    table = benchmark.main(["--device", "cpu", "--quick", "--cases", "attn", "--ops", "^quantize \\(nearest\\)$",
                            "--out-dir", str(tmp_path)])
    rows = [line for line in table.splitlines() if line.startswith("| attn")]
    assert [r.split(" | ")[2] for r in rows] == ["clone (baseline)", "quantize (nearest)"]
    assert not list(tmp_path.iterdir()) and "printed, not written" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["--cases", "nothing-like-this"], "matches no case; cases: ['tokens (2,65,96)"),
    (["--ops", "("], "is not a regular expression"),
    (["--launch-only", "--ops", "^no such op$"], "matches no op of the selected cases"),
])
def test_bad_selections_are_one_line_errors(argv, message, tmp_path, capsys):
    from mesa_train.quant import benchmark

    with pytest.raises(SystemExit):
        benchmark.main(["--device", "cpu", "--quick", "--out-dir", str(tmp_path), *argv])
    assert message in capsys.readouterr().err


def test_ncu_command_profiles_only_the_extension_kernels(ncu_kernels, tmp_path, capsys):
    fake = tmp_path / "ncu"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    assert ncu_kernels.main(["--ncu", str(fake), "--dry-run"]) == 0
    cmd = capsys.readouterr().out
    assert cmd.startswith(str(fake) + " --clock-control none")
    assert "--kernel-name-base function" in cmd and "row_cells_flat_kernel|row_cells_kernel|" in cmd
    assert all(f"--section {s}" in cmd for s in ncu_kernels.SECTIONS)
    assert "-m mesa_train.quant.benchmark --launch-only --cases" in cmd


def test_missing_ncu_is_a_one_line_error(ncu_kernels, tmp_path, capsys):
    with pytest.raises(SystemExit):
        ncu_kernels.main(["--ncu", str(tmp_path / "no-ncu"), "--dry-run"])
    assert "Nsight Compute not found: --ncu" in capsys.readouterr().err


# ncu's text for one launch, in the layout of Nsight Compute 2025 (sections' tables, a rule's
# wrapped paragraph); numbers made up
NCU_TEXT = """==PROF== Connected to process 4242 (/usr/bin/python3.12)
==PROF== Profiling "row_cells_kernel": 0%....50%....100% - 31 passes
  void mesa::(anonymous namespace)::row_cells_kernel<c10::BFloat16, true>(const T1 *, float *, float *, long, long, \
int, int, const float *, const float *, mesa::(anonymous namespace)::CellIndex) (2112, 1, 1)x(256, 1, 1), Context 1, \
Stream 7, Device 0, CC 9.0
    Section: GPU Speed Of Light Throughput
    ----------------------- ----------- ------------
    Metric Name             Metric Unit Metric Value
    ----------------------- ----------- ------------
    DRAM Frequency                  Ghz         2.62
    Elapsed Cycles                cycle      110,123
    Memory Throughput                 %        25.31
    DRAM Throughput                   %        24.90
    Duration                         us        62.91
    ----------------------- ----------- ------------
    Section: Occupancy
    Registers Per Thread             register/thread           63
    Theoretical Occupancy                          %           50
    Achieved Occupancy                             %        41.27
    Section: Warp State Statistics
    Warp Cycles Per Issued Instruction             cycle        28.43
    Avg. Active Threads Per Warp                                31.87

    OPT   Estimated Speedup: 61.37%
          On average, each warp of this kernel spends 17.4 cycles being stalled waiting for a scoreboard dependency on
          a L1TEX (local, global, surface, texture) operation. Find the instruction producing the data being waited
          upon to identify the culprit. This stall type represents about 61.4% of the total average of 28.4 cycles
          between issuing two instructions.
  quantize_kernel<c10::BFloat16, unsigned int, 16, true> (660, 1, 1)x(256, 1, 1), Context 1, Stream 7
    Section: GPU Speed Of Light Throughput
    Duration                    msecond         0.04
launched tokens (128,197,384) C-groups dim -1 | bf16 | observe_rows
"""


def test_the_summary_reads_each_launch_of_ncu_text(ncu_kernels):
    rows = ncu_kernels.summarize(NCU_TEXT)
    assert [r["kernel"] for r in rows] == ["row_cells_kernel<c10::BFloat16, true>",
                                           "quantize_kernel<c10::BFloat16, unsigned int, 16, true>"]
    first, second = rows
    assert (first["grid"], first["block"], first["duration_us"]) == ("2112, 1, 1", "256, 1, 1", 62.91)
    assert (first["Memory Throughput"], first["DRAM Throughput"]) == (25.31, 24.90)
    occupancy = (first["Achieved Occupancy"], first["Theoretical Occupancy"], first["Registers Per Thread"])
    assert occupancy == (41.27, 50, 63)
    assert first["Warp Cycles Per Issued Instruction"] == 28.43
    assert first["stall"].startswith("waiting for a scoreboard dependency on a L1TEX")
    assert first["stall"].endswith("(61.4%)")
    assert second["duration_us"] == pytest.approx(40.0) and "stall" not in second and "Memory Throughput" not in second
    table = "\n".join(ncu_kernels.summary_table(rows))
    assert ("| 1 | `row_cells_kernel<c10::BFloat16, true>` | (2112, 1, 1) x (256, 1, 1) | 62.9 | 25.3 | 24.9 "
            "| 41.3 / 50.0 | 63 | 28.4 |") in table
    assert ("| 2 | `quantize_kernel<c10::BFloat16, unsigned int, 16, true>` | (660, 1, 1) x (256, 1, 1) | 40.0 "
            "| – |") in table


def test_kernel_names_lose_the_anonymous_namespace_as_ncu_2025_prints_it(ncu_kernels):
    """The H200's ncu (2026-12-04) printed "void unnamed>::k<...>(const T1 *, unnamed>::S<T2>)": the
    summary then kept the whole signature, its brackets unbalanced."""
    name = "void unnamed>::row_finish_grid_kernel<c10::BFloat16>(unsigned int *, unnamed>::CellIndex, bool)"
    assert ncu_kernels.short_name(name) == "row_finish_grid_kernel<c10::BFloat16>"
    bracketed = "void <unnamed>::quantize_kernel<float, 1>(const T1 *)"
    assert ncu_kernels.short_name(bracketed) == "quantize_kernel<float, 1>"


def test_report_counts_the_profiled_launches_and_says_when_ncu_failed(ncu_kernels, monkeypatch):
    output = ("==PROF== Connected to process 1\n"
              "  row_cells_kernel<c10::BFloat16, true> (3152, 1, 1)x(256, 1, 1), Context 1, Stream 7, CC 9.0\n"
              "    Section: GPU Speed Of Light Throughput\n"
              "  quantize_kernel<c10::BFloat16, unsigned int, 16, true> (660, 1, 1)x(256, 1, 1), Context 1, Stream 7\n")
    text = ncu_kernels.report("NVIDIA H200", "torch 2.11", ["ncu", "python3"], output, 0)
    assert text.startswith("# Nsight Compute: the Mesa kernels of a DeiT-S step on NVIDIA H200")
    assert "2 kernel launches profiled" in text and "```\n==PROF== Connected" in text
    failed = ncu_kernels.report("NVIDIA H200", "torch 2.11", ["ncu"], "==ERROR== LibraryNotLoaded", 1)
    assert "**ncu exited 1**" in failed

    # the report's file is named as the bench names the device (results/host/nvidia-h200.md)
    import torch
    from mesa_train.bench.report import device_slug

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert device_slug(torch.device("cuda")) == "nvidia-h200"


def test_the_report_is_written_from_the_streamed_output(ncu_kernels, tmp_path, monkeypatch, capsys):
    """A stand-in ncu that prints one profiled launch and fails: its lines are printed as they
    come (the step's log keeps them) and the report has them and the failure."""
    fake = tmp_path / "ncu"
    fake.write_text("#!/bin/sh\necho '  row_cells_kernel<float, true> (2112, 1, 1)x(256, 1, 1), Context 1'\n"
                    "echo '==ERROR== the rest failed' >&2\nexit 3\n")
    fake.chmod(0o755)
    rc, output = ncu_kernels.run_streaming([str(fake)])
    assert rc == 3 and "row_cells_kernel<float, true>" in output and "==ERROR== the rest failed" in output
    assert "row_cells_kernel<float, true>" in capsys.readouterr().out
