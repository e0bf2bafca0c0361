"""``relax rewards try ADAPTER``: one registered reward adapter on one sample, run as a user runs
it (the ``relax`` command in a subprocess), with nothing started.

The adapters are registered for real: the shipped ``relax-reward-rules`` (contrib), ``relax-genrm``
and the test suite's ``relax-testplugin``, plus distributions these tests put on ``PYTHONPATH``
(a package and its ``.dist-info`` with a ``relax`` entry point, found by entry-point discovery
as an installed plugin is) for what no shipped adapter does: return NaN, inf or a word, read the
metadata, take the same name as a shipped adapter.
"""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import pytest

from tests.support import commands
from tests.support.gateway import Registry, gateway, snapshot, upstream

TRIAL_PLUGIN = """
import math

from relax_core import RewardResult, RewardSpec, hookimpl


def nan(response, label):
    return math.nan


async def infinite(response, label, *, context):
    return RewardResult(math.inf)


def word(response, label):
    return "yes"


def bonus(response, label, *, metadata):
    return float(metadata["bonus"])


async def prompt_words(response, label, *, context):
    words = len(context.prompt.split())
    return RewardResult(float(words), parse_failed=True, detail=f"prompt {context.prompt!r}")


@hookimpl
def relax_register_reward_adapters(register):
    register(RewardSpec(name="trial-nan", fn=nan))
    register(RewardSpec(name="trial-inf", fn=infinite, mode="async"))
    register(RewardSpec(name="trial-word", fn=word))
    register(RewardSpec(name="trial-bonus", fn=bonus, pass_metadata=True))
    register(RewardSpec(name="trial-prompt-words", fn=prompt_words, mode="async"))
"""

#: A plugin that takes a name the shipped relax-reward-rules already registered.
SHADOW_PLUGIN = """
from relax_core import RewardSpec, hookimpl


@hookimpl
def relax_register_reward_adapters(register):
    register(RewardSpec(name="exact-match", fn=lambda response, label: 1.0))
"""


def _distribution(site: Path, dist: str, entry_point: str, source: str) -> None:
    """Install ``source`` as the package of distribution ``dist`` into ``site``, the way pip
    leaves it: the package and a ``.dist-info`` whose ``relax`` entry point names it."""
    package = dist.replace("-", "_")
    (site / package).mkdir(parents=True)
    (site / package / "__init__.py").write_text(textwrap.dedent(source))
    info = site / f"{package}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[relax]\n{entry_point} = {package}\n")


@pytest.fixture(scope="module")
def trial_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    site = tmp_path_factory.mktemp("trial-site")
    _distribution(site, "relax-trial-rewards", "trial-rewards", TRIAL_PLUGIN)
    return site


def _relax(
    *args: str, site: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return commands.relax(*args, site=site, env=env)


def _try(*args: str, site: Path | None = None) -> subprocess.CompletedProcess[str]:
    return _relax("rewards", "try", *args, site=site)


def test_a_shipped_adapter_prints_its_reward_and_its_distribution() -> None:
    out = _try("exact-match", "--prompt", "What is 2 + 2?", "--response", " 4 ", "--label", "4")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "reward adapter  exact-match (relax-reward-rules; sync; supports_deferred)",
        "reward          1.0",
    ]


