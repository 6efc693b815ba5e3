"""``python -m mesa_train.bench.accuracy [preset=accuracy|accuracy-quick] [key=value ...]``

Useful overrides: ``jobs=N`` (parallel training processes), ``output_dir=DIR``,
``preset.seeds=[0,1,2]``, ``'preset.train=[trainer.epochs=5]'``, ``dry_run=true``,
``keep_runs=DIR`` (keep every run's logs and checkpoints), ``progress=false``.
Exit status: 0 ok, 1 a run failed, 2 a bad configuration (the message names the valid choices).
"""
from __future__ import annotations

import shlex
import sys

import hydra
from omegaconf import DictConfig

from mesa_train.bench.accuracy import CONFIG_DIR
from mesa_train.hydra_cli import exit_on_bad_overrides


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from mesa_train.bench.accuracy.app import run_app
    from mesa_train.bench.presets import BenchConfigError

    overrides = list(HydraConfig.get().overrides.task)
    command = ("python -m mesa_train.bench.accuracy " + " ".join(shlex.quote(o) for o in overrides)).strip()
    try:
        code = run_app(cfg, command=command)
    except BenchConfigError as err:
        print(f"mesa_train.bench.accuracy: error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    sys.exit(code)


if __name__ == "__main__":
    exit_on_bad_overrides(CONFIG_DIR, "config", prefix="mesa_train.bench.accuracy: error: ")
    main()
