"""The reference trainer: GRPO and on-policy distillation on a torch Llama, in a Ray actor.

:class:`PolicyTrainer` implements :class:`relax_core.Trainer` with the policy of
:mod:`relax_torch_trainer.policy` (the checkpoint's own architecture, in float32, bf16
autocast on CUDA) and the loss of :mod:`relax_torch_trainer.loss`, with Adam. It stands in for
Megatron or FSDP: a real trainer keeps the same two methods.

- ``train(batch_id)`` waits for the batch's commit, reads its partition from the batch sink,
  takes one optimizer step over it in micro-batches (the loss token-weighted over the whole
  batch), deletes the partition and returns the loss report;
- ``push(weight_version)`` sends every weight, in the checkpoint's dtype, to the rollout
  engines in one fenced manager update, in buckets of ``push_bucket_bytes`` (one engine call
  each: a safetensors file, one CUDA IPC handle of a flat buffer, or one broadcast of it);
- ``measure_copy(sizes)`` times the pinned copies ``relax run --measure`` compares each phase
  switch with;
- ``save(directory)`` / ``load(directory)``: the run's checkpoints (``relax run --resume``):
  the policy's weights, Adam's state, the optimizer steps taken and torch's RNG, in one
  ``trainer.pt``, so a resumed run's optimizer goes on where it stopped.

``train`` and ``push`` run concurrently in the actor, so each holds the model's lock. torch is
imported inside the methods: importing this module (as loading the plugin does) imports none.
"""

from __future__ import annotations

import asyncio
import datetime
import statistics
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from relax_core import LifecycleError, TrainerContext
from relax_torch_trainer.options import GRPOOptions

__all__ = ["PolicyTrainer"]

#: The file of :meth:`PolicyTrainer.save` in its directory.
STATE_FILE = "trainer.pt"
#: The deadline of the ``distributed`` push's group: its rendezvous and each broadcast.
_GROUP_TIMEOUT = datetime.timedelta(minutes=5)


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


