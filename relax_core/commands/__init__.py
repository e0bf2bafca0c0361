"""Sub-commands of the ``relax`` CLI, one module each (see :mod:`relax_core.cli`)."""
