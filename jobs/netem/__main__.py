"""``python -m jobs.netem``: see jobs/netem/job.py."""

import sys

from jobs.netem.job import main

sys.exit(main())
