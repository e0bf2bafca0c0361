"""The built-in trainer's parts in-process: its policy is the checkpoint's own model (logits and
weight names equal transformers'), its GRPO advantages and loss, its distillation terms, and
the switch report of ``--measure``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import attrs
import pytest
import torch

from relax_core.coordination.sample import Sample
from relax_core.errors import ConfigError
from relax_core.run.loss import batch_loss, group_advantages, pad_batch
from relax_core.run.measure import Switch, switch_report
from relax_core.run.policy import load_policy
from tests.support.serve import make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("trainer") / "policy")


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
        reward=reward,
        rollout_logprobs=[-1.0] * n,
        **fields,  # type: ignore[arg-type]
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
        Sample("g", "p", [1, 2, 3], good, reward=1.0, rollout_logprobs=lp[0].tolist()),
        Sample("b", "p", [1, 2, 3], bad, reward=0.0, rollout_logprobs=lp[1].tolist()),
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
        s = Sample("s", "g", [1, 2, 3], response, reward=0.0, rollout_logprobs=own.tolist())
        for k, v in fields.items():
            setattr(s, k, v)
        batch, mask, targets = pad_batch([s], "cpu")
        mode = "top-k" if "teacher_topk_ids" in fields else "sampled"
        return batch_loss(
            policy(batch), [s], mask, targets, advantages=[0.0], clip=0.2, distill_coef=1.0,
            teacher_mode=mode,
        )[1]  # fmt: skip

    # A teacher equal to the policy: no gap in either mode.
    same = loss_of(teacher_logprobs=tuple(own.tolist()))
    assert same.teacher_kl == pytest.approx(0.0, abs=1e-6)  # type: ignore[attr-defined]
    topk = loss_of(
        teacher_topk_ids=tuple(map(tuple, top.indices.tolist())),
        teacher_topk_logprobs=tuple(map(tuple, top.values.tolist())),
    )
    assert topk.teacher_kl == pytest.approx(0.0, abs=1e-6)  # type: ignore[attr-defined]
    # A teacher surer of these tokens: the policy is behind it by the log-prob gap.
    surer = loss_of(teacher_logprobs=tuple(v / 10 for v in own.tolist()))
    gap = float((own - own / 10).mean())
    assert surer.teacher_kl == pytest.approx(gap, rel=1e-5) and gap < 0  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="no teacher log-prob for each of its 3 tokens"):
        loss_of(teacher_logprobs=(-1.0,))


def test_the_switch_report_sets_each_switch_against_the_copy_of_its_bytes() -> None:
    def switch(direction: str, seconds: float, free_before: int, free_after: int) -> Switch:
        return Switch(
            step=0, role="genrm", direction=direction, seconds=seconds, weight_bytes=1000,
            kv_cache_bytes=5000, held_before=6000 if direction == "offload" else 0,
            held_after=0 if direction == "offload" else 6000, device_free_before=free_before,
            device_free_after=free_after, device_total=10_000,
        )  # fmt: skip

    report = switch_report(
        [switch("onload", 0.06, 9000, 3000), switch("offload", 0.2, 3000, 8700)],
        {1000: {"h2d": 0.01, "d2h": 0.02}},
        step_seconds=2.6,
    )
    onload, offload = report["switches"]
    assert onload["copy_seconds"] == 0.01 and onload["limit_seconds"] == pytest.approx(0.0625)
    assert onload["within_limit"] is True and "freed_fraction" not in onload
    assert offload["copy_seconds"] == 0.02 and offload["within_limit"] is False
    assert offload["freed_fraction"] == pytest.approx(5700 / 6000)
    assert report["switch_seconds"] == pytest.approx(0.26)
    assert report["share_of_step"] == pytest.approx(0.1)
    assert report["all_within_limit"] is False and report["min_freed_fraction"] == 0.95
    assert math.isclose(onload["copy_gb_per_s"], 1000 / 0.01 / 1e9)


def test_memory_an_offload_hands_over_counts_as_freed_and_is_reported_apart() -> None:
    # An engine with --memory-handoff parks most of what it held for the next role: the
    # device's free memory moves only by the rest (its torch cache), yet the role holds nothing.
    handed = Switch(
        step=0, role="rollout", direction="offload", seconds=0.04, weight_bytes=1000,
        kv_cache_bytes=9000, held_before=10_000, held_after=0, device_free_before=4000,
        device_free_after=4800, device_total=20_000, parked_before=0, parked_after=9200,
    )  # fmt: skip
    taken = attrs.evolve(
        handed, direction="onload", held_before=0, held_after=10_000, device_free_before=4800,
        device_free_after=4800, parked_before=0, parked_after=0,
    )  # fmt: skip
    report = switch_report([handed, taken], {1000: {"h2d": 0.01, "d2h": 0.01}}, step_seconds=1.0)
    offload, onload = report["switches"]
    assert offload["handed_over_bytes"] == 9200 and offload["freed_bytes"] == 800 + 9200
    assert offload["freed_fraction"] == pytest.approx(1.0)
    assert onload["handed_over_bytes"] == 0 and onload["freed_bytes"] == 0
    # Without the hand-over the same device numbers would have freed only 8%.
    plain = attrs.evolve(handed, parked_after=0)
    assert switch_report([plain], {}, step_seconds=1.0)["min_freed_fraction"] == pytest.approx(0.08)
