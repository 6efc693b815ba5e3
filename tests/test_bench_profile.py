"""``python -m mesa_train.bench ... profile=true``: where the time of a training step goes.
One small cpu-quick run end to end (files, categories, deltas), the categorisation rules,
and the aggregation of profiler events (no double counting on CPU or CUDA)."""
from __future__ import annotations

import csv
import types
from pathlib import Path

import pytest
import torch

from test_bench import _run  # the app as a subprocess, as the other bench tests run it

from mesa_train.bench.profile import (CATEGORIES, ENCLOSING, UNATTRIBUTED, aggregate, categorize, kernel_name,
                                      mesa_function_names, mesa_kernels)
from mesa_train.nn import quantizer as quantizer_mod

REPO = Path(__file__).resolve().parents[1]
MESA_ROW = "DeiT-tiny w/ Mesa all"
BASE_ROW = "DeiT-tiny"




def _table(md: str, heading: str) -> list[dict[str, str]]:
    """The Markdown table under the first heading that starts with ``heading``."""
    lines = md.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(heading))
    rows = []
    for line in lines[start + 1:]:
        if line.startswith("#"):
            break
        if line.startswith("|"):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    head, body = rows[0], rows[2:]
    return [dict(zip(head, r)) for r in body]


def _ms(cell: str) -> float:
    return float(cell.replace(",", ""))


# --------------------------------------------------------------------------- end to end

@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("profile")
    proc = _run("preset=cpu-quick", "profile=true", f"only={MESA_ROW}",
                "preset.common.steps=2", "preset.common.warmup=1", "profile_steps=1",
                "progress=false", "threads=1", "process_warmup=false", f"output_dir={out}")
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    folder = out / "cpu-quick"
    md = (folder / "cpu.profile.md").read_text()
    return {"dir": folder, "proc": proc, "md": md,
            "cats": {r["Row"].removesuffix(" (baseline)"): r
                     for r in _table(md, "## Self CPU time per step by category")},
            "csv": list(csv.DictReader(open(folder / "cpu.profile.csv")))}


def test_profile_files_and_rows(run):
    assert (run["dir"] / "cpu.md").is_file()  # the normal measurement still ran
    for name in ("cpu.profile.md", "cpu.profile.csv"):
        assert (run["dir"] / name).stat().st_size > 0, name
    md = run["md"]
    assert "self CPU time per step" in md and "only=" in md  # time meaning, command
    assert set(run["cats"]) == {BASE_ROW, MESA_ROW}
    assert run["cats"][BASE_ROW]["Row"] == f"{BASE_ROW} (baseline)"
    assert {r["label"] for r in run["csv"]} == {BASE_ROW, MESA_ROW}
    assert f"profile {MESA_ROW}:" in run["proc"].stderr  # a progress line per row
    index = (run["dir"].parent / "README.md").read_text()  # results index links the profile
    assert "[profile](cpu-quick/cpu.profile.md)" in index and "cpu.profile.md](" not in index.split("[profile]")[0]


def test_mesa_ops_are_found(run):
    cats = run["cats"]
    assert _ms(cats[MESA_ROW]["mesa"]) > 0
    # Python Mesa Functions ("mesa-layer"): none when every layer runs as a C++ op (eager,
    # extension loaded: csrc/layers_autograd.cpp), else some
    python_layers = _ms(cats[MESA_ROW].get("mesa-layer", "0"))
    assert python_layers == 0 if quantizer_mod._FUSED_LAYERS else python_layers > 0
    assert _ms(cats[BASE_ROW]["mesa"]) == 0 and _ms(cats[BASE_ROW].get("mesa-layer", "0")) == 0
    assert _ms(cats[BASE_ROW]["matmul"]) > 0 and _ms(cats[MESA_ROW]["matmul"]) > 0
    mesa_ops = [r for r in run["csv"] if r["op"].startswith("mesa::")]
    assert mesa_ops and all(r["label"] == MESA_ROW and r["category"] == "mesa" for r in mesa_ops)
    assert {"mesa::quantize", "mesa::dequantize"} <= {r["op"] for r in mesa_ops}


