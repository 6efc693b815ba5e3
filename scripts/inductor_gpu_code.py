"""The Triton kernels Inductor would generate on an H100 for one training step of a model's
block, stock and Mesa, generated on a machine without a GPU.

Why: the traced compression (``compile_kernels=traceable``) is only worth having where
Inductor fuses it into the kernels around it, and whether it does is decided by Inductor's
GPU scheduler, not its CPU one: on the CPU a column min/max fuses into the loop nest that
produces the activation, while Triton splits it into separate kernels that read the
activation again (found with this script; ``mesa_train/quant/traceable.py``,
``_row_segments_minmax``). GPU time is rare here; Inductor's code for a GPU is not.

How, in two stages:

1. the block (``torch.compile(fullgraph=True)``, autocast) runs its training step(s) on the
   CPU, with an inner compiler that keeps AOTAutograd's forward and backward graphs (aten
   ops, after Inductor's decompositions and the partitioner) and runs them eagerly;
2. each graph's devices are rewritten to ``cuda:0`` and Inductor lowers it again for a fake
   H100 (``torch.cuda`` answers as an sm_90 device with 132 SMs, Triton's target is fixed,
   kernels are written, never compiled or run).

Not the GPU's exact program: stage 1 traced under CPU autocast, whose op lists differ from
CUDA's (``--amp`` makes softmax run in float32, as CUDA autocast does; other differences may
remain); the decompositions and the partition were chosen for a CPU graph; Inductor's
device-specific passes whose setup needs a live device are off (its attention and padding
pattern rewrites). The kernel launches (a kernel Inductor launches twice counts twice) and
the bytes each launch moves (Inductor's own ``kernel_num_gb`` estimate) are what to read; the
times are for a GPU to measure.

    python scripts/inductor_gpu_code.py                          # DeiT-S block, batch 128, all variants
    python scripts/inductor_gpu_code.py --variants stock ops --batch 8
    python scripts/inductor_gpu_code.py --out results/inductor-gpu-code --kernels   # + per-kernel tables
    python scripts/inductor_gpu_code.py --attention fused       # timm's fused attention, Mesa's sdpa set

Variants: ``stock``; Mesa with every op compressed and its compression as the extension's
ops (``ops``), traced (``traceable``), traced with ``estimator=delayed`` (``delayed``, two
steps: the graph is rebuilt once the estimates are initialized), and the same without the
Linear / LayerNorm inputs' row scales (``delayed-norows``: ``row_scale=False``, what they
cost). A traced variant takes a few minutes on 2 cores.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import re
import sys
import types
from pathlib import Path
from typing import NoReturn
from unittest import mock

import torch

# variant -> patch_model's quantizer options (None: stock); the traced variants compile the
# compression as plain PyTorch (compile_kernels=traceable), the others as the extension's ops
VARIANT_OPTIONS = {
    "stock": None,
    "ops": {},
    "traceable": {},
    "delayed": {"estimator": "delayed"},
    # what the power-of-two row scales of the Linear / LayerNorm inputs cost the traced
    # delayed block (nn/rowscale.py): each needs its rows' maxima before its codes
    "delayed-norows": {"estimator": "delayed", "row_scale": False},
}
VARIANTS = tuple(VARIANT_OPTIONS)
TRACED = ("traceable", "delayed", "delayed-norows")
# the attention path of the block, and the op set Mesa patches on it (the modern preset's):
# explicit softmax(q k^T) v with every op, or F.scaled_dot_product_attention with the sdpa set
ATTENTION_OPS = {"explicit": ["all"], "fused": ["linear", "gelu", "layernorm", "conv", "relu", "sdpa"]}
# what torch.cuda says about the fake device: an H100 SXM (the lent GPU; sm_90)
H100 = types.SimpleNamespace(
    name="NVIDIA H100 80GB HBM3", type="cuda", major=9, minor=0, multi_processor_count=132, warp_size=32,
    total_memory=80 * 2**30, max_threads_per_multi_processor=2048, max_threads_per_block=1024,
    regs_per_multiprocessor=65536, shared_memory_per_block_optin=227 * 1024, max_shared_memory_per_block=48 * 1024,
    L2_cache_size=50 * 2**20, is_integrated=False, gcnArchName="", uuid="0")
# a launch in the wrapper Inductor writes for a graph: ``triton_..._9.run(buf3, buf5, ...)``.
# Inductor defines a kernel once per distinct source and launches it wherever that source is
# needed (two compressions of same-shaped operands share one), so kernels are counted by launch.
# (Each kernel's source also holds a benchmark harness calling ``name.run(*args, ...)``: not a launch.)
LAUNCH = re.compile(r"\b(triton_\w+)\.run\((?!\*args\b)")


def fail(message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


# ----------------------------------------------------------------------------- stage 1: CPU graphs
class Captured(types.SimpleNamespace):
    """One AOTAutograd graph: ``gm``, its inputs as (shape, stride, dtype) or a non-tensor value,
    and the keyword arguments Inductor's inner compiler was called with."""


