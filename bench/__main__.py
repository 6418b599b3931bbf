"""``python -m bench``: see :mod:`bench`."""

import sys

from bench.suite import main

sys.exit(main())
