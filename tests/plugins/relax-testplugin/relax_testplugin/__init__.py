"""A test plugin: reward adapters, one routing policy, one engine backend (``test-sim``), one
trainer (``record-fields``), one tracker that raises (``raises``) and one environment that
raises in the second step (``fails-on-step-1``), found through the entry point."""

from __future__ import annotations

import asyncio
import sys
import zlib
from collections.abc import Callable, Mapping
from typing import Any

from relax_agent import Observation, Reset, Turn

from relax_core import (
    ControlClient,
    EngineBackend,
    EngineLaunchSpec,
    EnvironmentSpec,
    RewardSpec,
    RoutingPolicy,
    SubprocessEngineProcess,
    TrackerContext,
    TrackerSpec,
    TrainerContext,
    TrainerSpec,
    hookimpl,
)


def exact_match(response: str, label: str) -> float:
    return 1.0 if response.strip() == label.strip() else 0.0


def constant_or_checksum(response: str, label: str | None, metadata: Mapping[str, Any]) -> float:
    """0.5 for every sample of a prompt whose metadata says ``constant`` (its group's rewards
    do not vary), else a checksum of the response in [0, 1) (they do, unless two responses are
    the same): groups a dynamic-sampling test knows in advance."""
    if metadata.get("constant"):
        return 0.5
    return (zlib.crc32(response.encode()) % 1000) / 1000


class RecordFields:
    """A trainer that trains on nothing: it waits for each batch's commit, reads it, deletes it
    and reports the sample fields and the samples it got (``fields``, ``samples``); ``push``
    reloads rollout's own checkpoint under the version it was asked for (the weights stay the
    same, the version rollout serves moves, as the driver's staleness check requires)."""

    def __init__(self, context: TrainerContext) -> None:
        self.context = context

    def train(self, batch_id: int) -> dict[str, Any]:
        ctx = self.context
        receipt = asyncio.run(ctx.coordinator.wait_committed(batch_id, ctx.commit_timeout))
        samples = asyncio.run(ctx.sink.get(receipt.partition))
        asyncio.run(ctx.sink.delete(receipt.partition))
        fields = sorted({name for s in samples for name in s.fields})
        return {"samples": len(samples), "fields": fields, "declared": list(ctx.fields)}

    def push(self, weight_version: str) -> dict[str, Any]:
        import ray

        update = self.context.rollout.update_weights_from_disk.remote(
            self.context.model_path, weight_version=weight_version
        )
        ray.get(update).raise_for_failures()
        return {"weight_version": weight_version}


class FirstSelector:
    """Always picks the first candidate (deterministic; only for tests)."""

    def select(self, *, candidates: tuple[Any, ...], **_: Any) -> Any:
        return candidates[0]


@hookimpl
def relax_register_reward_adapters(register: Callable[[RewardSpec], None]) -> None:
    register(RewardSpec(name="test-exact-match", fn=exact_match, description="test plugin"))
    register(
        RewardSpec(
            name="constant-or-checksum",
            fn=constant_or_checksum,
            pass_metadata=True,
            supports_deferred=True,
            description="test plugin: 0.5 for prompts marked constant, else a response checksum",
        )
    )


@hookimpl
def relax_register_trainers(register: Callable[[TrainerSpec], None]) -> None:
    register(
        TrainerSpec(
            name="record-fields",
            trainer_class=RecordFields,
            description="test plugin: reads each batch and reports its fields; trains nothing",
        )
    )


@hookimpl
def relax_register_routing_policies(register: Callable[[RoutingPolicy], None]) -> None:
    register(RoutingPolicy(name="test-first", factory=FirstSelector, description="test plugin"))


def _launch_sim(spec: EngineLaunchSpec) -> SubprocessEngineProcess:
    """The core's lightweight SGLang-protocol engine (no model) as a real engine process."""
    argv = [sys.executable, "-m", "relax_bench._sim_engine", "--host", spec.host]
    argv += ["--port", str(spec.port), "--engine-id", spec.engine_id]
    argv += ["--nnodes", str(spec.nnodes), "--node-rank", str(spec.node_rank)]
    if spec.dist_init_addr:
        argv += ["--dist-init-addr", spec.dist_init_addr]
    return SubprocessEngineProcess.start(
        [*argv, *spec.options.extra_args],
        base_url=f"http://{spec.host}:{spec.port}" if spec.node_rank == 0 else None,
        engine_id=spec.engine_id,
        log_path=spec.log_path,
    )


@hookimpl
def relax_register_engine_backends(register: Callable[[EngineBackend], None]) -> None:
    # Declared for cuda too (it touches no device), so a test can place it on Ray's fake GPUs
    # and exercise placement groups under `relax serve` without a GPU or a model.
    register(
        EngineBackend(
            name="test-sim",
            launch=_launch_sim,
            control_client=ControlClient,
            devices={"cpu", "cuda"},
            multi_node=True,
            description="test plugin: the core's simulated SGLang-protocol engine, no model",
            loads_model_dir=False,
        )
    )


class RaisesTracker:
    """A tracker that raises on the step its ``step`` option names (default 0) and counts what
    it heard before, in ``RUN_DIR/raises.log``: a run must report it once and go on."""

    def __init__(self, context: TrackerContext) -> None:
        self.step = int(context.options.get("step", 0))
        self.log = open(f"{context.run_dir}/raises.log", "a")  # noqa: SIM115 - closed in close()

    def _heard(self, what: str) -> None:
        self.log.write(what + "\n")
        self.log.flush()

    def log_config(self, config: Mapping[str, Any]) -> None:
        self._heard("config")

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        self._heard(f"metrics {step}")
        if step == self.step:
            raise RuntimeError(f"the raises tracker raises at step {step}")

    def log_span(self, span: Any) -> None:
        self._heard("span")

    def log_samples(self, step: int, samples: Any) -> None:
        self._heard(f"samples {step}")

    def close(self, summary: Mapping[str, Any] | None) -> None:
        self._heard("close")
        self.log.close()


@hookimpl
def relax_register_trackers(register: Callable[[TrackerSpec], None]) -> None:
    register(
        TrackerSpec(
            name="raises",
            open=RaisesTracker,
            options=("step",),
            description="test plugin: raises in log_metrics at one step",
        )
    )


class FailsOnStep1:
    """An environment that ends every trajectory after one turn in step 0 and raises on the
    first turn of step 1 (its trajectories are ``b1-…``): a step failed by its environment."""

    def __init__(self, config: Any) -> None:
        self.trajectory = config.trajectory_id

    def reset(self, prompt: Any) -> Reset:
        return Reset([{"role": "user", "content": prompt.prompt}])

    def step(self, turn: Turn) -> Observation:
        if self.trajectory.startswith("b1-"):
            raise RuntimeError("the environment broke on purpose")
        return Observation(reward=1.0, done=True)


@hookimpl
def relax_register_environments(register: Callable[[EnvironmentSpec], None]) -> None:
    register(
        EnvironmentSpec(
            name="fails-on-step-1",
            make=FailsOnStep1,
            description="test plugin: raises on the first turn of step 1",
        )
    )
