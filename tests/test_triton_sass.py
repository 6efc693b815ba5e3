"""scripts/triton_sass.py: the machine code of Inductor's Triton kernels for sm_90, compiled and
read without a GPU (registers, occupancy, instructions a thread runs)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import load_script

pytest.importorskip("triton")

REPO = Path(__file__).resolve().parents[1]
ts = load_script("triton_sass")


def test_instructions_a_thread_runs_count_loop_bodies_per_trip():
    """Straight-line code once; a loop body (backward branch to its target) once per trip; the
    branch to itself after EXIT is not a loop."""
    code = [(0x00, "S2R R0, SR_TID.X"), (0x10, "LDG.E R2, desc[UR4][R4.64]"),  # loop body: 0x10-0x30
            (0x20, "FADD R3, R3, R2"), (0x30, "@P0 BRA 0x10"), (0x40, "STG.E desc[UR4][R6.64], R3"),
            (0x50, "EXIT"), (0x60, "BRA 0x60"), (0x70, "NOP")]
    assert ts.executed_per_thread(code, trips=1) == 7  # (the NOP never runs)
    assert ts.executed_per_thread(code, trips=5) == 7 + 4 * 3


@pytest.mark.parametrize("regs, smem, warps, expected", [
    (166, 0, 1, 12),   # 166 -> 5376 registers a warp: 12 warps
    (34, 0, 1, 32),    # one-warp blocks: capped by 32 blocks an SM
    (32, 0, 4, 64),    # the 64-warp limit
    (80, 0, 2, 24),
    (32, 100 * 1024, 4, 8),  # shared memory: two blocks
])
def test_resident_warps_per_sm(regs, smem, warps, expected):
    assert ts.warps_per_sm(regs, smem, warps) == expected


def test_sizes_read_from_an_inductor_kernel():
    src = "def k(in_ptr0, xnumel, r0_numel, XBLOCK : tl.constexpr):\n    xnumel = 9456\n    r0_numel = 197\n"
    assert (ts.numel(src, "xnumel"), ts.numel(src, "r0_numel"), ts.numel(src, "ynumel")) == (9456, 197, 1)


# (a fresh interpreter: the fake GPU patches torch.cuda and Inductor process-wide)
GELU_KERNEL_ROWS = f"""
import importlib.util, json, sys, torch
sys.path.insert(0, {str(REPO / "scripts")!r})
import inductor_gpu_code as igc, triton_sass as ts
import mesa_train.nn as mnn
from mesa_train.nn.quantizer import mark_estimates_ready
from mesa_train.compile_scope import TRACED_INDUCTOR_OPTIONS
from mesa_train.quant.compile_kernels import set_compile_kernels
torch.manual_seed(0)
x = torch.randn(8, 50, 256, requires_grad=True)
stock, _ = igc.capture_step_graphs(torch.nn.GELU(), x, steps=1, amp=False)
stock_sources = igc.lower_for_h100(stock, {{}})[0]
set_compile_kernels("traceable")
layer = mnn.GELU(estimator="delayed", num_groups=4)
layer(x).sum().backward()          # the first step, eager: estimates initialized
mark_estimates_ready(layer)
traced, _ = igc.capture_step_graphs(layer, x, steps=1, amp=False)
sources = igc.lower_for_h100(traced, dict(TRACED_INDUCTOR_OPTIONS))[0]
coding = [n for n in sources if "rshift" in n]
tuned = "'coordinate_descent_tuning': True"
out = {{"tuned": [n for n in sources if tuned in sources[n]], "stock_tuned": [n for n in stock_sources
                                                                       if tuned in stock_sources[n]]}}
with igc.fake_h100():
    out["stock"] = [ts.kernel_rows(n, s, 1.0) for n, s in stock_sources.items()]
    out["coding"] = [ts.kernel_rows(n, sources[n], 1.0, alternatives=True) for n in coding]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def gelu_rows():
    out = subprocess.run([sys.executable, "-c", GELU_KERNEL_ROWS], capture_output=True, text=True, timeout=900,
                         cwd=REPO)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_traced_quantize_costs_its_hash_in_instructions(gelu_rows):
    """The delayed traced GELU's coding kernel (GELU, its row segments' min/max, the hash and
    the quantize in one kernel) compiled for sm_90: registers and instructions read from the
    cubin, and per element it runs more than stock's GELU by at least the hash's ~10 integer
    operations (a count that read nothing, or only the straight-line code, would not)."""
    assert len(gelu_rows["coding"]) == 1, gelu_rows
    rows = gelu_rows["coding"][0]
    listed = [r for r in rows if not r["alternative"]]
    stock = [r for kernel in gelu_rows["stock"] for r in kernel]
    assert listed and stock
    for r in rows + stock:
        assert r["registers"] > 0 and r["per_thread"] > 0 and 0 < r["warps_per_sm"] <= 64, r
        assert r["issue_us"] > 0 and r["bytes_us"] > 0
    assert min(r["per_element"] for r in listed) > max(r["per_element"] for r in stock) + 10, (listed, stock)


