"""The run's log file handler (Hydra's ``job_logging.handlers.file``, see configs/hydra).

Opened on the first record (``delay``), so a run rejected at start-up creates no log file
in an existing run directory; a directory it cannot write to does not make Hydra's logging
set-up fail with a traceback: records then only go to the console, and the run itself
reports "cannot write to <run dir>" in one line.
"""
from __future__ import annotations

import logging
import sys


class SafeFileHandler(logging.FileHandler):
    def __init__(self, filename, mode="a", encoding=None, delay=True, errors=None):
        super().__init__(filename, mode=mode, encoding=encoding, delay=True, errors=errors)
        self._failed = False

    def emit(self, record: logging.LogRecord) -> None:
        if self._failed:
            return
        if self.stream is None:
            try:
                self.stream = self._open()
            except OSError as err:
                self._failed = True
                print(f"warning: cannot write the log file {self.baseFilename} ({err.strerror})", file=sys.stderr)
                return
        super().emit(record)


def log_to_file(name: str, message: str) -> None:
    """``message`` as an ERROR record of logger ``name`` in the run's log file only (the
    console has already shown it): how a run that had begun ended."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.emit(logging.LogRecord(name, logging.ERROR, __file__, 0, message, None, None))
