"""Train GNN node classification on a Ray cluster.

Local:           python jobs/train_arxiv.py --dataset synthetic --epochs 3
                 (each run starts its own Ray cluster, so several can run at once on one machine)
On a cluster:    ray job submit --working-dir . -- python jobs/train_arxiv.py
                 or, on one of its nodes, RAY_ADDRESS=auto python jobs/train_arxiv.py
                 or, elsewhere, RAY_ADDRESS=HOST:PORT python jobs/train_arxiv.py; a cluster that
                 `ray start` began with token authentication (Ray's default) then also needs
                 RAY_AUTH_MODE=token and RAY_AUTH_TOKEN=<the token in the head's ~/.ray/auth_token>
``--help`` lists every option.
"""

import os
import sys

# Make the package importable when run from a checkout (e.g. `ray job submit
# --working-dir .`) without installing it.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Arrow's default pool (mimalloc) kept the freed buffers of the Parquet read, 3.6 GB after a 250 M-edge graph
# directory, through the whole CSC build (docs/performance.md#loading-and-memory).
# Read when pyarrow loads: set before any import.
os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", "system")

from gnnray.driver.cli import exit_now, main  # noqa: E402

if __name__ == "__main__":
    exit_now(main())
