"""A switch's engine calls: one per replica where the engine can do its part in one.

An engine whose release of ``kv_cache`` flushes its cache itself and refuses while a request
runs (``ControlClient.release_flushes``, the hf engine's) is released in one call, and waited
for with ``flush_cache`` only when it refused; one whose resume checks a generation when asked
(``resume_checks``) is onloaded in one call. Any other engine gets the calls SGLang needs.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from relax_core.errors import LifecycleError
from relax_core.manager.worker import EngineWorker
from relax_core.plugins import PluginManager
from tests.support import manager as support

TAGS = ["weights", "kv_cache", "cuda_graph"]


class _Control:
    """Records every engine call; ``refuse_release`` first releases are refused (busy)."""

    def __init__(
        self, *, flushes: bool, checks: bool, refuse_release: int = 0, checked: bool = True
    ) -> None:
        self.release_flushes = flushes
        self.resume_checks = checks
        self.refuse_release = refuse_release
        self.checked = checked
        self.calls: list[str] = []

    async def flush_cache(self, *, wait: float = 0.0, timeout: float | None = None) -> Any:
        self.calls.append("flush_cache")
        return {"success": True}

    async def release_memory(self, tags: Any, *, timeout: float | None = None) -> Any:
        self.calls.append("release")
        if self.refuse_release:
            self.refuse_release -= 1
            raise LifecycleError("release refused: 1 request(s) are in flight")
        return {"success": True}

    async def resume_memory(
        self, tags: Any, *, timeout: float | None = None, check_generation: bool = False
    ) -> Any:
        self.calls.append("resume+check" if check_generation else "resume")
        return {"success": True, "generation_checked": check_generation and self.checked}

    async def health_generate(self, *, timeout: float | None = None) -> None:
        self.calls.append("health_generate")

    async def pause_generation(self, mode: str, *, timeout: float | None = None) -> Any:
        self.calls.append(f"pause {mode}")
        return {"success": True}

    async def continue_generation(self, *, timeout: float | None = None) -> Any:
        self.calls.append("continue")
        return {"success": True}


class _Admission:
    is_open = False
    inflight = 0

    def close(self, reason: str) -> None:
        self.is_open = False

    def open(self) -> None:
        self.is_open = True

    async def wait_idle(self, timeout: float) -> bool:
        return True


def _worker(core_plugin_manager: PluginManager, control: _Control) -> EngineWorker:
    worker = support.bare_worker(core_plugin_manager, print)
    worker.control = control
    worker.admission = _Admission()  # type: ignore[assignment]
    return worker


def _switch(worker: EngineWorker) -> None:
    async def both() -> None:
        await worker.offload(TAGS, strict=True, drain_timeout=5, timeout=5)
        await worker.onload(TAGS, reopen=True, timeout=5)

    asyncio.run(both())


def test_a_plain_control_client_gets_the_calls_sglang_needs() -> None:
    from relax_core.engine.control import ControlClient

    plain = ControlClient("http://127.0.0.1:1")
    assert (plain.release_flushes, plain.resume_checks) == (False, False)
    both = ControlClient("http://127.0.0.1:1", release_flushes=True, resume_checks=True)
    assert (both.release_flushes, both.resume_checks) == (True, True)


@pytest.mark.parametrize(
    ("control", "calls"),
    [
        (_Control(flushes=True, checks=True), ["release", "resume+check"]),
        (
            _Control(flushes=True, checks=True, refuse_release=1),
            ["release", "flush_cache", "release", "resume+check"],
        ),
        (
            _Control(flushes=True, checks=True, checked=False),
            ["release", "resume+check", "health_generate"],
        ),
        (
            _Control(flushes=False, checks=False),
            ["flush_cache", "release", "resume", "health_generate"],
        ),
    ],
    ids=["one-call-each", "busy-release-waits", "check-not-done", "sglang-calls"],
)
def test_a_switch_makes_the_engine_calls_its_engine_needs(
    core_plugin_manager: PluginManager, control: _Control, calls: list[str]
) -> None:
    worker = _worker(core_plugin_manager, control)
    _switch(worker)
    assert control.calls == calls
    assert worker.admission is not None and worker.admission.is_open


def test_a_release_still_refused_after_the_wait_fails_the_offload(
    core_plugin_manager: PluginManager,
) -> None:
    control = _Control(flushes=True, checks=True, refuse_release=2)
    worker = _worker(core_plugin_manager, control)
    with pytest.raises(LifecycleError, match="in flight"):
        asyncio.run(worker.offload(TAGS, strict=True, drain_timeout=5, timeout=5))
    assert control.calls == ["release", "flush_cache", "release"]


@pytest.mark.parametrize("abort", [False, True], ids=["drained", "aborted"])
def test_a_switch_reports_its_seconds_and_those_of_its_parts(
    core_plugin_manager: PluginManager, abort: bool
) -> None:
    control = _Control(flushes=True, checks=True)
    worker = _worker(core_plugin_manager, control)

    async def both() -> tuple[dict[str, float], dict[str, float]]:
        out = await worker.offload(TAGS, strict=True, drain_timeout=5, timeout=5, abort=abort)
        return out, await worker.onload(TAGS, reopen=True, timeout=5)

    offload, onload = asyncio.run(both())
    assert set(offload) == {"seconds", "drain", "engine_calls"} and set(onload) == {
        "seconds", "engine_calls",
    }  # fmt: skip
    assert offload["seconds"] >= offload["drain"] + offload["engine_calls"] >= 0
    assert onload["seconds"] >= onload["engine_calls"] >= 0
    pause = ["pause abort"] if abort else []
    assert control.calls == [*pause, "release", *(["continue"] if abort else []), "resume+check"]