def capture_step_graphs(module: torch.nn.Module, x: torch.Tensor, steps: int, amp: bool,
                        after_step=None, inductor_options: dict | None = None) -> list[Captured]:
    """Compile ``module`` (fullgraph) and run ``steps`` training steps on the CPU; returns the
    last forward and backward graphs AOTAutograd handed to Inductor. ``inductor_options``: the
    Inductor config while it compiles (its joint-graph passes and the partition run here)."""
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._inductor.compile_fx import compile_fx

    graphs: list[Captured] = []

    def keep(gm, example_inputs, **kwargs):
        specs = [(tuple(t.shape), tuple(t.stride()), t.dtype) if isinstance(t, torch.Tensor) else t
                 for t in example_inputs]
        graphs.append(Captured(gm=copy.deepcopy(gm), specs=specs, kwargs=kwargs))
        return make_boxed_func(gm)

    compiled = torch.compile(module, backend=lambda gm, ins: compile_fx(gm, ins, inner_compile=keep),
                             fullgraph=True)
    for _ in range(steps):
        with cuda_autocast_softmax(amp), torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp), \
                torch._inductor.config.patch(inductor_options or {}):
            y = compiled(x)
        y.float().sum().backward()
        if after_step is not None:
            after_step()
    if len(graphs) < 2:
        fail(f"expected a forward and a backward graph, Inductor was handed {len(graphs)}")
    return graphs[-2:]


@contextlib.contextmanager
def cuda_autocast_softmax(enabled: bool):
    """Softmax as CUDA autocast runs it (float32 in and out; CPU autocast keeps bf16)."""
    if not enabled:
        yield
        return
    stock_f, stock_t = torch.nn.functional.softmax, torch.Tensor.softmax

    def f_softmax(t, dim=None, _stacklevel=3, dtype=None):
        return stock_f(t.float() if torch.is_autocast_enabled("cpu") else t, dim=dim, dtype=dtype)

    def t_softmax(t, dim, dtype=None):
        return stock_t(t.float() if torch.is_autocast_enabled("cpu") else t, dim, dtype=dtype)

    with mock.patch.object(torch.nn.functional, "softmax", f_softmax), \
            mock.patch.object(torch.Tensor, "softmax", t_softmax):
        yield


