"""Benchmark configurations: one `RowConfig` per measured training setup, expanded from a
preset (``configs/bench/preset/*.yaml``) and validated before anything is measured.

A preset has ``common`` (fields shared by every row), ``rows`` (each a partial
`RowConfig`, merged over ``common``) and optionally ``search`` (the Table 9 largest-model
search, see `mesa_train.bench.search`). Rows are grouped (``group``, default: the model);
exactly one row per group is its ``baseline`` and every ratio is taken against it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from collections.abc import Iterable, Sequence
from typing import Any

from mesa_train.bench.paper_numbers import paper_row
from mesa_train.compile_scope import SCOPES as COMPILE_SCOPES, close_inductor_options
from mesa_train.models import MODEL_NAMES, timm_name
from mesa_train.patch import MODULE_SETS, OPS as PATCH_OPS
from mesa_train.patch.duplicates import DUPLICATES
from mesa_train.quant.compile_kernels import CHOICES as COMPILE_KERNELS
from mesa_train.train.config import COMPILE_MODES as TRAIN_COMPILE_MODES
from mesa_train.train.config import CUDA_GRAPH_COMPILE_MODES

AMP_CHOICES = ("fp32", "fp16", "bf16")
ATTENTION_CHOICES = ("explicit", "fused")
OPTIMIZER_CHOICES = ("adamw", "sgd")
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
# torch.compile modes: the training config's (trainer.compile_mode), plus null (the default)
COMPILE_MODES = (None, *TRAIN_COMPILE_MODES)
# How a table names each compile scope ("" for the default)
_SCOPE_TAGS = {"model": "", "blocks": "per block"}
# Short op names for plot labels (paper Figure 6: G, LN, S, M).
OP_ABBREV = {"linear": "L", "matmul": "M", "softmax": "S", "gelu": "G", "layernorm": "LN",
             "conv": "C", "relu": "R", "sdpa": "SDPA", "all": "all"}


class BenchConfigError(ValueError):
    """A preset or row the benchmark cannot run (bad name, a value the model cannot take)."""


def valid_ops() -> tuple[str, ...]:
    """The op names a row's ``ops`` takes: patch_model's, and ``all``."""
    return (*PATCH_OPS, "all")


def valid_modules() -> tuple[str, ...]:
    """The module sets a row's ``modules`` takes: patch_model's, and ``all``."""
    return (*MODULE_SETS, "all")


@dataclass
class RowConfig:
    """One training setup to measure. ``batch_size`` is images per optimizer step;
    with ``accum_steps > 1`` it is split into that many micro-batches."""

    label: str
    model: str
    group: str | None = None
    baseline: bool = False
    mesa: bool = False
    ops: tuple[str, ...] = ("all",)
    modules: tuple[str, ...] = ("all",)
    quant: dict[str, Any] = field(default_factory=dict)  # extra patch_model options
    # skip: after patching, the Mesa layers that only duplicate what other modules keep go stock
    # (mesa_train.skip_duplicated on two random images under the row's amp, as train.py's start-up
    # does); keep: every layer the ops name stays compressed
    duplicates: str = "skip"
    short: str | None = None  # plot label (defaults to the ops, Figure 6 style)
    batch_size: int = 128
    img_size: int = 224
    num_classes: int = 1000
    amp: str = "fp16"
    attention: str = "explicit"
    grad_checkpointing: bool = False
    # NHWC memory format for the model and its input, as convnets train on a GPU (timm's
    # train.py --channels-last); every layer's backward then has to keep that layout
    channels_last: bool = False
    accum_steps: int = 1
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    optimizer: str = "adamw"
    lr: float = 1e-3
    warmup: int = 2
    steps: int = 10
    paper: str | None = None  # key into paper_numbers.PAPER_ROWS
    compile: bool = False  # torch.compile the model (Inductor) before the warm-up steps
    compile_mode: str | None = None  # torch.compile mode, e.g. reduce-overhead (CUDA graphs)
    compile_backend: str = "inductor"  # torch.compile backend (aot_eager: traced, no codegen; for tests)
    compile_kernels: str = "auto"  # Mesa's compression under compile: auto | ops | traceable (quant/compile_kernels.py)
    compile_scope: str = "model"  # one graph for the model, or one per repeated block (mesa_train/compile_scope.py)
    # Inductor options for this row's compile (torch._inductor.config names; another backend
    # ignores them), e.g. {coordinate_descent_tuning: true}: stock tuned as traced Mesa models are
    compile_options: dict[str, Any] = field(default_factory=dict)
    # the whole eager step (forward, backward, optimizer) captured once in one CUDA graph and
    # replayed (PyTorch's whole-network capture, torch.cuda.graph): the host launches nothing
    # per step, so an eager row's ratio becomes its GPU time's. Needs CUDA, bf16 or fp32 (the
    # fp16 GradScaler checks for inf on the host) and no compile (compile_mode=reduce-overhead is
    # the compiled counterpart); the optimizer is made capturable
    cuda_graph: bool = False

    def compile_tags(self) -> list[str]:
        """The compile options that differ from the defaults, as a table names them
        (``traceable kernels``, ``per block``)."""
        tags = [] if self.compile_kernels == "auto" else [f"{self.compile_kernels} kernels"]
        scope = _SCOPE_TAGS[self.compile_scope]
        tags += [f"{k}={v}" for k, v in sorted(self.compile_options.items())]
        return tags + ([scope] if scope else [])

    @property
    def micro_batch(self) -> int:
        return self.batch_size // self.accum_steps

    @property
    def group_name(self) -> str:
        return self.group or self.model

    @property
    def plot_label(self) -> str:
        if self.short:
            return self.short
        if not self.mesa:
            return "baseline"
        label = "+".join(OP_ABBREV.get(o, o) for o in self.ops)
        if tuple(self.modules) != ("all",):
            label += " [" + "+".join(m.upper() for m in self.modules) + "]"
        return label

    def model_overrides(self) -> dict[str, Any]:
        kw = {"num_classes": self.num_classes, "img_size": self.img_size}
        kw.update(self.model_kwargs)
        return kw

    def describe(self) -> str:
        bits = [self.model]
        if self.model_kwargs:
            bits.append("(" + ", ".join(f"{k}={v}" for k, v in self.model_kwargs.items()) + ")")
        bits += [f"b{self.batch_size}", f"{self.img_size}px", self.amp, self.attention]
        if self.mesa:
            bits.append("mesa[" + ",".join(self.ops) + ("|" + ",".join(self.modules)
                                                         if tuple(self.modules) != ("all",) else "") + "]")
            if self.quant:
                bits.append("(" + ", ".join(f"{k}={v}" for k, v in sorted(self.quant.items())) + ")")
            if self.duplicates != "skip":
                bits.append(f"duplicates={self.duplicates}")
        if self.channels_last:
            bits.append("channels_last")
        if self.grad_checkpointing:
            bits.append("ckpt")
        if self.accum_steps > 1:
            bits.append(f"accum{self.accum_steps}")
        if self.cuda_graph:
            bits.append("cuda-graph")
        if self.compile:
            bits.append("compiled" + (f"({self.compile_mode})" if self.compile_mode else "")
                        + "".join(f"[{tag}]" for tag in self.compile_tags()))
        return " ".join(bits)


_FIELDS = {f.name for f in dataclasses.fields(RowConfig)}


def make_row(common: dict, row: dict) -> RowConfig:
    """Merge ``row`` over ``common`` into a RowConfig. ``quant`` options are merged key by
    key; a row's ``model_kwargs`` replaces common's (they belong to one architecture)."""
    merged: dict[str, Any] = {}
    for src in (common or {}, row or {}):
        for key, value in src.items():
            if key == "quant" and isinstance(value, dict):
                merged[key] = {**merged.get(key, {}), **value}
            else:
                merged[key] = value
    unknown = sorted(set(merged) - _FIELDS)
    if unknown:
        raise BenchConfigError(
            f"row {merged.get('label', '?')!r}: unknown field(s) {unknown}; valid fields: "
            f"{', '.join(sorted(_FIELDS))}")
    for key in ("label", "model"):
        if key not in merged:
            raise BenchConfigError(f"row {row!r}: missing required field {key!r}")
    for key in ("ops", "modules"):
        if key in merged:
            value = merged[key]
            merged[key] = (value,) if isinstance(value, str) else tuple(value)
    return RowConfig(**merged)


def check_row(row: RowConfig) -> None:
    """Validate names and numbers (cheap, no model built). Raises BenchConfigError."""
    where = f"row {row.label!r}"
    try:
        timm_name(row.model)
    except ValueError as err:
        raise BenchConfigError(f"{where}: {err}") from None
    for name, value, choices in (("amp", row.amp, AMP_CHOICES),
                                 ("attention", row.attention, ATTENTION_CHOICES),
                                 ("optimizer", row.optimizer, OPTIMIZER_CHOICES),
                                 ("duplicates", row.duplicates, DUPLICATES)):
        if value not in choices:
            raise BenchConfigError(f"{where}: {name}={value!r} is not valid; valid choices: "
                                   f"{', '.join(choices)}")
    if row.mesa:
        for name, values, choices in (("ops", row.ops, valid_ops()),
                                      ("modules", row.modules, valid_modules())):
            bad = [v for v in values if v not in choices]
            if bad or not values:
                raise BenchConfigError(f"{where}: mesa {name} {bad or list(values)} not valid; "
                                       f"valid choices: {', '.join(choices)}")
    for name in ("batch_size", "img_size", "num_classes", "accum_steps", "steps"):
        value = getattr(row, name)
        if not isinstance(value, int) or value < 1:
            raise BenchConfigError(f"{where}: {name} must be a positive integer, got {value!r}")
    if not isinstance(row.warmup, int) or row.warmup < 0:
        raise BenchConfigError(f"{where}: warmup must be an integer >= 0, got {row.warmup!r}")
    for name in ("compile", "channels_last", "cuda_graph"):
        if not isinstance(getattr(row, name), bool):
            raise BenchConfigError(f"{where}: {name} must be true or false, got {getattr(row, name)!r}")
    if row.compile_backend not in COMPILE_BACKENDS:
        raise BenchConfigError(f"{where}: compile_backend={row.compile_backend!r} is not valid; valid choices: "
                               + ", ".join(COMPILE_BACKENDS))
    if row.compile_kernels not in COMPILE_KERNELS:
        raise BenchConfigError(f"{where}: compile_kernels={row.compile_kernels!r} is not valid; valid choices: "
                               + ", ".join(COMPILE_KERNELS))
    if row.compile_scope not in COMPILE_SCOPES:
        raise BenchConfigError(f"{where}: compile_scope={row.compile_scope!r} is not valid; valid choices: "
                               + ", ".join(COMPILE_SCOPES))
    if row.compile_mode not in COMPILE_MODES:
        raise BenchConfigError(f"{where}: compile_mode={row.compile_mode!r} is not valid; valid choices: "
                               + ", ".join("null" if m is None else m for m in COMPILE_MODES))
    _check_compile_options(row, where)
    if row.compile and row.compile_mode in CUDA_GRAPH_COMPILE_MODES and row.accum_steps > 1:
        # each micro-batch's backward replays the graph over the memory its gradients live in
        raise BenchConfigError(f"{where}: compile_mode={row.compile_mode!r} captures CUDA graphs, whose "
                               "gradient outputs the next micro-batch overwrites; use accum_steps=1 or "
                               "compile_mode=default")
    if row.cuda_graph and row.compile:
        raise BenchConfigError(f"{where}: cuda_graph=true captures an eager step; a compiled step is captured by "
                               "compile_mode=reduce-overhead (use one or the other)")
    if row.cuda_graph and row.amp == "fp16":
        raise BenchConfigError(f"{where}: cuda_graph=true cannot capture fp16's GradScaler (it checks for inf on the "
                               "host every step); valid amp with cuda_graph: bf16, fp32")
    if row.batch_size % row.accum_steps:
        raise BenchConfigError(f"{where}: batch_size={row.batch_size} is not divisible by "
                               f"accum_steps={row.accum_steps} (micro-batches must be equal)")
    paper = row.paper
    if paper is not None:
        try:
            paper_row(paper)
        except KeyError as err:
            raise BenchConfigError(f"{where}: {err.args[0]}") from None


def _check_compile_options(row: RowConfig, where: str) -> None:
    """``compile_options``: Inductor config names with scalar values. A ``compile_mode`` may stand
    beside them: ``compile_scope.compile_model`` turns the mode into its options and adds these
    (torch.compile itself takes one or the other)."""
    options = row.compile_options
    if not isinstance(options, dict):
        raise BenchConfigError(f"{where}: compile_options must be a mapping of Inductor options, got {options!r}")
    if not options:
        return
    for key, value in options.items():
        close = close_inductor_options(key)
        if close is not None:
            raise BenchConfigError(f"{where}: compile_options has {key!r}, not an Inductor option (torch._inductor"
                                   f".config){'; close: ' + ', '.join(close) if close else ''}")
        if not isinstance(value, (bool, int, float, str)):
            raise BenchConfigError(f"{where}: compile_options[{key!r}] must be a bool, number or string, "
                                   f"got {value!r}")


def validate_groups(rows: list[RowConfig]) -> None:
    groups: dict[str, list[RowConfig]] = {}
    for row in rows:
        groups.setdefault(row.group_name, []).append(row)
    labels = [r.label for r in rows]
    dup = sorted({lab for lab in labels if labels.count(lab) > 1})
    if dup:
        raise BenchConfigError(f"duplicate row labels: {dup}")
    for name, members in groups.items():
        base = [r.label for r in members if r.baseline]
        if len(base) != 1:
            raise BenchConfigError(
                f"group {name!r} must have exactly one baseline row, found {base or 'none'} "
                f"among {[r.label for r in members]}")


def check_switches(cfg: Any, names: Sequence[str]) -> None:
    """The app settings ``names`` are true or false, not a text (YAML reads ``dry_run=no`` as the
    string 'no', which Python's truth would take as true: a dry run that was not asked for)."""
    for name in names:
        value = cfg.get(name) if hasattr(cfg, "get") else getattr(cfg, name, None)
        if value is not None and not isinstance(value, bool):
            raise BenchConfigError(f"{name}={value!r} must be true or false")


def _texts(value: str | Sequence[str] | None) -> list[str]:
    """One text (``only=Swin``) or several (``only=[Swin,PVT]``) as a list; empty ones dropped."""
    many = isinstance(value, Iterable) and not isinstance(value, str)
    return [str(t) for t in (value if many else [value]) if t not in (None, "")]


def expand_preset(preset: dict, only: str | Sequence[str] | None = None,
                  skip: str | Sequence[str] | None = None) -> list[RowConfig]:
    """The preset's rows as validated RowConfigs (names only; their models are built by
    `mesa_train.bench.model_check.check_model`).
    ``only`` (one text or several) keeps rows whose label contains one, plus their groups'
    baselines; ``skip`` (one text or several) then drops the non-baseline rows whose label
    contains one (a time-bounded session's cut), and the baselines of groups it empties; each
    text must match such a row."""
    common = dict(preset.get("common") or {})
    rows = [make_row(common, r) for r in (preset.get("rows") or [])]
    for row in rows:
        check_row(row)
    validate_groups(rows)
    labels = [r.label for r in rows]
    for target in preset.get("targets") or []:
        if target.get("row") not in labels:
            raise BenchConfigError(f"target {target!r} names no row; rows: {', '.join(labels)}")
        unknown = set(target) - {"row", "memory_ratio_max", "throughput_ratio_min"}
        if unknown:
            raise BenchConfigError(f"target {target!r}: unknown keys {sorted(unknown)}; valid: "
                                   "row, memory_ratio_max, throughput_ratio_min")
    onlys = _texts(only)
    for text in onlys:
        if not any(text in r.label for r in rows):
            raise BenchConfigError(f"only={text!r} matches no row; rows: {', '.join(r.label for r in rows)}")
    if onlys:
        keep = {r.group_name for r in rows if any(text in r.label for text in onlys)}
        rows = [r for r in rows if r.group_name in keep and (r.baseline or any(text in r.label for text in onlys))]
    # one text (skip=traceable) or a list (skip=[traceable,fused]); an empty one skips nothing
    many = isinstance(skip, Iterable) and not isinstance(skip, str)
    skips = _texts(skip)
    for text in skips:
        if not any(text in r.label and not r.baseline for r in rows):
            raise BenchConfigError(f"skip={text!r} matches no (non-baseline) row; rows: "
                                   f"{', '.join(r.label for r in rows)}")
    kept = [r for r in rows if r.baseline or not any(text in r.label for text in skips)]
    # a baseline whose every other row was skipped has nothing left to be compared with
    emptied = {r.group_name for r in rows if not r.baseline} - {r.group_name for r in kept if not r.baseline}
    left = [r for r in kept if r.group_name not in emptied]
    if rows and skips and not left:
        kept_by = f" of the rows only={only!r} kept" if only else ""
        raise BenchConfigError(f"skip={skips if many else skips[0]!r} drops every row{kept_by}: nothing left to "
                               f"measure; rows: {', '.join(r.label for r in rows)}")
    return left


__all__ = ["AMP_CHOICES", "ATTENTION_CHOICES", "BenchConfigError", "MODEL_NAMES", "RowConfig",
           "check_row", "expand_preset", "make_row", "valid_modules", "valid_ops"]