def test_json_prints_one_object_with_the_reward() -> None:
    out = _try("digits", "--prompt", "What is 2 + 10?", "--response", "a12", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {
        "adapter": "digits",
        "distribution": "relax-reward-rules",
        "mode": "sync",
        "supports_deferred": True,
        "reward": pytest.approx(2 / 3),
        "parse_failed": False,
        "detail": None,
    }


def test_without_label_an_adapter_that_scores_only_labelled_samples_says_so() -> None:
    out = _try("exact-match", "--prompt", "What is 2 + 2?", "--response", "4")
    assert out.returncode == 1
    assert "reward adapter 'exact-match' (relax-reward-rules)" in out.stderr
    assert "does not score a sample with label None" in out.stderr
    assert "fails validation if no other adapter of the step scores it; give --label" in out.stderr
    assert out.stdout == ""


def test_an_unknown_adapter_lists_the_registered_ones_and_exits_2() -> None:
    out = _try("exact-mtach", "--prompt", "p", "--response", "r")
    assert out.returncode == 2
    assert "no reward adapter named 'exact-mtach' is registered" in out.stderr
    assert "exact-match (relax-reward-rules)" in out.stderr
    assert "test-exact-match (relax-testplugin)" in out.stderr


def test_an_adapter_that_raises_prints_its_name_and_the_exception_and_exits_1() -> None:
    # relax-testplugin's adapter has no label matcher and calls label.strip(): None breaks it.
    out = _try("test-exact-match", "--prompt", "p", "--response", "r")
    assert out.returncode == 1
    last = out.stderr.splitlines()[-1]
    assert last == (
        "relax rewards try: reward adapter 'test-exact-match' (relax-testplugin) raised "
        "AttributeError: 'NoneType' object has no attribute 'strip'"
    )
    # The traceback starts in the adapter's own code, where the fix is.
    lines = out.stderr.splitlines()
    first_frame = lines[lines.index("Traceback (most recent call last):") + 1]
    assert first_frame.endswith(", in exact_match"), out.stderr


def test_a_nan_reward_is_refused_naming_the_adapter_and_what_relax_run_would_do(
    trial_site: Path,
) -> None:
    out = _try("trial-nan", "--prompt", "p", "--response", "r", site=trial_site)
    assert out.returncode == 1
    assert "reward adapter 'trial-nan' (relax-trial-rewards) returned nan" in out.stderr
    assert "not a finite number" in out.stderr
    assert "fails the step's batch at validation" in out.stderr
    assert "it is not committed, and the run stops" in out.stderr


def test_an_infinite_reward_result_of_an_async_adapter_is_refused_too(trial_site: Path) -> None:
    out = _try("trial-inf", "--prompt", "p", "--response", "r", "--json", site=trial_site)
    assert out.returncode == 1
    row = json.loads(out.stdout)
    assert row["adapter"] == "trial-inf" and row["reward"] is None
    assert "returned inf, not a finite number" in row["error"]
    assert row["error"] in out.stderr


def test_an_answer_that_is_not_a_number_is_refused(trial_site: Path) -> None:
    out = _try("trial-word", "--prompt", "p", "--response", "r", site=trial_site)
    assert out.returncode == 1
    assert "returned 'yes': a reward adapter returns a number or a RewardResult" in out.stderr
    assert "fails the step at its reward stage, naming the adapter" in out.stderr


def test_metadata_reaches_an_adapter_that_asks_for_it(trial_site: Path) -> None:
    out = _try(
        "trial-bonus",
        *("--prompt", "p", "--response", "r", "--metadata", '{"bonus": 0.25}', "--json"),
        site=trial_site,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["reward"] == 0.25


def test_an_async_adapter_reads_the_prompt_from_its_context_and_its_detail_is_printed(
    trial_site: Path,
) -> None:
    out = _try(
        "trial-prompt-words", "--prompt", "one two three", "--response", "r", site=trial_site
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "reward adapter  trial-prompt-words (relax-trial-rewards; async)",
        "reward          3.0",
        "parse failed    yes: its source held no verdict (`relax run` counts it in "
        "trial-prompt-words.parse_failures)",
        "detail          prompt 'one two three'",
    ]


def test_an_adapter_calling_a_role_not_given_says_to_give_it_with_role_and_exits_2() -> None:
    out = _try("genrm-judge", "--prompt", "What is 2 + 2?", "--response", "4", "--label", "4")
    assert out.returncode == 2
    assert out.stderr.strip() == (
        "relax rewards try: reward adapter 'genrm-judge' (relax-genrm) calls the role 'genrm': "
        "give its gateway, e.g. --role genrm=http://127.0.0.1:8100/genrm (a job started with "
        "`relax serve`)"
    )


def test_the_genrm_judge_asks_the_role_given_with_role_and_reads_its_verdict() -> None:
    # The engine behind the genrm gateway answers "<its name>: tok0 tok1 …": named "right", its
    # answer holds the judge's yes-like word, a verdict of 1.0.
    with upstream("right") as engine:
        registry = Registry(snapshot("genrm", {"judge": {"urls": [engine.url]}}))
        with gateway("genrm", registry) as url:
            out = _try(
                "genrm-judge",
                *("--prompt", "What is 2 + 2?", "--response", "4", "--label", "4"),
                *("--role", f"genrm={url}/genrm", "--json"),
            )
        sent = engine.last()
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout)
    assert (row["reward"], row["parse_failed"]) == (1.0, False)
    # The detail is the tail of the judge's answer.
    answer = "right: " + " ".join(f"tok{i}" for i in range(sent["body"]["max_tokens"]))
    assert answer.endswith(row["detail"]) and len(row["detail"]) > 100
    assert sent["path"] == "/v1/chat/completions"
    assert "What is 2 + 2?" in json.dumps(sent["body"]["messages"])


def test_rewards_without_an_action_prints_its_help_and_exits_2() -> None:
    out = _relax("rewards")
    assert out.returncode == 2
    assert "usage: relax rewards [-h] ACTION" in out.stderr
    assert "try " in out.stderr
    assert "relax rewards: give an action, e.g. relax rewards try exact-match" in out.stderr


def test_metadata_that_is_not_a_json_object_is_a_usage_error() -> None:
    out = _try("digits", "--prompt", "p", "--response", "r", "--metadata", "[1]")
    assert out.returncode == 2
    assert "argument --metadata: give a JSON object" in out.stderr


def test_a_role_without_its_gateway_url_is_a_usage_error() -> None:
    out = _try("genrm-judge", "--prompt", "p", "--response", "r", "--role", "genrm")
    assert out.returncode == 2
    assert "argument --role: give ROLE=URL, a role's gateway" in out.stderr


def test_an_adapter_name_taken_twice_stops_relax_naming_both_distributions_and_the_way_out(
    tmp_path: Path,
) -> None:
    _distribution(tmp_path, "relax-my-exact-match", "my-exact-match", SHADOW_PLUGIN)
    out = _try("exact-match", "--prompt", "p", "--response", "4", "--label", "4", site=tmp_path)
    assert out.returncode == 2
    assert out.stderr.strip() == (
        "relax rewards: error: reward adapter name 'exact-match' is registered twice: by plugin "
        "'my-exact-match' (distribution 'relax-my-exact-match') and by plugin 'reward-rules' "
        "(distribution 'relax-reward-rules'); names are unique per kind, so Relax stops here. "
        "Rename the reward adapter in one of them, or disable one plugin by its entry-point "
        "name: RELAX_DISABLE_PLUGINS=my-exact-match or RELAX_DISABLE_PLUGINS=reward-rules"
    )
    # The way out it names works.
    again = _relax(
        *("rewards", "try", "exact-match", "--prompt", "p", "--response", "4", "--label", "4"),
        site=tmp_path,
        env={"RELAX_DISABLE_PLUGINS": "my-exact-match"},
    )
    assert again.returncode == 0, again.stderr
    assert "exact-match (relax-reward-rules; sync; supports_deferred)" in again.stdout
