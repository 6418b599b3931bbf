"""``jobs/train_arxiv.py``: parse options, run, print the summary; exit 0, 1 (training failed) or 2 (bad input)."""

from __future__ import annotations

import sys
from typing import Optional, Sequence

from gnnray.config import parse_args
from gnnray.errors import GnnrayError


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command-line entry point; returns the process exit code."""
    from gnnray.driver.failures import one_line
    from gnnray.driver.fit import run

    try:
        cfg = parse_args(argv)
        summary = run(cfg)
    except GnnrayError as e:
        print(f"gnnray: error: {e}", file=sys.stderr)
        return 2
    except _training_failed() as e:
        print(f"gnnray: training failed: {one_line(e)}", file=sys.stderr)
        return 1
    print(summary.line(), flush=True)
    return 0


def _training_failed() -> type:
    """Ray Train's ``TrainingFailedError``, imported only when something was raised: the driver starts Ray before
    it imports Ray Train (see ``gnnray.driver.launch.load_and_publish``)."""
    import ray.train

    return ray.train.TrainingFailedError
