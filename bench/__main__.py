"""``python -m bench``: see :mod:`bench`."""

import sys

from bench.cli import main

sys.exit(main())
