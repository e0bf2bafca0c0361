"""``python -m relax_core`` is the ``relax`` command."""

import sys

from relax_core.cli import main

sys.exit(main())
