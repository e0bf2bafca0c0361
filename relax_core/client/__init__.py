"""The discovery-aware client: :class:`InferenceClient`, its snapshot cache and the per-loop
pool."""

from relax_core._exports import claim as _claim
from relax_core.client.breaker import BreakerSettings
from relax_core.client.client import InferenceClient
from relax_core.client.pool import close_clients, get_client

__all__ = ["BreakerSettings", "InferenceClient", "close_clients", "get_client"]

_claim(__name__, globals(), __all__)
