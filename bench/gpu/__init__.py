"""The train worker's GPU path, checked on a bare GPU machine: ``python -m bench.gpu [--smoke] [--json PATH]``.

Torch and numpy only, on synthetic batches (``batches.py``); each row against the CPU or its bound: ``model`` and
``layerwise`` (``models.py``), ``prefetch`` (``overlap.py``), ``ddp step`` (``ddp.py``), ``syncs`` (``syncs.py``).
Without CUDA every row runs on the CPU at small sizes, a smoke test (tests/test_gpu_bench.py).
"""

from __future__ import annotations

import argparse
import platform
import traceback
from typing import Callable

import numpy as np
import torch

from bench.gpu.batches import FULL, SMOKE
from bench.gpu.ddp import ddp_row
from bench.gpu.models import layerwise_row, model_row
from bench.gpu.overlap import median_run, prefetch_overlap
from bench.harness import RESULTS, write_json

DEFAULT_JSON = RESULTS / "gpu.json"


def run(smoke: bool) -> dict:
    """Every row (a failed one carries its error), with the machine and the sizes."""
    from bench.gpu import syncs
    from gnnray.models.model import MODELS

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    z = SMOKE if smoke or not cuda else FULL
    if cuda:  # the comparison is of float32 arithmetic: no TF32 in matmuls
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    jobs: list[tuple[str, Callable[[], dict]]] = [(f"model {m}", lambda m=m: model_row(m, dev, z)) for m in MODELS]
    jobs += [(f"layerwise {m}", lambda m=m: layerwise_row(m, dev, z)) for m in MODELS if not m.startswith("r")]
    for dtype in (np.float32, np.float16):
        jobs.append((f"prefetch {np.dtype(dtype).name}", lambda dtype=dtype: median_run([prefetch_overlap(
            str(dev), z["prefetch_batches"], z["prefetch_inputs"], z["in_feats"], dtype) for _ in range(3)])))
    jobs.append(("ddp step", lambda: ddp_row(dev, z)))
    jobs += syncs.jobs(dev, z)  # host syncs of the embedding's and rgat's collectives
    rows = {}
    for name, fn in jobs:
        try:
            rows[name] = dict(fn(), status="ok")
        except Exception as exc:  # noqa: BLE001 - shown in its row; the others still run
            rows[name] = dict(status="error", error=f"{type(exc).__name__}: {exc}"[:300],
                              traceback=traceback.format_exc())
    return dict(device=str(dev), gpu=torch.cuda.get_device_name(0) if cuda else None, smoke=not cuda or smoke,
                cpu_only=not cuda, sizes=z, python=platform.python_version(), torch=torch.__version__,
                numpy=np.__version__, cuda=torch.version.cuda, gpus=torch.cuda.device_count() if cuda else 0,
                rows=rows)


def table(result: dict) -> str:
    """The rows as text, one line each."""
    lines = [f"{'row':<18} {'status':<6} figures"]
    for name, r in result["rows"].items():
        if r["status"] != "ok":
            lines.append(f"{name:<18} ERROR  {r['error']}")
            continue
        if name.startswith("model"):
            text = (f"out rel diff {r['out_rel_diff']:.1e}, grad rel diff {r['grad_rel_diff']:.1e}; step "
                    f"{1000 * r['device_step_s']:.2f} ms on {result['device']} vs {1000 * r['cpu_step_s']:.2f} ms on "
                    f"cpu" + (f"; {r['host_syncs_per_step']:g} host syncs/step" if "host_syncs_per_step" in r else ""))
        elif name.startswith("layerwise"):
            text = (f"{r['nodes']:,} nodes: hidden rel diff {r['hidden_rel_diff']:.1e}, predictions agree "
                    f"{100 * r['pred_agree']:.2f}%; {r['device_s']:.2f} s on {result['device']} vs "
                    f"{r['cpu_s']:.2f} s on cpu")
        elif name.startswith("syncs"):
            from bench.gpu.syncs import text as syncs_text

            text = syncs_text(name, r, result["device"])
        elif name.startswith("prefetch"):
            text = (f"{1000 * r['prefetch_s']:.2f} ms/batch with the Prefetcher vs max(copy {1000 * r['copy_s']:.2f}, "
                    f"compute {1000 * r['compute_s']:.2f}) = {r['prefetch_over_bound']:.2f}x; serial "
                    f"{1000 * r['serial_s']:.2f} ms")
        else:
            text = (f"{r['backend']} x{r['world']}: {1000 * r['step_s']:.2f} ms/step, loss {r['loss']:.3f}, "
                    f"ranks' weights differ by {r['weights_max_diff_across_ranks']:g}")
        lines.append(f"{name:<18} {'-' if r['met'] is None else 'ok' if r['met'] else 'NO':<6} {text}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="small sizes (always so without CUDA)")
    parser.add_argument("--json", default=str(DEFAULT_JSON), help="where to write the results")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: every row runs on the CPU at small sizes, as a smoke test (no GPU figures)")
    result = run(args.smoke)
    print(table(result))
    write_json(args.json, result)
    print(f"wrote {args.json}")
    return 1 if any(r["status"] != "ok" for r in result["rows"].values()) else 0
