"""The reference trainer's objective: a GRPO-style policy loss plus a distillation term.

- **Advantages** are group-normalised (:func:`group_advantages`): each sample's reward minus
  its group's mean (the samples of one prompt), over the group's standard deviation; a group
  whose rewards are all equal carries no signal (advantage 0).
- **Policy loss**: PPO's clipped surrogate per response token, the rollout's own log-probs
  (``Sample.rollout_logprobs``, what the engine sampled with) as the old policy:
  ``-min(r * A, clip(r, 1 - eps, 1 + eps) * A)`` with ``r = exp(logp - logp_rollout)``,
  averaged over every trained response token of the batch.
- **The loss mask** (``Sample.loss_mask``, a multi-turn trajectory's): only tokens of mask 1
  (the policy's) enter the policy and distillation terms and their means (the importance
  weights' statistics too); an environment's or a tool's tokens (mask 0) are context only, so
  no gradient flows through them. An empty mask trains every response token.
- **Off-policy correction** (``importance_cap`` > 0: asynchronous steps train on samples up
  to ``max_staleness`` versions old, some spanning a push): decoupled PPO / truncated
  importance sampling. The trainer's own log-probs before its step are the proximal policy:
  ``r = exp(logp - stop_grad(logp))`` is clipped as PPO's ratio, and each token's loss is
  weighted by ``w = min(exp(stop_grad(logp) - logp_rollout), cap)``, the importance weight of
  the trainer's policy over the one that sampled the token, truncated at ``cap``.
- **Distillation** from the teacher's fields, weighted by ``distill_coef``:

  - *sampled* (``teacher_logprobs``): the reverse KL ``KL(policy || teacher)`` estimated on
    the sampled tokens, ``mean(logp - logp_teacher)``, minimised with its policy-gradient
    estimator ``r * stop_grad(logp - logp_teacher)`` (on-policy distillation);
  - *top-k* (``teacher_topk_ids`` / ``teacher_topk_logprobs``): the forward KL over the
    teacher's top-k tokens at each position, both distributions renormalised over those k,
    differentiated directly.

:func:`batch_loss` returns the loss tensor and the numbers ``relax run`` prints. torch is
imported by this module (only the trainer's actor imports it).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import Any

import attrs
import torch

from relax_core import Sample

__all__ = ["LossReport", "batch_loss", "group_advantages", "pad_batch"]


def group_advantages(samples: Sequence[Sample], eps: float = 1e-6) -> list[float]:
    """Each sample's group-normalised advantage, in the order of ``samples``.

    :raises ValueError: a sample without a reward.
    """
    groups: dict[str, list[float]] = {}
    for s in samples:
        if s.reward is None:
            raise ValueError(f"sample {s.id} has no reward; a committed batch always has one")
        groups.setdefault(s.group_id, []).append(float(s.reward))
    stats = {}
    for gid, rewards in groups.items():
        mean = sum(rewards) / len(rewards)
        var = sum((r - mean) ** 2 for r in rewards) / max(1, len(rewards) - 1)
        stats[gid] = (mean, math.sqrt(var))
    out = []
    for s in samples:
        mean, std = stats[s.group_id]
        out.append(0.0 if std < eps else (float(s.reward or 0.0) - mean) / (std + eps))
    return out


@attrs.frozen
class LossReport:
    """The numbers of one batch's loss (plain floats)."""

    loss: float
    policy_loss: float
    distill_loss: float
    teacher_kl: float | None
    teacher_logprob_mean: float | None
    ratio_mean: float
    clip_fraction: float
    tokens: int
    importance_weight_mean: float | None = None
    truncated_fraction: float | None = None


def pad_batch(
    samples: Sequence[Sample], device: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids [B, T], response_mask [B, T-1], targets [B, T-1])`` of right-padded
    prompt + response sequences: position ``t`` of the mask and targets scores token
    ``t + 1``, so the mask covers exactly the response tokens."""
    longest = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    ids = torch.zeros((len(samples), longest), dtype=torch.long)
    mask = torch.zeros((len(samples), longest - 1), dtype=torch.bool)
    for i, s in enumerate(samples):
        seq = (*s.prompt_ids, *s.response_ids)
        ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        start = len(s.prompt_ids) - 1
        mask[i, start : start + len(s.response_ids)] = True
    return ids.to(device), mask.to(device), ids[:, 1:].to(device)


def _per_token(samples: Sequence[Sample], field: str, mask: torch.Tensor) -> torch.Tensor:
    """A per-response-token value of every sample (``rollout_logprobs``, or a field a stage
    wrote), laid out on ``mask``'s True positions."""
    flat = [
        float(v)
        for s in samples
        for v in (s.rollout_logprobs if field == "rollout_logprobs" else s.fields[field])
    ]
    return torch.tensor(flat, dtype=torch.float32, device=mask.device)


def teacher_mode(fields: Collection[str]) -> str | None:
    """The distillation term the step's fields allow: ``"top-k"`` when the teacher's top-k is
    written (``teacher_topk_logprobs``), ``"sampled"`` for its log-prob of each sampled token
    (``teacher_logprobs``) alone, ``None`` without a teacher stage."""
    if "teacher_topk_logprobs" in fields:
        return "top-k"
    return "sampled" if "teacher_logprobs" in fields else None


