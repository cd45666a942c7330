"""``python -m flashgen``: the ``flashgen`` command."""

import sys

from flashgen.cli import main

sys.exit(main())
