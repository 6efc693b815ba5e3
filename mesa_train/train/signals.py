"""Graceful stop on Ctrl-C (SIGINT) or SIGTERM (cluster pre-emption).

Inside ``with StopSignal(device):`` the first signal only sets a flag; the training loop
asks ``requested()`` after each optimizer step, stops there, and the runner writes
``last.pt`` (a consistent state: an update boundary). A second signal raises
``KeyboardInterrupt`` at once (nothing saved). Under torchrun the ranks agree (one small
all-reduce every 10 steps), so all of them stop at the same step.
"""
from __future__ import annotations

import logging
import signal
import threading

import torch

from mesa_train.train import distributed as dist_utils

log = logging.getLogger("mesa_train.train")

SIGNALS = (signal.SIGINT, signal.SIGTERM)
DDP_CHECK_EVERY = 10


class StopSignal:
    def __init__(self, device: torch.device):
        self.device = device
        self.signum: int | None = None
        self._previous: dict = {}
        self._calls = 0

    def _handle(self, signum, _frame) -> None:
        if self.signum is not None:  # second signal: stop now
            raise KeyboardInterrupt
        self.signum = signum
        log.warning("%s: stopping after this optimizer step and saving last.pt (press Ctrl-C again to "
                    "abort without saving)", signal.Signals(signum).name)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def requested(self) -> bool:
        """Called after every optimizer step, by every rank. Under torchrun the ranks
        compare notes every ``DDP_CHECK_EVERY`` calls (a small all-reduce and a host sync:
        not every step)."""
        local = 1.0 if self.signum is not None else 0.0
        if dist_utils.world_size() == 1:
            return bool(local)
        self._calls += 1
        if self._calls % DDP_CHECK_EVERY:
            return False
        agreed = dist_utils.all_reduce_sum([local], self.device)[0] > 0
        if agreed and self.signum is None:
            self.signum = signal.SIGINT  # another rank was interrupted
        return agreed
