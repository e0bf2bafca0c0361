"""InferenceManager: one lifecycle core for every role's engines.

One manager per model. It owns the model's engine slots (one Ray actor per node of each
logical replica, on the placement plan's bundles), starts and initialises them in parallel,
tracks each replica's state and resident tags, onloads and offloads them with per-replica
results, applies weight updates behind a fence, checks health, cleans up and rebuilds failed
replicas, scales out and in, publishes the model's schema-2 view (heads only), and shuts
everything down in order (workers, then actors, then owned placement groups).

The implementation is split by concern: :mod:`.base` (state, slots, publishing, start),
:mod:`.memory` (onload, offload), :mod:`.recovery` (health, recovery, scaling, shutdown),
:mod:`.updates` (weight updates and DCS checkpoints).
"""

from __future__ import annotations

from relax_core.manager.memory import MemoryMixin
from relax_core.manager.recovery import RecoveryMixin
from relax_core.manager.updates import WeightsMixin

__all__ = ["InferenceManager"]


class InferenceManager(MemoryMixin, RecoveryMixin, WeightsMixin):
    """The lifecycle core of one model's engines.

    Build it with the model's :class:`~relax_core.engine.spec.InferenceEngineSpec`, its engine
    backend record, a :class:`~relax_core.manager.ModelLaunch` and a
    :class:`~relax_core.manager.ReplicaPlacement`; then :meth:`start`. Every method blocks and
    takes the manager's lock; every lifecycle call fans out to all replicas in parallel and
    returns a :class:`~relax_core.manager.LifecycleResult` with one result per replica.

    States: a replica is READY only with weights, KV cache and CUDA graph resident, valid
    weights and open admission; STARTING, DRAINING, SLEEPING, ONLOADING, FAILED and STOPPING
    otherwise. FAILED never means the memory is free.

    Fail-stop: when a worker actor dies without confirmed cleanup of its engine process, its
    slot, pending record and placement group are kept, nothing is rebuilt, and lifecycle calls
    raise :class:`~relax_core.errors.InferenceRecoveryRequired` until an operator confirms the
    node is clean (:meth:`confirm_external_cleanup`).

    A manager can itself run as a Ray actor (``ray.remote(InferenceManager)``): every
    constructor argument is serialisable.
    """
