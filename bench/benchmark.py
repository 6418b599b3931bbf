"""``python bench/benchmark.py``, the command README and docs give: runs :func:`bench.suite.main`."""

import sys
from pathlib import Path

if __name__ == "__main__":
    # Run as a script, this folder is first on the path, where its modules would shadow top-level names
    # (Ray's workers inherit the path too); the repository root is where the bench package is found.
    here = Path(__file__).resolve().parent
    sys.path[:] = [str(here.parent)] + [p for p in sys.path if Path(p or ".").resolve() != here]

    from bench.suite import main

    sys.exit(main())
