"""Train a timm vision transformer, with or without Mesa (Hydra entry point).

    python train.py model=deit_ti data=cifar100 data.root=data/cifar100 'mesa.ops=[gelu,softmax]'
    python train.py experiment=cifar100_deit_ti_mesa            # a paper setting
    torchrun --nproc_per_node=8 train.py experiment=imagenet_deit_ti_mesa data.root=/data/imagenet
    python train.py -m mesa.decay=0,0.9,0.99 trainer.max_steps=100   # sweep + summary table

Configs live in configs/ (see configs/train.yaml); the work is done by
mesa_train.train.runner.fit. Logs, checkpoints and the resolved config go to the run
directory (outputs/<date>/<time>/, or hydra.run.dir=...).
"""
import logging
import sys

import hydra
from omegaconf import DictConfig

from mesa_train.train import distributed

log = logging.getLogger("train")


def _prepare_ranks() -> None:
    """Under torchrun: join the process group and share rank 0's run directory stamp;
    ranks > 0 keep Hydra from writing .hydra/ and a log file into that shared directory."""
    if distributed.init_from_env():
        distributed.share_run_stamp()
        if distributed.env_rank() != 0:
            sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=stdout"]


@hydra.main(config_path="configs", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    from hydra.core.hydra_config import HydraConfig

    from mesa_train.train.checkpoint import CheckpointError
    from mesa_train.train.config import ConfigError
    from mesa_train.train.data import DataError
    from mesa_train.train.runner import fit

    try:
        summary = fit(cfg, HydraConfig.get().runtime.output_dir)
    except (ConfigError, DataError, CheckpointError) as err:
        # A user error: one clear message, no traceback, non-zero exit, no checkpoint.
        log.error("%s", err)
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    return summary.get("top1")  # the objective for Hydra sweepers (e.g. Optuna)


if __name__ == "__main__":
    _prepare_ranks()
    try:
        main()
    finally:
        distributed.cleanup()
