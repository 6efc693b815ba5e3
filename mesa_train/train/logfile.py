"""The run's log file handler (Hydra's ``job_logging.handlers.file``, see configs/hydra).

Opened on the first record (``delay``), so a run rejected at start-up creates no log file
in an existing run directory; a directory it cannot write to does not make Hydra's logging
set-up fail with a traceback: records then only go to the console, and the run itself
reports "cannot write to <run dir>" in one line.
"""
from __future__ import annotations

import logging
import os
import sys


class SafeFileHandler(logging.FileHandler):
    def __init__(self, filename, mode="a", encoding=None, delay=True, errors=None):
        super().__init__(filename, mode=mode, encoding=encoding, delay=True, errors=errors)
        self._failed = False
        self._own_from = 0  # where this process's records begin in the file (it appends to a resumed run's)

    def emit(self, record: logging.LogRecord) -> None:
        if self._failed:
            return
        if self.stream is None:
            try:
                self._own_from = os.path.getsize(self.baseFilename) if os.path.exists(self.baseFilename) else 0
                self.stream = self._open()
            except OSError as err:
                self._failed = True
                print(f"warning: cannot write the log file {self.baseFilename} ({err.strerror})", file=sys.stderr)
                return
        super().emit(record)


    def drop_earlier_records(self) -> None:
        """Remove from the file what earlier processes wrote (a run ``trainer.overwrite=true``
        replaces), keeping this process's records; the stream appends, so it goes on at the end."""
        with self.lock:
            if self.stream is None:  # (nothing written yet: the file is all the earlier run's)
                if os.path.exists(self.baseFilename):
                    os.remove(self.baseFilename)
                return
            self.stream.flush()
            with open(self.baseFilename, "r+b") as f:
                f.seek(self._own_from)
                own = f.read()
                f.seek(0)
                f.write(own)
                f.truncate()
            self._own_from = 0


def drop_replaced_log(run_dir: str) -> None:
    """``trainer.overwrite=true``: the replaced run's lines leave this run's log file (they came
    first, with no mark between the runs); what this process logged stays."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, SafeFileHandler) and os.path.dirname(handler.baseFilename) == os.path.abspath(run_dir):
            try:
                handler.drop_earlier_records()
            except OSError as err:  # (the old lines stay: never stop a run for its log)
                print(f"warning: cannot remove the replaced run's lines from {handler.baseFilename} "
                      f"({err.strerror})", file=sys.stderr)


def log_to_file(name: str, message: str) -> None:
    """``message`` as an ERROR record of logger ``name`` in the run's log file only (the
    console has already shown it): how a run that had begun ended."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.emit(logging.LogRecord(name, logging.ERROR, __file__, 0, message, None, None))
