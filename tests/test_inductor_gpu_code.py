"""scripts/inductor_gpu_code.py: Inductor's Triton (H100) code, generated on a machine without a
GPU, and what it must show about the traced compression."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "inductor_gpu_code.py"

# (a fresh interpreter per check: the fake GPU patches torch.cuda and Inductor process-wide,
# and Inductor caches what it learnt about the device; the module registered under its name, as
# an import would: Dynamo in torch 2.11 re-imports a traced function's module by that name)
PRELUDE = f"""
import importlib.util, json, sys, torch
spec = importlib.util.spec_from_file_location("igc", {str(SCRIPT)!r})
igc = importlib.util.module_from_spec(spec); sys.modules["igc"] = igc; spec.loader.exec_module(igc)
"""


def _run(code: str):
    """The JSON value ``code`` prints on its last line, run after PRELUDE in a new interpreter."""
    out = subprocess.run([sys.executable, "-c", PRELUDE + code], capture_output=True, text=True, timeout=900,
                         cwd=REPO)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


GELU_FORWARD_KERNELS = """
import mesa_train.nn as mnn
from mesa_train.nn.quantizer import mark_estimates_ready
from mesa_train.compile_scope import TRACED_INDUCTOR_OPTIONS
from mesa_train.quant.compile_kernels import set_compile_kernels
set_compile_kernels("traceable")
torch.manual_seed(0)
layer = mnn.GELU(estimator=sys.argv[1], num_groups=4)
x = torch.randn(4, 10, 64, requires_grad=True)
layer(x).sum().backward()          # the first step, eager: estimates initialized
mark_estimates_ready(layer)
forward, _ = igc.capture_step_graphs(layer, x, steps=1, amp=False)
print(json.dumps(sorted(igc.lower_for_h100(forward, dict(TRACED_INDUCTOR_OPTIONS))[0])))
"""


@pytest.mark.parametrize("estimator", ["running", "delayed"])
def test_gpu_code_of_the_traced_delayed_compression_is_one_pass(estimator):
    """On the GPU (Triton), the traced delayed compression's codes and its min/max come from one
    kernel: the kernel with the rounding hash (a ``>>``) also reduces (amin / amax). With the
    one-stage min/max (a column reduction over every dim but the grouped one) Triton split it
    into kernels of their own that read the activation again, while CPU Inductor fused it
    (``test_inductor_fuses_the_delayed_compression_into_the_producer`` passed there). Running
    estimates need the finished reduction before any code: two passes, by definition."""
    kernels = _run(GELU_FORWARD_KERNELS.replace("sys.argv[1]", repr(estimator)))
    coding = [k for k in kernels if "rshift" in k]
    assert coding, kernels
    one_pass = any("amax" in k and "amin" in k for k in coding)
    assert one_pass == (estimator == "delayed"), kernels


LAYERNORM_FORWARD = """
import mesa_train.nn as mnn
from mesa_train.nn.quantizer import mark_estimates_ready
from mesa_train.compile_scope import TRACED_INDUCTOR_OPTIONS
from mesa_train.quant.compile_kernels import set_compile_kernels
set_compile_kernels("traceable")
torch.manual_seed(0)
layer = mnn.LayerNorm(384, estimator=sys.argv[1], num_groups=6)
x = torch.randn(2, 197, 384, requires_grad=True)
layer(x).sum().backward()          # the first step, eager: estimates initialized
mark_estimates_ready(layer)
forward, _ = igc.capture_step_graphs(layer, x, steps=1, amp=False)
kernels, ops, _ = igc.lower_for_h100(forward, dict(TRACED_INDUCTOR_OPTIONS))
print(json.dumps([sorted(kernels), [name for name, _, _ in ops]]))
"""


@pytest.mark.parametrize("estimator", ["running", "delayed"])
def test_traced_compression_launches_on_the_gpu(estimator):
    """What the traced compression of a DeiT-S LayerNorm output launches in forward on the GPU.
    Delayed: the kernel that makes the output, its codes and its row segments' min/max, and two
    small opaque ops, mesa::seed_of and mesa::delayed_observe. Running: mesa::observe on the
    cells, then the codes. No kernel copies the min/max cells for the op: Inductor pads the
    rows of the cells' buffer (197 x 6 floats -> 1184) and, before the ops took any layout
    (flexible_layout), copied them into the eager strides for a mutating op."""
    kernels, ops = _run(LAYERNORM_FORWARD.replace("sys.argv[1]", repr(estimator)))
    assert ops == (["mesa.seed_of", "mesa.delayed_observe"] if estimator == "delayed" else ["mesa.observe"]), ops
    assert not [k for k in kernels if "stack" in k or "cat" in k], kernels
    coding = [k for k in kernels if "rshift" in k]
    assert len(coding) == 1 and ("amax" in coding[0]) == (estimator == "delayed"), kernels


SOFTMAX_THEN_MATMUL = """
from mesa_train.compile_scope import TRACED_INDUCTOR_OPTIONS
from mesa_train.models import build_model
from mesa_train.patch.core import patch_model
from mesa_train.quant.compile_kernels import set_compile_kernels
set_compile_kernels("traceable")
torch.manual_seed(0)
model = build_model("deit_ti")
patch_model(model, ops=["softmax", "matmul"], estimator=sys.argv[1])
x = torch.randn(2, 197, model.embed_dim, requires_grad=True)
forward, _ = igc.capture_step_graphs(model.blocks[0].attn, x, steps=1, amp=True,
                                     inductor_options=dict(TRACED_INDUCTOR_OPTIONS))
