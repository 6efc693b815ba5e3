"""The run's log file (mesa_train/train/logfile.py): a run that trainer.overwrite=true replaces
leaves no lines behind (they came first, with nothing between the two runs), and this
process's own lines stay, also those written before the directory was cleared."""
import logging

import pytest

from mesa_train.train import rundir
from mesa_train.train.logfile import SafeFileHandler


@pytest.fixture
def run_log(tmp_path):
    (tmp_path / "train.log").write_text("old run line 1\nold run line 2\n")
    (tmp_path / "metrics.csv").write_text("epoch,step\n0,2\n")  # (an earlier run's artifact)
    handler = SafeFileHandler(str(tmp_path / "train.log"))
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger()
    logger.addHandler(handler)
    yield tmp_path, logging.getLogger("mesa_train.test_run_log_file")
    logger.removeHandler(handler)
    handler.close()


def _lines(folder):
    return (folder / "train.log").read_text().splitlines()


@pytest.mark.parametrize("before", [False, True])
def test_overwrite_drops_the_replaced_runs_lines_and_keeps_this_ones(run_log, before):
    folder, log = run_log
    log.setLevel(logging.INFO)
    if before:  # (train.py's warning about ignored mesa overrides comes before the clear)
        log.warning("this run, before the clear")
    rundir.refuse_or_clear(str(folder), overwrite=True)
    assert not (folder / "metrics.csv").exists()
    log.warning("this run, after the clear")
    assert _lines(folder) == ["this run, before the clear"] * before + ["this run, after the clear"]


def test_a_resumed_run_appends_to_its_log(run_log):
    folder, log = run_log
    log.warning("resumed")
    assert _lines(folder) == ["old run line 1", "old run line 2", "resumed"]
