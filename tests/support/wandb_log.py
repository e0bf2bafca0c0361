"""Reading a W&B offline run back: its transaction log (``offline-run-*/run-*.wandb``) record by
record, each decoded with wandb's own protobuf ``Record``.

wandb (0.19 on) ships no Python reader of the log any more (its service writes and reads it), so
the framing is read here as wandb's datastore writes it: a 7-byte header (``:W&B``, the magic
``0xBEE1``, version 0), then LevelDB-log blocks of 32 KiB, each record chunk a CRC-32 (of its
type byte and data), a little-endian length, a type (1 full, 2 first, 3 middle, 4 last) and the
data. Every CRC is checked.
"""

from __future__ import annotations

import glob
import json
import os
import struct
import zlib
from pathlib import Path
from typing import Any

BLOCK = 32768
HEADER = b":W&B" + struct.pack("<H", 0xBEE1) + b"\x00"


def records(path: str) -> list[Any]:
    """Every record of the log at ``path``, decoded (``wandb_internal_pb2.Record``)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:7] == HEADER, f"{path}: not a W&B transaction log ({data[:7]!r})"
    out, pos, parts = [], 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if crc == length == kind == 0:  # zero padding
            pos += left
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        assert zlib.crc32(bytes([kind]) + chunk) & 0xFFFFFFFF == crc, f"{path}@{pos}: bad CRC"
        pos += 7 + length
        parts += chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(parts)
            out.append(record)
            parts = b""
    return out


def offline_run(wandb_dir: str) -> dict[str, Any]:
    """The one offline run under ``wandb_dir``: ``history`` (step -> {key: value}), ``config``
    (key -> value), ``run`` (its RunRecord) and ``exit_code``."""
    (path,) = glob.glob(os.path.join(wandb_dir, "offline-run-*", "run-*.wandb"))
    history: dict[int, dict[str, Any]] = {}
    config: dict[str, Any] = {}
    run, exit_code = None, None
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {
                (i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                for i in record.history.item
            }
            step = items.pop("_step", record.history.step.num)
            history.setdefault(int(step), {}).update(items)
        elif kind == "config":
            for item in record.config.update:
                config[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
        elif kind == "run":
            run = record.run
        elif kind == "exit":
            exit_code = record.exit.exit_code
    return {"history": history, "config": config, "run": run, "exit_code": exit_code}
