"""Where the time of a training step goes: ``python -m mesa_train.bench ... profile=true``.

For every measured row the model is built again exactly as the measurement builds it
(`measure.warm_step`: same seed, same warm-up), then ``profile_steps`` training steps run
under `torch.profiler`. Each op's *self* time (its own time, without the ops it calls) is
summed into a few categories, so the categories of a row add up to its total with nothing
counted twice. Time is self CPU time on CPU and self device (CUDA) time on a GPU.

Categories (`RULES`, first match wins): an op is categorised by its name when a rule
names it (``mesa::*``, matmul, norm, ...); an op no such rule names (a view, a copy, a
``mul``) goes where the nearest enclosing named op goes. So the multiplies and casts a
Mesa layer issues to compress its input are Mesa's cost (``mesa-layer``), the transpose
inside ``aten::linear`` is ``matmul`` and the per-parameter ops of a for-loop AdamW are
``optimizer``, while a matmul inside a Mesa layer is still ``matmul`` (the same work the
stock layer does). That needs the event tree, so the events are aggregated here rather
than with ``prof.key_averages()``, which flattens it (the totals are the same).

Outputs: ``<device>.profile.md`` (per-category table, extra time vs the group's baseline,
top ops of each Mesa row; on a GPU also the host's side and who set the pace, `pace`; the
rules) and ``<device>.profile.csv`` (one line per row, op and category).
"""
from __future__ import annotations

import csv
import io
import re
import time
import warnings
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mesa_train.bench import pace
from mesa_train.bench.measure import is_oom, release, synchronize, warm_step
from mesa_train.bench.presets import RowConfig

# (category, what the report says, how it matches; first match wins). ``name``: a regex
# searched in the op name; ``mesa-function``: the name of one of Mesa's autograd
# Functions (forward: the class name; backward node: class name + "Backward");
# ``enclosing``: the category of the nearest enclosing op that a rule above (autograd
# excepted: its wrappers enclose all of backward) names; ``any``: the rest.
RULES: tuple[tuple[str | None, str, tuple[str, str]], ...] = (
    ("mesa", "`mesa::*` custom ops (quantize, dequantize, min/max, estimates)",
     ("name", r"^mesa::")),
    ("mesa-layer", "Mesa's autograd Functions themselves (the Python of their forward/backward)",
     ("mesa-function", "")),
    ("matmul", "mm, addmm, bmm, baddbmm, matmul, linear, einsum, convolutions",
     ("name", r"^aten::(mm|addmm|bmm|baddbmm|addbmm|addmv|mv|dot|matmul|linear|einsum"
              r"|_addmm_activation|_scaled_mm|\w*conv\w*)$")),
    ("attention", "fused attention (scaled_dot_product, flash, efficient, cudnn)",
     ("name", r"scaled_dot_product|flash_attention|efficient_attention|cudnn_attention")),
    ("norm", "layer/batch/group/rms norm, forward and backward",
     ("name", r"(layer|batch|group|instance|rms)_norm")),
    ("softmax", "softmax, log_softmax and their backward",
     ("name", r"softmax")),
    ("activation", "gelu, relu (threshold), silu, sigmoid, tanh, ... and their backward",
     ("name", r"^aten::(gelu|relu|silu|sigmoid|tanh|hardswish|hardsigmoid|hardtanh|elu"
              r"|leaky_relu|mish|threshold)")),
    ("optimizer", "`Optimizer.step/zero_grad` scopes, foreach and fused optimizer ops",
     ("name", r"^Optimizer\.|_foreach_|_fused_(adam|adamw|sgd)")),
    # torch.compile's own host work around the generated code (self time only: the kernels and
    # ops a compiled graph calls keep their categories): where a host-bound compiled step goes
    ("compiled", "torch.compile's runtime: Dynamo's guards (cache lookup), the compiled graphs' Python "
                 "wrappers, AOTAutograd's forward/backward functions",
     ("name", r"^(TorchDynamo Cache Lookup|## Call CompiledFxGraph|CompiledFunction(Backward)?$"
              r"|Torch-Compiled Region)")),
    ("autograd", "autograd engine: backward-node wrappers, AccumulateGrad",
     ("name", r"^autograd::engine::evaluate_function:|AccumulateGrad|^[\w.]+Backward\d*$")),
    (None, "any other op: the category of the nearest enclosing op named above (autograd "
           "excepted), e.g. the casts and multiplies inside a Mesa Function -> mesa-layer, "
           "the transpose inside aten::linear -> matmul, AdamW's per-parameter ops -> optimizer",
     ("enclosing", "")),
    ("copy/cast", "copy_, to, _to_copy, contiguous, clone (not inside an op named above)",
     ("name", r"^aten::(copy_|_copy_from\w*|to|_to_copy|contiguous|clone|type_as)$")),
    ("other", "everything else (elementwise, views, allocation, loss, ...)", ("any", "")),
)
CATEGORIES: tuple[str, ...] = tuple(dict.fromkeys(c for c, _, _ in RULES if c))
# categories an unnamed op can take from an enclosing op
# (not "compiled": the kernels a compiled graph launches are the model's work, not its wrapper's)
ENCLOSING = frozenset(CATEGORIES[:CATEGORIES.index("compiled")])
_COMPILED = [(cat, kind, re.compile(arg) if kind == "name" else arg) for cat, _, (kind, arg) in RULES]
UNATTRIBUTED = "(device time outside any op)"
TOP_OPS = 12


