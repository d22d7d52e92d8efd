"""``python -m flyspec.cli``: the ``flyspec`` command."""

import sys

from flyspec.cli import main

sys.exit(main())
