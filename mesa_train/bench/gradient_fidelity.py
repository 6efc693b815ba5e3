"""Gradient fidelity: how close Mesa's gradients are to the exact (stock) ones, per op type
and for the paper's ablations, on full-size models (``python -m
mesa_train.bench.gradient_fidelity``, configs in ``configs/bench/gradients/``).

For each model: one exact gradient (stock model, train mode, explicit attention) of a
cross-entropy loss on a batch of digits upscaled to the model's input size. For each row
(a set of ops / quantization options): a Mesa copy of the *same* weights warms its running
estimates on a few other batches (forward + backward, no update, as training would), then
computes the gradient of the test batch ``passes`` times (stochastic rounding draws a new
seed each pass). Measured, over all parameters concatenated:

- one pass: cosine and relative error ``|g_i - g| / |g|`` (mean over the passes);
- the mean of the passes: cosine and relative error of ``mean_i g_i`` against ``g``;
- bias: ``sqrt(max(0, |mean - g|^2 - s^2 / N)) / |g|`` with ``s^2`` the sample variance of
  the passes, an unbiased estimate of ``|E[g_i] - g|^2``: what would be left after
  infinitely many passes. The noise alone would leave ``noise / sqrt(N)``;
- the worst parameter tensor: the lowest cosine of the mean gradient over single tensors;
- the forward check: the Mesa model's logits equal the stock ones bit for bit.

Each Mesa copy is the model ``train.py`` would train with those ops: ``skip_duplicated`` leaves
stock the layers whose every copy another module keeps in full anyway (``duplicates: skip``, the
default, as ``mesa.duplicates``; PVT-v2's ``attn.q`` with ``ops=[linear]``, beside the stock ``sr``
conv on the same input), and the row's record names them (``skipped``). ``duplicates: keep``
measures every layer the ops ask for, as ``mesa.duplicates=keep`` trains.
"""
from __future__ import annotations

import copy
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from mesa_train.bench.presets import BenchConfigError, check_switches

QUANT_KEYS = ("num_groups", "decay", "estimator", "symmetric", "rounding", "mlp", "norm_linear")
CSV_COLUMNS = ["preset", "model", "label", "ops", "modules", "quant", "paper", "status", "error", "passes",
               "cos_single", "rel_err_single", "cos_mean", "rel_err_mean", "bias_rel", "noise_rel",
               "noise_rel_over_sqrt_n", "worst_tensor", "worst_tensor_cos_mean", "forward_exact",
               "skipped", "batch_size", "img_size", "params_m", "seconds", "device", "torch", "timm", "git", "date"]


@dataclass(frozen=True)
class ModelSpec:
    label: str
    model: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    rows: tuple[str, ...] | None = None  # the row labels measured on this model (None: all)


@dataclass(frozen=True)
class GradRow:
    label: str
    ops: tuple[str, ...] = ("all",)
    modules: tuple[str, ...] = ("all",)
    quant: dict[str, Any] = field(default_factory=dict)
    paper: str = ""

    def options(self) -> dict[str, Any]:
        return {"ops": self.ops, "modules": self.modules, **self.quant}


@dataclass
class GradSpec:
    name: str
    title: str
    description: str
    models: list[ModelSpec]
    rows: list[GradRow]
    batch_size: int
    img_size: int
    passes: int
    warmup_batches: int
    seed: int
    notes: list[str]
    duplicates: str = "skip"  # as mesa.duplicates: skip (what training runs) | keep (every layer the ops ask)


# --------------------------------------------------------------------------- preset

