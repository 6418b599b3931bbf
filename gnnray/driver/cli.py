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


def exit_now(code: int) -> None:
    """End the job's process with ``code`` once its output is written: Ray shut down (a local cluster's
    processes stopped), then no interpreter teardown. At exit Ray would first sleep 0.5 s for its workers' last
    lines (a finished run's have arrived), and tearing down torch's, numba's and Ray's modules takes 1.5-2 s
    more on 2 cores (docs/performance.md#start-up-and-the-end-of-a-run-a-whole-runs-fixed-cost); nothing is left to flush by then."""
    import logging
    import os

    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    ray = sys.modules.get("ray")  # not imported: a bad option found before Ray started
    if ray is not None and ray.is_initialized():
        ray.shutdown()
    os._exit(code)


def _training_failed() -> type:
    """Ray Train's ``TrainingFailedError``, imported only when something was raised: the driver starts Ray before
    it imports Ray Train (see ``gnnray.driver.launch.load_and_publish``)."""
    import ray.train

    return ray.train.TrainingFailedError
