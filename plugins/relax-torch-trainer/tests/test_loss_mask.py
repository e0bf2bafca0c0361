"""The loss mask of a multi-turn trajectory: the reference trainer's gradient flows only
through the policy's tokens (mask 1); an environment's tokens (mask 0) are context only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from relax_torch_trainer.loss import batch_loss, pad_batch
from relax_torch_trainer.policy import load_policy

from relax_core import Sample

#: Two policy turns around an observation: tokens 2-4 are the environment's.
MASK = (1, 1, 0, 0, 0, 1, 1)


def _trajectory(i: int, reward: float, mask: tuple[int, ...] = MASK) -> Sample:
    return Sample(
        f"s{i}",
        "g",
        [1, 2, 3],
        [10 + i, 11, 12, 13, 14, 15 + i, 16],
        rollout_logprobs=[-2.0] * 7,
        fields={"reward": reward, "teacher_logprobs": tuple([-1.5] * 7)},
        loss_mask=mask,
    )


def _logit_grads(policy: torch.nn.Module, samples: list[Sample], mode: str | None) -> torch.Tensor:
    """The gradient of the batch's loss with respect to every logit the loss could read."""
    ids, mask, targets = pad_batch(samples, torch.device("cpu"))
    logits = policy(ids).detach().requires_grad_(True)
    loss, _ = batch_loss(
        logits,
        samples,
        mask,
        targets,
        advantages=[1.0, 0.5],  # both unclipped (ratio < 1 - clip, A > 0)
        clip=0.2,
        distill_coef=1.0,
        teacher_mode=mode,
    )
    loss.backward()  # type: ignore[no-untyped-call]
    assert logits.grad is not None
    return logits.grad


@pytest.mark.parametrize("mode", [None, "sampled"])
def test_the_gradient_flows_only_through_mask_1_tokens(tiny: Path, mode: str | None) -> None:
    policy = load_policy(str(tiny))
    samples = [_trajectory(0, 1.0), _trajectory(1, 0.0)]
    grads = _logit_grads(policy, samples, mode)
    prompt = len(samples[0].prompt_ids)
    for row in range(2):
        # Logit position p predicts token p + 1: response token t is read at prompt - 1 + t.
        per_token = grads[row, prompt - 1 : prompt - 1 + 7].abs().sum(-1)
        for t, m in enumerate(MASK):
            if m:
                assert per_token[t] > 0, f"policy token {t} got no gradient"
            else:
                assert per_token[t] == 0, f"environment token {t} got a gradient"
        # Nothing before the response either (the prompt is context).
        assert grads[row, : prompt - 1].abs().sum() == 0


def test_an_empty_mask_trains_every_response_token(tiny: Path) -> None:
    policy = load_policy(str(tiny))
    samples = [_trajectory(0, 1.0, ()), _trajectory(1, 0.0, ())]
    grads = _logit_grads(policy, samples, None)
    prompt = len(samples[0].prompt_ids)
    per_token = grads[0, prompt - 1 : prompt - 1 + 7].abs().sum(-1)
    assert bool((per_token > 0).all())


def test_the_reported_tokens_are_the_trained_ones(tiny: Path) -> None:
    policy = load_policy(str(tiny))
    samples = [_trajectory(0, 1.0), _trajectory(1, 0.0)]
    ids, mask, targets = pad_batch(samples, torch.device("cpu"))
    with torch.no_grad():
        _, report = batch_loss(
            policy(ids), samples, mask, targets, advantages=[1.0, -1.0], clip=0.2,
            distill_coef=0.0, teacher_mode=None,
        )  # fmt: skip
    assert report.tokens == 2 * sum(MASK)


def test_a_mask_of_the_wrong_length_is_refused(tiny: Path) -> None:
    policy = load_policy(str(tiny))
    samples = [_trajectory(0, 1.0, (1, 0)), _trajectory(1, 0.0)]
    ids, mask, targets = pad_batch(samples, torch.device("cpu"))
    with pytest.raises(ValueError, match="2 loss-mask entries for 7 tokens"):
        batch_loss(
            policy(ids), samples, mask, targets, advantages=[1.0, -1.0], clip=0.2,
            distill_coef=0.0, teacher_mode=None,
        )  # fmt: skip
