"""Train a timm vision transformer, with or without Mesa (Hydra entry point).

    python train.py model=deit_ti data=cifar100 data.root=data/cifar100 'mesa.ops=[gelu,softmax]'
    python train.py experiment=cifar100_deit_ti_mesa            # a paper setting
    torchrun --nproc_per_node=8 train.py experiment=imagenet_deit_ti_mesa data.root=/data/imagenet
    torchrun --nproc_per_node=8 train.py experiment=imagenet_deit_b_mesa trainer.strategy=fsdp ...  # FSDP2
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=HOST:29400 \
        --rdzv_id=RUN train.py trainer.strategy=fsdp ...      # on every node (configs/README.md)
    python train.py -m mesa.decay=0,0.9,0.99 trainer.max_steps=100   # sweep + summary table

Configs live in configs/ (see configs/train.yaml); the work is done by
mesa_train.train.runner.fit. Logs, checkpoints and the resolved config go to the run
directory (outputs/<date>/<time>/, or hydra.run.dir=...).

A run that fails for a known reason (bad value, missing data, disk full, non-finite loss,
Ctrl-C) prints one line ``error: ...`` and exits non-zero (see mesa_train/train/errors.py
for the codes). In a sweep (-m) a failed job is recorded (failed.json) and the sweep goes
on; the summary table marks it with its error and the sweep exits 1.
"""
import logging
import os
import re
import sys
import time

import hydra
from omegaconf import DictConfig

from mesa_train.train import distributed
from mesa_train.hydra_cli import exit_on_bad_overrides

log = logging.getLogger("train")
_STARTED = time.time()  # (a run directory made after this is this process's)


def _prepare_ranks() -> None:
    """Under torchrun: join the process group and share rank 0's run directory stamp;
    ranks > 0 keep Hydra from writing .hydra/ and a log file into that shared directory."""
    if distributed.init_from_env():
        distributed.share_run_stamp()
        if distributed.env_rank() != 0:
            sys.argv += ["hydra.output_subdir=null", "hydra.job_logging.root.handlers=[console]"]


def _remove_if_left_empty(run_dir: str) -> None:
    """A run refused at start-up writes nothing (.hydra/ comes after the checks), but Hydra has
    made its directory by then: remove it when it is empty and this process made it (a folder
    made earlier, even empty, stays), and in the default layout outputs/<date>/ and outputs/
    when those are left empty and new too. Under torchrun every rank tries; an error (another
    rank was first) is ignored."""
    folders = [run_dir]
    date_folder = os.path.dirname(run_dir)
    if re.fullmatch(r"\d{4}-\d{2}-\d{2}", os.path.basename(date_folder)):  # (the default layout's)
        folders += [date_folder] + ([os.path.dirname(date_folder)]
                                    if os.path.basename(os.path.dirname(date_folder)) == "outputs" else [])
    for folder in folders:
        try:
            if os.listdir(folder) or os.stat(folder).st_ctime < _STARTED - 1:
                return
            os.rmdir(folder)
        except OSError:
            return


def _log_to_file(message: str) -> None:
    """Put the final error into the run's log file too (the console already shows it)."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.emit(logging.LogRecord("train", logging.ERROR, __file__, 0, message, None, None))


@hydra.main(config_path="configs", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from mesa_train.train import errors, rundir
    from mesa_train.train.config import ignored_mesa_overrides
    from mesa_train.train.runner import fit

    hydra_cfg = HydraConfig.get()
    run_dir = hydra_cfg.runtime.output_dir
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    ignored = ignored_mesa_overrides(cfg, hydra_cfg.overrides.task)
    if ignored is not None and distributed.env_rank() == 0:
        log.warning(ignored)
    accepted = []
    try:
        summary = fit(cfg, run_dir, on_accept=lambda: accepted.append(True))
    except BaseException as err:  # noqa: BLE001 - every failure gets its line and exit code
        described = errors.describe(err)
        if described is None and not multirun:
            raise  # a bug: Hydra prints the traceback
        code, message = described if described is not None else (1, errors.one_line(err))
        if described is None:
            log.exception("job failed")
        print(f"error: {message}", file=sys.stderr, flush=True)
        if accepted:
            _log_to_file(f"error: {message}")
        if not multirun:
            if not accepted:
                _remove_if_left_empty(run_dir)
            sys.exit(code)
        rundir.write_failure(run_dir, message)
        if code in (130, 143):  # Ctrl-C / SIGTERM ends the sweep, with its summary so far
            from mesa_train.train.sweep import write_summary

            write_summary(str(hydra_cfg.sweep.dir))
            sys.exit(code)
        return None
    return summary.get("top1")  # the objective for Hydra sweepers (e.g. Optuna)


if __name__ == "__main__":
    # (model=bogus, trainer.epochz=3: one line and exit 2, before Hydra makes a run directory)
    exit_on_bad_overrides(os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs"), "train")
    _prepare_ranks()
    try:
        main()
    finally:
        distributed.cleanup()
