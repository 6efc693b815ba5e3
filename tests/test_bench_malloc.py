"""The CPU bench's glibc settings (mesa_train.bench.measure.CpuRss): the memory step runs
with malloc returning freed tensors to the OS (RSS follows live tensors), the timed steps
with heap reuse as in an ordinary run (page faults on every large tensor slowed steps by
1.4-1.7x and Mesa more than stock)."""
from __future__ import annotations

import torch

from mesa_train.bench import measure
from mesa_train.bench.presets import RowConfig

ROW = dict(model="deit_ti", batch_size=2, img_size=32, num_classes=3, amp="fp32", warmup=1, steps=2,
           model_kwargs={"depth": 1, "embed_dim": 24, "patch_size": 16})


class _FakeLibc:
    def __init__(self, log):
        self.log = log

    def mallopt(self, param, value):
        self.log.append((param, value))
        return 1

    def malloc_trim(self, pad):
        self.log.append(("trim", pad))
        return 1


def _settings(log):
    """The (mmap, trim) thresholds set, in order."""
    opts = [v for v in log if v[0] != "trim"]
    return [(opts[i][1], opts[i + 1][1]) for i in range(0, len(opts), 2)]


MEMORY, SPEED = (128 * 1024, 128 * 1024), (32 * 1024 * 1024, 64 * 1024 * 1024)


def test_cpu_rss_sets_both_thresholds():
    log = []
    rss = measure.CpuRss()
    rss.libc = _FakeLibc(log)
    rss.for_speed()
    rss.for_memory()
    assert log == [(measure.CpuRss._M_MMAP_THRESHOLD, SPEED[0]), (measure.CpuRss._M_TRIM_THRESHOLD, SPEED[1]),
                   (measure.CpuRss._M_MMAP_THRESHOLD, MEMORY[0]), (measure.CpuRss._M_TRIM_THRESHOLD, MEMORY[1])]


def test_memory_step_then_timed_steps_switch_settings(monkeypatch):
    log: list = []
    real_init = measure.CpuRss.__init__

    def init(self):
        real_init(self)
        self.libc = _FakeLibc(log)

    monkeypatch.setattr(measure.CpuRss, "__init__", init)
    result = measure.run_row(RowConfig(label="x", **ROW), torch.device("cpu"))
    assert result.status == "ok", result.error
    settings = _settings(log)
    # memory settings right before the memory step (after a trim), speed settings for the timed steps
    assert settings[-2:] == [MEMORY, SPEED], settings
    assert ("trim", 0) in log[log.index((measure.CpuRss._M_TRIM_THRESHOLD, MEMORY[1])):]
