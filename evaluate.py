"""Evaluate a checkpoint written by train.py: top-1 / top-5 on a validation set.

    python evaluate.py checkpoint=outputs/2025-01-01/12-00-00/checkpoints/best.pt
    python evaluate.py checkpoint=PATH data=cifar100 data.root=data/cifar100 ema=true

The model (architecture and Mesa layout) comes from the config stored in the checkpoint;
the data group defaults to the checkpoint's too. Prints the metrics and writes them to
<output>/eval.json (default: this call's Hydra run directory).
"""
import json
import logging
import os
import sys

import hydra
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger("evaluate")


@hydra.main(config_path="configs", config_name="eval", version_base="1.3")
def main(cfg: DictConfig) -> float:
    from hydra.core.hydra_config import HydraConfig

    from mesa_train.train.checkpoint import CheckpointError
    from mesa_train.train.config import ConfigError
    from mesa_train.train.data import DataError
    from mesa_train.train.evaluation import evaluate_checkpoint

    output = cfg.output or HydraConfig.get().runtime.output_dir
    data = OmegaConf.to_container(cfg.data, resolve=True) if cfg.get("data") is not None else None
    try:
        metrics = evaluate_checkpoint(
            cfg.checkpoint, data=data, ema=cfg.ema, batch_size=cfg.batch_size,
            num_workers=cfg.num_workers, device=cfg.device, amp=cfg.amp,
        )
    except (ConfigError, DataError, CheckpointError) as err:
        log.error("%s", err)
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    os.makedirs(output, exist_ok=True)
    path = os.path.join(output, "eval.json")
    with open(path, "w") as f:
        json.dump(metrics, f, indent=2)
    print(f"top1 {metrics['top1']:.2f}  top5 {metrics['top5']:.2f}  loss {metrics['loss']:.4f}  "
          f"({metrics['images']} images, {'EMA' if cfg.ema else 'model'} weights) -> {path}")
    return metrics["top1"]


if __name__ == "__main__":
    main()