def categorize(name: str, enclosing: str | None = None,
               mesa_functions: Collection[str] = ()) -> str:
    """The category of one op (`RULES`, first match wins); ``enclosing`` is the category
    of the nearest enclosing op with one of the `ENCLOSING` categories (`enclosing_category`)."""
    for cat, kind, arg in _COMPILED:
        if kind == "enclosing":
            if enclosing:
                return enclosing
        elif (kind == "any"
              or (kind == "name" and arg.search(name))
              or (kind == "mesa-function" and name in mesa_functions)):
            return cat
    raise AssertionError("the last rule matches everything")


def mesa_function_names() -> frozenset[str]:
    """Profiler names of Mesa's autograd Functions, found by walking the subclasses of
    `torch.autograd.Function` defined in mesa_train (so new layers need no list here)."""
    names: set[str] = set()
    todo = list(torch.autograd.Function.__subclasses__())
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls.__module__.startswith("mesa_train."):
            names.update((cls.__name__, cls.__name__ + "Backward"))
    return frozenset(names)


def own_category(mesa_functions: Collection[str] = ()) -> Callable[[str], str]:
    """A name's category by the name alone (no enclosing op), memoised: a profile repeats
    a few hundred names over many thousand events."""
    by_name: dict[str, str] = {}

    def own(name: str) -> str:
        if name not in by_name:
            by_name[name] = categorize(name, None, mesa_functions)
        return by_name[name]

    return own


def enclosing_category(event: Any, own: Callable[[str], str]) -> str | None:
    """The `ENCLOSING` category of the nearest enclosing event that has one; ``own`` maps
    a name to its category by name alone."""
    parent = event.cpu_parent
    while parent is not None:
        cat = own(parent.name)
        if cat in ENCLOSING:
            return cat
        parent = parent.cpu_parent
    return None


def _self_device_us(event: Any) -> float:
    value = getattr(event, "self_device_time_total", None)
    return event.self_cuda_time_total if value is None else value


