"""``python -m bench``: the whole runs against the DGL loop (or ``--sharding``), each guarded; the table, the JSON."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import shutil
import tempfile
import time
from pathlib import Path

import bench
from bench import sharding, wall
from bench.harness import DEFAULT_DATASET, RESULTS, Row, error_row, guarded, machine, report
from bench.settings import Settings, base_data_config, quick_data_config
from gnnray.data.load import load_graph
from gnnray.driver.console import graph_line

STAGES = ("wall",)
ORDER = (wall.FIGURE, sharding.FIGURE, "setup", "")
JSON = str(RESULTS / "benchmark.json")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench", description=bench.__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer epochs, short epochs")
    p.add_argument("--json", default=JSON, help="where to write all results")
    p.add_argument("--dataset", default=None,
                   help=f"graph directory, or 'synthetic' (when not given: {DEFAULT_DATASET} if present, else "
                   "synthetic)")
    p.add_argument("--cores", type=int, default=None,
                   help="cores both sides of the whole runs use: the DGL loop's threads, the train workers' CPUs, "
                   "and their --trainer-threads when fewer than the node's cores (when not given: all)")
    p.add_argument("--fanouts", type=lambda t: tuple(int(f) for f in t.split(",")), default=Settings.fanouts,
                   help="neighbors per layer, input layer first, in every figure (e.g. 10,10,10)")
    p.add_argument("--sharding", action="store_true",
                   help="run only the --feature-shards section, on a simulated cluster of 4 nodes (bench/sharding/); "
                   f"--json then defaults to {RESULTS / sharding.DEFAULT_JSON_NAME}")
    p.add_argument("--stages", default=",".join(STAGES), help="comma-separated stages to run, of " + ", ".join(STAGES))
    p.add_argument("--wall-repeats", type=int, default=Settings.wall_repeats,
                   help="interleaved rounds of the whole runs (wall stage); each figure is the median over them")
    p.add_argument("--wall-only", default="", help="comma-separated whole-run configurations to run, of "
                   + ", ".join(wall.SHORT_NAMES) + "; empty: all")
    p.add_argument("--verbose", action="store_true", help="show the logs of Ray's workers")
    args = p.parse_args(argv)
    args.stages = set(args.stages.split(","))
    args.wall_only = tuple(n for n in args.wall_only.split(",") if n)
    for what, unknown, known in (("--wall-only", set(args.wall_only) - set(wall.SHORT_NAMES), wall.SHORT_NAMES),
                                 ("--stages", args.stages - set(STAGES), STAGES)):
        if unknown:
            p.error(f"{what}: unknown {', '.join(sorted(unknown))}; choose from {', '.join(known)}")
    if args.wall_repeats < 1:
        p.error("--wall-repeats must be at least 1")
    if args.sharding and args.json == JSON:
        args.json = str(RESULTS / sharding.DEFAULT_JSON_NAME)
    return args


def settings_for(args) -> Settings:
    s = Settings(quick=args.quick, cores=args.cores or os.cpu_count() or 1, wall_repeats=args.wall_repeats,
                 wall_only=args.wall_only, fanouts=args.fanouts)
    return dataclasses.replace(s, epochs=3, wall_epochs=(1, 3)) if args.quick else s


def run_figures(args, s: Settings, workdir: Path, result: dict, rows: list[Row]) -> None:
    """Load the graph and add every figure's rows to ``rows``; ``result`` gets the data's description."""
    data = base_data_config(args.dataset)
    graph = load_graph(data, s.seed)
    if s.quick:
        data = quick_data_config(graph, s, workdir)
        graph = load_graph(data, s.seed)
    result["data"] = dict(config=dataclasses.asdict(data), nodes=graph.num_nodes, edges=graph.num_edges,
                          train=len(graph.train_idx), graph_mib=graph.nbytes / 2**20)
    print(f"{graph_line(graph)}; {s.cores} cores, {result['mode']} mode", flush=True)
    if "wall" in args.stages:  # whole runs start their own Ray cluster, as a user's run does
        rows += guarded(wall.FIGURE, "", lambda: wall.bench_wall(data, s, workdir, len(graph.train_idx)))


def main(argv=None) -> int:
    args = parse_args(argv)
    s = settings_for(args)
    started = time.perf_counter()
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    workdir = Path(tempfile.mkdtemp(prefix="gnnray-bench-"))
    result = dict(date=date, mode="quick" if s.quick else "full", machine=machine(), settings=dataclasses.asdict(s))
    rows: list[Row] = []
    try:
        if args.sharding:
            ss = sharding.settings(args.quick)
            result["settings"] = dataclasses.asdict(ss)
            rows += sharding.run_section(ss, workdir, args.verbose, result, guarded)
        else:
            run_figures(args, s, workdir, result, rows)
    except Exception as exc:  # noqa: BLE001 - still print and save what we have
        rows.append(error_row("setup", "", exc))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    rows.sort(key=lambda r: next(i for i, key in enumerate(ORDER) if r.figure.startswith(key)))  # stable
    took = time.perf_counter() - started
    note = (f"\n{result['mode']} mode, {date}, {s.cores} cores, load average {os.getloadavg()[0]:.1f}, {took:.0f} s; "
            f"all numbers in {args.json}\n")
    failed = report(rows, args.json, note, wall_s=took, **result)
    steady = next((r.detail["all"] for r in rows if "all" in r.detail), {})
    if steady:
        print("\nWhere the CPU goes (bench/cpu.py):\n" + wall.process_table(steady), flush=True)
    return failed