kernels, _, launches = igc.lower_for_h100(forward, dict(TRACED_INDUCTOR_OPTIONS))
print(json.dumps([{name: src for name, src in kernels.items() if "rshift" in name},
                  [name for name in launches if "rshift" in name]]))
"""


@pytest.mark.parametrize("estimator", ["running", "per_sample"])
def test_two_pass_softmax_codes_read_the_stored_map(estimator):
    """With two passes (running or per-sample estimates: the codes wait for the finished
    min/max) the kernel that makes the softmax's codes reads the stored map; it does not
    compute the map again from the logits and the row statistics (no exp). The map is stored
    for ``attn @ v`` anyway, but only when that matmul is lowered, after the compression:
    before ``traceable.stored_here`` the coding kernel inlined the softmax, 124 instructions an
    element on sm_90 against 73 for the one-pass kernel that also computes it
    (``scripts/triton_sass.py``)."""
    coding, launched = _run(SOFTMAX_THEN_MATMUL.replace("sys.argv[1]", repr(estimator)))
    map_numel = 2 * 3 * 197 * 197  # deit_ti: 3 heads
    assert any(f"xnumel = {map_numel}" in source for source in coding.values()), list(coding)
    # four compressions, four coding launches: q, k^T, the map, v (q's and v's, same-shaped
    # operands, may share one kernel; the census counts launches)
    assert len(launched) == 4 and set(launched) == set(coding), (launched, list(coding))
    for name, source in coding.items():
        assert not re.search(r"\.exp2?\(", source), name  # tl_math.exp / libdevice.exp: a softmax inlined


def test_census_of_a_stock_block():
    """The script end to end on a small stock block: every kernel has Inductor's byte count,
    and the forward moves at least the block's input once (float32)."""
    result = _run("""
out = igc.census("deit_ti", "stock", 2, True)
res = {part: [[name, kind, mb] for name, kind, mb in out[part]] for part in ("forward", "backward")}
res["saved"] = [[str(dtype), n] for dtype, n in out["saved"]]
print(json.dumps(res))
""")
    assert set(result) == {"forward", "backward", "saved"}
    # what the forward keeps for backward: at least the block's input (2, 197, 192), in float32
    assert sum(n * (4 if dtype == "torch.float32" else 2) for dtype, n in result["saved"]) >= 2 * 197 * 192 * 4
    for rows in (result["forward"], result["backward"]):
        assert rows and all(mb > 0 for _, _, mb in rows), rows
        assert {kind for _, kind, _ in rows} <= {"pointwise", "reduction", "persistent reduction"}
    assert any("layer_norm" in name for name, _, _ in result["forward"])
    # the softmax over 197 columns: one persistent reduction (torch 2.11 writes it as a loop that
    # reads its rows again, unless mesa_train.inductor_backports gives its decision the scores)
    softmax = [kind for name, kind, _ in result["forward"] if "softmax" in name]
    assert softmax and set(softmax) == {"persistent reduction"}, result["forward"]
    x_mb = 2 * 197 * 192 * 4 / 1e6
    assert sum(mb for _, _, mb in result["forward"]) >= x_mb


def test_a_kernel_launched_twice_counts_twice():
    """Inductor defines a kernel once per distinct source and launches it wherever that source
    is needed: here ``sin(2 x)`` before and after a matmul of the same shape, one kernel, two
    launches. The census counts launches and their bytes (it counted each distinct kernel once,
    so two compressions of same-shaped operands, q's and v's, read as one)."""
    result = _run("""
class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(64, 64))
    def forward(self, x):
        return ((x * 2).sin() @ self.w * 2).sin()
forward, _ = igc.capture_step_graphs(Toy(), torch.randn(8, 64, requires_grad=True), steps=1, amp=False)
sources, ops, launches = igc.lower_for_h100(forward, {})
print(json.dumps([sorted(sources), launches, igc.kernel_rows(sources, launches)]))
""")
    sources, launches, rows = result
    assert len(sources) == 1 and launches == sources * 2, result
    assert [name for name, _, _ in rows] == launches and rows[0][2] == rows[1][2] > 0, rows
    # each launch reads 8 x 64 float32 and writes as much
    assert abs(rows[0][2] - 2 * 8 * 64 * 4 / 1e6) < 1e-6, rows