def aggregate(events: Iterable[Any], *, device_time: bool, steps: int,
              mesa_functions: Collection[str] = ()) -> dict[tuple[str, str], tuple[float, float]]:
    """``{(op, category): (ms per step, calls per step)}`` from profiler events.

    Only host-side (CPU) events are categorised. On a GPU their self device time is the
    time of the kernels they launched themselves; the kernel events (device type CUDA)
    hold the same time once more, so they are not added again. Kernel time no host op
    claims is kept as `UNATTRIBUTED` so that the total is the GPU's busy time."""
    from torch.autograd import DeviceType

    us: dict[tuple[str, str], float] = {}
    calls: dict[tuple[str, str], int] = {}
    attributed = kernels = 0.0
    own = own_category(mesa_functions)

    for ev in events:
        if ev.is_async:
            continue
        if ev.device_type != DeviceType.CPU:
            if device_time and not getattr(ev, "is_user_annotation", False):
                kernels += _self_device_us(ev)
            continue
        t = _self_device_us(ev) if device_time else ev.self_cpu_time_total
        attributed += t
        key = (ev.name, categorize(ev.name, enclosing_category(ev, own), mesa_functions))
        us[key] = us.get(key, 0.0) + t
        calls[key] = calls.get(key, 0) + 1
    if device_time and kernels - attributed > 1e-3 * max(kernels, 1.0):
        key = (UNATTRIBUTED, "other")
        us[key], calls[key] = kernels - attributed, 0
    # ops without time of their own (views, wrappers on a GPU) would only lengthen the files
    return {k: (v / 1000 / steps, calls[k] / steps) for k, v in us.items() if v > 0}


MESA_CATEGORIES = ("mesa", "mesa-layer")
TOP_KERNELS = 15


def kernel_name(name: str) -> str:
    """A CUDA kernel's name without its return type, anonymous namespace and parameter list:
    ``void (anonymous namespace)::row_cells_kernel<c10::BFloat16, true>(c10::BFloat16 const*,
    ...)`` -> ``row_cells_kernel<c10::BFloat16, true>``."""
    name = name.removeprefix("void ").replace("(anonymous namespace)::", "")
    depth = 0
    for i, ch in enumerate(name):
        depth += (ch == "<") - (ch == ">")
        if ch == "(" and depth == 0 and i > 0:
            return name[:i]
    return name


def mesa_kernels(events: Iterable[Any], *, steps: int,
                 mesa_functions: Collection[str] = ()) -> dict[tuple[str, str], tuple[float, float]]:
    """``{(kernel, launching op): (ms per step, launches per step)}`` over the GPU kernels that
    Mesa's ops launch: those of host events in a Mesa category, by their own name or the
    enclosing op's (a ``mesa::`` op, a Mesa autograd Function, and the ATen ops inside
    them, named ``<Mesa op> > <ATen op>``: a cast inside ``mesa::linear_train`` is not one
    inside ``mesa::quantize``), with the shape of the op's first input where the profile
    recorded shapes. Why: an op such as ``mesa::observe_rows`` launches several kernels (its row pass,
    whose last block finds the mean and k, then observe's reduction and estimate update), and
    its op-level time does not say which one to make faster. Empty on CPU (no kernels)."""
    own = own_category(mesa_functions)

    us: dict[tuple[str, str], float] = {}
    launches: dict[tuple[str, str], int] = {}
    for ev in events:
        if getattr(ev, "is_async", False) or not getattr(ev, "kernels", None):
            continue
        if categorize(ev.name, enclosing_category(ev, own), mesa_functions) not in MESA_CATEGORIES:
            continue
        launcher = ev.name
        if own(ev.name) not in MESA_CATEGORIES:  # an ATen op inside: name the Mesa op around it
            parent = ev.cpu_parent
            while parent is not None and own(parent.name) not in MESA_CATEGORIES:
                parent = parent.cpu_parent
            if parent is not None:
                launcher = f"{parent.name} > {ev.name}"
        shapes = getattr(ev, "input_shapes", None)
        if shapes and shapes[0]:  # the first input's shape: which tensor (profiled with record_shapes)
            launcher += " (" + ", ".join(map(str, shapes[0])) + ")"
        for k in ev.kernels:
            key = (kernel_name(k.name), launcher)
            us[key] = us.get(key, 0.0) + k.duration
            launches[key] = launches.get(key, 0) + 1
    return {k: (v / 1000 / steps, launches[k] / steps) for k, v in us.items()}