class PolicyTrainer:
    """The reference trainer (see the module docstring), registered as ``grpo``. Built from a
    :class:`~relax_core.TrainerContext` inside its Ray actor; every method blocks."""

    def __init__(self, context: TrainerContext) -> None:
        import torch

        from relax_torch_trainer.policy import load_policy

        self.context = context
        #: The ``[run]`` keys this trainer reads (their defaults without a job file's).
        self.options = context.options if context.options is not None else GRPOOptions()
        torch.manual_seed(context.seed)
        self.device = torch.device(context.device)
        self.policy = load_policy(context.model_path, device=context.device)
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=self.options.learning_rate)
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

    def save(self, directory: str) -> dict[str, Any]:
        """Write the trainer's state to ``directory/trainer.pt`` (a temp file renamed into
        place): the policy's weights, Adam's state, the optimizer steps and torch's RNG;
        return ``{"optimizer_steps": N, "bytes": size}``."""
        import os

        import torch

        path = os.path.join(directory, STATE_FILE)
        with self._model_lock:
            state = {
                "policy": self.policy.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "steps": self.steps,
                "rng": torch.get_rng_state(),
            }
            torch.save(state, f"{path}.tmp")
        os.replace(f"{path}.tmp", path)
        return {"optimizer_steps": self.steps, "bytes": os.path.getsize(path)}

    def load(self, directory: str) -> dict[str, Any]:
        """Read back what :meth:`save` wrote to ``directory``; return
        ``{"optimizer_steps": N}``.

        :raises LifecycleError: no state there, or one of another model (its error quoted).
        """
        import os

        import torch

        path = os.path.join(directory, STATE_FILE)
        try:
            state = torch.load(path, map_location=self.device, weights_only=True)
            with self._model_lock:
                self.policy.load_state_dict(state["policy"])
                self.optimizer.load_state_dict(state["optimizer"])
                self.steps = int(state["steps"])
                torch.set_rng_state(state["rng"].cpu())
        except (OSError, RuntimeError, KeyError, ValueError) as exc:
            raise LifecycleError(
                f"the trainer's state in {path} cannot be loaded ({type(exc).__name__}: {exc}); "
                "it must be a checkpoint of the same model"
            ) from None
        return {"optimizer_steps": self.steps}

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
                clip=self.options.clip,
                importance_cap=self.options.cap(ctx.mode),
                distill_coef=self.options.distill_weight(),
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
        """Send every weight to the rollout engines, in buckets of ``push_bucket_bytes``, in
        one fenced manager update; return the version the manager published, the bytes, the
        buckets and the seconds.

        ``push_format``: ``safetensors`` (one safetensors file per bucket), ``ipc`` (one flat
        CUDA buffer per bucket, SGLang's ``flattened_bucket``: one IPC handle each) or
        ``distributed`` (a broadcast group made for the push: one broadcast of each bucket's
        flat buffer from this process, rank 0, while the manager's update receives them).

        :raises LifecycleError: some replica did not take the update (its error quoted: which
            bucket failed; such a replica is FAILED and the published version did not move).
        """
        import ray

        from relax_core import plan_weight_buckets

        began = time.perf_counter()
        fmt = self.context.push_format
        pause = {"pause": self.context.push_pause} if self.context.push_pause else {}
        with self._model_lock:
            pairs = dict(self.policy.named_weights())
            buckets = plan_weight_buckets(pairs.items(), self.context.push_bucket_bytes)
            nbytes = sum(b.nbytes for b in buckets)
            if fmt == "distributed":
                result = self._push_distributed(pairs, buckets, weight_version, pause)
            else:
                result = self._push_tensors(pairs, buckets, weight_version, pause)
            del pairs  # the checkpoint-dtype copies (the tensor pushes emptied it bucket by bucket)
        if not result.ok:
            raise LifecycleError(
                f"the weight push (version {weight_version}, {len(buckets)} bucket(s)) was not "
                "taken: "
                + "; ".join(f"{r.engine_id}: {r.error}" for r in result.failed)
                + ". A replica that failed is FAILED (its weights may mix both versions) and "
                "serves nothing until the manager rebuilds it (health_check/recover); push "
                "again after that"
            )
        version = ray.get(self.context.rollout.weight_version.remote())
        return {
            "weight_version": version,
            "bytes": nbytes,
            "buckets": len(buckets),
            "format": fmt,
            "seconds": time.perf_counter() - began,
        }

    def _push_tensors(
        self,
        pairs: dict[str, Any],
        buckets: Sequence[Any],
        weight_version: str,
        pause: dict[str, Any],
    ) -> Any:
        """The ``safetensors`` and ``ipc`` pushes: every bucket's payload in one manager call."""
        import ray
        import torch
        from relax_torch_weights import flatten_bucket, serialize_bucket, serialize_named_tensors

        ipc = self.context.push_format == "ipc"
        load_format = "flattened_bucket" if ipc else "safetensors"
        flats, payloads = [], []
        for bucket in buckets:
            if ipc:
                flats.append(flatten_bucket(bucket, pairs))
            else:
                named = [(n, pairs[n]) for n in bucket.names]
                payloads.append([serialize_named_tensors(named, load_format=load_format)])
            for name in bucket.names:
                del pairs[name]  # one copy of the weights at a time, plus the buckets made
        if ipc:
            torch.cuda.synchronize()
            payloads = [[serialize_bucket(b, f)] for b, f in zip(buckets, flats, strict=True)]
        result = ray.get(
            self.context.rollout.update_weights_from_tensor.remote(
                [],
                buckets=payloads,
                load_format=load_format,
                weight_version=weight_version,
                # async steps: generation paused, not fenced (requests in flight kept)
                **pause,
            )
        )
        del flats  # the engines copied them (each IPC handle points at one)
        return result

    def _push_distributed(
        self,
        pairs: dict[str, Any],
        buckets: Sequence[Any],
        weight_version: str,
        pause: dict[str, Any],
    ) -> Any:
        """The ``distributed`` push: a group of this process (rank 0) and every serving
        replica's head (one rank each), made for this push and left after it, so a replica
        rebuilt since the last push takes part."""
        import ray
        import torch
        import torch.distributed as dist

        from relax_core import free_port

        if pause:
            raise LifecycleError(
                "push_format 'distributed' is fenced: its broadcast group has no pause mode; "
                "use push_pause = 'fence' (or another push_format)"
            )
        if dist.is_initialized():
            dist.destroy_process_group()  # the group of a push that failed before
        rollout = self.context.rollout
        cuda = self.device.type == "cuda"
        backend = "nccl" if cuda else "gloo"
        states = ray.get(rollout.states.remote())
        serving = [e for e, s in states.items() if s not in ("FAILED", "STOPPING")]
        if not serving:
            raise LifecycleError("the weight push: no rollout replica is serving")
        # One rank per replica: engines that do not shard (the hf engine; SGLang with tp 1).
        offsets, rank = [], 1
        for engine_id in states:
            offsets.append(rank)
            rank += engine_id in serving
        world = 1 + len(serving)
        address = ray.util.get_node_ip_address()
        port = free_port()
        group = f"relax-push-{weight_version}"
        # NCCL binds the group to one GPU: the trainer's (its index, where it has none).
        device = self.device
        if cuda and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        joined: list[BaseException | None] = []

        def join() -> None:
            try:
                dist.init_process_group(
                    backend,
                    init_method=f"tcp://{address}:{port}",
                    world_size=world,
                    rank=0,
                    timeout=_GROUP_TIMEOUT,
                    **({"device_id": device} if cuda else {}),
                )
                joined.append(None)
            except BaseException as exc:  # reported by the push, below
                joined.append(exc)

        joiner = threading.Thread(target=join, name="push-join", daemon=True)
        joiner.start()
        init = ray.get(
            rollout.init_weights_update_group.remote(
                master_address=address,
                master_port=port,
                rank_offsets=offsets,
                world_size=world,
                group_name=group,
                backend=backend,
            )
        )
        joiner.join(_GROUP_TIMEOUT.total_seconds() if init.ok else 1.0)
        if not init.ok or joined != [None]:
            raise LifecycleError(
                "the weight push: the broadcast group was not made: "
                + "; ".join(f"{r.engine_id}: {r.error}" for r in init.failed)
                + (f"; this trainer: {joined[0]!r}" if joined and joined[0] else "")
            )
        failure: list[BaseException] = []

        def send() -> None:
            try:
                self._broadcast(pairs, buckets)
            except BaseException as exc:  # reported by the push, below
                failure.append(exc)

        sender = threading.Thread(target=send, name="push-broadcast", daemon=True)
        result = None
        try:
            update = rollout.update_weights_from_distributed.remote(
                [],
                [],
                [],
                group_name=group,
                weight_version=weight_version,
                load_format="flattened_bucket",
                buckets=buckets,
            )
            sender.start()
            result = ray.get(update)
        finally:
            # The replicas leave (a replica leaving ends a broadcast it would never receive);
            # this side leaves once its broadcasts ended (a group torn down under a running
            # broadcast can hang; one left behind is destroyed by the next push).
            left = rollout.destroy_weights_update_group.remote(group)
            ok = result is not None and result.ok
            sender.join(_GROUP_TIMEOUT.total_seconds() if ok else 10.0)
            if not sender.is_alive():
                dist.destroy_process_group()
            ray.get(left)
        if result.ok and failure:
            raise LifecycleError(f"the weight push: broadcasting failed: {failure[0]!r}")
        return result

    def _broadcast(self, pairs: dict[str, Any], buckets: Sequence[Any]) -> None:
        """Broadcast each bucket's flat buffer from rank 0, one bucket in memory at a time."""
        import torch
        import torch.distributed as dist
        from relax_torch_weights import flatten_bucket

        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.set_device(self.device)  # the current device is per thread
        for bucket in buckets:
            flat = flatten_bucket(bucket, pairs)
            dist.broadcast(flat, 0)
            if cuda:
                torch.cuda.synchronize()
            del flat

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