# ----------------------------------------------------------------------------- stage 2: Triton
@contextlib.contextmanager
def fake_h100():
    """torch.cuda and Inductor see an sm_90 GPU; Triton kernels are collected, not compiled.
    Yields the ``{kernel name: Triton source}`` dict that Inductor's compiles fill."""
    import torch._inductor.async_compile as async_compile
    import torch._inductor.fx_passes.fuse_attention as fuse_attention
    import torch._inductor.fx_passes.joint_graph as joint_graph
    import torch._inductor.fx_passes.post_grad as post_grad
    import torch._inductor.scheduler as scheduler
    import torch.utils._triton as torch_triton
    from torch._dynamo.device_interface import CudaInterface
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    sources: dict[str, str] = {}

    def collect(self, kernel_name, source_code, device_str="cuda"):
        sources[kernel_name] = source_code
        return mock.MagicMock()

    props = lambda *a, **k: H100  # noqa: E731
    patches = [  # torch.cuda as an H100 with no driver behind it
        ("torch.cuda.is_available", lambda: True), ("torch.cuda.is_initialized", lambda: True),
        ("torch.cuda.device_count", lambda: 1), ("torch.cuda.current_device", lambda: 0),
        ("torch.cuda.get_device_capability", lambda *a, **k: (9, 0)), ("torch.cuda.get_device_properties", props),
        ("torch.cuda.get_device_name", lambda *a, **k: H100.name),
        ("torch.cuda.is_bf16_supported", lambda *a, **k: True),
        ("torch.cuda.get_rng_state", lambda *a, **k: torch.zeros(16, dtype=torch.uint8)),
        ("torch.cuda.set_rng_state", lambda *a, **k: None), ("torch.cuda.set_device", lambda i: None),
        ("torch.cuda._exchange_device", lambda i: 0), ("torch.cuda._maybe_exchange_device", lambda i: 0),
        ("torch.cuda.synchronize", lambda *a: None), ("torch.cuda.is_current_stream_capturing", lambda: False),
        ("torch.accelerator.current_device_index", lambda: 0),
    ]
    objects = [  # Inductor's view of the device, and the setup that would touch a real one
        (CudaInterface, "get_device_properties", staticmethod(props)),
        (CudaInterface, "get_compute_capability", staticmethod(lambda *a: 90)),
        (CudaInterface, "is_available", staticmethod(lambda: True)),
        (CudaInterface, "current_device", staticmethod(lambda: 0)),
        (CudaInterface, "device_count", staticmethod(lambda: 1)),
        (CudaInterface, "exchange_device", staticmethod(lambda i: 0)),
        (CudaInterface, "maybe_exchange_device", staticmethod(lambda i: 0)),
        (CudaInterface, "set_device", staticmethod(lambda i: None)),
        (CudaInterface, "synchronize", staticmethod(lambda *a: None)),
        (CudaInterface, "get_raw_stream", staticmethod(lambda *a: 0)),
        (CudaInterface, "is_bf16_supported", staticmethod(lambda *a, **k: True)),
        (fuse_attention, "_sfdp_init", lambda *a, **k: None),  # (its pattern setup makes CUDA tensors)
        (joint_graph, "lazy_init", lambda *a, **k: None),
        (post_grad, "lazy_init", lambda *a, **k: None),
        (scheduler, "has_triton", lambda: True),
        (torch_triton, "triton_backend", lambda: make_backend(GPUTarget("cuda", 90, 32))),
        (torch_triton, "triton_hash_with_backend", lambda: "fake-h100"),
        (async_compile.AsyncCompile, "triton", collect),
        (async_compile.AsyncCompile, "wait", lambda self, scope: None),
    ]
    with contextlib.ExitStack() as stack:
        for target, value in patches:
            stack.enter_context(mock.patch(target, value))
        for owner, name, value in objects:
            stack.enter_context(mock.patch.object(owner, name, value))
        stack.enter_context(torch._inductor.config.patch(compile_threads=1, benchmark_kernel=True))
        yield sources


def _on_cuda(value, cuda: torch.device):
    if isinstance(value, torch.device) and value.type == "cpu":
        return cuda
    if isinstance(value, (list, tuple)):
        return type(value)(_on_cuda(v, cuda) for v in value)
    if isinstance(value, dict):
        return {k: _on_cuda(v, cuda) for k, v in value.items()}
    return value


