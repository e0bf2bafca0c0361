"""The reference trainer: GRPO and on-policy distillation on a torch Llama, in a Ray actor.

:class:`PolicyTrainer` implements :class:`relax_core.Trainer` with the policy of
:mod:`relax_torch_trainer.policy` (the checkpoint's own architecture, in float32, bf16
autocast on CUDA) and the loss of :mod:`relax_torch_trainer.loss`, with Adam. It stands in for
Megatron or FSDP: a real trainer keeps the same two methods (and may push through
``update_weights_from_distributed`` instead).

- ``train(batch_id)`` waits for the batch's commit, reads its partition from the batch sink,
  takes one optimizer step over it in micro-batches (the loss token-weighted over the whole
  batch), deletes the partition and returns the loss report;
- ``push(weight_version)`` sends every weight, in the checkpoint's dtype, to the rollout
  engines in one fenced update (safetensors bytes, or CUDA IPC handles);
- ``measure_copy(sizes)`` times the pinned copies ``relax run --measure`` compares each phase
  switch with.

``train`` and ``push`` run concurrently in the actor, so each holds the model's lock. torch is
imported inside the methods: importing this module (as loading the plugin does) imports none.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from relax_core import LifecycleError, TrainerContext

__all__ = ["PolicyTrainer"]


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


class PolicyTrainer:
    """The reference trainer (see the module docstring), registered as ``grpo``. Built from a
    :class:`~relax_core.TrainerContext` inside its Ray actor; every method blocks."""

    def __init__(self, context: TrainerContext) -> None:
        import torch

        from relax_torch_trainer.policy import load_policy

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

        from relax_torch_trainer.loss import batch_loss, group_advantages, pad_batch, teacher_mode

        ctx = self.context
        started = time.perf_counter()
        advantages = group_advantages(samples)
        # Trained tokens (loss mask 1): micro-batches are weighted by them.
        total_tokens = max(sum(sum(s.trained()) for s in samples), 1)
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
                importance_cap=ctx.importance_cap,
                distill_coef=ctx.distill_coef,
                teacher_mode=teacher_mode(ctx.fields),
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
            "fields": sorted({name for s in samples for name in s.fields}),
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

        from relax_core import serialize_named_tensors

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
                    [payload],
                    load_format=fmt,
                    weight_version=weight_version,
                    # async steps: generation paused, not fenced (requests in flight kept)
                    **({"pause": self.context.push_pause} if self.context.push_pause else {}),
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
            "importance_weight_mean",
            "truncated_fraction",
        )
    }
    return dict(out)