@dataclass
class RowProfile:
    label: str
    status: str = "ok"  # ok | oom | error | skipped
    error: str = ""
    ops: dict[tuple[str, str], tuple[float, float]] = field(default_factory=dict)
    wall_ms: float | None = None  # wall clock per profiled step, profiler overhead included
    kernels: dict[tuple[str, str], tuple[float, float]] = field(default_factory=dict)  # mesa_kernels
    # on a GPU: the host side, self CPU time per op (where a host-bound step's time goes)
    host_ops: dict[tuple[str, str], tuple[float, float]] = field(default_factory=dict)

    def by_category(self, host: bool = False) -> dict[str, float]:
        out = dict.fromkeys(CATEGORIES, 0.0)
        for (_, cat), (ms, _) in (self.host_ops if host else self.ops).items():
            out[cat] += ms
        return out

    @property
    def total_ms(self) -> float:
        return sum(ms for ms, _ in self.ops.values())


def profile_row(row: RowConfig, device: torch.device, *, steps: int, seed: int = 0) -> RowProfile:
    """Profile ``steps`` training steps of ``row`` after its warm-up. OOM and errors are
    results (as in `measure.run_row`), not exceptions."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    result = RowProfile(row.label)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.utils.checkpoint.*")
            step = warm_step(row, device, seed=seed)
            # (shapes: the kernel table names the tensor a Mesa op's cast or copy moved)
            with profile(activities=activities, record_shapes=device.type == "cuda") as prof:
                t0 = time.perf_counter()
                for _ in range(steps):
                    step()
                synchronize(device)  # the last step's kernels belong to the profile
                result.wall_ms = 1000 * (time.perf_counter() - t0) / steps
            del step
        fns = mesa_function_names()
        result.ops = aggregate(prof.events(), device_time=device.type == "cuda", steps=steps,
                               mesa_functions=fns)
        result.kernels = mesa_kernels(prof.events(), steps=steps, mesa_functions=fns)
        if device.type == "cuda":
            result.host_ops = aggregate(prof.events(), device_time=False, steps=steps, mesa_functions=fns)
    except Exception as err:  # noqa: BLE001 - reported in the file
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
        result.status = "oom" if is_oom(err) else "error"
        result.error = first if result.status == "oom" else f"{type(err).__name__}: {first}"
    release(device)
    return result


def run_profiles(rows: list[RowConfig], statuses: list[str], device: torch.device, *,
                 steps: int, seed: int, progress: Callable[[int, str], Any],
                 say: Callable[..., None],
                 on_row: Callable[[list[RowProfile]], Any] | None = None) -> list[RowProfile]:
    """Profile every row whose measurement succeeded (``statuses``: the measurement's
    status per row); a row that failed or ran out of memory would only do so again.
    ``on_row(profiles so far)`` after each row but the last (the caller writes partial files:
    a time limit during the profiles keeps the rows profiled before it)."""
    out: list[RowProfile] = []
    bar = progress(len(rows), "profile")
    try:
        for row, status in zip(rows, statuses):
            bar.set_postfix_str(row.label[:40])
            if status != "ok":
                p = RowProfile(row.label, status="skipped", error=f"measurement: {status}")
            else:
                p = profile_row(row, device, steps=steps, seed=seed)
            out.append(p)
            if p.status == "ok":
                top = sorted(p.by_category().items(), key=lambda kv: -kv[1])[:3]
                say(f"profile {row.label}: {p.total_ms:,.1f} ms/step ("
                    + ", ".join(f"{c} {ms:,.1f}" for c, ms in top) + ")", bar)
            else:
                say(f"profile {row.label}: {p.status} {p.error}", bar)
            bar.update(1)
            if on_row is not None and len(out) < len(rows):
                on_row(out)
    finally:
        bar.close()
    return out


# --------------------------------------------------------------------------- files

# (device and date: the run's, as in its results JSON's environment, so that a profile is never
# read against another run's results: mesa_train.bench.pace checks them)
CSV_COLUMNS = ["preset", "label", "op", "category", "ms_per_step", "calls_per_step", "time", "device", "date"]


def _ms(value: float | None, signed: bool = False) -> str:
    if value is None:
        return "–"
    if abs(value) < 0.005:  # no "-0.00" or "+0.00": nothing changed at this precision
        return "0.00"
    return f"{value:+,.2f}" if signed else f"{value:,.2f}"


def _cell(text: str) -> str:
    return text.replace("|", "/")


def render_markdown(*, preset: str, env: dict[str, Any], command: str, steps: int,
                    rows: list[RowConfig], profiles: list[RowProfile], partial_of: int | None = None,
                    step_ms: dict[str, float | None] | None = None) -> str:
    """``partial_of``: the run's row count while only ``profiles`` (its first rows) exist;
    ``step_ms``: each row's measured median step (no profiler), for the pace table."""
    cuda = env.get("device_type") == "cuda"
    time_name = "self CUDA time per step" if cuda else "self CPU time per step"
    by_label = {p.label: p for p in profiles}
    ok = [(r, by_label[r.label]) for r in rows if r.label in by_label and by_label[r.label].status == "ok"]
    baseline = {r.group_name: r.label for r in rows if r.baseline}  # ratios use the same rule
    cats = {r.label: by_label[r.label].by_category() for r, _ in ok}
    shown = _shown_categories(cats)

    out = io.StringIO()
    w = out.write
    _render_header(w, preset=preset, env=env, command=command, steps=steps, warm=sorted({r.warmup for r in rows}),
                   n_profiled=len(profiles), partial_of=partial_of, cuda=cuda, time_name=time_name)
    w(f"## {time_name[0].upper() + time_name[1:]} by category (ms)\n\n")
    _category_table(w, ok, cats, shown, lambda p: p.total_ms)
    failed = [p for p in profiles if p.status != "ok"]
    if failed:
        w("\nNot profiled: " + "; ".join(f"{p.label} ({p.status}: {p.error})" for p in failed) + "\n")
    _render_deltas(w, ok, by_label, cats, shown, baseline)
    _render_top_ops(w, ok, by_label, cats, baseline)
    _render_host_time(w, ok, baseline)
    _render_pace(w, ok, baseline, step_ms or {})
    w("\n## Categories (first matching rule wins)\n\n| Category | Rule |\n|---|---|\n")
    for cat, text, _ in RULES:
        w(f"| {cat or '(enclosing op)'} | {text} |\n")
    w("\nBaseline ms/step in the top-ops tables is the same op in the same category of the "
      "baseline row (– where it does not occur there).\n")
    return out.getvalue()