def lower_for_h100(graph: Captured, inductor_options: dict) -> tuple[dict[str, str], list, list[str]]:
    """Inductor's Triton kernels for one captured graph on the fake H100 (``{name: source}``,
    each distinct kernel once), the graph's opaque Mesa ops as :func:`mesa_op_rows` gives them,
    and the kernels' launches in the order the generated wrapper makes them (:data:`LAUNCH`)."""
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.graph import GraphLowering
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    from mesa_train import inductor_backports

    inductor_backports.install()  # (as the bench's and the trainer's compile: compile_scope.compile_model)

    cuda = torch.device("cuda", 0)
    gm, mode = copy.deepcopy(graph.gm), FakeTensorMode()
    for node in gm.graph.nodes:  # devices, and the CPU fake values stage 1 left in the metadata
        node.args, node.kwargs = _on_cuda(node.args, cuda), _on_cuda(node.kwargs, cuda)
        for key in ("val", "tensor_meta", "eager_input_vals", "example_value"):
            node.meta.pop(key, None)
        if node.op == "get_attr" and isinstance(getattr(gm, node.target), torch.Tensor):
            t = getattr(gm, node.target)  # (a constant's values do not change the kernels' code)
            with mode:
                setattr(gm, node.target, torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=cuda))
    gm.recompile()
    with mode:
        inputs = [torch.empty_strided(s[0], s[1], dtype=s[2], device=cuda) if isinstance(s, tuple) else s
                  for s in graph.specs]
    FakeTensorProp(gm, mode).propagate(*inputs)
    ops = mesa_op_rows(gm)
    wrappers: list[str] = []  # (GraphLowering.save_output_code: Inductor's hook for the wrapper's code)
    # (benchmark_kernel, for the byte counts, also prints each module's path: to stderr)
    with fake_h100() as sources, torch._inductor.config.patch(inductor_options), \
            mock.patch.object(GraphLowering, "save_output_code", wrappers.append), \
            contextlib.redirect_stdout(sys.stderr):
        compile_fx_inner(gm, inputs, **graph.kwargs)
    launches = [name for code in wrappers for name in LAUNCH.findall(code)]
    if set(launches) != set(sources):
        fail(f"the wrapper's launches ({sorted(set(launches))}) are not the kernels Inductor defined "
             f"({sorted(sources)}): has its wrapper code changed? (LAUNCH)")
    return dict(sources), ops, launches


def backports_note() -> str:
    """What the tables' header says of :mod:`mesa_train.inductor_backports` on this torch."""
    from mesa_train import inductor_backports

    state = inductor_backports.status()
    if state == "not needed":
        return ""
    return f" (mesa_train.inductor_backports {state}: the persistent-reduction decision with the tiling scores)"


def _tensor_mb(values) -> float:
    leaves = torch.utils._pytree.tree_leaves(values)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor)) / 1e6


def mesa_op_rows(gm: torch.fx.GraphModule) -> list[tuple[str, str, float]]:
    """(op name, "Mesa op", MB) of every opaque ``mesa::`` op of a graph whose nodes carry fake
    values: MB is its tensor inputs read once and its outputs written once, a floor on what its
    CUDA kernels move (mutated buffers reached through auto_functionalized count as inputs)."""
    rows = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        target = node.target
        if "auto_functionalized" in str(target):  # (a mutating op: the op itself is the first argument)
            target = node.args[0]
        if not str(target).startswith("mesa."):
            continue
        inputs = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta.get("val"))
        outputs = node.meta.get("val")
        rows.append((str(target).removesuffix(".default"), "Mesa op", _tensor_mb(inputs) + _tensor_mb(outputs)))
    return rows


# ----------------------------------------------------------------------------- reading the kernels
def kernel_rows(sources: dict[str, str], launches: list[str]) -> list[tuple[str, str, float]]:
    """(name, kind: pointwise / reduction / persistent reduction, MB moved) of each launch, in
    launch order; MB is Inductor's ``kernel_num_gb`` (the bytes of its loads and stores, each
    buffer once) for every launch of the kernel."""
    rows = []
    for name in launches:
        gb = re.search(r"'kernel_num_gb': ([0-9.e+-]+)", sources[name])
        kind = {"poi": "pointwise", "red": "reduction", "per": "persistent reduction"}.get(
            name.split("_")[1], name.split("_")[1])
        rows.append((name, kind, float(gb.group(1)) * 1e3 if gb else float("nan")))
    return rows