def parse_spec(preset: dict) -> GradSpec:
    from mesa_train.bench.presets import valid_modules, valid_ops
    from mesa_train.models import timm_name
    from mesa_train.patch.duplicates import DUPLICATES

    known = {"name", "title", "description", "models", "rows", "batch_size", "img_size", "passes",
             "warmup_batches", "seed", "notes", "duplicates"}
    unknown = sorted(set(preset) - known)
    if unknown:
        raise BenchConfigError(f"gradients preset: unknown key(s) {unknown}; valid: {', '.join(sorted(known))}")
    models = []
    for m in preset.get("models") or []:
        try:
            timm_name(m.get("model", ""))
        except ValueError as err:
            raise BenchConfigError(f"model {m!r}: {err}") from None
        subset = m.get("rows")
        models.append(ModelSpec(str(m.get("label", m["model"])), m["model"], dict(m.get("kwargs") or {}),
                                None if subset is None else tuple(subset)))
    rows = []
    for r in preset.get("rows") or []:
        extra = sorted(set(r) - {"label", "ops", "modules", "quant", "paper"})
        if extra or "label" not in r:
            raise BenchConfigError(f"row {r!r}: needs a label; unknown keys {extra}; valid: label, ops, "
                                   "modules, quant, paper")
        ops = tuple([r["ops"]] if isinstance(r.get("ops"), str) else r.get("ops") or ("all",))
        modules = tuple([r["modules"]] if isinstance(r.get("modules"), str) else r.get("modules") or ("all",))
        for what, values, valid in (("ops", ops, valid_ops()), ("modules", modules, valid_modules())):
            bad = [v for v in values if v not in valid]
            if bad:
                raise BenchConfigError(f"row {r.get('label')!r}: unknown {what} {bad}; valid: {', '.join(valid)}")
        quant = dict(r.get("quant") or {})
        bad = sorted(set(quant) - set(QUANT_KEYS))
        if bad:
            raise BenchConfigError(f"row {r.get('label')!r}: unknown quant option(s) {bad}; "
                                   f"valid: {', '.join(QUANT_KEYS)}")
        rows.append(GradRow(str(r["label"]), ops, modules, quant, str(r.get("paper", ""))))
    if not models or not rows:
        raise BenchConfigError("gradients preset needs 'models' and 'rows'")
    labels = [r.label for r in rows]
    for m in models:
        bad = sorted(set(m.rows or ()) - set(labels))
        if bad:
            raise BenchConfigError(f"model {m.label!r}: rows {bad} are not rows of the preset; "
                                   f"rows: {', '.join(labels)}")
    ints = {}
    for key, low in (("batch_size", 1), ("img_size", 1), ("passes", 2), ("warmup_batches", 0), ("seed", 0)):
        value = preset.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise BenchConfigError(f"{key} must be an integer >= {low}, got {value!r}")
        ints[key] = value
    duplicates = preset.get("duplicates", "skip")
    if duplicates not in DUPLICATES:
        raise BenchConfigError(f"duplicates must be one of {', '.join(DUPLICATES)}, got {duplicates!r}")
    return GradSpec(name=str(preset["name"]), title=str(preset.get("title") or preset["name"]),
                    description=str(preset.get("description") or "").strip(), models=models, rows=rows,
                    notes=[str(n) for n in preset.get("notes") or []], duplicates=duplicates, **ints)


# --------------------------------------------------------------------------- measuring

