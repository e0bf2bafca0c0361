"""The one job runtime behind ``relax serve`` and ``relax run`` (``docs/jobs.md``); ``relax
run``'s own parts are in :mod:`relax_core.run.job`."""

from relax_core._exports import claim as _claim
from relax_core.jobs.checks import check_job, servable_problems, serve_phase_problems
from relax_core.jobs.managers import (
    backend_options,
    build_role_service,
    describe_job,
    engine_launch_specs,
    manager_arguments,
    router_launch_spec,
    router_record,
    routing_spec,
    start_model_actor,
)
from relax_core.jobs.models import LocalModel, ModelHandle, RayModel
from relax_core.jobs.phases import deferred_roles, put_to_sleep, start_models, start_order
from relax_core.jobs.pools import bind_pools, release_pools, replica_placements
from relax_core.jobs.preflight import (
    Preflight,
    job_preflight,
    model_dir_problems,
    port_problems,
    ray_address_problem,
    resolve_model_paths,
)
from relax_core.jobs.roles import RoleService, health_printer
from relax_core.jobs.runtime import JobRuntime
from relax_core.jobs.serving import ServedJob, place_served_job, serve_job, teardown_served_job
from relax_core.jobs.session import ShutdownSignals, ray_session
from relax_core.jobs.teardown import Stop, still_running

__all__ = [
    "JobRuntime",
    "LocalModel",
    "ModelHandle",
    "Preflight",
    "RayModel",
    "RoleService",
    "ServedJob",
    "ShutdownSignals",
    "Stop",
    "backend_options",
    "bind_pools",
    "build_role_service",
    "check_job",
    "deferred_roles",
    "describe_job",
    "engine_launch_specs",
    "health_printer",
    "job_preflight",
    "manager_arguments",
    "model_dir_problems",
    "place_served_job",
    "port_problems",
    "put_to_sleep",
    "ray_address_problem",
    "ray_session",
    "release_pools",
    "replica_placements",
    "resolve_model_paths",
    "router_launch_spec",
    "router_record",
    "routing_spec",
    "servable_problems",
    "serve_job",
    "serve_phase_problems",
    "start_model_actor",
    "start_models",
    "start_order",
    "still_running",
    "teardown_served_job",
]

_claim(__name__, globals(), __all__)
