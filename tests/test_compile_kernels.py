"""Which kernels the compression runs under torch.compile (mesa_train/quant/compile_kernels.py):
the extension's ops as opaque graph nodes, or the traceable plain-PyTorch version. Both give
eager Mesa's bits; the choice is validated with the valid names, in the library and in the
training config."""
from __future__ import annotations

import copy

import pytest
import torch
from omegaconf import OmegaConf

import mesa_train.nn as mnn
from mesa_train import quant
from mesa_train.quant import compile_kernels as ck
from mesa_train.train.config import ConfigError, validate
from kernel_marks import DEVICES

needs_extension = pytest.mark.skipif(quant.BACKEND != "extension", reason="needs the compiled extension")


@pytest.fixture(autouse=True)
def _restore():
    yield
    ck.set_compile_kernels("auto")


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(mnn.Linear(12, 16, num_groups=2), mnn.GELU(num_groups=2),
                               mnn.LayerNorm(16, num_groups=2), mnn.Linear(16, 4, num_groups=2))


def _ops_in_graph(model, x, first_args: list | None = None) -> list[str]:
    """The mesa ops in the graphs Dynamo captured (run as they were captured, no AOT); with
    ``first_args``, each op's first argument (its example value) is appended there too."""
    seen: list[str] = []

    def backend(gm, example_inputs):
        # (the Mesa layers' forward and backward are subgraphs of autograd_function_apply nodes)
        for sub in gm.modules():
            if isinstance(sub, torch.fx.GraphModule):
                for n in sub.graph.nodes:
                    if n.op == "call_function" and "mesa" in str(n.target):
                        seen.append(str(n.target))
                        if first_args is not None:
                            first_args.append(n.args[0].meta.get("example_value"))
        return gm

    torch._dynamo.reset()
    out = torch.compile(model, backend=backend, fullgraph=True)(x)
    out.square().sum().backward()
    return seen


def test_bad_choice_names_the_valid_ones():
    with pytest.raises(ValueError, match="must be one of auto, ops, traceable, got 'fast'"):
        ck.set_compile_kernels("fast")
    assert ck.compile_kernels() == "auto"


def test_eager_never_traces_as_pytorch():
    for mode in ck.CHOICES:
        ck.set_compile_kernels(mode)
        assert not ck.traced_as_pytorch(torch.zeros(2))


@needs_extension
@pytest.mark.parametrize("mode,opaque", [("ops", True), ("traceable", False), ("auto", True)])
def test_the_choice_decides_what_the_graph_holds(mode, opaque):
    """ops (and auto with the extension, on any device): one mesa::compress graph node per
    compression (the activation one input of one opaque op); traceable: the passes over the
    activations are plain aten ops, and one opaque op per compression finishes the min/max
    and does the estimate and seed steps: mesa::observe on the (2, ..., groups) cells of the
    traced per-segment min/max, never on the activation itself (traceable.observe). The
    LayerNorm's backward stays the extension's op (compile_kernels.traced_row_sums)."""
    ck.set_compile_kernels(mode)
    first_args: list = []
    x = torch.randn(5, 3, 12, requires_grad=True)
    seen = _ops_in_graph(_model(), x, first_args)
    if opaque:
        assert seen.count("mesa.compress.default") == 4, seen
        assert "mesa.observe.default" not in seen and "mesa.quantize.default" not in seen, seen
    else:
        assert sorted(seen) == ["mesa.layer_norm_backward"] + ["mesa.observe.default"] * 4, seen
        # the Linear / GELU / LayerNorm inputs (5, 3, 12|16) in 2 groups of channels: 2 x 15 rows x 2 cells
        observed = [t for name, t in zip(seen, first_args) if name == "mesa.observe.default"]
        assert [tuple(t.shape) for t in observed] == [(2, 5, 3, 2)] * 4, first_args


@needs_extension
def test_traced_delayed_compression_is_two_small_ops_in_forward():
    """estimator=delayed, traceable, estimates known to be initialized: the codes and the row
    segments' min/max are plain aten ops (one kernel with the producer under Inductor), between
    two opaque ops a compression: mesa::seed_of before, mesa::delayed_observe on the cells after
    (before: estimate_and_seed, group_minmax and update_estimates, and a fill kernel)."""
    from mesa_train.nn.quantizer import mark_estimates_ready

    ck.set_compile_kernels("traceable")
    torch.manual_seed(0)
    model = torch.nn.Sequential(mnn.Linear(12, 16, num_groups=2, estimator="delayed"),
                                mnn.GELU(num_groups=2, estimator="delayed"),
                                mnn.LayerNorm(16, num_groups=2, estimator="delayed"),
                                mnn.Linear(16, 4, num_groups=2, estimator="delayed"))
    x = torch.randn(5, 3, 12, requires_grad=True)
    model(x).sum().backward()  # the first batch initializes the estimates
    assert mark_estimates_ready(model) == 4
    first_args: list = []
    seen = _ops_in_graph(model, x, first_args)
    assert sorted(seen) == (["mesa.delayed_observe.default"] * 4 + ["mesa.layer_norm_backward"]
                            + ["mesa.seed_of.default"] * 4), seen
    assert [tuple(t.shape) for t in first_args if t.dim() == 4] == [(2, 5, 3, 2)] * 4, first_args