def digits_batches(count: int, batch: int, img_size: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` batches of scikit-learn digits (real scans) upscaled to ``img_size``,
    normalised to [-1, 1], drawn without replacement with ``seed``."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(x), generator=g)[: count * batch]
    images = torch.as_tensor(x[order.numpy()], dtype=torch.float32).reshape(-1, 1, 8, 8) / 8.0 - 1.0
    images = F.interpolate(images, size=(img_size, img_size), mode="bilinear", align_corners=False)
    images = images.expand(-1, 3, -1, -1).contiguous()
    labels = torch.as_tensor(y[order.numpy()], dtype=torch.long)
    return [(images[i * batch:(i + 1) * batch], labels[i * batch:(i + 1) * batch]) for i in range(count)]


def build_stock(spec: GradSpec, m: ModelSpec) -> torch.nn.Module:
    """The stock model, seeded, train mode, explicit attention, no dropout / drop-path.
    DeiT and Swin are built for ``img_size``; PVT-v2 and CNNs take any size (no img_size argument)."""
    from mesa_train.models import build_model

    torch.manual_seed(spec.seed)
    kwargs = {"num_classes": 10, "drop_path_rate": 0.0, "drop_rate": 0.0, "img_size": spec.img_size, **m.kwargs}
    try:
        return build_model(m.model, fused_attn=False, img_size_optional="img_size" not in m.kwargs, **kwargs).train()
    except (ValueError, AssertionError, TypeError) as err:  # timm asserts on impossible shapes
        raise BenchConfigError(f"model {m.label!r} cannot take {m.kwargs}: {type(err).__name__}: {err}") from None


def check_models(spec: GradSpec) -> None:
    """Build every model on the meta device and run one forward, so a configuration the
    architecture cannot take fails before the (long) measurements start."""
    for m in spec.models:
        with torch.device("meta"):
            model = build_stock(spec, m)
            try:
                model(torch.empty(spec.batch_size, 3, spec.img_size, spec.img_size))
            except Exception as err:  # noqa: BLE001 - timm asserts, shape errors
                raise BenchConfigError(f"model {m.label!r} cannot take {spec.img_size}x{spec.img_size} "
                                       f"inputs with {m.kwargs}: {type(err).__name__}: {err}") from None


def gradient(model: torch.nn.Module,
             batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """(all parameter gradients as one float64 vector, tensor sizes, logits)."""
    model.zero_grad(set_to_none=True)
    logits = model(batch[0])
    F.cross_entropy(logits.float(), batch[1]).backward()
    parts = [(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).double()
             for p in model.parameters()]
    return torch.cat(parts), [t.numel() for t in parts], logits.detach()


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a, b, dim=0, eps=1e-30))


def measure_row(stock: torch.nn.Module, exact: torch.Tensor, exact_logits: torch.Tensor, sizes: list[int],
                names: list[str], row: GradRow, test: tuple, warm: list[tuple], passes: int,
                duplicates: str = "skip") -> dict[str, Any]:
    from mesa_train import patch_model
    from mesa_train.patch.start_up import skip_duplicated_at_start_up, skipped_note, start_up_images

    model = patch_model(copy.deepcopy(stock), **row.options()).train()
    skipped = ""
    if duplicates == "skip":  # (as train.py's start-up: two random images; the RNG and buffers restored)
        images = test[0]
        skip_duplicated_at_start_up(model, start_up_images(2, images.shape[-1], channels_last=False,
                                                           device=images.device, random=True))
        skipped = skipped_note(model)
    for batch in warm:  # running estimates as after a few training steps
        gradient(model, batch)
    norm = float(exact.norm())
    total = torch.zeros_like(exact)
    sq_sum, cos1, rel1 = 0.0, [], []
    forward_exact = True
    for i in range(passes):
        g, _, logits = gradient(model, test)
        forward_exact &= bool(torch.equal(logits, exact_logits))
        total += g
        sq_sum += float(g.dot(g))
        cos1.append(_cos(g, exact))
        rel1.append(float((g - exact).norm()) / norm)
    mean = total / passes
    var = max(0.0, (sq_sum - passes * float(mean.dot(mean))) / (passes - 1))  # sum_i |g_i - mean|^2 / (N-1)
    err2 = float((mean - exact).pow(2).sum())
    worst_name, worst_cos = "", 1.0
    for name, part_mean, part_exact in zip(names, mean.split(sizes), exact.split(sizes)):
        if float(part_exact.norm()) > 0:
            c = _cos(part_mean, part_exact)
            if c < worst_cos:
                worst_name, worst_cos = name, c
    noise = math.sqrt(var) / norm
    return {"cos_single": sum(cos1) / passes, "rel_err_single": sum(rel1) / passes,
            "cos_mean": _cos(mean, exact), "rel_err_mean": math.sqrt(err2) / norm,
            "bias_rel": math.sqrt(max(0.0, err2 - var / passes)) / norm, "noise_rel": noise,
            "noise_rel_over_sqrt_n": noise / math.sqrt(passes), "worst_tensor": worst_name,
            "worst_tensor_cos_mean": worst_cos, "forward_exact": forward_exact, "passes": passes,
            "skipped": skipped}


def rows_of(spec: GradSpec, m: ModelSpec) -> list[GradRow]:
    return [r for r in spec.rows if m.rows is None or r.label in m.rows]


def measure_all(spec: GradSpec, show: bool, say) -> list[dict[str, Any]]:
    from tqdm.auto import tqdm

    batches = digits_batches(1 + spec.warmup_batches, spec.batch_size, spec.img_size, spec.seed)
    test, warm = batches[0], batches[1:]
    records = []
    bar = tqdm(total=sum(len(rows_of(spec, m)) for m in spec.models), desc=f"gradients {spec.name}", unit="cfg",
               disable=not show, file=sys.stderr, dynamic_ncols=True)
    try:
        for m in spec.models:
            stock = build_stock(spec, m)
            names = [n for n, _ in stock.named_parameters()]
            exact, sizes, exact_logits = gradient(stock, test)
            params_m = sum(p.numel() for p in stock.parameters()) / 1e6
            for row in rows_of(spec, m):
                bar.set_postfix_str(f"{m.label}: {row.label}"[:40])
                rec = {"preset": spec.name, "model": m.label, "label": row.label, "ops": "+".join(row.ops),
                       "modules": "+".join(row.modules), "quant": ", ".join(f"{k}={v}" for k, v in row.quant.items()),
                       "paper": row.paper, "batch_size": spec.batch_size, "img_size": spec.img_size,
                       "params_m": params_m}
                start = time.perf_counter()
                torch.manual_seed(spec.seed + 1)  # the rounding seeds of every row's passes
                try:
                    rec.update(status="ok", error="", **measure_row(stock, exact, exact_logits, sizes, names, row,
                                                                   test, warm, spec.passes, spec.duplicates))
                except Exception as err:  # noqa: BLE001 - e.g. an op the model does not have
                    rec.update(status="error", error=f"{type(err).__name__}: {err}")
                    say(f"{m.label} / {row.label}: {rec['error']}", bar)
                rec["seconds"] = time.perf_counter() - start
                records.append(rec)
                bar.update(1)
            del stock
    finally:
        bar.close()
    return records


# --------------------------------------------------------------------------- report

def _fmt(value: Any, digits: int = 4) -> str:
    if value is None or value == "":
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}" if abs(value) >= 10 ** -digits or value == 0 else f"{value:.1e}"
    return str(value)


def markdown(spec: GradSpec, records: list[dict[str, Any]], env: dict[str, Any], command: str,
             facts: list[str]) -> str:
    lines = [f"# {spec.title}", ""]
    if spec.description:
        lines += [spec.description, ""]
    lines += [f"- Device: **{env['device']}**; {', '.join(facts)}",
              f"- Date: {env['date']}; versions: torch {env['torch']}, timm {env['timm']}, mesa_train "
              f"{env['mesa_train']}; Mesa extension: {env['mesa_extension']}; git {env['git']}",
              f"- Command: `{command}`",
              f"- Batch {spec.batch_size} of digits upscaled to {spec.img_size}x{spec.img_size}, 10 classes, random "
              f"init (seed {spec.seed}), cross-entropy; {spec.warmup_batches} warm-up batch(es) for the running "
              f"estimates, then {spec.passes} passes on the test batch.", ""]
    head = ["Row", "Ops", "Options", "Paper", "cos (1 pass)", "rel. err (1 pass)", f"cos (mean of {spec.passes})",
            f"rel. err (mean of {spec.passes})", "bias (∞ passes)", "noise/√N", "worst tensor: cos (mean)",
            "forward exact"]
    for model in dict.fromkeys(r["model"] for r in records):
        rows = [r for r in records if r["model"] == model]
        params = rows[0].get("params_m")
        lines += [f"## {model}" + (f" ({params:.1f}M parameters)" if params else ""), "",
                  "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in rows:
            if r["status"] != "ok":
                lines.append(f"| {r['label']} | {r['ops']} | {r['quant'] or '–'} | {r['paper'] or '–'} | "
                             + " | ".join(["–"] * 7) + f" | {r['status']}: {r['error']} |")
                continue
            lines.append("| " + " | ".join([
                r["label"], r["ops"] + (f" [{r['modules']}]" if r["modules"] != "all" else ""), r["quant"] or "–",
                r["paper"] or "–", _fmt(r["cos_single"], 5), _fmt(r["rel_err_single"]), _fmt(r["cos_mean"], 5),
                _fmt(r["rel_err_mean"]), _fmt(r["bias_rel"]), _fmt(r["noise_rel_over_sqrt_n"]),
                f"{r['worst_tensor']}: {_fmt(r['worst_tensor_cos_mean'], 4)}",
                "yes" if r["forward_exact"] else "**no**",
            ]) + " |")
        lines.append("")
        skipped = [f"- {r['label']}: {r['skipped']}" for r in rows if r.get("skipped")]
        if skipped:  # (what training with those ops leaves stock: measured as it trains)
            lines += ["Left as training leaves them (mesa.duplicates=skip):", "", *skipped, ""]
    lines += ["## How to read it", "",
              "- rel. err = |g_Mesa - g_exact| / |g_exact| over all parameters; cos = their cosine.",
              ("- Each row is the model train.py trains with its ops (mesa.duplicates=skip): a layer whose every "
               "8-bit copy duplicates what another module keeps in full is left stock, listed under the table."
               if spec.duplicates == "skip" else "- duplicates: keep: every layer the ops ask for is compressed, "
               "also those whose copies duplicate what another module keeps in full (mesa.duplicates=keep)."),
              "- bias (∞ passes) estimates |E[g_Mesa] - g_exact| / |g_exact| from the passes: the mean's "
              "squared error minus the part the pass-to-pass noise explains (s²/N). An unbiased "
              "estimator has bias ≈ 0 and rel. err (mean) ≈ noise/√N; a biased one keeps rel. err "
              "(mean) ≈ bias however many passes are averaged.",
              "- Expected: stochastic rounding makes the 8-bit copy unbiased inside its range, so "
              "gradients linear in the saved activation (weight gradients of Linear and both attention "
              "matmuls) are unbiased unless values fall outside the running range (clipped); the backward "
              "of GELU, Softmax and LayerNorm is nonlinear in the saved activation and can keep a bias. "
              "The bias column is itself an estimate from N passes: values below about noise/√N are "
              "not resolved.",
              *(f"- {n}" for n in spec.notes), ""]
    return "\n".join(lines)


def write_csv(path: Path, records: list[dict[str, Any]]) -> None:
    """Like the benchmark's CSV, but floats with 6 significant digits (errors go down to 1e-6)."""
    import csv

    def cell(value: Any) -> Any:
        if value is None:
            return ""
        if isinstance(value, bool):
            return "true" if value else "false"
        return f"{value:.6g}" if isinstance(value, float) else value

    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for rec in records:
            writer.writerow({k: cell(rec.get(k)) for k in CSV_COLUMNS})


def run_app(cfg: Any, command: str) -> int:
    from omegaconf import OmegaConf

    from mesa_train.bench import report as bench_report

    check_switches(cfg, ("dry_run", "progress"))
    preset = cfg.preset if isinstance(cfg.preset, dict) else OmegaConf.to_container(cfg.preset, resolve=True)
    spec = parse_spec(dict(preset))
    check_models(spec)
    threads = cfg.get("threads")
    if threads:
        torch.set_num_threads(int(threads))
    if cfg.get("dry_run"):
        print(f"preset {spec.name}: {len(spec.models)} models x {len(spec.rows)} rows, {spec.passes} passes, "
              f"batch {spec.batch_size}, {spec.img_size}px")
        for m in spec.models:
            print(f"  model {m.label}: {m.model} {m.kwargs or ''} "
                  f"rows: {'all' if m.rows is None else ', '.join(m.rows)}")
        for r in spec.rows:
            print(f"  {r.label:<32} {r.options()}")
        return 0

    def say(msg, bar=None):
        (bar.write if bar is not None and not bar.disable else print)(msg, file=sys.stderr)

    env = bench_report.environment(torch.device("cpu"))
    load_start, started = os.getloadavg(), time.perf_counter()
    records = measure_all(spec, bool(cfg.get("progress", True)), say)
    wall, load_end = time.perf_counter() - started, os.getloadavg()
    for r in records:
        r.update({k: env.get(k) for k in ("device", "torch", "timm", "git", "date")})
    facts = [f"{torch.get_num_threads()} thread(s)", f"wall time {wall:.0f} s",
             f"load average {load_start[0]:.2f} at the start, {load_end[0]:.2f} at the end (1-minute; "
             f"{os.cpu_count()} CPUs)"]
    out_dir = Path(cfg.get("output_dir") or "results") / spec.name
    out_dir.mkdir(parents=True, exist_ok=True)
    md = markdown(spec, records, env, command, facts)
    (out_dir / "cpu.md").write_text(md)
    write_csv(out_dir / "cpu.csv", records)
    (out_dir / "cpu.json").write_text(json.dumps({"preset": preset, "environment": env, "command": command,
                                                  "wall_s": wall, "rows": records}, indent=2, default=str))
    bench_report.write_index(out_dir.parent)
    print(md)
    say("wrote " + ", ".join(str(out_dir / f"cpu.{k}") for k in ("md", "csv", "json")))
    return 1 if any(r["status"] != "ok" for r in records) else 0


def main() -> None:
    """``python -m mesa_train.bench.gradient_fidelity [preset=gradients|gradients-quick] ...``
    (overrides: output_dir=DIR, threads=N, dry_run=true, progress=false, preset.passes=N)."""
    import shlex

    import hydra

    from mesa_train.hydra_cli import exit_on_bad_overrides

    config_dir = str(Path(__file__).resolve().parents[2] / "configs" / "bench" / "gradients")
    exit_on_bad_overrides(config_dir, "config", prefix="mesa_train.bench.gradient_fidelity: error: ")

    @hydra.main(version_base="1.3", config_path=config_dir, config_name="config")
    def _app(cfg) -> None:
        from hydra.core.hydra_config import HydraConfig

        overrides = list(HydraConfig.get().overrides.task)
        command = ("python -m mesa_train.bench.gradient_fidelity "
                   + " ".join(shlex.quote(o) for o in overrides)).strip()
        try:
            code = run_app(cfg, command)
        except BenchConfigError as err:
            print(f"mesa_train.bench.gradient_fidelity: error: {err}", file=sys.stderr, flush=True)
            sys.exit(2)
        sys.exit(code)

    _app()


if __name__ == "__main__":
    main()