def _render_header(w: Callable[[str], Any], *, preset: str, env: dict[str, Any], command: str, steps: int,
                   warm: list[int], n_profiled: int, partial_of: int | None, cuda: bool, time_name: str) -> None:
    """Title, machine and versions, the command, and how the times were taken."""
    w(f"# Profile: {preset} (where the time of a training step goes)\n\n")
    w(f"- Device: **{env['device']}**\n")
    w(f"- Date: {env['date']}\n")
    w(f"- Versions: torch {env['torch']}, timm {env['timm']}, mesa_train {env['mesa_train']}, "
      f"CUDA {env['cuda']}; Mesa extension: {env['mesa_extension']}; git {env['git']}\n")
    w(f"- Command: `{command}`\n")
    if partial_of is not None:
        w(f"- PARTIAL: {n_profiled} of {partial_of} rows profiled; the run was stopped or is still "
          "going (its end rewrites these files).\n")
    w(f"- Time: **{time_name}** in ms, from `torch.profiler` over {steps} training step(s) "
      f"after the row's warm-up ({'/'.join(map(str, warm))} step(s)). Each op's self time "
      "excludes the ops it calls, so a row's categories add up to its Total. "
      + "Step wall: wall clock per profiled step (profiler overhead included); Step wall minus "
      + ("Total is time the GPU sat idle (kernel launches, Python)." if cuda else
         "Total is Python time outside any op.") + "\n\n")