def test_categories_add_up_to_the_total(run):
    for label, row in run["cats"].items():
        shown = [c for c in CATEGORIES if c in row]
        assert "other" in shown and "matmul" in shown
        total = _ms(row["Total"])
        assert sum(_ms(row[c]) for c in shown) == pytest.approx(total, abs=0.006 * len(shown))
        # the CSV has every op: it must give the same total and the same categories
        ops = [r for r in run["csv"] if r["label"] == label]
        assert sum(float(r["ms_per_step"]) for r in ops) == pytest.approx(total, abs=0.006)
        for c in shown:
            got = sum(float(r["ms_per_step"]) for r in ops if r["category"] == c)
            assert got == pytest.approx(_ms(row[c]), abs=0.006), (label, c)
        assert {r["category"] for r in ops} <= set(CATEGORIES)
        assert _ms(row["Step wall"]) >= total * 0.95  # ops run inside the step


def test_delta_vs_baseline(run):
    deltas = _table(run["md"], "## Extra time vs the group's baseline")
    assert [d["Row"] for d in deltas] == [MESA_ROW]
    d = deltas[0]
    assert d["Baseline"] == BASE_ROW
    mesa, base = run["cats"][MESA_ROW], run["cats"][BASE_ROW]
    for col in [c for c in CATEGORIES if c in d] + ["Total"]:
        assert _ms(d[col]) == pytest.approx(_ms(mesa[col]) - _ms(base[col]), abs=0.011), col
    assert _ms(d["mesa"]) > 0


def test_top_ops_of_the_mesa_row(run):
    top = _table(run["md"], f"## Top 12 ops by self time: {MESA_ROW}")
    assert 1 <= len(top) <= 12
    times = [_ms(r["ms/step"]) for r in top]
    assert times == sorted(times, reverse=True)
    # the heaviest op (op, category) pairs of the CSV, in the same order
    csv_top = sorted((r for r in run["csv"] if r["label"] == MESA_ROW),
                     key=lambda r: -float(r["ms_per_step"]))[:len(top)]
    assert [r["Category"] for r in top] == [r["category"] for r in csv_top]
    for r in top:
        if r["Op"].startswith("`mesa::"):
            assert r["baseline ms/step"] == "–"  # the stock row has no mesa:: op
    assert "Top 12 ops by self time: DeiT-tiny (" not in run["md"]  # none for the baseline


