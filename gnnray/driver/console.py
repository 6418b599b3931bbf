"""What a run prints: the graph, a progress bar per epoch on a terminal, one line per epoch, restarts, resizes,
the summary.

Rank 0 appends each epoch's metrics to ``metrics.jsonl`` and rewrites a small
progress file during the epoch; an elastic run's worker groups log their starts
and preemption notices to ``workers.jsonl``; :class:`EpochPrinter` follows them
from a thread on the driver, reading them where the run keeps them (a directory
or an object store, ``gnnray.run_storage``): the driver needs no disk shared with
the workers. Ray's own INFO logs (Train's per-report lines, Data's
execution plans) go to Ray's session logs instead of the console
(:func:`quiet_ray`); its warnings and errors still show.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Optional

from gnnray import run_storage
from gnnray.logs import quiet_console
from gnnray.run_storage import METRICS_LOG, PROGRESS_FILE, WORKERS_LOG


def say(line: str) -> None:
    """Print one of the run's own lines."""
    print(line, flush=True)


def graph_line(graph, feat_dim: Optional[int] = None, feat_bytes: int = 0) -> str:
    """The graph's one line; ``feat_dim`` and ``feat_bytes`` when its features are sharded (not in ``graph``)."""
    dim = graph.feat_dim if feat_dim is None else feat_dim
    return (f"graph {graph.name}: {graph.num_nodes:,} nodes, {graph.num_edges:,} edges, {dim} features, "
            f"{graph.num_classes} classes, train/valid/test {len(graph.train_idx):,}/{len(graph.valid_idx):,}/"
            f"{len(graph.test_idx):,}, {(graph.nbytes + feat_bytes) / 2**20:.1f} MiB")


def cluster_line(local: bool, gcs_address: str, dashboard_url: str, nodes: int, checked: int,
                 stack: dict) -> str:
    """The line naming the run's cluster, its dashboard and the stack checked on its nodes."""
    where = "local cluster" if local else "cluster"
    versions = ", ".join(f"{k} {v}" for k, v in stack.items())
    return (f"ray: {where} {gcs_address}, {nodes} node{'s' if nodes != 1 else ''} ({versions} on "
            f"{'every node' if checked == nodes else f'{checked} of them'}), dashboard "
            + (f"http://{dashboard_url}" if dashboard_url else "off"))


# What the driver prints of other processes' logs, yet reads like a failure or is noise, matched in each line;
# their own log files keep them (``worker-*.err`` in the session's logs).
RAY_WORKER_NOISE = (
    # Ray Data puts every actor pool's function into the object store and passes it to its actors as a
    # constructor argument, with restarts on (ray-project/ray#53727): logged for every pool, whatever it holds.
    r"has constructor arguments in the object store and max_restarts > 0",
    # Ray Data's hint on how to turn on the progress bars gnnray turned off on purpose, and its INFO line
    # at the end of a stream (the split coordinator's console is its .err file).
    r"Progress bars disabled\. To enable",
    r"Dataset \S+ execution finished in ",
    # The raylet's notice to every driver that more worker processes start at once than the node has cores:
    # gnnray starts its train workers and sampler actors together on purpose.
    r"PYTHON worker processes have been started on node",
    # Ray Train's placement-group cleaner asks the state API, which the dashboard serves, whether the controller
    # lives, every second: where the cluster has no dashboard ("dashboard off" on the cluster line) it never can.
    r"Failed to query Ray Train Controller actor state",
    # A raylet's error, every 10 s while it runs, that its spill disk is past Ray's threshold: said once, with
    # what to do, by the run's own warning (gnnray.driver.preflight.full_disks).
    r"file_system_monitor\.cc:\d+: .* is over \S+% full, available space",
)


def quiet_ray(verbose: bool) -> None:
    """Keep Ray's INFO records and its noise out of this process's console, unless ``verbose``.

    Ray Data's records here go to its log file (``ray-data.log`` in the
    session's logs). The DataContext travels with the datasets, so the
    processes that execute them skip the execution plans too. Lines of
    :data:`RAY_WORKER_NOISE` in other processes' logs are not printed here
    (Ray's log deduplicator skips them; with ``RAY_DEDUP_LOGS=0`` they show).
    """
    import ray.data

    # Dropped too: its hint on how to turn on the progress bars gnnray turned off on purpose.
    quiet_console("ray.data", verbose, drop="Progress bars disabled")
    ray.data.DataContext.get_current().print_on_execution_start = verbose
    skip_ray_noise(verbose)


def skip_ray_noise(verbose: bool) -> None:
    """Leave the lines of :data:`RAY_WORKER_NOISE` that other processes log out of this process's console,
    unless ``verbose``; called before Ray starts too, since a new raylet logs at once."""
    import re

    from gnnray import ray_internals

    if verbose:
        return
    noise = "|".join(RAY_WORKER_NOISE)
    for dedup in ray_internals.log_deduplicators():  # what prints other processes' lines here
        user = dedup.skip_re.pattern if dedup.skip_re else ""  # the user's RAY_DEDUP_LOGS_SKIP_REGEX
        if noise not in user:
            dedup.skip_re = re.compile(f"{user}|{noise}" if user else noise)