def test_unknown_model_is_one_line_error():
    out = subprocess.run([sys.executable, str(SCRIPT), "--model", "no_such_model", "--variants", "stock"],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith("error: unknown model 'no_such_model'")


def test_census_lists_the_opaque_mesa_ops():
    """With compile_kernels=ops the compression is Mesa's own ops, which Inductor does not
    generate: they are listed beside the Triton kernels with the bytes of their tensors."""
    result = _run("""
out = igc.census("deit_ti", "ops", 2, True)
res = {part: [[name, kind, mb] for name, kind, mb in out[part]] for part in ("forward", "backward")}
res["saved"] = [[str(dtype), n] for dtype, n in out["saved"]]
print(json.dumps(res))
""")
    ops = {part: [(name, mb) for name, kind, mb in result[part] if kind == "Mesa op"]
           for part in ("forward", "backward")}
    assert any(name == "mesa.compress" for name, _ in ops["forward"]), ops
    assert any(dtype == "torch.uint8" for dtype, _ in result["saved"]), result["saved"]  # the codes
    assert any(name == "mesa.softmax_backward" for name, _ in ops["backward"]), ops
    # a block's input (2, 197, 192) float32 is compressed at least once: its bytes in, codes out
    assert all(mb > 0 for rows in ops.values() for _, mb in rows)
    assert max(mb for _, mb in ops["forward"]) >= 2 * 197 * 192 * 2 / 1e6


def test_census_of_the_fused_attention_block():
    """--attention fused: timm's fused attention with Mesa's sdpa set; its backward is
    ``mesa::sdpa_recompute_backward`` (an opaque op), q, k, v compressed, no softmax op."""
    result = _run("""
out = igc.census("deit_ti", "ops", 2, True, "fused")
res = {part: [[name, kind, mb] for name, kind, mb in out[part]] for part in ("forward", "backward")}
res["saved"] = [[str(dtype), n] for dtype, n in out["saved"]]
print(json.dumps(res))
""")
    ops = {part: [name for name, kind, _ in result[part] if kind == "Mesa op"] for part in ("forward", "backward")}
    assert "mesa.sdpa_recompute_backward" in ops["backward"], ops
    assert "mesa.softmax_backward" not in ops["backward"], ops
    assert ops["forward"].count("mesa.compress") >= 3 + 4, ops  # q, k, v and the Linear / GELU / norm inputs


def test_variants_are_valid_quantizer_options():
    """Each variant's patch_model options are QuantOptions (a typo would only show minutes into
    a census), and triton_sass.py offers the same variants."""
    import importlib.util

    from mesa_train.nn.quantizer import QuantOptions

    spec = importlib.util.spec_from_file_location("igc_variants", SCRIPT)
    igc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(igc)
    assert igc.VARIANTS[0] == "stock" and igc.VARIANT_OPTIONS["stock"] is None
    for name, options in igc.VARIANT_OPTIONS.items():
        if options is not None:
            QuantOptions(**options)
    assert igc.VARIANT_OPTIONS["delayed-norows"] == {"estimator": "delayed", "row_scale": False}
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "triton_sass.py"), "--help"], capture_output=True,
                         text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0 and "delayed-norows" in out.stdout, out.stderr[-2000:]


def test_an_inductor_option_reaches_the_census():
    """``--inductor-option`` (``census(..., extra_options)``) is in force while Inductor writes the
    block's code: with ``combo_kernels`` a stock block launches fewer kernels (independent small
    ones, such as the weights' bf16 casts, go out as one) that move the same bytes."""
    plain, combo = _run("""
rows = [igc.census("deit_ti", "stock", 2, True, extra_options=options)
        for options in (None, {"combo_kernels": True})]
print(json.dumps([[len(r["forward"]), round(sum(mb for _, _, mb in r["forward"]), 3)] for r in rows]))
""")
    assert combo[0] < plain[0], (plain, combo)
    assert abs(combo[1] - plain[1]) < 1e-3, (plain, combo)


@pytest.mark.parametrize("option,message", [
    ("combo_kernel=True", "error: --inductor-option 'combo_kernel' is not an Inductor option (torch._inductor.config);"
                          " close: combo_kernels"),
    ("combo_kernels", "error: --inductor-option 'combo_kernels': expected NAME=VALUE"),
    ("combo_kernels=[1]", "error: --inductor-option combo_kernels: '[1]' is not a bool, number or string"),
])
def test_a_bad_inductor_option_is_one_line_error(option, message):
    out = subprocess.run([sys.executable, str(SCRIPT), "--variants", "stock", "--inductor-option", option],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith(message), out.stderr[-2000:]