def _render_deltas(w: Callable[[str], Any], ok: list[tuple[RowConfig, RowProfile]], by_label: dict[str, RowProfile],
                   cats: dict[str, dict[str, float]], shown: list[str], baseline: dict[str, str]) -> None:
    """Each Mesa row's categories minus its group baseline's (when that baseline was profiled)."""
    deltas = [(r, p) for r, p in ok if not r.baseline and baseline.get(r.group_name) in cats]
    if not deltas:
        return
    w("\n## Extra time vs the group's baseline (ms/step; + is slower)\n\n")
    head = ["Row", "Baseline", *shown, "Total", "Step wall"]
    w("| " + " | ".join(head) + " |\n|" + "---|" * len(head) + "\n")
    for r, p in deltas:
        b = baseline[r.group_name]
        bp = by_label[b]
        cells = [_ms(cats[r.label][k] - cats[b][k], signed=True) for k in shown]
        wall = None if p.wall_ms is None or bp.wall_ms is None else p.wall_ms - bp.wall_ms
        w("| " + " | ".join([_cell(r.label), _cell(b), *cells,
                             _ms(p.total_ms - bp.total_ms, signed=True), _ms(wall, signed=True)]) + " |\n")


def _render_top_ops(w: Callable[[str], Any], ok: list[tuple[RowConfig, RowProfile]], by_label: dict[str, RowProfile],
                    cats: dict[str, dict[str, float]], baseline: dict[str, str]) -> None:
    """Per Mesa row: its top ops by self time beside the baseline's, then the kernels Mesa's ops launch."""
    for r, p in ok:
        if not r.mesa:
            continue
        b = baseline.get(r.group_name)
        bops = by_label[b].ops if b in cats else {}
        w(f"\n## Top {TOP_OPS} ops by self time: {_cell(r.label)}" + (f" (vs {_cell(b)})" if b else "") + "\n\n")
        _top_ops_table(w, p.ops, bops, per_call=False)
        if p.kernels:
            w(f"\n### Top {TOP_KERNELS} kernels Mesa's ops launch: {_cell(r.label)}\n\n")
            w("| Kernel | launched by | ms/step | launches/step | us/launch |\n|---|---|---|---|---|\n")
            for (kern, op), (ms, n) in sorted(p.kernels.items(), key=lambda kv: -kv[1][0])[:TOP_KERNELS]:
                w(f"| `{_cell(kern)}` | `{_cell(op)}` | {_ms(ms)} | {n:g} | {1000 * ms / n:,.1f} |\n")


def _render_host_time(w: Callable[[str], Any], ok: list[tuple[RowConfig, RowProfile]],
                      baseline: dict[str, str]) -> None:
    """On a GPU, the host's side of the same steps: self CPU time per step by category, and each
    Mesa row's top ops by it against its baseline. A step is host-bound where this Total comes
    near the step wall while the GPU Total stays below it (the GPU waits on launches)."""
    host = [(r, p) for r, p in ok if p.host_ops]
    if not host:
        return
    cats = {r.label: p.by_category(host=True) for r, p in host}
    w("\n## Host: self CPU time per step by category (ms)\n\n"
      "The same profiled steps, CPU side: Python and C++ dispatch, autograd, kernel launches.\n\n")
    _category_table(w, host, cats, _shown_categories(cats), lambda p: sum(ms for ms, _ in p.host_ops.values()))
    by_label = {r.label: p for r, p in host}
    for r, p in host:
        if not r.mesa:
            continue
        b = baseline.get(r.group_name)
        bops = by_label[b].host_ops if b in by_label else {}
        w(f"\n### Top {TOP_OPS} ops by host time: {_cell(r.label)}" + (f" (vs {_cell(b)})" if b else "") + "\n\n")
        _top_ops_table(w, p.host_ops, bops, per_call=True)


