"""Table 9: the largest model that still trains under a memory cap, stock vs Mesa.

For each dimension (depth = number of blocks, width = number of heads with a fixed head
dimension, resolution = input size in multiples of the patch size) and each variant, the
search grows the value from the base by doubling until a training step does not fit, then
bisects. "Fits" means:

* CUDA: one warm-up step and one more training step run without out-of-memory while
  ``torch.cuda.set_per_process_memory_fraction(cap / total)`` limits the caching
  allocator to ``cap_gb`` (the paper: a 32 GB V100). A GPU smaller than the cap is used
  whole, and the effective cap is recorded.
* CPU (only with ``emulate_on_cpu: true``; otherwise a clear error): an *estimate*
  ``saved activation bytes (SavedTensorMeter, one forward) + k * parameter bytes``
  (k = 4 for AdamW: weights, gradients, two moments; 3 for SGD with momentum) must be
  at most the cap. Nothing that big is allocated, so it runs on a laptop; it exercises the
  search and shows the trend, but it is a model of memory, not a measurement.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from mesa_train.bench.measure import MB, TrainStep, build_for_row, release, run_row
from mesa_train.bench.paper_numbers import TABLE9
from mesa_train.bench.model_check import check_model
from mesa_train.bench.presets import BenchConfigError, RowConfig, check_row, make_row

DIM_CHOICES = ("depth", "width", "resolution")


@dataclass
class DimSpec:
    name: str
    base: int  # value of the unmodified model (depth 12, heads 12, 224 px)
    max: int
    step: int = 1  # resolution moves in multiples of the patch size
    head_dim: int = 64  # width: embed_dim = heads * head_dim

    def apply(self, row: RowConfig, value: int) -> RowConfig:
        kw = dict(row.model_kwargs)
        if self.name == "depth":
            kw["depth"] = value
            return dataclasses.replace(row, model_kwargs=kw)
        if self.name == "width":
            kw["num_heads"] = value
            kw["embed_dim"] = value * self.head_dim
            return dataclasses.replace(row, model_kwargs=kw)
        return dataclasses.replace(row, img_size=value)


@dataclass
class Probe:
    value: int
    fits: bool
    memory_mb: float | None  # CUDA peak during the step, or the CPU estimate


@dataclass
class SearchOutcome:
    dim: str
    label: str
    base: int
    largest: int | None  # None: not even the smallest value fits
    hit_max: bool
    probes: list[Probe] = field(default_factory=list)


@dataclass
class SearchSpec:
    variants: list[RowConfig]
    dims: list[DimSpec]
    cap_gb: float = 32.0
    emulate_on_cpu: bool = False


def parse_search(search: dict | None, common: dict) -> SearchSpec | None:
    if not search:
        return None
    base = dict(search.get("base") or {})
    variants = []
    for v in search.get("variants") or []:
        row = make_row({**common, **base}, {"group": "search", **v})
        check_row(row)
        variants.append(row)
    if len(variants) != 2:
        raise BenchConfigError("search.variants must list exactly two variants (stock, then Mesa)")
    dims = []
    for name, spec in (search.get("dims") or {}).items():
        if name not in DIM_CHOICES:
            raise BenchConfigError(f"search dim {name!r} is not valid; valid choices: {', '.join(DIM_CHOICES)}")
        spec = dict(spec or {})
        unknown = set(spec) - {"base", "max", "step", "head_dim"}
        if unknown:
            raise BenchConfigError(f"search dim {name!r}: unknown keys {sorted(unknown)}; "
                                   "valid: base, max, step, head_dim")
        if "base" not in spec or "max" not in spec:
            raise BenchConfigError(f"search dim {name!r} needs base and max")
        dim = DimSpec(name=name, **spec)
        if dim.base % dim.step or dim.max < dim.base or dim.base < dim.step:
            raise BenchConfigError(f"search dim {name!r}: need step <= base <= max and base a multiple of step")
        dims.append(dim)
    if not dims:
        raise BenchConfigError(f"search.dims is empty; valid dims: {', '.join(DIM_CHOICES)}")
    cap = float(search.get("cap_gb", 32))
    if cap <= 0:
        raise BenchConfigError("search.cap_gb must be positive")
    return SearchSpec(variants=variants, dims=dims, cap_gb=cap,
                      emulate_on_cpu=bool(search.get("emulate_on_cpu", False)))


def check_search(spec: SearchSpec) -> None:
    """Meta-build every variant at the base of each dim (the probes reuse that shape)."""
    for dim in spec.dims:
        for variant in spec.variants:
            check_model(dim.apply(variant, dim.base))


def largest_fitting(fits: Callable[[int], bool], base_units: int, max_units: int) -> tuple[int, bool]:
    """Largest u in [1, max_units] with fits(u), assuming fits is monotone (True then False).
    Returns (u or 0 when nothing fits, whether max_units itself fits)."""
    if fits(base_units):
        lo, u = base_units, base_units
        while True:
            nxt = min(2 * u, max_units)
            if nxt == u:
                return lo, True
            if fits(nxt):
                lo = u = nxt
                if nxt == max_units:
                    return lo, True
            else:
                hi = nxt
                break
    else:
        lo, hi = 0, base_units
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo, False


def _estimate_mb(row: RowConfig) -> float:
    from mesa_train.memory import SavedTensorMeter

    model = build_for_row(row, "cpu")
    step = TrainStep(row, model, torch.device("cpu"))
    x, y = next(step.micro_batches())
    with SavedTensorMeter(model) as meter:
        loss = step.forward_loss(x, y)
    loss.backward()  # frees the saved tensors (see measure.saved_bytes)
    del loss
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    k = 4 if row.optimizer == "adamw" else 3
    return (meter.activation_bytes + k * param_bytes) / MB


class Searcher:
    def __init__(self, spec: SearchSpec, device: torch.device, seed: int = 0,
                 on_probe: Callable[[str], None] | None = None):
        self.spec, self.device, self.seed = spec, device, seed
        self.on_probe = on_probe or (lambda _msg: None)
        self.effective_cap_gb = spec.cap_gb
        self.notes: list[str] = []

    def _fits(self, row: RowConfig, record: list[Probe], value: int) -> bool:
        if self.device.type == "cuda":
            probe_row = dataclasses.replace(row, warmup=1, steps=1)
            m = run_row(probe_row, self.device, seed=self.seed, measure_saved=False, timed=False)
            if m.status == "error":
                raise RuntimeError(f"search probe {row.label} {value} failed: {m.error}")
            ok, mem = m.status == "ok", m.peak_mb
        else:
            try:
                mem = _estimate_mb(row)
            finally:
                release(self.device)
            ok = mem <= self.effective_cap_gb * 1024
        record.append(Probe(value, ok, mem))
        self.on_probe(f"{row.label}: {value} -> {'fits' if ok else 'does not fit'}"
                      + (f" ({mem:,.0f} MB)" if mem is not None else ""))
        return ok

    def run(self) -> list[SearchOutcome]:
        dev = self.device
        if dev.type == "cuda":
            total = torch.cuda.get_device_properties(dev).total_memory
            cap = self.spec.cap_gb * 1024 ** 3
            if cap >= total:
                self.effective_cap_gb = total / 1024 ** 3
                self.notes.append(f"the GPU has {total / 1024**3:.1f} GB, less than the "
                                  f"{self.spec.cap_gb:g} GB cap: the whole GPU is used")
                fraction = 1.0
            else:
                fraction = cap / total
            torch.cuda.set_per_process_memory_fraction(fraction, dev)
        else:
            self.notes.append("CPU emulation: 'fits' means saved activation bytes (meter) + "
                              "4x parameter bytes <= cap; an estimate, not a measurement")
        outcomes = []
        try:
            for dim in self.spec.dims:
                start = dim.base // dim.step
                for variant in self.spec.variants:
                    probes: list[Probe] = []

                    def fits(units: int, variant=variant, dim=dim, probes=probes) -> bool:
                        value = units * dim.step
                        return self._fits(dim.apply(variant, value), probes, value)

                    units, hit_max = largest_fitting(fits, start, dim.max // dim.step)
                    # Mesa is expected to fit at least what stock fits: start it there (if it
                    # does not, the bisection below that start still finds the answer)
                    start = max(start, units)
                    outcomes.append(SearchOutcome(dim.name, variant.label, dim.base,
                                                  units * dim.step if units else None, hit_max, probes))
        finally:
            if dev.type == "cuda":
                torch.cuda.set_per_process_memory_fraction(1.0, dev)
                release(dev)
        return outcomes


def summarize(spec: SearchSpec, outcomes: list[SearchOutcome]) -> list[dict[str, Any]]:
    """One row per dim: stock and Mesa largest values, their ratio, the paper's."""
    stock, mesa = spec.variants[0].label, spec.variants[1].label
    rows = []
    for dim in spec.dims:
        got = {o.label: o for o in outcomes if o.dim == dim.name}
        s, m = got.get(stock), got.get(mesa)
        sv = s.largest if s else None
        mv = m.largest if m else None
        paper = TABLE9.get(dim.name)
        rows.append({
            "dim": dim.name,
            "stock_label": stock,
            "mesa_label": mesa,
            "stock_max": sv,
            "mesa_max": mv,
            "ratio": (mv / sv) if sv and mv else None,
            "stock_hit_limit": bool(s and s.hit_max),
            "mesa_hit_limit": bool(m and m.hit_max),
            "search_limit": dim.max,
            "probes": sum(len(o.probes) for o in got.values()),
            "paper_stock": paper[0] if paper else None,
            "paper_mesa": paper[1] if paper else None,
            "paper_ratio": paper[2] if paper else None,
        })
    return rows
