"""``relax rewards try ADAPTER --prompt P --response R [--label L]``: one adapter, one sample.

``try`` calls a registered reward adapter (a :class:`~relax_core.records.RewardSpec`) as the
reward stage of ``relax run`` calls it — ``fn(response, label)``, plus ``metadata=`` when the
adapter asks for it and ``context=`` (a :class:`~relax_core.coordination.RewardContext`) when it
is ``async`` — but here, in this process, on one sample, with nothing started: no Ray, no
engines. A sync adapter runs in this process instead of a Ray worker. An adapter that calls a
role (the genrm judge) reaches it through ``--role ROLE=URL``, the gateway of a running job.

It prints the reward, and what a :class:`~relax_core.coordination.RewardResult` adds (a judge's
parse failure, its detail). What ``relax run`` would refuse, it refuses too, saying what the run
would do: a reward that is not a finite number, an answer that is not a number or a
``RewardResult``, an adapter that raises, and a label the adapter's ``label_matcher`` does not
score.

Exit status: 0 the adapter returned a finite reward; 1 it did not (it raised, returned a
non-finite number or something else, or does not score a sample with this label); 2 bad usage
(no action, an unknown adapter, a bad ``--metadata`` or ``--role``, an adapter calling a role
not given with ``--role``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import sys
import traceback
from types import TracebackType
from typing import Any

from relax_core import (
    InferenceClient,
    PluginManager,
    RewardContext,
    RewardResult,
    RewardSpec,
    RoleClients,
    Sample,
)

NAME = "rewards"
HELP = "Try a registered reward adapter on one prompt and response (starts nothing)."

_PREFIX = "relax rewards try"
#: A role's name, as the job file takes it.
_ROLE_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]*$")
#: What ``relax run`` does with a step whose reward stage fails (an adapter raised or returned
#: something that is not a number) or whose batch fails validation (a non-finite reward).
_RUN_STOPS = "and the run stops (exit status 1)"


def _metadata(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            f'give a JSON object, e.g. {{"route_key": "math"}}: {text}'
        )
    return value


def _role_source(text: str) -> tuple[str, str]:
    role, _, url = text.partition("=")
    if not _ROLE_NAME.match(role) or not url.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(
            f"give ROLE=URL, a role's gateway, e.g. genrm=http://127.0.0.1:8100/genrm: {text!r}"
        )
    return role, url.rstrip("/")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(_rewards_help=parser.format_help)
    sub = parser.add_subparsers(dest="action", metavar="ACTION")
    text = "run one registered reward adapter on one sample and print its reward"
    p = sub.add_parser("try", help=text, description=text)
    p.add_argument("adapter", help="the reward adapter's name (`relax plugins` lists them)")
    p.add_argument("--prompt", required=True, help="the sample's prompt text")
    p.add_argument("--response", required=True, help="the response text to score")
    p.add_argument(
        "--label",
        help="the sample's label (its reference answer); omitted: None, a prompt without one",
    )
    p.add_argument(
        "--metadata",
        type=_metadata,
        default={},
        metavar="JSON",
        help="the sample's metadata, a JSON object (given to adapters with pass_metadata; "
        "route_key picks a role's model)",
    )
    p.add_argument(
        "--role",
        type=_role_source,
        action="append",
        default=[],
        metavar="ROLE=URL",
        help="the gateway of a role the adapter calls, e.g. genrm=http://127.0.0.1:8100/genrm "
        "(a job started with `relax serve`); repeatable",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")


class _RoleNotGiven(LookupError):
    """An async adapter asked for the client of a role no ``--role`` names."""

    def __init__(self, role: str) -> None:
        super().__init__(role)
        self.role = role


class _GivenRoles(RoleClients):
    """The roles given with ``--role``; asking for another stops the adapter with a hint."""

    def client(self, role: str) -> InferenceClient:
        if role not in self.sources:
            raise _RoleNotGiven(role)
        return super().client(role)


def run(args: argparse.Namespace) -> int:
    if args.action is None:
        print(args._rewards_help(), file=sys.stderr)
        print(
            "relax rewards: give an action, e.g. relax rewards try exact-match --prompt 'What is "
            "2 + 2?' --response 4 --label 4",
            file=sys.stderr,
        )
        return 2
    return _try(args)


def _try(args: argparse.Namespace) -> int:
    """``relax rewards try``: the adapter on the sample, reported; the exit status."""
    table = PluginManager.create().registered("reward_adapters")
    found = table.get(args.adapter)
    if found is None:
        known = ", ".join(f"{n} ({r.distribution})" for n, r in sorted(table.items()))
        print(
            f"{_PREFIX}: no reward adapter named {args.adapter!r} is registered; registered: "
            f"{known or 'none'}. Install and enable the plugin that provides it "
            "(`relax plugins` lists every record and its distribution).",
            file=sys.stderr,
        )
        return 2
    trial = _Trial(found, args.json)
    spec = found.record
    sample = Sample(
        id="try-0",
        group_id="try",
        prompt_ids=(),
        response_ids=(),
        prompt=args.prompt,
        response=args.response,
        label=args.label,
        metadata=dict(args.metadata),
    )
    try:
        scores = spec.label_matcher is None or spec.label_matcher(sample.label)
    except Exception as exc:
        return trial.failed(f"its label_matcher raised {_exception(exc)}", exc)
    if not scores:
        return trial.failed(
            f"does not score a sample with label {sample.label!r} (its label_matcher refuses "
            "it). In `relax run` such a sample gets no reward from it, and fails validation if "
            "no other adapter of the step scores it"
            + ("; give --label" if sample.label is None else "")
        )
    try:
        value = _call(spec, sample, dict(args.role))
    except _RoleNotGiven as exc:
        return trial.failed(
            f"calls the role {exc.role!r}: give its gateway, e.g. --role "
            f"{exc.role}=http://127.0.0.1:8100/{exc.role} (a job started with `relax serve`)",
            status=2,
        )
    except Exception as exc:
        return trial.failed(f"raised {_exception(exc)}", exc)
    return trial.scored(value)


def _call(spec: RewardSpec, sample: Sample, roles: dict[str, str]) -> object:
    """``spec.fn`` on ``sample`` with the arguments the reward stage gives it."""
    kwargs: dict[str, Any] = {}
    if spec.pass_metadata:
        kwargs["metadata"] = sample.metadata
    if spec.mode == "sync":
        return spec.fn(sample.response, sample.label, **kwargs)

    async def once() -> object:
        context = RewardContext(sample, 0, _GivenRoles(roles))
        return await spec.fn(sample.response, sample.label, context=context, **kwargs)

    return asyncio.run(once())


def _adapter_frames(exc: BaseException) -> TracebackType | None:
    """``exc``'s traceback from the adapter's first frame on (this module's and asyncio's
    frames above it say nothing about the adapter)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_globals.get("__name__", "").startswith(
        (__name__, "asyncio.")
    ):
        tb = tb.tb_next
    return tb or exc.__traceback__


