"""The on-policy-distillation prefill request and the check of its answer.

They are the core's (:mod:`relax_core.coordination.distill`, which the teacher distillation stage
uses), re-exported here where teacher users look for them.
"""

from __future__ import annotations

from relax_core import PrefillResult, parse_prefill, prefill_payload

__all__ = ["PrefillResult", "parse_prefill", "prefill_payload"]
