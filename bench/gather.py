"""The feature gather and the prefetch overlap against torch's thread count: ``python -m bench.gather``.

``gather``: 100k rows of a 200k x 128 float32 table by ``np.take`` (the baseline) and by ``index_select``, and the
pinned copy; ``threads``: ``bench.gpu``'s ``prefetch float32`` row.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import numpy as np
import torch


def _median_ms(fn) -> float:
    from bench.harness import median_s

    return 1000 * median_s(fn, 9)  # h2d synchronises itself


def gather(cores: int) -> dict:
    rng = np.random.default_rng(0)
    table = rng.standard_normal((200_000, 128), dtype=np.float32)
    ids = rng.integers(0, 200_000, 100_000)
    dst = torch.empty((100_000, 128), dtype=torch.float32, pin_memory=torch.cuda.is_available())
    out = {"np_take_ms": _median_ms(lambda: np.take(table, ids, axis=0, out=dst.numpy()))}
    src, idx = torch.from_numpy(table), torch.from_numpy(ids)
    for n in sorted({1, 2, 4, 8, cores} & set(range(1, cores + 1))):
        torch.set_num_threads(n)
        out[f"index_select_{n}t_ms"] = _median_ms(lambda: torch.index_select(src, 0, idx, out=dst))
    torch.set_num_threads(cores)
    if torch.cuda.is_available():
        d = torch.empty_like(dst, device="cuda")

        def h2d():
            d.copy_(dst, non_blocking=True)
            torch.cuda.synchronize()
        out["h2d_pinned_ms"] = _median_ms(h2d)
    return out


def threads(cores: int) -> dict:
    from bench.gpu.overlap import prefetch_overlap

    dev, out = "cuda" if torch.cuda.is_available() else "cpu", {}
    for n in sorted({cores, max(1, cores - 1), 8, 4, 2} & set(range(1, cores + 1)), reverse=True):
        torch.set_num_threads(n)
        runs = [prefetch_overlap(dev, 30, 100_000, 128) for _ in range(3)]
        out[n] = {k: statistics.median(r[k] for r in runs)
                  for k in ("copy_s", "compute_s", "serial_s", "prefetch_s", "prefetch_over_bound")}
    torch.set_num_threads(cores)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gather", description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="bench-results/gather.json")
    args = ap.parse_args(argv)
    cores = len(os.sched_getaffinity(0))
    result = {"cores": cores, "torch": torch.__version__, "cuda": torch.cuda.get_device_name(0)
              if torch.cuda.is_available() else None}
    for name, fn in (("gather", gather), ("threads", threads)):
        result[name] = fn(cores)
        print(name, json.dumps(result[name]), flush=True)
    from bench.harness import write_json

    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
