"""``python -m kvtier.cli`` is the ``kvtier`` command, as ``python -m kvtier`` is."""

import sys

from kvtier.cli import main

sys.exit(main())
