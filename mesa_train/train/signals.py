"""Graceful stop on Ctrl-C (SIGINT) or SIGTERM (cluster pre-emption).

Inside ``with StopSignal(device):`` the first signal only sets a flag; the training loop
asks ``requested()`` after each optimizer step, stops there, and the runner writes
``last.pt`` (a consistent state: an update boundary). A second signal raises
``KeyboardInterrupt`` at once (nothing saved). Under torchrun the ranks agree (one small
all-reduce every few steps, and at each epoch's end), so all of them stop at the same step.
How many steps between checks follows the step time: about ``CHECK_SECONDS`` of training, at
most ``DDP_CHECK_EVERY`` steps (a fixed 10 let a run of 3 s steps train on past torchrun's and
SLURM's 30 s grace, killed before it saved); every rank computes the same number from the
all-reduced values.
"""
from __future__ import annotations

import logging
import signal
import threading
import time

import torch

from mesa_train.train import distributed as dist_utils

log = logging.getLogger("mesa_train.train")

SIGNALS = (signal.SIGINT, signal.SIGTERM)
DDP_CHECK_EVERY = 10
CHECK_SECONDS = 5.0


class StopSignal:
    def __init__(self, device: torch.device):
        self.device = device
        self.signum: int | None = None
        self._previous: dict = {}
        self._calls = 0
        self._next_check = 1  # (the first step's time sets the interval)
        self._last_check = time.perf_counter()

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
        compare notes every few calls (module doc: a small all-reduce and a host sync, not
        every step where steps are short)."""
        if dist_utils.world_size() == 1:
            return self.signum is not None
        self._calls += 1
        if self._calls < self._next_check:
            return False
        return self.agreed_now()

    def agreed_now(self) -> bool:
        """Whether any rank was signalled, asked of all ranks at the same point (every rank
        must call it there: a collective); also sets the number of steps to the next check."""
        local = 1.0 if self.signum is not None else 0.0
        if dist_utils.world_size() == 1:
            return bool(local)
        now = time.perf_counter()
        per_step = (now - self._last_check) / max(self._calls, 1)
        flags, seconds = dist_utils.all_reduce_sum([local, per_step], self.device)
        mean = seconds / dist_utils.world_size()
        self._next_check = max(1, min(DDP_CHECK_EVERY, int(CHECK_SECONDS / mean) if mean > 0 else DDP_CHECK_EVERY))
        self._calls, self._last_check = 0, now
        agreed = flags > 0
        if agreed and self.signum is None:
            self.signum = signal.SIGINT  # another rank was interrupted
        return agreed
