"""Training pieces, free of Hydra (train.py composes the config and calls ``runner.fit``):

    config.py       start-up checks, derived values (learning rate, Mesa options)
    data.py         datasets (checked: class lists, labels, unreadable files), timm transforms,
                    resumable samplers, loaders, mixup
    model.py        timm model (+ local pretrained weights) + Mesa patching from a config
    engine.py       train_one_epoch (non-finite stop/skip, graceful stop), evaluate
    checkpoint.py   atomic checkpoints, RNG states, compatibility / changed-settings errors
    rundir.py       run directory ownership (lock), no accidental overwrite, .hydra/ record
    signals.py      Ctrl-C / SIGTERM: stop at the next step and save last.pt
    errors.py       exception types, one-line messages and exit codes
    distributed.py  torchrun / process group helpers
    loggers.py      CSV / JSONL / wandb logs
    logfile.py      the run's log file handler (lazy, tolerant of unwritable directories)
    runner.py       fit(): one training run
    sweep.py        summary table of a Hydra sweep (failed jobs included)
"""
