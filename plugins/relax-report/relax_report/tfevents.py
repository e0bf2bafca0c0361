"""A TensorBoard event file written without TensorFlow, torch or protobuf: the few messages the
``tensorboard`` tracker needs, encoded by hand.

An event file is a TFRecord stream (each record: its length as a little-endian uint64, the
masked CRC-32C of those 8 bytes, the data, the masked CRC-32C of the data) of ``Event``
protocol buffers (``tensorflow/core/util/event.proto``): the first one carries
``file_version = "brain.Event:2"``; each later one a wall time, a step and a ``Summary`` whose
values are scalars (``simple_value``) or text (a string tensor tagged for the text plugin).
TensorBoard reads the file as it reads TensorFlow's (the tests read it back with TensorBoard's
own ``event_accumulator``).
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections.abc import Mapping

__all__ = ["EventWriter", "crc32c"]


def _crc_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli) of ``data``, as TFRecord frames use it."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked(data: bytes) -> bytes:
    crc = crc32c(data)
    return struct.pack("<I", (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF)


# -- protocol buffer wire format ---------------------------------------------------------------


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1
    out = bytearray()
    while True:
        bits, value = value & 0x7F, value >> 7
        if value:
            out.append(bits | 0x80)
        else:
            out.append(bits)
            return bytes(out)


def _key(field: int, wire: int) -> bytes:
    return _varint(field << 3 | wire)


def _bytes(field: int, data: bytes) -> bytes:
    return _key(field, 2) + _varint(len(data)) + data


def _scalar(tag: str, value: float) -> bytes:
    """A ``Summary.Value`` with ``tag`` (1) and ``simple_value`` (2, a float)."""
    return _bytes(1, tag.encode()) + _key(2, 5) + struct.pack("<f", value)


def _text(tag: str, text: str) -> bytes:
    """A ``Summary.Value`` with ``tag``, ``metadata`` (9: the text plugin's) and ``tensor``
    (8: a scalar ``DT_STRING`` tensor, dtype 7, holding ``text``)."""
    metadata = _bytes(1, _bytes(1, b"text"))  # SummaryMetadata.plugin_data.plugin_name
    tensor = _key(1, 0) + _varint(7) + _bytes(2, b"") + _bytes(8, text.encode())
    return _bytes(1, tag.encode()) + _bytes(9, metadata) + _bytes(8, tensor)


def _event(
    wall_time: float, step: int, *, summary: bytes = b"", version: str = "", session: int = 0
) -> bytes:
    out = _key(1, 1) + struct.pack("<d", wall_time) + _key(2, 0) + _varint(step)
    if version:
        out += _bytes(3, version.encode())
    if summary:
        out += _bytes(5, summary)
    if session:
        out += _bytes(7, _key(1, 0) + _varint(session))  # session_log (7): SessionLog.status
    return out


class EventWriter:
    """Appends events to a new ``events.out.tfevents.*`` file in ``directory`` (made if
    needed; never one that is there already); every write is flushed. Thread-safe;
    :meth:`close` is idempotent."""

    def __init__(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        stem = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}"
        index = 0
        while True:  # a file of this process and second already there is another run's part
            self.path = os.path.join(directory, f"{stem}.{index}")
            try:
                self._file = open(self.path, "xb")  # noqa: SIM115 - open until close()
                break
            except FileExistsError:
                index += 1
        self._lock = threading.Lock()
        self._write(_event(time.time(), 0, version="brain.Event:2"))

    def _write(self, data: bytes) -> None:
        header = struct.pack("<Q", len(data))
        with self._lock:
            self._file.write(header + _masked(header) + data + _masked(data))
            self._file.flush()

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        """One event at ``step`` with a scalar per tag."""
        if values:
            summary = b"".join(_bytes(1, _scalar(tag, v)) for tag, v in values.items())
            self._write(_event(time.time(), step, summary=summary))

    def text(self, step: int, tag: str, text: str) -> None:
        """One event at ``step`` with ``text`` (Markdown, shown by TensorBoard's text tab)."""
        self._write(_event(time.time(), step, summary=_bytes(1, _text(tag, text))))

    def restart(self, step: int) -> None:
        """A ``SessionLog.START`` at ``step``: TensorBoard drops the events of this folder at
        ``step`` and later written before it (a run resumed at ``step``)."""
        self._write(_event(time.time(), step, session=1))

    def close(self) -> None:
        """Close the file."""
        with self._lock:
            self._file.close()