def test_traced_kernels_are_tuned_on_the_gpu(gelu_rows):
    """TRACED_INDUCTOR_OPTIONS reach every kernel of a traced Mesa graph as coordinate-descent
    tuning (Inductor's runtime autotuner reads it from the kernel's meta: the launch shape is
    timed on the GPU); stock's kernels, compiled without them, keep the heuristic's."""
    assert gelu_rows["tuned"] and gelu_rows["stock_tuned"] == [], gelu_rows["tuned"]
    assert any("rshift" in n for n in gelu_rows["tuned"])


def test_a_persistent_reduction_lists_other_launch_shapes(gelu_rows):
    """``--configs``: the coding kernel (a persistent row reduction) again at XBLOCK 1-8 and
    1-4 warps, each compiled: distinct shapes, and more elements a thread needs more registers
    (XBLOCK 8 on one warp holds more than XBLOCK 1 on four)."""
    rows = gelu_rows["coding"][0]
    alternatives = [r for r in rows if r["alternative"]]
    shapes = [r["config"] for r in rows]
    assert len(alternatives) >= 8 and len(set(shapes)) == len(shapes), shapes
    regs = {r["config"]: r["registers"] for r in rows}
    assert regs["XBLOCK=8, warps=1"] > regs["XBLOCK=1, warps=4"], regs


def test_cli_reads_a_kernel_cache_and_rejects_bad_input(tmp_path):
    """The command on a cached kernel (no capture): a table and the totals line; a regex that
    matches nothing and a missing number fail with one line."""
    kernel = """
import triton
import triton.language as tl
from torch._inductor.runtime import triton_helpers, triton_heuristics
from torch._inductor.runtime.hints import AutotuneHint, ReductionHint, TileHint, DeviceProperties
triton_helpers.set_driver_to_gpu()

@triton_heuristics.pointwise(
    size_hints={'x': 1024}, filename=__file__,
    triton_meta={'signature': {'in_ptr0': '*fp32', 'out_ptr0': '*fp32', 'xnumel': 'i32', 'XBLOCK': 'constexpr'},
                 'device': DeviceProperties(type='cuda', index=0, multi_processor_count=132, cc=90, major=9,
                 regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048, max_threads_per_block=1024,
                 warp_size=32), 'constants': {}, 'configs': [{(0,): [['tt.divisibility', 16]],
                 (1,): [['tt.divisibility', 16]], (2,): [['tt.divisibility', 16]]}]},
    inductor_meta={'grid_type': 'Grid1D', 'kernel_name': 'triton_poi_fused_mul_0', 'mutated_arg_names': [],
                   'backend_hash': 'fake-h100', 'kernel_num_gb': 8e-06},
    min_elem_per_thread=0)
@triton.jit
def triton_poi_fused_mul_0(in_ptr0, out_ptr0, xnumel, XBLOCK : tl.constexpr):
    xnumel = 1024
    xoffset = tl.program_id(0) * XBLOCK
    xindex = xoffset + tl.arange(0, XBLOCK)[:]
    xmask = xindex < xnumel
    tmp0 = tl.load(in_ptr0 + (xindex), xmask)
    tl.store(out_ptr0 + (xindex), tmp0 * 2.0, xmask)
"""
    cache = tmp_path / "kernels.json"
    # launched twice by its graph, each launch 26 MB by Inductor's count (10 us at 2.6 TB/s)
    cache.write_text(json.dumps({"kernels": [["forward", "triton_poi_fused_mul_0", kernel, 26.0, 2]],
                                 "ops": [["forward", "mesa.observe", 26.0], ["forward", "mesa.quantize", 26.0]]}))
    script = str(REPO / "scripts" / "triton_sass.py")
    out = subprocess.run([sys.executable, script, "--cache", str(cache)], capture_output=True, text=True,
                         timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "| forward | `triton_poi_fused_mul_0` | 2 |" in out.stdout, out.stdout
    # the kernel's two launches (10 us each by their bytes) beside the extension ops' bytes
    # at 2.6 TB/s (52 MB in 20 us)
    assert "forward: 20 us in 2 Triton kernel launches + 20 us in 2 extension ops" in out.stdout, out.stdout
    assert "(40 us with each launch at least 2.5 us)" in out.stdout, out.stdout
    # a launch whose work takes less than LAUNCH_FLOOR_US costs that floor in the second sum
    assert ts.totals([{"part": "forward", "kernel": "k", "alternative": False, "issue_us": 0.1,
                       "bytes_us": 0.2, "launches": 3}]) == {"forward": (3, 0.2 * 3, 2.5 * 3)}
    old = tmp_path / "old.json"  # a cache from before launches were counted: refused, not read as one each
    old.write_text(json.dumps({"kernels": [["forward", "triton_poi_fused_mul_0", kernel, 26.0]], "ops": []}))
    bad = subprocess.run([sys.executable, script, "--cache", str(old)], capture_output=True, text=True,
                         timeout=300, cwd=REPO)
    assert bad.returncode == 2 and "before kernels were counted by launch" in bad.stderr, bad.stderr
    bad = subprocess.run([sys.executable, script, "--cache", str(cache), "--kernels", "softmax"],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == ["error: no kernel matches --kernels 'softmax'"]
    bad = subprocess.run([sys.executable, script, "--batch", "0"], capture_output=True, text=True, timeout=300,
                         cwd=REPO)
    assert bad.returncode == 2 and "--batch must be at least 1" in bad.stderr
