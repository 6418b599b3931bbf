"""Job runs read by several test modules: session fixtures, registered in conftest.py.

Every run costs half a minute of process start-up before its first step on a slow machine, so a run whose
results several modules check is made once: ``script_run`` (the command users run) serves tests/test_job.py
(its console, then a resume) and tests/test_metrics.py (its Prometheus metrics, scraped while it runs).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SYNTHETIC = ["--dataset", "synthetic", "--synthetic-nodes", "3000", "--synthetic-feat-dim", "16",
             "--fanouts", "5,5", "--batch-size", "128", "--hidden", "32", "--num-workers", "2",
             "--sample-on", "actors", "--sampler-actors", "1,2", "--eval", "sampled"]  # layer-wise inference: tests/inference/test_inference.py
SCRIPT_EPOCHS = 2


class Scraper:
    """Poll every alive node's metrics endpoint; keep the last value of each ``gnnray_`` sample of one run.

    Gauges of a process vanish from the endpoint some seconds after it exits,
    so the test scrapes while the job runs; counters stay.
    """

    def __init__(self, ray, run: str):
        self._ray, self._run = ray, run
        self.samples: dict[tuple, float] = {}  # (name without "ray_", sorted labels) -> value
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> "Scraper":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        while not self._stop.wait(1.0):
            self.scrape()

    def scrape(self) -> None:
        from prometheus_client.parser import text_string_to_metric_families

        for node in self._ray.nodes():
            if not node["Alive"]:
                continue
            url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
            try:
                body = urllib.request.urlopen(url, timeout=10).read().decode()
            except OSError:
                continue  # an agent still starting; the next poll retries
            # Only gnnray's lines are parsed: a node's whole body (Ray's ~1,000 lines) took 0.13 CPU-s to parse,
            # every second on each of four nodes a quarter of this 2-core machine, taken from the run scraped.
            ours = "".join(line + "\n" for line in body.splitlines() if "gnnray_" in line)
            for family in text_string_to_metric_families(ours):
                for s in family.samples:
                    name = s.name[len("ray_"):] if s.name.startswith("ray_") else s.name
                    if name.startswith("gnnray_") and s.labels.get("run") == self._run:
                        keep = {k: v for k, v in s.labels.items() if k in ("rank", "actor", "le")}
                        self.samples[(name, tuple(sorted(keep.items())))] = s.value

    def values(self, name: str, **labels) -> dict[tuple, float]:
        return {k: v for k, v in self.samples.items()
                if k[0] == name and all(dict(k[1]).get(a) == b for a, b in labels.items())}

    def total(self, name: str) -> float:
        return sum(self.values(name).values())


@dataclass
class ScriptRun:
    """A finished ``jobs/train_arxiv.py`` run: its process, run directory and arguments (without ``--epochs``),
    what it logged per epoch, its training set's size and its metrics as last scraped."""

    proc: subprocess.CompletedProcess
    address: str  # the cluster's, as RAY_ADDRESS gave it
    storage: Path
    name: str
    args: list
    logged: list
    n_train: int
    scraper: Scraper


@pytest.fixture(scope="session")
def script_run(ray_cluster, tmp_path_factory) -> ScriptRun:
    """``jobs/train_arxiv.py`` on SYNTHETIC for SCRIPT_EPOCHS epochs, a subprocess joined to the session's
    cluster, scraped while it runs. Its run directory may be resumed (tests/test_job.py) once this returned."""
    from gnnray.config import parse_args
    from gnnray.data.load import load_graph
    from gnnray.seeds import steps_per_epoch

    name = f"syn-{uuid.uuid4().hex[:8]}"  # metrics are labelled by run name
    storage = tmp_path_factory.mktemp("script")
    # An interval longer than the run: only the last epoch's checkpoint (tests/test_job.py resumes under 0).
    args = SYNTHETIC + ["--lr", "0.02", "--checkpoint-interval", "3600", "--storage-path", str(storage),
                        "--name", name]
    cfg = parse_args(args + ["--epochs", str(SCRIPT_EPOCHS)])
    n_train = len(load_graph(cfg.data).train_idx)
    workers = cfg.train.workers_min
    env = dict(os.environ, RAY_ADDRESS=ray_cluster.get_runtime_context().gcs_address)
    with Scraper(ray_cluster, name) as scraper:
        proc = subprocess.run([sys.executable, "jobs/train_arxiv.py", *args, "--epochs", str(SCRIPT_EPOCHS)],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        # Metrics reach the endpoint some seconds after they are recorded: wait for the last epoch's (the
        # epoch gauge is set last, after the other gauges of that epoch) and the final counts.
        deadline = time.monotonic() + 60
        while proc.returncode == 0 and time.monotonic() < deadline and not (
                scraper.total("gnnray_train_seeds_total") >= SCRIPT_EPOCHS * n_train
                and sorted(scraper.values("gnnray_train_epochs_completed").values()) == [SCRIPT_EPOCHS] * workers
                and scraper.total("gnnray_sampler_minibatches_total")
                >= SCRIPT_EPOCHS * steps_per_epoch(n_train, cfg.sampler.batch_size, workers) * workers):
            time.sleep(1)
    logged = [json.loads(line) for line in (storage / name / "metrics.jsonl").read_text().splitlines()] \
        if proc.returncode == 0 else []
    return ScriptRun(proc, env["RAY_ADDRESS"], storage, name, args, logged, n_train, scraper)