def capture_block(model_name: str, variant: str, batch: int, amp: bool,
                  attention: str = "explicit", extra_options: dict | None = None) -> tuple[list[Captured], dict]:
    """Stage 1 for one block of ``model_name`` in ``variant``: its forward and backward graphs,
    and the Inductor options its compile uses (the traced compression's, or none, then
    ``extra_options``: ``--inductor-option``, every variant's, stock's too)."""
    from mesa_train.compile_scope import TRACED_INDUCTOR_OPTIONS
    from mesa_train.models import build_model
    from mesa_train.nn.quantizer import mark_estimates_ready
    from mesa_train.patch.core import patch_model
    from mesa_train.quant.compile_kernels import set_compile_kernels

    torch.manual_seed(0)
    model = build_model(model_name, fused_attn=attention == "fused")
    traced = variant in TRACED
    options = VARIANT_OPTIONS[variant]
    delayed = options is not None and options.get("estimator") == "delayed"
    if options is not None:
        patch_model(model, ops=ATTENTION_OPS[attention], **options)
        set_compile_kernels("traceable" if traced else "ops")
    if not hasattr(model, "blocks") or not hasattr(model, "embed_dim") or not hasattr(model, "patch_embed"):
        fail(f"{model_name} is not a ViT-style model (blocks of (batch, tokens, embed_dim)); this script takes those")
    block = model.blocks[0]
    tokens = getattr(model.patch_embed, "num_patches", 196) + getattr(model, "num_prefix_tokens", 1)
    x = torch.randn(batch, tokens, model.embed_dim, requires_grad=True)
    torch._dynamo.reset()
    inductor_options = {**(TRACED_INDUCTOR_OPTIONS if traced else {}), **(extra_options or {})}
    graphs = capture_step_graphs(block, x, steps=2 if delayed else 1, amp=amp,
                                 after_step=(lambda: mark_estimates_ready(model)) if delayed else None,
                                 inductor_options=inductor_options)
    return graphs, inductor_options


def census(model_name: str, variant: str, batch: int, amp: bool, attention: str = "explicit",
           extra_options: dict | None = None) -> dict[str, list]:
    """{"forward": rows, "backward": rows, "saved": (dtype, numel) pairs (:func:`saved_for_backward`)} for
    one block of ``model_name`` in ``variant`` (``extra_options``: see :func:`capture_block`)."""
    graphs, options = capture_block(model_name, variant, batch, amp, attention, extra_options)
    out = {}
    for graph in graphs:
        sources, ops, launches = lower_for_h100(graph, options)
        part = "backward" if graph.kwargs.get("is_backward") else "forward"
        out[part] = kernel_rows(sources, launches) + ops
        if part == "forward":
            out["saved"] = saved_for_backward(graph)
    return out


def saved_for_backward(forward: Captured) -> list[tuple[torch.dtype, int]]:
    """(dtype, numel) of each tensor a captured forward graph keeps for its backward: its outputs
    after the first (the block's output), as AOTAutograd's partitioner chose them."""
    outputs = next(n for n in forward.gm.graph.nodes if n.op == "output").args[0]
    vals = [n.meta.get("val") for n in outputs[1:] if isinstance(n, torch.fx.Node)]
    return [(v.dtype, v.numel()) for v in vals if isinstance(v, torch.Tensor)]


def parse_inductor_options(items: list[str]) -> dict:
    """``NAME=VALUE`` strings -> Inductor options (VALUE a Python literal: True, 128, 'x'); an
    unknown name or a value that is not a bool, number or string fails with the close names."""
    import ast

    from mesa_train.compile_scope import unknown_option_message

    options = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep:
            fail(f"--inductor-option {item!r}: expected NAME=VALUE, e.g. combo_kernels=True")
        message = unknown_option_message(name)
        if message is not None:
            fail(f"--inductor-option {message}")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text
        if not isinstance(value, (bool, int, float, str)):
            fail(f"--inductor-option {name}: {text!r} is not a bool, number or string")
        options[name] = value
    return options


