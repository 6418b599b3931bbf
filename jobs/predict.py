"""Predict every node from a training checkpoint with layer-wise full-neighbor inference.

    python jobs/predict.py --checkpoint ~/.gnnray/runs/NAME --output preds.parquet [--embeddings]
    python jobs/predict.py --checkpoint s3://BUCKET/runs/NAME --output s3://BUCKET/preds/NAME.parquet

writes one row per node: ``id``, ``pred`` (the predicted class) and, with
``--embeddings``, ``embedding`` (the input of the model's output layer). The
model and the graph are rebuilt from the configuration stored in the
checkpoint. ``RAY_ADDRESS=auto`` joins a running cluster; ``--help`` lists
every option.
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

from gnnray.driver.cli import exit_now  # noqa: E402
from gnnray.driver.predict_job import main  # noqa: E402

if __name__ == "__main__":
    exit_now(main())
