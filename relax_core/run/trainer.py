"""The training consumer of ``relax run``: a trainer in a Ray actor, and the interface any
trainer implements.

A trainer is a class built from one :class:`TrainerContext` with two methods, run in its own
Ray actor (:func:`start_trainer`):

- ``train(batch_id) -> dict``: wait until batch ``batch_id`` is committed
  (``context.coordinator.wait_committed``; a failed batch raises
  :class:`~relax_core.errors.BatchFailedError`), read its partition from the batch sink
  (``context.sink.get(receipt.partition)``) with every scored field, take an optimizer step,
  delete the partition, and return what it measured (the numbers ``relax run`` prints);
- ``push(weight_version) -> dict``: send the current weights to the rollout engines through
  the generation model's manager (``context.rollout``, a manager actor:
  ``update_weights_from_tensor`` on the ACTOR path, behind the manager's fence), so the
  published weight version becomes ``weight_version``.

The two are called concurrently (the actor runs two calls at once): ``train(N)`` is asked for
at the start of step ``N`` and waits for the commit, while ``push`` of the weights trained on
batch ``N - 1`` runs before batch ``N`` is generated. A trainer guards its model accordingly
(the built-in one holds a lock around each optimizer step and each push).

:class:`PolicyTrainer` is the built-in one: the policy of :mod:`relax_core.run.policy` (the
checkpoint's own architecture, in float32) and the loss of :mod:`relax_core.run.loss`, with
Adam. It stands in for Megatron or FSDP: a real trainer keeps the same two methods (and may
push through ``update_weights_from_distributed`` instead); ``docs/run.md`` says how to plug
one in (``[run] trainer = "package.module:Class"``).
"""

from __future__ import annotations

import asyncio
import importlib
import statistics
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from relax_core.errors import ConfigError, LifecycleError
from relax_core.run.config import PUSH_FORMATS

__all__ = ["PolicyTrainer", "TrainerContext", "load_trainer_class", "start_trainer"]


@attrs.frozen
class TrainerContext:
    """Everything a trainer is built from (picklable: it travels to the trainer's actor).

    ``coordinator`` is the job's :class:`~relax_core.coordination.RemoteCoordinator`,
    ``sink`` its :class:`~relax_core.coordination.RayBatchSink`, ``rollout`` the manager actor
    of the generation model (weights are pushed through it). ``teacher_mode`` is ``sampled``,
    ``top-k`` or ``None`` (no teacher stage); ``commit_timeout`` bounds one
    ``wait_committed``.
    """

    job: str
    model_path: str
    coordinator: Any
    sink: Any
    rollout: Any
    device: str = "cpu"
    learning_rate: float = 1e-5
    clip: float = 0.2
    distill_coef: float = 0.0
    teacher_mode: str | None = None
    seed: int = 0
    push_format: str = "safetensors"
    micro_batch: int = 64
    commit_timeout: float = 3600.0


def load_trainer_class(path: str) -> Any:
    """The class ``package.module:Class`` names.

    :raises ConfigError: (``run.trainer``) the module cannot be imported or has no such
        class, or it lacks ``train`` / ``push``.
    """
    module_name, _, name = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError("run.trainer", f"cannot import {module_name!r}: {exc}") from None
    cls = getattr(module, name, None)
    if not isinstance(cls, type):
        raise ConfigError("run.trainer", f"{module_name!r} has no class {name!r}")
    missing = [m for m in ("train", "push") if not callable(getattr(cls, m, None))]
    if missing:
        raise ConfigError(
            "run.trainer",
            f"{path} has no {' and no '.join(missing)} method; a trainer implements "
            "train(batch_id) and push(weight_version) (docs/run.md#the-trainer)",
        )
    return cls


