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
import sys
import time

import hydra
from omegaconf import DictConfig

from mesa_train.train import distributed
from mesa_train.hydra_cli import run_dir_before_hydra, exit_on_bad_overrides

log = logging.getLogger("train")
_STARTED = time.time()  # (a run directory made after this is this process's)
_BEFORE_HYDRA = None  # (the way to the run directory before Hydra made it: __main__)


def _prepare_ranks() -> None:
    """Under torchrun: join the process group and share rank 0's run directory stamp;
    ranks > 0 keep Hydra from writing .hydra/ and a log file into that shared directory."""
    if distributed.init_from_env():
        distributed.share_run_stamp()
        if distributed.env_rank() != 0:
            sys.argv += ["hydra.output_subdir=null", "hydra.job_logging.root.handlers=[console]"]


@hydra.main(config_path="configs", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from mesa_train.train import errors, rundir
    from mesa_train.train.config import ConfigError
    from mesa_train.train.logfile import log_to_file
    from mesa_train.train.config import ignored_mesa_overrides
    from mesa_train.train.runner import fit

    hydra_cfg = HydraConfig.get()
    run_dir = hydra_cfg.runtime.output_dir
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    ignored = ignored_mesa_overrides(cfg, hydra_cfg.overrides.task)
    if ignored is not None and distributed.env_rank() == 0:
        log.warning(ignored)
    accepted = []

    def on_accept():
        accepted.append(True)
        if multirun:  # (a refusal of an earlier sweep over this job's directory is history now)
            rundir.remove_file(rundir.refusal_record(run_dir))

    try:
        summary = fit(cfg, run_dir, on_accept=on_accept)
    except BaseException as err:  # noqa: BLE001 - every failure gets its line and exit code
        described = errors.describe(err)
        if described is None and not multirun:
            raise  # a bug: Hydra prints the traceback
        code, message = described if described is not None else (1, errors.one_line(err))
        if described is None:
            log.exception("job failed")
        rank = distributed.env_rank() if distributed.env_world_size() > 1 else 0
        # a config mistake or a stop signal is every rank's alike: said once; a rank's own failure (a
        # corrupt image in its shard, its checkpoint shard) by that rank
        alike = isinstance(err, (ConfigError, errors.Interrupted, KeyboardInterrupt))
        if rank == 0 or not alike:
            # one write, so that two ranks' lines do not run together
            sys.stderr.write(f"{f'[rank {rank}] ' if rank else ''}error: {message}\n")
            sys.stderr.flush()
        if accepted:
            log_to_file("train", f"error: {message}")
        if not multirun:
            if not accepted:
                rundir.remove_if_left_empty(run_dir, _STARTED, _BEFORE_HYDRA)
            sys.exit(code)
        stopped = code in (130, 143)  # Ctrl-C / SIGTERM: this job is interrupted (it resumes), not failed
        status = "interrupted" if stopped else "failed"
        if not accepted and rundir.existing_run(run_dir):  # (refused, or stopped before it was accepted, over
            # an earlier run: that run's folder is left as it was, the record goes beside it)
            rundir.write_failure(run_dir, message, path=rundir.refusal_record(run_dir), status=status)
        else:
            rundir.write_failure(run_dir, message, status=status)
        if stopped:  # the signal ends the sweep, with its summary so far
            from mesa_train.train.sweep import write_summary

            write_summary(str(hydra_cfg.sweep.dir), interrupted=True)
            sys.exit(code)
        return None
    return summary.get("top1")  # the objective for Hydra sweepers (e.g. Optuna)


if __name__ == "__main__":
    # (model=bogus, trainer.epochz=3: one line and exit 2, before Hydra makes a run directory)
    configs = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
    exit_on_bad_overrides(configs, "train")
    _BEFORE_HYDRA = run_dir_before_hydra(configs, "train")
    _prepare_ranks()
    try:
        main()
    finally:
        distributed.cleanup()
