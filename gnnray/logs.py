"""Console logging of Ray's own records, shared by the driver and the train workers."""

from __future__ import annotations

import logging

def quiet_console(logger: str, verbose: bool) -> None:
    """Raise the console handlers of ``logger`` to WARNING unless ``verbose``; file handlers keep every record."""
    level = logging.INFO if verbose else logging.WARNING
    for handler in logging.getLogger(logger).handlers:
        if not isinstance(handler, logging.FileHandler):
            handler.setLevel(level)