def test_profile_with_dry_run_runs_nothing(tmp_path):
    proc = _run("preset=cpu-quick", "profile=true", "dry_run=true", f"only={MESA_ROW}",
                f"output_dir={tmp_path}", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "profile:" in proc.stdout and "not run: dry_run" in proc.stdout
    assert not list(tmp_path.rglob("*.profile.*"))


def test_bad_profile_steps_is_a_clear_error(tmp_path):
    proc = _run("preset=cpu-quick", "profile=true", "profile_steps=0", "dry_run=true",
                f"only={MESA_ROW}", f"output_dir={tmp_path}", timeout=120)
    assert proc.returncode == 2
    assert "profile_steps=0" in proc.stderr and "positive integer" in proc.stderr


# --------------------------------------------------------------------------- rules

def test_categorize_by_name():
    fns = {"_LinearFn", "_LinearFnBackward"}
    cases = {
        "mesa::quantize": "mesa", "mesa::dequantize": "mesa", "mesa::group_minmax": "mesa",
        "mesa::update_estimates": "mesa", "mesa::a_future_kernel": "mesa",
        "_LinearFn": "mesa-layer", "_LinearFnBackward": "mesa-layer",
        "aten::mm": "matmul", "aten::addmm": "matmul", "aten::bmm": "matmul",
        "aten::baddbmm": "matmul", "aten::matmul": "matmul", "aten::linear": "matmul",
        "aten::convolution_backward": "matmul", "aten::mkldnn_convolution": "matmul",
        "aten::cudnn_convolution": "matmul",
        "aten::scaled_dot_product_attention": "attention",
        "aten::_scaled_dot_product_flash_attention_for_cpu_backward": "attention",
        "aten::_efficient_attention_forward": "attention", "aten::_flash_attention_backward": "attention",
        "aten::layer_norm": "norm", "aten::native_layer_norm_backward": "norm",
        "aten::native_batch_norm": "norm", "aten::_fused_rms_norm": "norm",
        "aten::_softmax": "softmax", "aten::_softmax_backward_data": "softmax",
        "aten::_log_softmax": "softmax",
        "aten::gelu": "activation", "aten::gelu_backward": "activation", "aten::relu_": "activation",
        "aten::threshold_backward": "activation", "aten::silu_backward": "activation",
        "Optimizer.step#AdamW.step": "optimizer", "Optimizer.zero_grad#AdamW.zero_grad": "optimizer",
        "aten::_foreach_mul_": "optimizer", "aten::_fused_adamw_": "optimizer",
        "autograd::engine::evaluate_function: AddmmBackward0": "autograd",
        "autograd::engine::evaluate_function: _LinearFnBackward": "autograd",
        "AddmmBackward0": "autograd", "torch::autograd::AccumulateGrad": "autograd",
        "aten::copy_": "copy/cast", "aten::_to_copy": "copy/cast", "aten::to": "copy/cast",
        "aten::contiguous": "copy/cast", "aten::clone": "copy/cast",
        "aten::mul": "other", "aten::add_": "other", "aten::view": "other",
        "aten::norm": "other", "aten::conj": "other", "aten::empty": "other",
        "cudaLaunchKernel": "other",
        "TorchDynamo Cache Lookup": "compiled", "Torch-Compiled Region: 0/0": "compiled",
        "## Call CompiledFxGraph fbyhiudnkctqmwhznxy4yoatqs7q ##": "compiled",
        "CompiledFunction": "compiled", "CompiledFunctionBackward": "compiled",
    }
    got = {name: categorize(name, None, fns) for name in cases}
    assert got == cases
    # without the Function names a Mesa backward node is plain autograd bookkeeping
    assert categorize("_LinearFnBackward") == "autograd" and categorize("_LinearFn") == "other"


def test_categorize_takes_the_enclosing_category_only_when_unnamed():
    for enclosing in ("mesa-layer", "optimizer", "matmul", "mesa"):
        for name in ("aten::mul", "aten::where", "aten::copy_", "aten::to", "aten::t"):
            assert categorize(name, enclosing) == enclosing
    # a named op keeps its own category wherever it runs
    assert categorize("aten::mm", "mesa-layer") == "matmul"
    assert categorize("mesa::quantize", "mesa-layer") == "mesa"
    assert categorize("aten::native_layer_norm", "mesa-layer") == "norm"
    # a compiled graph's wrapper is not an enclosing category: what it calls keeps its own
    assert "compiled" not in ENCLOSING and "autograd" not in ENCLOSING


def test_mesa_function_names_come_from_mesa_train():
    import mesa_train.nn  # noqa: F401  (defines the Functions)

    names = mesa_function_names()
    assert len(names) >= 8 and len(names) % 2 == 0
    forward = {n for n in names if not n.endswith("Backward")}
    assert {n + "Backward" for n in forward} == names - forward
    fns = {c.__name__: c for c in _all_functions()}
    assert all(fns[n].__module__.startswith("mesa_train.") for n in forward)
    assert "CheckpointFunction" not in names


def _all_functions():
    todo, out = list(torch.autograd.Function.__subclasses__()), []
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        out.append(cls)
    return out


# --------------------------------------------------------------------------- aggregation

def _ev(name, parent=None, cpu=0.0, dev=0.0, device="CPU", **kw):
    from torch.autograd import DeviceType

    return types.SimpleNamespace(name=name, cpu_parent=parent, self_cpu_time_total=cpu,
                                 self_device_time_total=dev, is_async=False,
                                 device_type=getattr(DeviceType, device),
                                 is_user_annotation=False, **kw)


def test_aggregate_counts_each_op_once():
    fns = {"_LinearFn"}
    fn = _ev("_LinearFn", cpu=100, dev=0)
    addmm = _ev("aten::addmm", fn, cpu=50, dev=400)
    t = _ev("aten::t", addmm, cpu=10, dev=0)
    quant = _ev("mesa::quantize", fn, cpu=30, dev=200)
    mul = _ev("aten::mul", fn, cpu=20, dev=60)
    step = _ev("Optimizer.step#AdamW.step", cpu=40, dev=0)
    lerp = _ev("aten::lerp_", step, cpu=8, dev=16)
    mul2 = _ev("aten::mul", cpu=6, dev=12)
    host = [fn, addmm, t, quant, mul, step, lerp, mul2]
    # the same kernels once more as device events, plus 100 us no host op launched
    kernels = [_ev("ampere_sgemm", dev=400, device="CUDA"), _ev("quantize_kernel", dev=200, device="CUDA"),
               _ev("mul_kernel", dev=60, device="CUDA"), _ev("lerp_kernel", dev=16, device="CUDA"),
               _ev("mul_kernel", dev=12, device="CUDA"), _ev("orphan", dev=100, device="CUDA")]

    cpu = aggregate(host + kernels, device_time=False, steps=2, mesa_functions=fns)
    assert cpu == {("_LinearFn", "mesa-layer"): (0.05, 0.5), ("aten::addmm", "matmul"): (0.025, 0.5),
                   ("aten::t", "matmul"): (0.005, 0.5), ("mesa::quantize", "mesa"): (0.015, 0.5),
                   ("aten::mul", "mesa-layer"): (0.01, 0.5),
                   ("Optimizer.step#AdamW.step", "optimizer"): (0.02, 0.5),
                   ("aten::lerp_", "optimizer"): (0.004, 0.5), ("aten::mul", "other"): (0.003, 0.5)}

    dev = aggregate(host + kernels, device_time=True, steps=1, mesa_functions=fns)
    assert dev.pop((UNATTRIBUTED, "other"))[0] == pytest.approx(0.1)
    assert dev == {("aten::addmm", "matmul"): (0.4, 1), ("mesa::quantize", "mesa"): (0.2, 1),
                   ("aten::mul", "mesa-layer"): (0.06, 1), ("aten::lerp_", "optimizer"): (0.016, 1),
                   ("aten::mul", "other"): (0.012, 1)}
    # no orphan kernel: nothing unattributed; the deprecated attribute name still works
    old = [types.SimpleNamespace(**{k: v for k, v in vars(e).items() if k != "self_device_time_total"},
                                 self_cuda_time_total=e.self_device_time_total)
           for e in host + kernels[:-1]]
    for e in old:  # keep the tree over the copies
        if e.cpu_parent is not None:
            e.cpu_parent = old[host.index(e.cpu_parent)]
    assert aggregate(old, device_time=True, steps=1, mesa_functions=fns) == dev


@pytest.mark.parametrize("fused", [False, True], ids=["python-function", "cpp-layer-op"])
def test_aggregate_matches_the_profilers_own_total(fused, monkeypatch):
    """On a real profile of a Mesa layer: the same total as key_averages (nothing lost or
    counted twice), the mesa:: kernels found, the matmul inside the Mesa layer kept. The
    Python Function path shows as mesa-layer; the C++ layer op (csrc/layers_autograd.cpp)
    has no Python Function, its own time is a mesa:: op."""
    from torch.profiler import ProfilerActivity, profile

    from mesa_train.nn import Linear

    monkeypatch.setattr(quantizer_mod, "_FUSED_LAYERS", fused and quantizer_mod._FUSED_LAYERS)

    torch.manual_seed(0)
    layer = Linear(32, 16)
    x = torch.randn(8, 32, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        layer(x).square().sum().backward()
    ops = aggregate(prof.events(), device_time=False, steps=1, mesa_functions=mesa_function_names())
    total = sum(e.self_cpu_time_total for e in prof.key_averages()) / 1000
    assert sum(ms for ms, _ in ops.values()) == pytest.approx(total, rel=1e-6)
    cats = {c for _, c in ops}
    assert {"mesa", "matmul"} | (set() if fused else {"mesa-layer"}) <= cats
    assert all(c == "mesa" for (op, c) in ops if op.startswith("mesa::"))
    assert all(c == "matmul" for (op, c) in ops if op in ("aten::addmm", "aten::mm"))


def test_kernel_names_lose_return_type_namespace_and_parameters():
    assert kernel_name("void (anonymous namespace)::row_cells_kernel<c10::BFloat16, true>(c10::BFloat16 const*, "
                       "float*, long)") == "row_cells_kernel<c10::BFloat16, true>"
    assert kernel_name("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps"
                       "<float, float, float, float>, unsigned int, float, 4, 4> >(at::native::ReduceOp<float>)") \
        == "at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, float, " \
           "float, float>, unsigned int, float, 4, 4> >"
    assert kernel_name("sm90_xmma_gemm_bf16bf16_bf16f32") == "sm90_xmma_gemm_bf16bf16_bf16f32"


def test_mesa_kernels_are_those_mesa_ops_launch():
    """Kernels of mesa:: ops, of Mesa Functions and of the ATen ops inside either, by kernel
    and launching op; a stock op's kernels are left out."""
    def k(name, us):
        return types.SimpleNamespace(name=name, device=0, duration=us)

    fns = {"_LinearFn"}
    rows = _ev("mesa::observe_rows", kernels=[k("void row_cells_kernel<float, true>(float const*)", 30.0),
                                               k("void row_k_cells_kernel<float>(float const*)", 5.0)])
    mean = _ev("aten::mean", rows, kernels=[k("void reduce_kernel<512>(int)", 4.0)])
    fn = _ev("_LinearFn", kernels=[])
    cast = _ev("aten::copy_", fn, kernels=[k("void elementwise_kernel<128>(int)", 12.0)],
               input_shapes=[[128, 197, 384], [128, 197, 384]])
    rows2 = _ev("mesa::observe_rows", kernels=[k("void row_cells_kernel<float, true>(float const*)", 34.0)])
    stock = _ev("aten::copy_", kernels=[k("void elementwise_kernel<128>(int)", 99.0)])
    got = mesa_kernels([rows, mean, fn, cast, rows2, stock], steps=2, mesa_functions=fns)
    assert got == {("row_cells_kernel<float, true>", "mesa::observe_rows"): (0.032, 1.0),
                   ("row_k_cells_kernel<float>", "mesa::observe_rows"): (0.0025, 0.5),
                   ("reduce_kernel<512>", "mesa::observe_rows > aten::mean"): (0.002, 0.5),
                   ("elementwise_kernel<128>", "_LinearFn > aten::copy_ (128, 197, 384)"): (0.006, 0.5)}
    assert mesa_kernels([stock], steps=1, mesa_functions=fns) == {}


def test_kernel_table_is_rendered_for_mesa_rows_with_kernels():
    from mesa_train.bench.presets import make_row
    from mesa_train.bench.profile import RowProfile, render_markdown

    rows = [make_row({"model": "deit_ti"}, {"label": "stock", "baseline": True}),
            make_row({"model": "deit_ti"}, {"label": "Mesa", "mesa": True, "ops": ["all"]})]
    ops = {("mesa::observe_rows", "mesa"): (2.5, 50.0)}
    kernels = {("row_cells_kernel<c10::BFloat16, true>", "mesa::observe_rows"): (1.0, 50.0),
               ("reduce_kernel<512>", "aten::mean"): (0.25, 50.0)}
    env = {"device": "GPU", "device_type": "cuda", "date": "d", "torch": "t", "timm": "t",
           "mesa_train": "m", "cuda": "c", "mesa_extension": "e", "git": "g"}
    md = render_markdown(preset="p", env=env, command="c", steps=1, rows=rows,
                         profiles=[RowProfile("stock", ops={("aten::mm", "matmul"): (1.0, 1.0)}),
                                   RowProfile("Mesa", ops=ops, kernels=kernels)])
    table = _table(md, "### Top 15 kernels Mesa's ops launch: Mesa")
    assert [(r["Kernel"], r["launched by"], r["us/launch"]) for r in table] == [
        ("`row_cells_kernel<c10::BFloat16, true>`", "`mesa::observe_rows`", "20.0"),
        ("`reduce_kernel<512>`", "`aten::mean`", "5.0")]
    assert md.count("kernels Mesa's ops launch") == 1  # the stock row has none


def test_host_time_is_rendered_on_a_gpu(tmp_path):
    """On a GPU the profile also tabulates the host's self CPU time of the same steps (a step
    waits on the host where its host Total nears the step wall), per category and per op of
    the Mesa rows against their baseline, and writes it to the CSV as self_cpu rows."""
    import csv

    from mesa_train.bench.presets import make_row
    from mesa_train.bench.profile import RowProfile, render_markdown, write_files

    rows = [make_row({"model": "deit_ti"}, {"label": "stock", "baseline": True}),
            make_row({"model": "deit_ti"}, {"label": "Mesa", "mesa": True, "ops": ["all"]})]
    env = {"device": "GPU", "device_type": "cuda", "date": "d", "torch": "t", "timm": "t",
           "mesa_train": "m", "cuda": "c", "mesa_extension": "e", "git": "g"}
    profiles = [RowProfile("stock", ops={("aten::mm", "matmul"): (1.0, 1.0)}, wall_ms=5.0,
                           host_ops={("aten::mm", "matmul"): (0.5, 10.0)}),
                RowProfile("Mesa", ops={("mesa::quantize", "mesa"): (2.0, 4.0)}, wall_ms=9.0,
                           host_ops={("aten::mm", "matmul"): (0.5, 10.0), ("mesa::quantize", "mesa"): (1.5, 30.0)})]
    md = render_markdown(preset="p", env=env, command="c", steps=1, rows=rows, profiles=profiles)
    table = _table(md, "## Host: self CPU time per step by category (ms)")
    assert [(r["Row"], r["Total"], r["Step wall"]) for r in table] == [("stock (baseline)", "0.50", "5.00"),
                                                                        ("Mesa", "2.00", "9.00")]
    top = _table(md, "### Top 12 ops by host time: Mesa (vs stock)")
    assert [(r["Op"], r["ms/step"], r["us/call"], r["baseline ms/step"]) for r in top] == [
        ("`mesa::quantize`", "1.50", "50.0", "–"), ("`aten::mm`", "0.50", "50.0", "0.50")]
    write_files(tmp_path / "p.md", tmp_path / "p.csv", preset="p", env=env, command="c", steps=1, rows=rows,
                profiles=profiles)
    kinds = [(r["label"], r["op"], r["time"]) for r in csv.DictReader(open(tmp_path / "p.csv"))]
    assert ("Mesa", "mesa::quantize", "self_cuda") in kinds and ("Mesa", "mesa::quantize", "self_cpu") in kinds
    # on a CPU the op table already is host time: no second one
    cpu = render_markdown(preset="p", env={**env, "device_type": "cpu"}, command="c", steps=1, rows=rows,
                          profiles=[RowProfile("stock", ops={("aten::mm", "matmul"): (1.0, 1.0)}),
                                    RowProfile("Mesa", ops={("aten::mm", "matmul"): (1.0, 1.0)})])
    assert "## Host:" not in cpu