def start_trainer(
    context: TrainerContext,
    *,
    trainer: str,
    placement_group: Any = None,
    bundle_index: int = 0,
    num_gpus: float = 0.0,
    timeout: float = 300.0,
) -> Any:
    """Start the trainer class ``trainer`` (``package.module:Class``) in a Ray actor built from
    ``context``; return its handle once it is constructed (its model loaded).

    On a placement group the actor takes ``num_gpus`` of bundle ``bundle_index`` (the training
    share of a pool shared with inference), so it sees that bundle's GPU.

    :raises ConfigError: see :func:`load_trainer_class`; a bad ``push_format``.
    :raises LifecycleError: the actor failed to construct (its error quoted).
    """
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    cls = load_trainer_class(trainer)
    if context.push_format not in PUSH_FORMATS:
        raise ConfigError("run.push_format", f"must be one of {PUSH_FORMATS}")
    # Two calls at once: train(N) waits for batch N's commit while push() of the weights of
    # N - 1 runs (the run pushes before it generates batch N).
    options: dict[str, Any] = {
        "num_cpus": 0,
        "num_gpus": num_gpus,
        "max_restarts": 0,
        "max_concurrency": 2,
    }
    if placement_group is not None:
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=placement_group, placement_group_bundle_index=bundle_index
        )
    actor = ray.remote(cls).options(**options).remote(context)
    try:
        ray.get(actor.__ray_ready__.remote(), timeout=timeout)
    except ray.exceptions.RayActorError as exc:
        # The creation task's own error is the text's last line.
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        raise LifecycleError(
            f"the trainer {trainer} did not start: {lines[-1] if lines else exc}"
        ) from None
    except ray.exceptions.GetTimeoutError:
        ray.kill(actor, no_restart=True)
        raise LifecycleError(
            f"the trainer {trainer} was not constructed within {timeout:g}s (loading its model)"
        ) from None
    return actor


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


