"""``python -m jobs.peers``: see jobs/peers/driver.py."""

import sys

from jobs.peers.driver import main

sys.exit(main())