def _exception(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class _Trial:
    """How one try is reported: text on stdout (errors on stderr), or one JSON object."""

    def __init__(self, found: Any, as_json: bool) -> None:
        # ``found``: the adapter's registration (its ``record`` and ``distribution``).
        self.spec: RewardSpec = found.record
        self.distribution = found.distribution
        self.as_json = as_json

    def _row(self, **fields: Any) -> dict[str, Any]:
        return {
            "adapter": self.spec.name,
            "distribution": self.distribution,
            "mode": self.spec.mode,
            "supports_deferred": self.spec.supports_deferred,
            **fields,
        }

    def failed(self, why: str, exc: BaseException | None = None, *, status: int = 1) -> int:
        """Report that the adapter gave no usable reward (``why``, ``exc``'s traceback first);
        return ``status``."""
        if exc is not None:
            traceback.print_exception(type(exc), exc, _adapter_frames(exc), file=sys.stderr)
        message = f"{_PREFIX}: reward adapter {self.spec.name!r} ({self.distribution}) {why}"
        print(message, file=sys.stderr)
        if self.as_json:
            print(json.dumps(self._row(reward=None, error=message)))
        return status

    def scored(self, value: object) -> int:
        """Report ``value``, the adapter's answer, as ``relax run`` would take it."""
        if isinstance(value, RewardResult):
            result = value
        elif isinstance(value, int | float) and not isinstance(value, bool):
            result = RewardResult(float(value))
        else:
            return self.failed(
                f"returned {value!r}: a reward adapter returns a number or a RewardResult. "
                f"`relax run` fails the step at its reward stage, naming the adapter, {_RUN_STOPS}"
            )
        reward = result.value
        if isinstance(reward, bool) or not isinstance(reward, int | float):
            return self.failed(
                f"returned a RewardResult whose value is {reward!r}, not a number. `relax run` "
                f"fails the step's batch at validation: it is not committed, {_RUN_STOPS}"
            )
        if not math.isfinite(reward):
            return self.failed(
                f"returned {reward!r}, not a finite number. `relax run` fails the step's batch "
                f"at validation (the error names the adapter): it is not committed, {_RUN_STOPS}"
            )
        if self.as_json:
            row = self._row(
                reward=float(reward), parse_failed=result.parse_failed, detail=result.detail
            )
            print(json.dumps(row))
            return 0
        deferred = "; supports_deferred" if self.spec.supports_deferred else ""
        print(f"reward adapter  {self.spec.name} ({self.distribution}; {self.spec.mode}{deferred})")
        print(f"reward          {float(reward)!r}")
        if result.parse_failed:
            print(
                "parse failed    yes: its source held no verdict (`relax run` counts it in "
                f"{self.spec.name}.parse_failures)"
            )
        if result.detail is not None:
            print(f"detail          {result.detail}")
        return 0