class PolicyTrainer:
    """The built-in trainer (see the module docstring). Runs inside its Ray actor; every
    method blocks."""

    def __init__(self, context: TrainerContext) -> None:
        import torch

        from relax_core.run.policy import load_policy

        self.context = context
        torch.manual_seed(context.seed)
        self.device = torch.device(context.device)
        self.policy = load_policy(context.model_path, device=context.device)
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=context.learning_rate)
        self.steps = 0
        self.parameters = sum(p.numel() for p in self.policy.parameters())
        self._model_lock = threading.Lock()

    def describe(self) -> dict[str, Any]:
        """What the trainer holds: parameters, device, optimizer steps taken."""
        return {"parameters": self.parameters, "device": str(self.device), "steps": self.steps}

    def train(self, batch_id: int) -> dict[str, Any]:
        """Wait for batch ``batch_id``'s commit, train on it, delete its partition.

        :raises BatchFailedError: the batch failed (nothing was trained on).
        :raises ValueError: a committed sample lacks a field the loss needs.
        """
        ctx = self.context
        began = time.perf_counter()
        receipt = _run(ctx.coordinator.wait_committed(batch_id, ctx.commit_timeout))
        waited = time.perf_counter() - began
        samples = _run(ctx.sink.get(receipt.partition))
        with self._model_lock:
            out = self._step(batch_id, samples)
        out["partition"] = receipt.partition
        out["wait_seconds"] = waited
        _run(ctx.sink.delete(receipt.partition))
        return out

    def _step(self, batch_id: int, samples: Sequence[Any]) -> dict[str, Any]:
        import torch

        from relax_core.run.loss import batch_loss, group_advantages, pad_batch

        ctx = self.context
        started = time.perf_counter()
        advantages = group_advantages(samples)
        total_tokens = sum(len(s.response_ids) for s in samples)
        self.policy.train()
        self.optimizer.zero_grad(set_to_none=True)
        reports = []
        for i in range(0, len(samples), ctx.micro_batch):
            chunk = samples[i : i + ctx.micro_batch]
            ids, mask, targets = pad_batch(chunk, self.device)
            with torch.autocast(
                device_type=self.device.type,
                dtype=torch.bfloat16,
                enabled=self.device.type == "cuda",
            ):
                logits = self.policy(ids)
            loss, report = batch_loss(
                logits,
                chunk,
                mask,
                targets,
                advantages=advantages[i : i + ctx.micro_batch],
                clip=ctx.clip,
                distill_coef=ctx.distill_coef,
                teacher_mode=ctx.teacher_mode,
            )
            # Token-weighted: the step's loss is the mean over every response token.
            (loss * (report.tokens / total_tokens)).backward()  # type: ignore[no-untyped-call]
            reports.append(report)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.policy.parameters(), 1.0))
        self.optimizer.step()
        self.steps += 1
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the next phase's engine reserves most of the GPU
        rewards = [float(s.reward or 0.0) for s in samples]
        out: dict[str, Any] = {
            "batch_id": batch_id,
            "samples": len(samples),
            "sample_ids": [s.id for s in samples],
            "tokens": total_tokens,
            "reward_mean": statistics.fmean(rewards),
            "reward_std": statistics.pstdev(rewards),
            "train_seconds": time.perf_counter() - started,
            "grad_norm": grad_norm,
            "optimizer_steps": self.steps,
        }
        out.update(_combine(reports))
        return out

    def push(self, weight_version: str) -> dict[str, Any]:
        """Send every weight to the rollout engines (one fenced update); return the version
        the manager published, the bytes and the seconds.

        :raises LifecycleError: some replica did not take the update (its error quoted).
        """
        import ray
        import torch

        from relax_core.engine.control import serialize_named_tensors

        began = time.perf_counter()
        fmt = None if self.context.push_format == "ipc" else "safetensors"
        with self._model_lock:
            pairs = list(self.policy.named_weights())
            nbytes = sum(t.numel() * t.element_size() for _, t in pairs)
            if fmt is None:
                torch.cuda.synchronize()
            payload = serialize_named_tensors(pairs, load_format=fmt)
            result = ray.get(
                self.context.rollout.update_weights_from_tensor.remote(
                    [payload], load_format=fmt, weight_version=weight_version
                )
            )
            del pairs  # kept alive until the engines copied them (IPC handles point at them)
        if not result.ok:
            raise LifecycleError(
                f"the weight push (version {weight_version}) was not taken: "
                + "; ".join(f"{r.engine_id}: {r.error}" for r in result.failed)
            )
        version = ray.get(self.context.rollout.weight_version.remote())
        return {
            "weight_version": version,
            "bytes": nbytes,
            "format": self.context.push_format,
            "seconds": time.perf_counter() - began,
        }

    def measure_copy(self, sizes: Sequence[int], repeats: int = 3) -> dict[int, dict[str, float]]:
        """Seconds of one pinned host-to-device and device-to-host copy of each byte count
        (median of ``repeats``), on the trainer's device — the baseline a phase switch of
        the same bytes is compared with. On a CPU device: a host memory copy each way."""
        import torch

        out: dict[int, dict[str, float]] = {}
        cuda = self.device.type == "cuda"
        for n in sorted(set(int(s) for s in sizes if s > 0)):
            host = torch.empty(n, dtype=torch.uint8, pin_memory=cuda)
            dev = torch.empty(n, dtype=torch.uint8, device=self.device)
            times: dict[str, list[float]] = {"h2d": [], "d2h": []}
            for _ in range(repeats + 1):
                for name, (dst, src) in (("h2d", (dev, host)), ("d2h", (host, dev))):
                    if cuda:
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    dst.copy_(src, non_blocking=cuda)
                    if cuda:
                        torch.cuda.synchronize()
                    times[name].append(time.perf_counter() - t0)
            out[n] = {k: statistics.median(v[1:]) for k, v in times.items()}
            del host, dev
            if cuda:
                torch.cuda.empty_cache()
        return out


def _combine(reports: Sequence[Any]) -> dict[str, Any]:
    """Token-weighted means of the micro-batches' loss reports."""
    tokens = sum(r.tokens for r in reports) or 1

    def mean(field: str) -> float | None:
        values = [(getattr(r, field), r.tokens) for r in reports]
        if any(v is None for v, _ in values):
            return None
        return float(sum(v * n for v, n in values) / tokens)

    out: Mapping[str, Any] = {
        name: mean(name)
        for name in (
            "loss",
            "policy_loss",
            "distill_loss",
            "teacher_kl",
            "teacher_logprob_mean",
            "ratio_mean",
            "clip_fraction",
        )
    }
    return dict(out)
