"""The reference trainer's parts in-process: its policy is the checkpoint's own model (logits
and weight names equal transformers'), its GRPO advantages and loss, its distillation terms."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from relax_torch_trainer.loss import (
    LossReport,
    batch_loss,
    group_advantages,
    pad_batch,
    teacher_mode,
)
from relax_torch_trainer.policy import load_policy

from relax_core import ConfigError, Sample


def test_the_policy_is_the_checkpoints_model_with_its_weight_names(tiny: Path) -> None:
    from transformers import AutoModelForCausalLM

    policy = load_policy(str(tiny))
    reference = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    ids = torch.randint(
        0, policy.shape.vocab_size, (3, 17), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        assert torch.allclose(policy(ids), reference(ids).logits, atol=1e-5)
    ours = dict(policy.named_weights())
    theirs = reference.state_dict()
    assert set(ours) == set(theirs)
    assert all(ours[n].shape == theirs[n].shape and ours[n].dtype == theirs[n].dtype for n in ours)


def test_a_model_this_trainer_does_not_implement_is_refused_naming_it(
    tiny: Path, tmp_path: Path
) -> None:
    other = tmp_path / "qwen"
    other.mkdir()
    config = json.loads((tiny / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(ConfigError, match="model_type 'gpt2'") as info:
        load_policy(str(other))
    assert info.value.path.endswith("config.json")


def _sample(i: int, group: str, reward: float, n: int = 3, **fields: object) -> Sample:
    return Sample(
        f"s{i}",
        group,
        [1, 2, 3 + i % 2],
        [4 + i, 5, 6][:n],
        rollout_logprobs=[-1.0] * n,
        fields={"reward": reward, **fields},
    )


def test_advantages_are_normalised_within_each_group() -> None:
    samples = [
        _sample(0, "a", 1.0),
        _sample(1, "a", 0.0),
        _sample(2, "b", 0.5),
        _sample(3, "b", 0.5),
    ]
    adv = group_advantages(samples)
    assert adv[0] == pytest.approx(-adv[1]) and adv[0] > 0
    assert adv[2] == adv[3] == 0.0  # equal rewards: no signal
    with pytest.raises(ValueError, match="s9 has no reward"):
        group_advantages([Sample("s9", "g", [1], [2])])


def test_pad_batch_masks_exactly_the_response_tokens() -> None:
    samples = [_sample(0, "a", 1.0, n=3), _sample(1, "a", 0.0, n=1)]
    ids, mask, targets = pad_batch(samples, "cpu")
    assert ids.shape == (2, 6) and mask.tolist() == [
        [False, False, True, True, True],
        [False, False, True, False, False],
    ]
    assert targets[mask].tolist() == [4, 5, 6, 5]


def test_the_policy_gradient_raises_the_better_samples_log_probs(tiny: Path) -> None:
    policy = load_policy(str(tiny))
    good, bad = [11, 12, 13], [21, 22, 23]
    with torch.no_grad():
        ids = torch.tensor([[1, 2, 3, *good], [1, 2, 3, *bad]])
        lp = torch.log_softmax(policy(ids)[:, 2:-1], -1).gather(-1, ids[:, 3:, None])[..., 0]
    samples = [
        Sample("g", "p", [1, 2, 3], good, rollout_logprobs=lp[0].tolist(), fields={"reward": 1.0}),
        Sample("b", "p", [1, 2, 3], bad, rollout_logprobs=lp[1].tolist(), fields={"reward": 0.0}),
    ]
    batch, mask, targets = pad_batch(samples, "cpu")
    loss, report = batch_loss(
        policy(batch), samples, mask, targets, advantages=group_advantages(samples), clip=0.2,
        distill_coef=0.0, teacher_mode=None,
    )  # fmt: skip
    # On-policy: the ratio is 1 and nothing is clipped.
    assert report.ratio_mean == pytest.approx(1.0, abs=1e-5) and report.clip_fraction == 0.0
    assert report.tokens == 6 and report.teacher_kl is None
    optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        after = torch.log_softmax(policy(ids)[:, 2:-1], -1).gather(-1, ids[:, 3:, None])[..., 0]
    assert after[0].sum() > lp[0].sum() and after[1].sum() < lp[1].sum()


def test_distillation_terms_measure_the_gap_to_the_teacher(tiny: Path) -> None:
    policy = load_policy(str(tiny))
    response = [11, 12, 13]
    ids = torch.tensor([[1, 2, 3, *response]])
    with torch.no_grad():
        logp_all = torch.log_softmax(policy(ids)[0, 2:-1], -1)
    own = logp_all.gather(-1, torch.tensor(response)[:, None])[:, 0]
    top = logp_all.topk(4, dim=-1)

    def loss_of(**fields: object) -> object:
        s = Sample(
            "s", "g", [1, 2, 3], response, rollout_logprobs=own.tolist(),
            fields={"reward": 0.0, **fields},
        )  # fmt: skip
        batch, mask, targets = pad_batch([s], "cpu")
        mode = teacher_mode(fields)
        return batch_loss(
            policy(batch), [s], mask, targets, advantages=[0.0], clip=0.2, distill_coef=1.0,
            teacher_mode=mode,
        )[1]  # fmt: skip

    # A teacher equal to the policy: no gap in either mode.
    same = loss_of(teacher_logprobs=tuple(own.tolist()))
    assert same.teacher_kl == pytest.approx(0.0, abs=1e-6)
    topk = loss_of(
        teacher_topk_ids=tuple(map(tuple, top.indices.tolist())),
        teacher_topk_logprobs=tuple(map(tuple, top.values.tolist())),
    )
    assert topk.teacher_kl == pytest.approx(0.0, abs=1e-6)
    # A teacher surer of these tokens: the policy is behind it by the log-prob gap.
    surer = loss_of(teacher_logprobs=tuple(v / 10 for v in own.tolist()))
    gap = float((own - own / 10).mean())
    assert surer.teacher_kl == pytest.approx(gap, rel=1e-5) and gap < 0
    with pytest.raises(ValueError, match="no teacher log-prob for each of its 3 tokens"):
        loss_of(teacher_logprobs=(-1.0,))


def test_the_off_policy_correction_weights_each_token_by_its_truncated_importance(
    tiny: Path,
) -> None:
    """Samples from older weights (their rollout log-probs lower than the trainer's by a known
    amount): each token's gradient is weighted by min(π_trainer / π_rollout, cap), the
    weights above the cap truncated; on-policy tokens get weight 1, as without the
    correction."""
    policy = load_policy(str(tiny))
    good, bad = [11, 12, 13], [21, 22, 23]
    with torch.no_grad():
        ids = torch.tensor([[1, 2, 3, *good], [1, 2, 3, *bad]])
        lp = torch.log_softmax(policy(ids)[:, 2:-1], -1).gather(-1, ids[:, 3:, None])[..., 0]

    def run(shift: list[float], cap: float) -> tuple[list[torch.Tensor], LossReport]:
        samples = [
            Sample(
                "g", "p", [1, 2, 3], good, fields={"reward": 1.0},
                rollout_logprobs=[x - d for x, d in zip(lp[0].tolist(), shift, strict=True)],
            ),
            Sample(
                "b", "p", [1, 2, 3], bad, rollout_logprobs=lp[1].tolist(), fields={"reward": 0.0}
            ),
        ]  # fmt: skip
        policy.zero_grad()
        batch, mask, targets = pad_batch(samples, "cpu")
        loss, report = batch_loss(
            policy(batch), samples, mask, targets, advantages=group_advantages(samples),
            clip=0.2, distill_coef=0.0, teacher_mode=None, importance_cap=cap,
        )  # fmt: skip
        loss.backward()
        return [p.grad.clone() for p in policy.parameters() if p.grad is not None], report

    on_policy, plain = run([0.0, 0.0, 0.0], 0.0)
    corrected, report = run([0.0, 0.0, 0.0], 2.0)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(on_policy, corrected, strict=True))
    assert report.importance_weight_mean == pytest.approx(1.0, abs=1e-5)
    assert plain.importance_weight_mean is None
    # Stale tokens: π_trainer / π_rollout = e^0.5 ≈ 1.65 (kept), e^2 ≈ 7.4 (truncated to 2).
    _, stale = run([0.5, 2.0, 0.0], 2.0)
    weights = [1.0, 1.0, 1.0, min(2.0, 2.718281828**0.5), 2.0, 1.0]
    assert stale.importance_weight_mean == pytest.approx(sum(weights) / 6, rel=1e-4)
    assert stale.truncated_fraction == pytest.approx(1 / 6)
