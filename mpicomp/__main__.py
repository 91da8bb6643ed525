"""``python -m mpicomp``: the ``mpicomp`` command line."""

import sys

from mpicomp.tools.cli import main

sys.exit(main())
