"""``python -m flyspec``: the ``flyspec`` command, as its console script runs it (started again
with huge pages where they gain, :mod:`flyspec.entry`)."""

import sys

from flyspec.entry import main

sys.exit(main())
