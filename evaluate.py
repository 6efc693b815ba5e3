"""Evaluate a checkpoint written by train.py: top-1 / top-5 on a validation set.

    python evaluate.py checkpoint=outputs/2025-01-01/12-00-00/checkpoints/best.pt
    python evaluate.py checkpoint=outputs/my_fsdp_run/checkpoints/last.dcp   # sharded (FSDP): read whole
    python evaluate.py checkpoint=PATH data=cifar100 data.root=data/cifar100 ema=true
    python evaluate.py checkpoint=PATH data.root=/elsewhere/imagenet trainer.batch_size=256

The model (architecture and Mesa layout) comes from the config stored in the checkpoint;
the data too, unless a data group or single data.* values are given. Options share
train.py's names (trainer.batch_size, trainer.num_workers, trainer.device, trainer.amp).
Prints the metrics and writes them to <output>/eval.json (default: this call's Hydra run
directory, next to evaluate.log).
"""
import json
import logging
import os
import sys
import time

import hydra
from omegaconf import DictConfig, OmegaConf

from mesa_train.hydra_cli import directory_problem, run_dir_before_hydra, exit_on_bad_overrides

log = logging.getLogger("evaluate")
_STARTED = time.time()  # (a run directory made after this is this call's)
_BEFORE_HYDRA = None  # (the way to the run directory before Hydra made it: __main__)


def _write_json(data: dict, path: str) -> None:
    """``path`` whole or not at all: a full disk leaves no empty eval.json behind."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(data, f, indent=2)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


@hydra.main(config_path="configs", config_name="eval", version_base="1.3")
def main(cfg: DictConfig) -> float:
    from hydra.core.hydra_config import HydraConfig

    from mesa_train.train import errors, rundir
    from mesa_train.train.evaluation import check_eval_settings, evaluate_checkpoint
    from mesa_train.train.logfile import log_to_file

    run_dir = HydraConfig.get().runtime.output_dir
    if OmegaConf.is_missing(cfg, "checkpoint") or not cfg.checkpoint:
        print("error: evaluate.py needs checkpoint=PATH (a last.pt or best.pt written by train.py, e.g. "
              "outputs/<date>/<time>/checkpoints/best.pt); see python evaluate.py --help", file=sys.stderr)
        rundir.remove_if_left_empty(run_dir, _STARTED, _BEFORE_HYDRA)  # (Hydra made it: nothing is left behind)
        sys.exit(2)
    output = cfg.output or run_dir
    data = OmegaConf.to_container(cfg.data, resolve=True) if cfg.get("data") is not None else None
    trainer = OmegaConf.to_container(cfg.trainer, resolve=True)
    accepted = []

    def on_accept(run_cfg, images: int) -> None:  # (the first record opens evaluate.log)
        accepted.append(True)
        log.info("evaluating %s (%s weights, model %s) on %d images of %s", cfg.checkpoint,
                 "EMA" if cfg.ema else "model", run_cfg.model.name, images, run_cfg.data.name)

    problem = directory_problem(output, "the output folder")  # (before the pass over the data, not after)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        rundir.remove_if_left_empty(run_dir, _STARTED, _BEFORE_HYDRA)
        sys.exit(1)
    try:
        check_eval_settings(cfg)
        metrics = evaluate_checkpoint(cfg.checkpoint, data=data, ema=cfg.ema, trainer=trainer, on_accept=on_accept)
        os.makedirs(output, exist_ok=True)
        path = os.path.join(output, "eval.json")
        _write_json(metrics, path)
    except Exception as err:  # noqa: BLE001
        described = errors.describe(err)
        if described is None:
            raise
        print(f"error: {described[1]}", file=sys.stderr)
        if accepted:
            log_to_file("evaluate", f"error: {described[1]}")  # (how the evaluation ended)
        else:  # refused before it began: no log, no directory left behind
            rundir.remove_if_left_empty(run_dir, _STARTED, _BEFORE_HYDRA)
        sys.exit(described[0])
    log.info("top1 %.2f  top5 %.2f  loss %.4f  (%d images of %s, step %d, amp %s) -> %s", metrics["top1"],
             metrics["top5"], metrics["loss"], metrics["images"], metrics["data"], metrics["step"],
             metrics["amp"], path)
    print(f"top1 {metrics['top1']:.2f}  top5 {metrics['top5']:.2f}  loss {metrics['loss']:.4f}  "
          f"({metrics['images']} images, {'EMA' if cfg.ema else 'model'} weights) -> {path}")
    return metrics["top1"]


if __name__ == "__main__":
    # (a full disk under the run directory fails every log record's write: the one error line
    # below says so, not logging's traceback for each record)
    logging.raiseExceptions = False
    configs = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
    exit_on_bad_overrides(configs, "eval")
    _BEFORE_HYDRA = run_dir_before_hydra(configs, "eval")
    main()
