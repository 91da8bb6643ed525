"""``python -m mpicomp``: the ``mpicomp`` command line."""

import sys

from mpicomp.cli import main

sys.exit(main())