def _render_pace(w: Callable[[str], Any], ok: list[tuple[RowConfig, RowProfile]], baseline: dict[str, str],
                 step_ms: dict[str, float | None]) -> None:
    """On a GPU, each Mesa row's measured throughput ratio beside the GPU-time ratio (its ceiling
    where both steps run GPU-bound) and the host-time ratio (mesa_train.bench.pace); a row whose
    baseline was not profiled has none."""
    profiled = {r.label: p for r, p in ok if p.host_ops}

    def host_total(p: RowProfile) -> float:
        return sum(ms for ms, _ in p.host_ops.values())

    times = []
    for r, p in ok:
        b = baseline.get(r.group_name)
        if r.baseline or r.label not in profiled or b not in profiled:
            continue
        times.append(pace.RowTimes(r.label, b, p.total_ms, profiled[b].total_ms, host_total(p),
                                   host_total(profiled[b]), step_ms.get(r.label), step_ms.get(b)))
    if times:
        w("\n## Who set the pace: measured throughput ratio against the GPU-time ratio\n\n"
          + pace.pace_table(times) + "\n\n" + pace.EXPLANATION + "\n")


def _shown_categories(cats: dict[str, dict[str, float]]) -> list[str]:
    """The categories some row spends time in (the others are only noise in a table)."""
    return [c for c in CATEGORIES if any(c_ms[c] > 0.005 for c_ms in cats.values())] or ["other"]


def _category_table(w: Callable[[str], Any], pairs: list[tuple[RowConfig, RowProfile]],
                    cats: dict[str, dict[str, float]], shown: list[str],
                    total_of: Callable[[RowProfile], float]) -> None:
    """One line per row: its ms per step in each shown category, its Total and Step wall."""
    head = ["Row", *shown, "Total", "Step wall"]
    w("| " + " | ".join(head) + " |\n|" + "---|" * len(head) + "\n")
    for r, p in pairs:
        c = cats[r.label]
        w("| " + " | ".join([_cell(r.label) + (" (baseline)" if r.baseline else ""),
                             *[_ms(c[k]) for k in shown], _ms(total_of(p)), _ms(p.wall_ms)]) + " |\n")


def _top_ops_table(w: Callable[[str], Any], ops: dict[tuple[str, str], tuple[float, float]],
                   baseline_ops: dict[tuple[str, str], tuple[float, float]], *, per_call: bool) -> None:
    """A row's TOP_OPS ops by time, with the same op (same category) in its baseline row;
    ``per_call``: a us/call column too."""
    w("| Op | Category | ms/step | calls/step |" + (" us/call |" if per_call else "") + " baseline ms/step |\n"
      + "|---" * (6 if per_call else 5) + "|\n")
    for (op, cat), (ms, n) in sorted(ops.items(), key=lambda kv: -kv[1][0])[:TOP_OPS]:
        base = baseline_ops.get((op, cat))
        per = (f" {1000 * ms / n:,.1f} |" if n else " – |") if per_call else ""
        w(f"| `{_cell(op)}` | {cat} | {_ms(ms)} | {n:g} |{per} {_ms(base[0]) if base else '–'} |\n")


def write_files(md_path: Path, csv_path: Path, *, preset: str, env: dict[str, Any],
                command: str, steps: int, rows: list[RowConfig],
                profiles: list[RowProfile], partial_of: int | None = None,
                step_ms: dict[str, float | None] | None = None) -> str:
    """Writes ``<device>.profile.md`` and ``.profile.csv``; returns the Markdown."""
    md = render_markdown(preset=preset, env=env, command=command, steps=steps, rows=rows,
                         profiles=profiles, partial_of=partial_of, step_ms=step_ms)
    md_path.write_text(md)
    kind = "self_cuda" if env.get("device_type") == "cuda" else "self_cpu"
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for p in profiles:
            for ops, time_kind in ((p.ops, kind), (p.host_ops, "self_cpu")):
                for (op, cat), (ms, n) in sorted(ops.items(), key=lambda kv: -kv[1][0]):
                    writer.writerow({"preset": preset, "label": p.label, "op": op, "category": cat,
                                     "ms_per_step": f"{ms:.4f}", "calls_per_step": f"{n:g}",
                                     "time": time_kind, "device": env.get("device", ""), "date": env.get("date", "")})
    return md