def batch_loss(
    logits: torch.Tensor,
    samples: Sequence[Sample],
    mask: torch.Tensor,
    targets: torch.Tensor,
    *,
    advantages: Sequence[float],
    clip: float,
    distill_coef: float,
    teacher_mode: str | None,
    importance_cap: float = 0.0,
) -> tuple[torch.Tensor, LossReport]:
    """The loss of one batch (see the module docstring) and its report.

    ``logits [B, T, V]`` are the policy's over ``pad_batch``'s ``input_ids``; ``advantages``
    one per sample (:func:`group_advantages` over the whole batch, so a micro-batch never
    splits a group's statistics); ``teacher_mode`` is ``"sampled"``, ``"top-k"`` or ``None``
    (no distillation term). The loss is the mean over the samples' trained response tokens
    (mask 1; ``report.tokens`` counts them).

    :raises ValueError: a sample lacks a field the loss needs (rollout log-probs, or the
        teacher fields of ``teacher_mode``), or its lengths disagree with its response.
    """
    for s in samples:
        n = len(s.response_ids)
        if len(s.rollout_logprobs) != n:
            raise ValueError(
                f"sample {s.id}: {len(s.rollout_logprobs)} rollout log-probs for {n} tokens"
            )
        if s.loss_mask and len(s.loss_mask) != n:
            raise ValueError(f"sample {s.id}: {len(s.loss_mask)} loss-mask entries for {n} tokens")
        if teacher_mode == "sampled" and len(s.fields.get("teacher_logprobs") or ()) != n:
            raise ValueError(f"sample {s.id}: no teacher log-prob for each of its {n} tokens")
        if teacher_mode == "top-k" and len(s.fields.get("teacher_topk_ids") or ()) != n:
            raise ValueError(f"sample {s.id}: no teacher top-k for each of its {n} tokens")
    logits = logits[:, :-1].float()
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets[..., None])[..., 0][mask]
    old = _per_token(samples, "rollout_logprobs", mask)
    adv = torch.tensor(
        [a for s, a in zip(samples, advantages, strict=True) for _ in s.response_ids],
        dtype=torch.float32,
        device=logp.device,
    )
    keep = torch.tensor(
        [m for s in samples for m in s.trained()], dtype=torch.bool, device=logp.device
    )
    trained = max(int(keep.sum()), 1)

    def masked_mean(values: torch.Tensor) -> torch.Tensor:
        return torch.where(keep, values, torch.zeros_like(values)).sum() / trained

    ratio = torch.exp(logp - old)
    weight_mean: float | None = None
    truncated: float | None = None
    if importance_cap > 0:
        behaviour = torch.exp(logp.detach() - old)
        weight = torch.clamp(behaviour, max=importance_cap)
        proximal = torch.exp(logp - logp.detach())
        clipped = torch.clamp(proximal, 1.0 - clip, 1.0 + clip)
        policy_loss = masked_mean(-(weight * torch.minimum(proximal * adv, clipped * adv)))
        weight_mean = float(masked_mean(weight))
        truncated = float(masked_mean((behaviour > importance_cap).float()))
    else:
        clipped = torch.clamp(ratio, 1.0 - clip, 1.0 + clip)
        policy_loss = masked_mean(-torch.minimum(ratio * adv, clipped * adv))
    distill = torch.zeros((), device=logp.device)
    kl: float | None = None
    teacher_mean: float | None = None
    if teacher_mode == "sampled":
        teacher = _per_token(samples, "teacher_logprobs", mask)
        gap = logp - teacher
        distill = masked_mean(ratio * gap.detach())
        kl = float(masked_mean(gap.detach()))
        teacher_mean = float(masked_mean(teacher))
    elif teacher_mode == "top-k":
        ids = torch.tensor(
            [row for s in samples for row in s.fields["teacher_topk_ids"]],
            dtype=torch.long,
            device=logp.device,
        )
        t_lp = torch.tensor(
            [row for s in samples for row in s.fields["teacher_topk_logprobs"]],
            dtype=torch.float32,
            device=logp.device,
        )
        student = logp_all[mask].gather(-1, ids)  # [tokens, k]
        p_teacher = torch.softmax(t_lp, dim=-1)
        log_q = torch.log_softmax(student, dim=-1)
        per_token = (p_teacher * (torch.log_softmax(t_lp, dim=-1) - log_q)).sum(-1)
        distill = masked_mean(per_token)
        kl = float(distill.detach())
        teacher_mean = float(masked_mean(t_lp[:, 0]))
    loss = policy_loss + distill_coef * distill
    report = LossReport(
        loss=float(loss.detach()),
        policy_loss=float(policy_loss.detach()),
        distill_loss=float(distill.detach()),
        teacher_kl=kl,
        teacher_logprob_mean=teacher_mean,
        ratio_mean=float(masked_mean(ratio.detach())),
        clip_fraction=float(masked_mean(((ratio - 1.0).abs() > clip).float())),
        tokens=int(keep.sum()),
        importance_weight_mean=weight_mean,
        truncated_fraction=truncated,
    )
    return loss, report