@needs_extension
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_auto_keeps_the_cuda_kernels_in_the_graph():
    """auto on a GPU: the extension's CUDA ops, not traced PyTorch (compile_kernels.py says why)."""
    ck.set_compile_kernels("auto")
    seen = _ops_in_graph(_model().cuda(), torch.randn(5, 3, 12, device="cuda", requires_grad=True))
    assert seen.count("mesa.compress.default") == 4, seen


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["ops", "traceable"])
def test_compiled_train_steps_are_bitwise_eager(mode, device):
    """Forward, gradients, estimates and rounding counters of two compiled steps equal eager's."""
    ck.set_compile_kernels(mode)
    model = _model().to(device)
    eager = copy.deepcopy(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    for step in range(2):
        x = torch.randn(5, 3, 12, device=device) * (step + 1)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        out, ref = compiled(xa), eager(xb)
        out.square().sum().backward()
        ref.square().sum().backward()
        assert torch.equal(out, ref) and torch.equal(xa.grad, xb.grad), step
    for (n, p), (_, q) in zip(model.named_parameters(), eager.named_parameters()):
        assert torch.equal(p.grad, q.grad), n
    for (n, b), (_, c) in zip(model.named_buffers(), eager.named_buffers()):
        assert torch.equal(b, c), n


def test_config_rejects_an_unknown_choice(compose_train):
    cfg = compose_train([])
    assert cfg.mesa.compile_kernels == "auto"
    OmegaConf.update(cfg, "mesa.compile_kernels", "fast")
    with pytest.raises(ConfigError, match=r"mesa.compile_kernels='fast' is not valid; choose one of: auto, ops, "
                                          r"traceable"):
        validate(cfg)



def _saved_between_passes(model, x) -> dict[torch.dtype, int]:
    """Bytes per dtype that the min-cut partitioner (Inductor's) keeps from forward for
    backward: the backward graph's tensor inputs (parameters included)."""
    from functorch.compile import min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    saved: dict[torch.dtype, int] = {}

    def backward_compiler(gm, example_inputs):
        for t in example_inputs:
            if isinstance(t, torch.Tensor):
                saved[t.dtype] = saved.get(t.dtype, 0) + t.numel() * t.element_size()
        return gm

    backend = aot_autograd(fw_compiler=lambda gm, _: gm, bw_compiler=backward_compiler,
                           partition_fn=min_cut_rematerialization_partition)
    torch._dynamo.reset()
    torch.compile(model, backend=backend, fullgraph=True)(x).sum().backward()
    return saved


@pytest.mark.parametrize("mode", ["ops", "traceable"])
def test_the_partitioner_keeps_the_codes_not_the_activations(mode):
    """Under compile the partitioner decides what crosses from forward to backward, and may
    recompute what is cheap: with the compression traced it could keep an activation and
    quantize it again in backward. It keeps the uint8 codes: the float bytes saved are the
    parameters' (and a few per-row / per-group floats), the activations are all uint8."""
    from mesa_train.models import build_model
    from mesa_train.patch import patch_model

    torch.manual_seed(0)
    stock = build_model("deit_s", fused_attn=False, img_size=64, num_classes=10, depth=1)
    mesa = patch_model(copy.deepcopy(stock), ops=["all"])
    x = torch.randn(16, 3, 64, 64)
    params = sum(p.numel() * p.element_size() for p in stock.parameters())
    stock_saved = _saved_between_passes(stock, x)
    ck.set_compile_kernels(mode)
    mesa_saved = _saved_between_passes(mesa, x)
    stock_acts = stock_saved[torch.float32] - params
    assert stock_acts > 0.2 * params, stock_saved  # the check below has something to see
    assert mesa_saved[torch.float32] - params < 0.05 * stock_acts, (mode, mesa_saved, stock_saved)
    # (0.20x with one uint8 copy per MLP for GELU and fc2, patch_model(mlp="shared"); 0.25x separate)
    assert 0.15 * stock_acts < mesa_saved[torch.uint8] < 0.3 * stock_acts, (mode, mesa_saved, stock_saved)


def test_trace_cost_script_reports_time_and_graph_sizes():
    """scripts/trace_cost.py (the compile-cost figures in compile_kernels.py and DESIGN.md)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    for estimator in ("running", "delayed"):
        proc = subprocess.run([sys.executable, str(repo / "scripts" / "trace_cost.py"), "--mode", "ops", "--depth",
                               "1", "--estimator", estimator], capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        line = proc.stdout.strip().splitlines()[-1]
        assert line.startswith(f"ops {estimator} depth=1: trace+partition ") and " nodes forward " in line, line
        assert int(line.split("nodes forward ")[1].split()[0]) > 0
