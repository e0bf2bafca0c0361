"""Engines: what an engine may do (its spec), engine processes, the SGLang-protocol control
client, weight buckets and the admission server in front of a strict engine head."""

from relax_core._exports import claim as _claim
from relax_core.engine.admission import AdmissionServer
from relax_core.engine.buckets import WeightBucket, plan_weight_buckets
from relax_core.engine.control import ControlClient
from relax_core.engine.process import SubprocessEngineProcess
from relax_core.engine.spec import InferenceEngineSpec

__all__ = [
    "AdmissionServer",
    "ControlClient",
    "InferenceEngineSpec",
    "SubprocessEngineProcess",
    "WeightBucket",
    "plan_weight_buckets",
]

_claim(__name__, globals(), __all__)
