"""``python -m mesa_train.bench preset=NAME [key=value ...]``

Presets: see ``configs/bench/preset/`` (``preset=auto``, the default, picks ``table1``
when CUDA is available and ``cpu-quick`` otherwise). Useful overrides: ``device=cpu``,
``output_dir=DIR``, ``only=SUBSTRING`` (or ``[A,B]``), ``skip=SUBSTRING`` (or ``[A,B]``),
``dry_run=true``, ``allow_cpu=true``, ``preset.common.batch_size=N``,
``preset.search.cap_gb=24``, ``profile=true`` (also
write ``<device>.profile.{md,csv}``: where the time of each row's step goes).
Exit status: 0 ok, 1 a configuration failed while running, 2 a bad configuration (the
message names the valid choices), 3 Mesa is not importable.
"""
from __future__ import annotations

import os
import shlex
import sys

import hydra
from omegaconf import DictConfig

from mesa_train.bench import CONFIG_DIR
from mesa_train.hydra_cli import exit_on_bad_overrides


def _error(msg: str, code: int) -> None:
    print(f"mesa_train.bench: error: {msg}", file=sys.stderr, flush=True)
    sys.exit(code)


# environment variables that change what a run measures (compile times with a cold or warm
# Inductor cache, the compiled compression kernels): the recorded command names them
_RECORDED_ENV = ("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "TORCHINDUCTOR_CACHE_DIR", "MESA_COMPILE_KERNELS")


def _environment_prefix() -> str:
    return "".join(f"{k}={shlex.quote(os.environ[k])} " for k in _RECORDED_ENV if os.environ.get(k))


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from mesa_train.bench.measure import MesaUnavailable
    from mesa_train.bench.presets import BenchConfigError, check_switches
    from mesa_train.bench.runner import run_app

    overrides = list(HydraConfig.get().overrides.task)
    if cfg.preset.get("name") == "auto":
        cfg = _resolve_auto(cfg, overrides)
        overrides = [o for o in overrides if not o.startswith("preset=")] + [f"preset={cfg.preset.name}"]
    command = _environment_prefix() + "python -m mesa_train.bench " + " ".join(shlex.quote(o) for o in overrides)
    try:
        check_switches(cfg, ("allow_cpu", "dry_run", "progress", "process_warmup", "profile"))
        if cfg.preset.get("kind") == "planner":  # the planner's frontier (mesa_train/bench/planner.py)
            from mesa_train.bench.planner import run_planner

            code = run_planner(cfg, command=command.strip())
        else:
            code = run_app(cfg, command=command.strip())
    except BenchConfigError as err:
        _error(str(err), 2)
    except MesaUnavailable as err:
        _error(str(err), 3)
    sys.exit(code)


def _resolve_auto(cfg: DictConfig, overrides: list[str]) -> DictConfig:
    """preset=auto: a GPU preset when CUDA is visible (and device is not cpu), else cpu-quick."""
    import torch
    from hydra import compose

    device = str(cfg.get("device") or "auto")
    on_gpu = torch.cuda.is_available() and not device.startswith("cpu")
    target = cfg.preset.on_cuda if on_gpu else cfg.preset.on_cpu
    print(f"preset=auto -> preset={target} ({'CUDA' if on_gpu else 'no CUDA device'})", file=sys.stderr)
    rest = [o for o in overrides if not o.startswith("preset=")]
    return compose(config_name="config", overrides=[f"preset={target}", *rest])


if __name__ == "__main__":
    exit_on_bad_overrides(CONFIG_DIR, "config", prefix="mesa_train.bench: error: ")
    main()
