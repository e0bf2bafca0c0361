"""A stand-in trainer process: pushes new weights to an hf engine through the control client.

Usage: ``python trainer_process.py URL MODE ROWS COLS [PORT]`` with MODE one of ``safetensors``,
``sglang`` (SGLang's pickle format, CPU tensors through shared-memory files) or
``distributed`` (a gloo broadcast group, this process is rank 0) or ``distributed-nccl`` (NCCL,
this process on ``cuda:1``, the engine on another GPU). Sets ``lm_head.weight`` to
zeros, so every logit is 0 afterwards. Prints the engine's answer as JSON.
"""

from __future__ import annotations

import asyncio
import faulthandler
import json
import sys

import torch
import torch.distributed as dist
from relax_torch_weights import serialize_named_tensors

from relax_core import ControlClient


async def main(url: str, mode: str, rows: int, cols: int, port: int) -> dict:
    nccl = mode == "distributed-nccl"
    backend = "nccl" if nccl else "gloo"
    if nccl:
        torch.cuda.set_device(1)
    weight = torch.zeros(rows, cols, device="cuda:1" if nccl else "cpu")
    async with ControlClient(url, timeout=120) as client:
        if mode == "safetensors":
            payload = serialize_named_tensors(
                [("lm_head.weight", weight)], load_format="safetensors"
            )
            return await client.update_weights_from_tensor(
                [payload], load_format="safetensors", weight_version="st-1"
            )
        if mode == "sglang":
            torch.multiprocessing.set_sharing_strategy("file_system")
            payload = serialize_named_tensors([("lm_head.weight", weight)])
            return await client.update_weights_from_tensor([payload], weight_version="sgl-1")
        init = asyncio.to_thread(
            dist.init_process_group,
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            world_size=2,
            rank=0,
            **({"device_id": torch.device("cuda:1")} if nccl else {}),
        )
        join = client.init_weights_update_group(
            master_address="127.0.0.1",
            master_port=port,
            rank_offset=1,
            world_size=2,
            group_name="g1",
            backend=backend,
        )
        await asyncio.gather(init, join)
        update = client.update_weights_from_distributed(
            ["lm_head.weight"],
            ["float32"],
            [[rows, cols]],
            group_name="g1",
            weight_version=f"{backend}-1",
        )

        def broadcast() -> None:
            if nccl:
                torch.cuda.set_device(1)  # the current device is per thread
            dist.broadcast(weight, 0)
            if nccl:
                torch.cuda.synchronize()

        answer, _ = await asyncio.gather(update, asyncio.to_thread(broadcast))
        # Both sides leave together: tearing NCCL down can wait for the peer.
        await asyncio.gather(
            client.destroy_weights_update_group("g1"), asyncio.to_thread(dist.destroy_process_group)
        )
        return answer


if __name__ == "__main__":
    faulthandler.dump_traceback_later(100, exit=True)  # a hang prints where it hangs
    url, mode, rows, cols = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    port = int(sys.argv[5]) if len(sys.argv) > 5 else 0
    print(json.dumps(asyncio.run(main(url, mode, rows, cols, port))))
