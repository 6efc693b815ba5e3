"""Training pieces, free of Hydra (train.py composes the config and calls ``runner.fit``):

    config.py       start-up checks, derived values (learning rate, Mesa options)
    data.py         datasets, timm transforms, resumable samplers, loaders, mixup
    model.py        timm model + Mesa patching from a config
    engine.py       train_one_epoch, evaluate
    checkpoint.py   atomic checkpoints, RNG states, compatibility errors
    distributed.py  torchrun / process group helpers
    loggers.py      CSV / JSONL / wandb logs
    runner.py       fit(): one training run
    sweep.py        summary table of a Hydra sweep
"""
