"""``python -m bench.gpu``: see :mod:`bench.gpu`."""

import sys

from bench.gpu import main

sys.exit(main())
