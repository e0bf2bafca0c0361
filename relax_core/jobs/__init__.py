"""What ``relax serve`` and ``relax run`` share about a job: how its paths are read and what is
checked on this machine before anything starts (:mod:`~relax_core.jobs.preflight`).

See ``docs/jobs.md``.
"""

from relax_core._exports import claim as _claim
from relax_core.jobs.preflight import (
    Preflight,
    job_preflight,
    model_dir_problems,
    port_problems,
    ray_address_problem,
    resolve_model_paths,
)

__all__ = [
    "Preflight",
    "job_preflight",
    "model_dir_problems",
    "port_problems",
    "ray_address_problem",
    "resolve_model_paths",
]

_claim(__name__, globals(), __all__)
