"""The accuracy preset (``configs/bench/accuracy/preset/*.yaml``) as checked Python objects.

A preset names a training experiment (``configs/experiment/``), the seeds every row is
trained with, one row per setting (stock or a ``mesa`` group override), the paper tables
that show those rows beside the paper's numbers, and the paper's claims to test.
Everything is validated (names, values, paper keys, and each row's composed training
config) before any training starts.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mesa_train.bench.accuracy.paper import TABLE_TITLES, paper_accuracy
from mesa_train.bench.presets import BenchConfigError

# the train config's mesa.* keys a row may set (mlp: shared / separate copies in the MLP)
MESA_KEYS = ("ops", "modules", "num_groups", "decay", "estimator", "symmetric", "rounding", "row_scale", "bits",
             "scale", "layout", "clip_horizon", "mlp", "norm_linear")
CLAIM_KINDS = ("better", "on_par")
PRESET_KEYS = {"name", "title", "description", "experiment", "train", "seeds", "jobs",
               "threads_per_job", "rows", "tables", "claims", "notes"}


@dataclass(frozen=True)
class AccuracyRow:
    label: str
    mesa: dict[str, Any] | None  # None: stock; {}: Mesa with the experiment's defaults
    baseline: bool = False
    note: str = ""

    def overrides(self) -> list[str]:
        """Hydra overrides of the training config for this row."""
        if self.mesa is None:
            return ["mesa.enabled=false"]
        return ["mesa.enabled=true"] + [f"mesa.{k}={_hydra_value(v)}" for k, v in self.mesa.items()]

    def setting(self) -> str:
        """What differs from the default Mesa configuration, for the tables."""
        if self.mesa is None:
            return "stock (no compression)"
        if not self.mesa:
            return "Mesa defaults"
        return ", ".join(f"{k}={_show(v)}" for k, v in self.mesa.items())


@dataclass(frozen=True)
class TableEntry:
    row: str
    paper: str | None  # key into paper.PAPER_ACCURACY


@dataclass(frozen=True)
class Claim:
    table: str
    kind: str  # better: a > b; on_par: |a - b| <= tol
    a: str
    b: str
    text: str
    tol: float = 1.0


@dataclass
class AccuracySpec:
    name: str
    title: str
    description: str
    experiment: str
    train: list[str]
    seeds: list[int]
    jobs: int
    threads_per_job: int
    rows: list[AccuracyRow]
    tables: dict[str, list[TableEntry]]
    claims: list[Claim]
    notes: list[str] = field(default_factory=list)

    @property
    def baseline(self) -> AccuracyRow:
        return next(r for r in self.rows if r.baseline)

    def row(self, label: str) -> AccuracyRow:
        return next(r for r in self.rows if r.label == label)


def _hydra_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_hydra_value(v) for v in value) + "]"
    return str(value)


def _show(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "+".join(map(str, value))
    return str(value)


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BenchConfigError(f"{name} must be a positive integer, got {value!r}")
    return value


def _rows(raw: list[dict]) -> list[AccuracyRow]:
    rows = []
    for item in raw:
        unknown = sorted(set(item) - {"label", "mesa", "baseline", "note"})
        if unknown or "label" not in item:
            raise BenchConfigError(f"accuracy row {item!r}: needs 'label'; unknown keys {unknown}; "
                                   "valid keys: label, mesa, baseline, note")
        mesa = item.get("mesa")
        if mesa is not None:
            if not isinstance(mesa, dict):
                raise BenchConfigError(f"row {item['label']!r}: mesa must be null (stock) or a mapping "
                                       f"of {', '.join(MESA_KEYS)}")
            bad = sorted(set(mesa) - set(MESA_KEYS))
            if bad:
                raise BenchConfigError(f"row {item['label']!r}: unknown mesa option(s) {bad}; valid: "
                                       f"{', '.join(MESA_KEYS)}")
        rows.append(AccuracyRow(label=str(item["label"]), mesa=None if mesa is None else dict(mesa),
                                baseline=bool(item.get("baseline", False)), note=str(item.get("note", ""))))
    labels = [r.label for r in rows]
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise BenchConfigError(f"duplicate row labels: {dup}")
    base = [r.label for r in rows if r.baseline]
    if len(base) != 1:
        raise BenchConfigError(f"exactly one row must be the baseline (baseline: true), found {base or 'none'}")
    return rows


def parse_spec(preset: dict) -> AccuracySpec:
    """Validate a preset dict (names and values; see `check_training_configs` for the
    composed training configs). Raises BenchConfigError with the valid choices."""
    unknown = sorted(set(preset) - PRESET_KEYS)
    if unknown:
        raise BenchConfigError(f"accuracy preset: unknown key(s) {unknown}; valid: {', '.join(sorted(PRESET_KEYS))}")
    for key in ("name", "experiment", "seeds", "rows"):
        if not preset.get(key):
            raise BenchConfigError(f"accuracy preset: missing {key!r}")
    seeds = list(preset["seeds"])
    if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise BenchConfigError(f"seeds must be distinct integers >= 0, got {seeds}")
    rows = _rows(list(preset["rows"]))
    labels = {r.label for r in rows}

    tables: dict[str, list[TableEntry]] = {}
    for table, entries in (preset.get("tables") or {}).items():
        if table not in TABLE_TITLES:
            raise BenchConfigError(f"unknown paper table {table!r}; valid: {', '.join(TABLE_TITLES)}")
        tables[table] = []
        for entry in entries:
            if entry.get("row") not in labels:
                raise BenchConfigError(f"{table}: entry {entry!r} names no row; rows: {', '.join(sorted(labels))}")
            paper = entry.get("paper")
            if paper is not None:
                try:
                    paper_accuracy(paper)
                except KeyError as err:
                    raise BenchConfigError(f"{table}: {err.args[0]}") from None
            tables[table].append(TableEntry(row=entry["row"], paper=paper))

    claims = []
    for item in preset.get("claims") or []:
        kind = item.get("kind")
        if kind not in CLAIM_KINDS:
            raise BenchConfigError(f"claim {item!r}: kind must be one of {', '.join(CLAIM_KINDS)}")
        for side in ("a", "b"):
            if item.get(side) not in labels:
                raise BenchConfigError(f"claim {item!r}: {side}={item.get(side)!r} names no row")
        if item.get("table") not in TABLE_TITLES:
            raise BenchConfigError(f"claim {item!r}: table must be one of {', '.join(TABLE_TITLES)}")
        claims.append(Claim(table=item["table"], kind=kind, a=item["a"], b=item["b"],
                            text=str(item.get("text", "")), tol=float(item.get("tol", 1.0))))

    train = [str(o) for o in (preset.get("train") or [])]
    return AccuracySpec(
        name=str(preset["name"]), title=str(preset.get("title") or preset["name"]),
        description=str(preset.get("description") or "").strip(), experiment=str(preset["experiment"]),
        train=train, seeds=seeds, jobs=_positive_int("jobs", preset.get("jobs", 1)),
        threads_per_job=_positive_int("threads_per_job", preset.get("threads_per_job", 1)),
        rows=rows, tables=tables, claims=claims, notes=[str(n) for n in preset.get("notes") or []])


def check_training_configs(spec: AccuracySpec) -> None:
    """Compose every row's training config and run the trainer's start-up checks, so a bad
    op name or value fails now with the trainer's message, not after an hour of training."""
    from mesa_train.bench.accuracy.train import compose_run
    from mesa_train.train.config import ConfigError, validate

    for row in spec.rows:
        try:
            validate(compose_run(spec.experiment, [*spec.train, *row.overrides()], seed=spec.seeds[0]))
        except ConfigError as err:
            raise BenchConfigError(f"row {row.label!r}: {err}") from None
        except Exception as err:  # Hydra: unknown experiment or override key
            raise BenchConfigError(f"row {row.label!r}: the training config does not compose: "
                                   f"{type(err).__name__}: {err}") from None