def summary_table(results: dict[str, dict[str, list]]) -> str:
    """Per variant and pass: Triton kernels and their MB, opaque Mesa ops and theirs, the total."""
    lines = ["| variant | forward kernels | forward MB | forward Mesa ops (MB) | backward kernels | backward MB "
             "| backward Mesa ops (MB) | total MB | saved for backward MB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for variant, parts in results.items():
        cells, total = [], 0.0
        for part in ("forward", "backward"):
            kernels = [r for r in parts[part] if r[1] != "Mesa op"]
            ops = [r for r in parts[part] if r[1] == "Mesa op"]
            k_mb, o_mb = sum(r[2] for r in kernels), sum(r[2] for r in ops)
            cells += [f"{len(kernels)}", f"{k_mb:,.1f}", f"{len(ops)} ({o_mb:,.1f})"]
            total += k_mb + o_mb
        saved = sum(n * d.itemsize for d, n in parts.get("saved", [])) / 1e6
        lines.append(f"| {variant} | {' | '.join(cells)} | {total:,.1f} | {saved:,.1f} |")
    return "\n".join(lines)


def kernel_table(rows: list) -> str:
    lines = ["| kernel | kind | MB |", "|---|---|---:|"]
    lines += [f"| `{name[:110]}` | {kind} | {mb:,.2f} |" for name, kind, mb in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="deit_s")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--attention", default="explicit", choices=list(ATTENTION_OPS),
                    help="explicit softmax(q k^T) v, Mesa with every op (default), or fused "
                         "(F.scaled_dot_product_attention, Mesa with the sdpa set)")
    ap.add_argument("--no-amp", dest="amp", action="store_false", help="float32 (default: bf16 autocast)")
    ap.add_argument("--kernels", action="store_true", help="also list every kernel of every variant")
    ap.add_argument("--out", type=Path, help="write <model>-block.md there as well")
    ap.add_argument("--inductor-option", dest="inductor_options", action="append", default=[], metavar="NAME=VALUE",
                    help="an Inductor config option for every variant's compile, stock's too (repeatable; "
                         "e.g. combo_kernels=True: what an option would change, before a GPU times it)")
    args = ap.parse_args(argv)
    extra = parse_inductor_options(args.inductor_options)
    try:
        import triton  # noqa: F401
    except ImportError:
        fail("Triton is not installed (it comes with torch's CUDA wheels): nothing to generate code with")
    from mesa_train.models import is_known_model
    if not is_known_model(args.model):
        fail(f"unknown model {args.model!r} (mesa_train.models.build_model's names)")
    results = {}
    for variant in args.variants:
        print(f"{variant}: compiling one {args.model} block (batch {args.batch})...", file=sys.stderr, flush=True)
        results[variant] = census(args.model, variant, args.batch, args.amp, args.attention, extra)
    fused = args.attention == "fused"
    text = [f"# Inductor's Triton kernels for one {args.model} block{' (fused attention)' if fused else ''} "
            "on an H100 (generated without a GPU)", "",
            f"Batch {args.batch}, {'bf16 autocast' if args.amp else 'float32'}, one training step "
            f"(forward and backward graphs), torch {torch.__version__}{backports_note()}; "
            f"`python scripts/inductor_gpu_code.py --model {args.model} --batch {args.batch}"
            f"{' --attention fused' if fused else ''}{'' if args.amp else ' --no-amp'}"
            f"{''.join(f' --inductor-option {o}' for o in args.inductor_options)}`. "
            "Kernels: Triton kernel launches (Inductor defines a kernel once per distinct source and may "
            "launch it more than once). "
            "MB: the bytes Inductor counts for each Triton kernel's loads and stores; for Mesa's opaque ops "
            "(CUDA kernels of the extension) their tensor inputs and "
            "outputs once, a floor. Matmuls (cuBLAS) are not counted. Saved for backward: the tensors "
            "the forward graph keeps for the backward (AOTAutograd's partition; parameters and their "
            "casts included).", "",
            summary_table(results)]
    if args.kernels:
        for variant, parts in results.items():
            for part in ("forward", "backward"):
                text += ["", f"## {variant}: {part}", "", kernel_table(parts[part])]
    report = "\n".join(text) + "\n"
    print(report)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        suffix = ("-fused" if fused else "") + "".join(f"-{k.replace('_', '-')}" for k in extra)
        (args.out / f"{args.model.replace('/', '_')}-block{suffix}.md").write_text(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
