"""Console logging of Ray's own records, shared by the driver and the train workers."""

from __future__ import annotations

import logging


def quiet_console(logger: str, verbose: bool, drop: str = "") -> None:
    """Raise the console handlers of ``logger`` to WARNING unless ``verbose``; file handlers keep every record.

    ``drop``: also keep console records containing this text off (once per handler).
    """
    level = logging.INFO if verbose else logging.WARNING
    for handler in logging.getLogger(logger).handlers:
        if isinstance(handler, logging.FileHandler):
            continue
        handler.setLevel(level)
        if drop and not verbose and not any(getattr(f, "drops", None) == drop for f in handler.filters):
            handler.addFilter(_Drop(drop))


class _Drop(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.drops = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.drops not in record.getMessage()


def drop_records(logger: str, text: str) -> None:
    """Drop the records of ``logger`` whose message contains ``text`` (a filter on the logger, added once)."""
    log = logging.getLogger(logger)
    if not any(getattr(f, "drops", None) == text for f in log.filters):
        log.addFilter(_Drop(text))
