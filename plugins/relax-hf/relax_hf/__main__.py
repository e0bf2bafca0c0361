"""``python -m relax_hf …`` is ``relax-hf …`` (the backend launches servers this way)."""

import sys

from relax_hf.cli import main

sys.exit(main())
