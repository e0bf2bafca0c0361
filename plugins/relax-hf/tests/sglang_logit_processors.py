"""SGLang custom logit processors, serialized by SGLang's own ``CustomLogitProcessor.to_str()``:
``python sglang_logit_processors.py`` prints ``{name: serialized}`` as one JSON object.

Run in its own process by ``test_custom_logit_processor.py``: the classes are defined in
``__main__``, so dill pickles them by value, as it does for a user's script (their base class,
SGLang's, by reference); ``disallowed`` is SGLang's own ``DisallowedTokensLogitsProcessor``.
SGLang's package ``__init__`` imports its GPU runtime, so the module is imported from the
installed files with the package's ``__init__`` left out (as the engine does).
"""

from __future__ import annotations

import json
from typing import Any

from relax_hf.logit_processors import _sglang_importable

_sglang_importable()

import torch  # noqa: E402
from sglang.srt.sampling.custom_logit_processor import (  # noqa: E402
    CustomLogitProcessor,
    DisallowedTokensLogitsProcessor,
)


class CountUp(CustomLogitProcessor):
    """Forces token ``start + len(output_ids)``: reads each row's ``custom_params`` and the
    ``__req__`` view of its request."""

    def __call__(
        self, logits: torch.Tensor, custom_param_list: list[dict[str, Any] | None] | None = None
    ) -> torch.Tensor:
        assert custom_param_list is not None
        for i, params in enumerate(custom_param_list):
            assert params is not None
            target = params["start"] + len(params["__req__"].output_ids)
            logits[i, :] = -float("inf")
            logits[i, target] = 0.0
        return logits


class Raises(CustomLogitProcessor):
    def __call__(
        self, logits: torch.Tensor, custom_param_list: list[dict[str, Any] | None] | None = None
    ) -> torch.Tensor:
        raise RuntimeError("boom from the processor")


class WrongShape(CustomLogitProcessor):
    def __call__(
        self, logits: torch.Tensor, custom_param_list: list[dict[str, Any] | None] | None = None
    ) -> torch.Tensor:
        return logits[:, :10]


if __name__ == "__main__":
    print(
        json.dumps(
            {
                "disallowed": DisallowedTokensLogitsProcessor.to_str(),
                "count_up": CountUp.to_str(),
                "raises": Raises.to_str(),
                "wrong_shape": WrongShape.to_str(),
            }
        )
    )