def epoch_line(m: dict, eta_s: Optional[float] = None, workers: bool = False) -> str:
    """The driver's per-epoch line (grep-friendly ``key=value`` pairs), with ``eta=`` when ``eta_s`` is given and
    ``workers=`` (the epoch's world size) with ``workers``."""
    line = (f"epoch={m['epoch']} loss={m['loss']:.4f} train_acc={m['train_acc']:.4f} val_acc={m['val_acc']:.4f} "
            f"seeds_per_s={m['seeds_per_s']:.0f} data_wait={m['data_wait']:.2f} epoch_time={m['epoch_time']:.1f}s")
    line += f" eta={eta_s:.0f}s" if eta_s is not None else ""
    line += f" workers={m['world_size']}" if workers and "world_size" in m else ""
    return line + (f" test_acc={m['test_acc']:.4f}" if "test_acc" in m else "")


def worker_line(event: dict, before: Optional[int], preempted: list[str]) -> str:
    """An elastic run's line for a worker-group start (``event`` from ``workers.jsonl``).

    ``before``: the previous group's world size (``None``: the first start);
    ``preempted``: nodes of preemption notices the previous group saw.
    """
    where = f"at epoch {event['epoch']} step {event['step']}"
    now = event["world_size"]
    if before is None:
        return f"workers: started {now}, {where}"
    if now > before:
        why = "grew: nodes joined"
    elif now < before and preempted:
        why = f"shrank: node{'s' if len(preempted) > 1 else ''} {', '.join(n[:8] for n in preempted)} drained"
    elif now < before:
        why = "shrank: a node or a worker was lost"
    else:
        why = "restarted: a worker failed" + (f" or node {', '.join(n[:8] for n in preempted)} drained"
                                              if preempted else "")
    return f"workers: {before} -> {now} ({why}), resuming {where}"


def preemption_line(event: dict) -> str:
    """The line of a preemption notice that rank 0 logged."""
    nodes = ", ".join(n[:8] for n in event["nodes"])
    deadline = event.get("deadline_ms")
    left = f"in {deadline / 1000 - event['time']:.0f}s" if deadline else "with no deadline"
    return (f"preemption: node {nodes} drains {left}; checkpoint at epoch {event['epoch']} step {event['step']}, "
            f"then the group restarts without it")


class EpochPrinter:
    """Print one line per epoch as rank 0 appends to the metrics log, and a progress bar on a terminal.

    Args:
        run_dir: The run's directory or URI (``metrics.jsonl`` and the progress file).
        epochs: Epochs of the run, for the ETA.
        workers: An elastic run's ``--num-workers`` (MIN, MAX): also print its
            worker-group starts, resizes and preemption notices (``workers.jsonl``).
        bar: Draw the progress bar (default: when stdout is a terminal).
    """

    def __init__(self, run_dir: str, epochs: int, workers: Optional[tuple] = None, bar: Optional[bool] = None):
        self._path = run_storage.join(run_dir, METRICS_LOG)
        self._progress = run_storage.join(run_dir, PROGRESS_FILE)
        self._epochs = epochs
        self._bar = sys.stdout.isatty() if bar is None else bar
        self._drawn = False
        self._seen: list[float] = []  # when the driver saw each epoch's line
        self._metrics = Tail(self._path)
        self._elastic = workers is not None
        self._workers_log = Tail(run_storage.join(run_dir, WORKERS_LOG))
        self._world: Optional[int] = None  # the last group's world size
        self._preempted: list[str] = []  # nodes drained since the last group started
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
            for _ in range(3 if stopping else 1):  # the last poll must not lose the run's last lines
                try:
                    self._print_new()
                    break
                except OSError:  # an object store failed a request: its lines come at the next poll
                    time.sleep(0.5 if stopping else 0)
            if self._bar and not stopping:
                self._draw_bar()
            if stopping:
                return

    def _print_new(self) -> None:
        if self._elastic:  # a group's start comes before its epochs' lines
            for event in self._workers_log.new():
                self._clear_bar()
                if event["event"] == "start":
                    say(worker_line(event, self._world, self._preempted))
                    self._world, self._preempted = event["world_size"], []
                elif event["event"] == "preempted":
                    self._preempted += [n for n in event["nodes"] if n not in self._preempted]
                    say(preemption_line(event))
        for m in self._metrics.new():
            self._clear_bar()
            say(epoch_line(m, self._eta(m), self._elastic))

    def _draw_bar(self, width: int = 30) -> None:
        try:
            epoch, step, steps = map(int, run_storage.read_bytes(self._progress).split())
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


class Tail:
    """The complete JSON lines appended to a file or object since this object was made (or since its last
    :meth:`new`); only the bytes after those already seen are read."""

    def __init__(self, location: str):
        self._location = location
        self._offset = run_storage.size(location) or 0

    def new(self) -> list[dict]:
        data = run_storage.read_from(self._location, self._offset)
        complete = data[: data.rfind(b"\n") + 1]  # a line still being written waits for the next poll
        self._offset += len(complete)
        return [json.loads(line) for line in complete.decode().splitlines()]
