"""What a run prints: the graph, a progress bar per epoch on a terminal, one line per epoch, restarts, the summary.

Rank 0 appends each epoch's metrics to ``metrics.jsonl`` and rewrites a small
progress file during the epoch; :class:`EpochPrinter` follows both from a
thread on the driver. Ray's own INFO logs (Train's per-report lines, Data's
execution plans) go to Ray's session logs instead of the console
(:func:`quiet_ray`); its warnings and errors still show.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Optional

from gnnray.logs import quiet_console
from gnnray.train.report import METRICS_LOG, PROGRESS_FILE


def say(line: str) -> None:
    """Print one of the run's own lines."""
    print(line, flush=True)


def graph_line(graph, feat_dim: Optional[int] = None, feat_bytes: int = 0) -> str:
    """The graph's one line; ``feat_dim`` and ``feat_bytes`` when its features are sharded (not in ``graph``)."""
    dim = graph.feat_dim if feat_dim is None else feat_dim
    return (f"graph {graph.name}: {graph.num_nodes:,} nodes, {graph.num_edges:,} edges, {dim} features, "
            f"{graph.num_classes} classes, train/valid/test {len(graph.train_idx):,}/{len(graph.valid_idx):,}/"
            f"{len(graph.test_idx):,}, {(graph.nbytes + feat_bytes) / 2**20:.1f} MiB")


def quiet_ray(verbose: bool) -> None:
    """Keep Ray Data's INFO records (execution plans, finish lines) out of this process's console.

    Its log file (``ray-data.log`` in the session's logs) keeps them. The
    DataContext travels with the datasets, so the processes that execute them
    skip the execution plans too.
    """
    import ray.data

    # Dropped too: its hint on how to turn on the progress bars gnnray turned off on purpose.
    quiet_console("ray.data", verbose, drop="Progress bars disabled")
    ray.data.DataContext.get_current().print_on_execution_start = verbose



def epoch_line(m: dict, eta_s: Optional[float] = None) -> str:
    """The driver's per-epoch line (grep-friendly ``key=value`` pairs), with ``eta=`` when ``eta_s`` is given."""
    line = (f"epoch={m['epoch']} loss={m['loss']:.4f} train_acc={m['train_acc']:.4f} val_acc={m['val_acc']:.4f} "
            f"seeds_per_s={m['seeds_per_s']:.0f} data_wait={m['data_wait']:.2f} epoch_time={m['epoch_time']:.1f}s")
    line += f" eta={eta_s:.0f}s" if eta_s is not None else ""
    return line + (f" test_acc={m['test_acc']:.4f}" if "test_acc" in m else "")


class EpochPrinter:
    """Print one line per epoch as rank 0 appends to the metrics log, and a progress bar on a terminal.

    Args:
        run_dir: The run's directory (``metrics.jsonl`` and the progress file).
        epochs: Epochs of the run, for the ETA.
        bar: Draw the progress bar (default: when stdout is a terminal).
    """

    def __init__(self, run_dir: str, epochs: int, bar: Optional[bool] = None):
        self._path = os.path.join(run_dir, METRICS_LOG)
        self._progress = os.path.join(run_dir, PROGRESS_FILE)
        self._epochs = epochs
        self._bar = sys.stdout.isatty() if bar is None else bar
        self._drawn = False
        self._seen: list[float] = []  # when the driver saw each epoch's line
        self._offset = os.path.getsize(self._path) if os.path.exists(self._path) else 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "EpochPrinter":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._clear_bar()

    def _run(self) -> None:
        while True:
            stopping = self._stop.wait(0.5)
            self._print_new()
            if self._bar and not stopping:
                self._draw_bar()
            if stopping:
                return

    def _print_new(self) -> None:
        if not os.path.exists(self._path):
            return
        with open(self._path, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        complete = data[: data.rfind(b"\n") + 1]  # a line still being written waits for the next poll
        self._offset += len(complete)
        for line in complete.decode().splitlines():
            m = json.loads(line)
            self._clear_bar()
            say(epoch_line(m, self._eta(m)))

    def _draw_bar(self, width: int = 30) -> None:
        try:
            with open(self._progress) as f:
                epoch, step, steps = map(int, f.read().split())
        except (OSError, ValueError):
            return
        done = int(width * step / max(steps, 1))
        sys.stdout.write(f"\repoch {epoch} [{'#' * done}{'.' * (width - done)}] {step}/{steps} steps")
        sys.stdout.flush()
        self._drawn = True

    def _clear_bar(self) -> None:
        if self._drawn:
            sys.stdout.write("\r\033[K")
            sys.stdout.flush()
            self._drawn = False

    def _eta(self, m: dict) -> Optional[float]:
        """Seconds until the last epoch ends: epochs left times the mean epoch seen so far.

        Between two lines the driver sees a whole epoch (training, evaluation,
        checkpoint); for the first line it has only rank 0's training time.
        """
        self._seen.append(time.monotonic())
        left = self._epochs - 1 - m["epoch"]
        if left <= 0:
            return None
        if len(self._seen) >= 2:
            return left * (self._seen[-1] - self._seen[0]) / (len(self._seen) - 1)
        return left * m["epoch_time"]
