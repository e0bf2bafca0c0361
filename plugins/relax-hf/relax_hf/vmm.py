"""Device memory the engine maps itself, and a hand-over of it between engines on one GPU.

A :class:`Segment` is a fixed range of device virtual addresses (reserved once, through the CUDA
driver's virtual memory API) backed, while resident, by physical *chunks*: those parked on the
GPU that it takes over, largest first, then new ones for the rest (:func:`chunk_layout`: as
many of :data:`BULK_CHUNK_BYTES` as fit, then halves of it down to :data:`CHUNK_BYTES`).
Releasing a segment unmaps its chunks and either gives them back to the driver or, with an
:class:`Exchange`, *parks* them: the physical memory stays allocated, the engine no longer maps
it, and the next engine on the same GPU that resumes takes it over instead of asking the driver
for new memory.

Why: on an H200, giving ~90 GB back to the driver (``cudaFree``) takes 35-69 ms and taking
~90 GB again right after another process freed it takes 0.2-0.25 s (the driver scrubs freed
memory first); a phase switch between two inference roles that time-share a GPU would spend
that on every switch. Handing the chunks over costs a few system calls and page-table updates.

The hand-over is opt-in (``--memory-handoff``): parked memory is still in use on the device, so
it only helps where the memory goes to another engine next (the defer layout's roles on one
GPU). Parked chunks go back to the driver when another engine takes them and is done with them,
when the parking engine exits, or when it is asked to (:meth:`Exchange.return_parked`).

How chunks travel: every chunk is created exportable as a POSIX file descriptor; an engine that
parks chunks serves them on a Unix socket in a directory of its GPU (by UUID, only the user's);
a taker connects, receives descriptors with ``SCM_RIGHTS``, imports and maps them, and
acknowledges, after which the giver drops its own references. The physical memory lives as
long as any process holds a handle or a descriptor of it, so a giver that dies mid-way loses
nothing the taker already imported.

Only Linux with a CUDA driver that supports virtual memory management (CUDA 10.2+). Nothing
here is used on CPU.
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = [
    "BULK_CHUNK_BYTES",
    "CHUNK_BYTES",
    "Chunk",
    "DriverError",
    "DriverWarmer",
    "Exchange",
    "Segment",
    "chunk_layout",
    "device_uuid",
]

#: Size of the smallest physical chunk (a multiple of every GPU's allocation granularity).
CHUNK_BYTES = 1 << 30
#: Size of the chunks a segment's bulk is made of. Taking a chunk over, mapping it and
#: unmapping it cost the driver about the same whatever its size, so a switch of an 84 GiB pool
#: pays for 84 chunks of 1 GiB but for 11 of 8 GiB (docs/benchmarks.md).
BULK_CHUNK_BYTES = 8 << 30


def chunk_layout(nbytes: int) -> list[int]:
    """The sizes of the new chunks that back ``nbytes`` (rounded up to :data:`CHUNK_BYTES`):
    as many :data:`BULK_CHUNK_BYTES` as fit, then the rest in halves of it, each at most once,
    down to :data:`CHUNK_BYTES` (78 GiB: nine of 8 GiB, one of 4, one of 2)."""
    left = -(-nbytes // CHUNK_BYTES) * CHUNK_BYTES
    sizes = [BULK_CHUNK_BYTES] * (left // BULK_CHUNK_BYTES)
    left -= len(sizes) * BULK_CHUNK_BYTES
    size = BULK_CHUNK_BYTES // 2
    while left > 0:
        if size <= left or size == CHUNK_BYTES:
            sizes.append(size)
            left -= size
        size = max(CHUNK_BYTES, size // 2)
    return sizes


_TYPE_PINNED = 1
_HANDLE_POSIX_FD = 1
_LOCATION_DEVICE = 1
_ACCESS_READWRITE = 3
_MAX_FDS_PER_MESSAGE = 200  # the kernel allows 253 descriptors in one SCM_RIGHTS message


class DriverError(RuntimeError):
    """A CUDA driver call failed: which call, its error name and what it means."""


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _AllocationProp(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class _Driver:
    """The few driver API entry points used here, from ``libcuda.so.1``."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.check("cuInit", self.lib.cuInit(0))

    def check(self, what: str, result: int) -> None:
        if result == 0:
            return
        name = ctypes.c_char_p()
        text = ctypes.c_char_p()
        self.lib.cuGetErrorName(result, ctypes.byref(name))
        self.lib.cuGetErrorString(result, ctypes.byref(text))
        raise DriverError(
            f"{what} failed: {(name.value or b'?').decode()} ({result}): "
            f"{(text.value or b'').decode()}"
        )

    def call(self, name: str, *args: Any) -> None:
        self.check(name, getattr(self.lib, name)(*args))

    def bind_context(self, device: int) -> None:
        """Make ``device``'s primary context current on the calling thread (the one torch
        uses), so driver calls from any thread act on the same context."""
        dev = ctypes.c_int()
        self.call("cuDeviceGet", ctypes.byref(dev), device)
        ctx = ctypes.c_void_p()
        self.call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
        self.call("cuCtxSetCurrent", ctx)
        self.lib.cuDevicePrimaryCtxRelease(dev)  # torch holds it; we only needed the pointer


_DRIVER: _Driver | None = None
_DRIVER_LOCK = threading.Lock()


def _driver() -> _Driver:
    global _DRIVER
    with _DRIVER_LOCK:
        if _DRIVER is None:
            _DRIVER = _Driver()
        return _DRIVER


def device_uuid(device: int) -> str:
    """The GPU's UUID (``GPU-…``, as ``nvidia-smi -L`` shows it): the same GPU has the same
    UUID in every process, whatever ``CUDA_VISIBLE_DEVICES`` numbers it."""
    d = _driver()
    dev = ctypes.c_int()
    d.call("cuDeviceGet", ctypes.byref(dev), device)
    raw = (ctypes.c_ubyte * 16)()
    d.call("cuDeviceGetUuid_v2", raw, dev)
    h = bytes(raw).hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _create(device: int, nbytes: int, *, exportable: bool = True) -> ctypes.c_ulonglong:
    """``cuMemCreate``: the handle of ``nbytes`` of new physical memory on ``device``."""
    handle = ctypes.c_ulonglong()
    prop = _prop(device, exportable=exportable)
    _driver().call(
        "cuMemCreate", ctypes.byref(handle), ctypes.c_size_t(nbytes), ctypes.byref(prop), 0
    )
    return handle


def _prop(device: int, *, exportable: bool = True) -> _AllocationProp:
    prop = _AllocationProp()
    prop.type = _TYPE_PINNED
    prop.requestedHandleTypes = _HANDLE_POSIX_FD if exportable else 0
    prop.location.type = _LOCATION_DEVICE
    prop.location.id = device
    return prop


class Chunk:
    """One physical allocation (``nbytes``, :data:`CHUNK_BYTES` or :data:`BULK_CHUNK_BYTES`):
    the driver handle and the POSIX file descriptor it is shared by (both references keep the
    memory allocated)."""

    __slots__ = ("fd", "handle", "nbytes")

    def __init__(self, handle: int, fd: int, nbytes: int) -> None:
        self.handle = handle
        self.fd = fd
        self.nbytes = nbytes

    @classmethod
    def create(cls, device: int, nbytes: int | None = None) -> Chunk:
        """New physical memory from the driver (:data:`CHUNK_BYTES` unless said), exportable
        to other processes."""
        nbytes = CHUNK_BYTES if nbytes is None else nbytes
        d = _driver()
        handle = _create(device, nbytes)
        fd = ctypes.c_int(-1)
        try:
            d.call(
                "cuMemExportToShareableHandle",
                ctypes.byref(fd),
                handle,
                _HANDLE_POSIX_FD,
                ctypes.c_ulonglong(0),
            )
        except DriverError:
            d.lib.cuMemRelease(handle)
            raise
        return cls(handle.value, fd.value, nbytes)

    @classmethod
    def imported(cls, fd: int, nbytes: int) -> Chunk:
        """The chunk another process shared as ``fd`` (this process now owns ``fd``)."""
        d = _driver()
        handle = ctypes.c_ulonglong()
        d.call(
            "cuMemImportFromShareableHandle",
            ctypes.byref(handle),
            ctypes.c_void_p(fd),
            _HANDLE_POSIX_FD,
        )
        return cls(handle.value, fd, nbytes)

    def free(self) -> None:
        """Drop this process's references; the driver frees the memory once no process holds
        one. Idempotent."""
        if self.handle:
            _driver().call("cuMemRelease", ctypes.c_ulonglong(self.handle))
            self.handle = 0
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class _DeviceBuffer:
    """What ``torch.as_tensor`` reads to view device memory it did not allocate."""

    def __init__(self, ptr: int, nbytes: int, owner: Segment) -> None:
        self.owner = owner  # the tensor keeps this object, and so the segment, alive
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
        }


class Segment:
    """``nbytes`` of device memory at fixed virtual addresses, mapped and unmapped as a whole.

    Compute thread only (the exchange's server thread touches only parked chunks).
    """

    def __init__(
        self, device: int, nbytes: int, *, exchange: Exchange | None = None, name: str = ""
    ) -> None:
        self.device = device
        self.nbytes = nbytes
        self.name = name
        self.exchange = exchange
        # What it maps: nbytes in whole small chunks; parked chunks taken over may pass that by
        # less than one bulk chunk (Exchange.take), which the reservation leaves room for.
        self.need = max(1, -(-nbytes // CHUNK_BYTES)) * CHUNK_BYTES
        reserved = self.need + BULK_CHUNK_BYTES
        d = _driver()
        d.bind_context(device)
        ptr = ctypes.c_ulonglong()
        d.call(
            "cuMemAddressReserve",
            ctypes.byref(ptr),
            ctypes.c_size_t(reserved),
            ctypes.c_size_t(CHUNK_BYTES),
            ctypes.c_ulonglong(0),
            ctypes.c_ulonglong(0),
        )
        self.ptr = ptr.value
        self.chunks: list[Chunk] = []

    @property
    def resident(self) -> bool:
        return bool(self.chunks)

    @property
    def size(self) -> int:
        """The bytes mapped now (at least ``nbytes`` while resident)."""
        return sum(c.nbytes for c in self.chunks)

    def map(self) -> dict[str, Any]:
        """Back the addresses with physical chunks (parked ones first); what it took."""
        if self.chunks:
            return {"bytes": 0, "seconds": 0.0}
        start = time.perf_counter()
        d = _driver()
        d.bind_context(self.device)
        taken = self.exchange.take(self.need) if self.exchange is not None else []
        took = time.perf_counter()
        chunks = sorted(taken, key=lambda c: -c.nbytes)
        try:
            for size in chunk_layout(max(0, self.need - sum(c.nbytes for c in taken))):
                chunks.append(Chunk.create(self.device, size))
            created = time.perf_counter()
            offset = 0
            for c in chunks:
                d.call(
                    "cuMemMap",
                    ctypes.c_ulonglong(self.ptr + offset),
                    ctypes.c_size_t(c.nbytes),
                    ctypes.c_size_t(0),
                    ctypes.c_ulonglong(c.handle),
                    ctypes.c_ulonglong(0),
                )
                offset += c.nbytes
                self.chunks.append(c)
            access = _AccessDesc()
            access.location.type = _LOCATION_DEVICE
            access.location.id = self.device
            access.flags = _ACCESS_READWRITE
            d.call(
                "cuMemSetAccess",
                ctypes.c_ulonglong(self.ptr),
                ctypes.c_size_t(self.size),
                ctypes.byref(access),
                ctypes.c_size_t(1),
            )
        except BaseException:
            self._unmap_mapped()
            for c in chunks:  # the taken ones first
                c.free()
            self.chunks = []
            raise
        return {
            "bytes": self.size,
            "chunks": len(chunks),
            "handed_in_bytes": sum(c.nbytes for c in taken),
            "take_seconds": took - start,
            "create_seconds": created - took,
            "map_seconds": time.perf_counter() - created,
        }

    def _unmap_mapped(self) -> None:
        if self.chunks:
            _driver().call(
                "cuMemUnmap",
                ctypes.c_ulonglong(self.ptr),
                ctypes.c_size_t(sum(c.nbytes for c in self.chunks)),
            )

    def tensor(self) -> torch.Tensor:
        """A ``uint8`` torch tensor of the segment's ``nbytes`` (mapped segments only)."""
        import torch

        if not self.chunks:
            raise RuntimeError(f"segment {self.name or hex(self.ptr)} is not mapped")
        buf = _DeviceBuffer(self.ptr, self.nbytes, self)
        return torch.as_tensor(buf, device=torch.device("cuda", self.device))

    def unmap(self, *, park: bool) -> dict[str, Any]:
        """Unmap every chunk (no tensor may read the segment any more: the caller drops its
        views and synchronises first); park them with the exchange, or free them."""
        if not self.chunks:
            return {"bytes": 0, "parked_bytes": 0, "seconds": 0.0}
        start = time.perf_counter()
        _driver().bind_context(self.device)
        self._unmap_mapped()
        chunks, self.chunks = self.chunks, []
        unmapped = time.perf_counter()
        parked, nbytes = 0, sum(c.nbytes for c in chunks)
        if park and self.exchange is not None:
            self.exchange.park(chunks)
            parked = nbytes
        else:
            for c in chunks:
                c.free()
        return {
            "bytes": nbytes,
            "parked_bytes": parked,
            "unmap_seconds": unmapped - start,
            "free_seconds": time.perf_counter() - unmapped,
        }


#: When a :class:`DriverWarmer` allocates after a release (seconds after it): the driver's
#: cost shows from ~0.1-0.25 s after a large free until an allocation pays it.
WARM_SCHEDULE = (0.05, 0.15, 0.3, 0.5, 1.0, 2.0)


class DriverWarmer:
    """Pays the driver's deferred cost of the first allocation after a large free, off the
    critical path.

    Measured on an H200: once ~0.1-0.25 s have passed since a large free (tens of GB back to
    the driver), the first allocation of any size costs 20-38 ms, and every one after it is
    fast again (a 1 GiB allocation 0.5-1 ms, even 8 s later). A resume would pay it on its
    weight buffer. After each release the warmer allocates and frees the driver's smallest
    chunk (2 MiB) a few times on its own thread (:data:`WARM_SCHEDULE`), so that the allocation
    that pays is one of these. Each costs ~1.5 ms of this thread when there is nothing to pay.
    """

    def __init__(self, device: int, *, schedule: Sequence[float] = WARM_SCHEDULE) -> None:
        self.device = device
        self.schedule = tuple(schedule)
        self._since = 0.0
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._granularity = 0
        #: The last warm-ups: ``(seconds after the release, milliseconds it took)``.
        self.log: list[tuple[float, float]] = []
        self.error: str | None = None

    def released(self) -> None:
        """Memory went back to the driver just now: warm it again on the schedule."""
        with self._wake:
            if self._stopped or self.error is not None:
                return
            self._since = time.monotonic()
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"driver-warmer-{self.device}", daemon=True
                )
                self._thread.start()
            self._wake.notify_all()

    def _allocate_once(self) -> float:
        d = _driver()
        if not self._granularity:
            size = ctypes.c_size_t()
            prop = _prop(self.device, exportable=False)
            d.call("cuMemGetAllocationGranularity", ctypes.byref(size), ctypes.byref(prop), 0)
            self._granularity = size.value
        start = time.perf_counter()
        d.call("cuMemRelease", _create(self.device, self._granularity, exportable=False))
        return (time.perf_counter() - start) * 1e3

    def _run(self) -> None:
        _driver().bind_context(self.device)
        step = 0
        since = -1.0
        while True:
            with self._wake:
                if self._since != since:  # a new release: start the schedule again
                    since, step = self._since, 0
                if step >= len(self.schedule):
                    self._wake.wait()
                    if self._stopped:
                        return
                    continue
                delay = since + self.schedule[step] - time.monotonic()
                if delay > 0:
                    self._wake.wait(delay)
                    if self._stopped:
                        return
                    continue
            try:
                ms = self._allocate_once()
            except DriverError as exc:  # nothing depends on it: say so once and stop
                self.error = str(exc)
                return
            self.log = [*self.log[-15:], (round(time.monotonic() - since, 3), round(ms, 2))]
            step += 1

    def stop(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5.0)


def _default_root() -> Path:
    return Path(tempfile.gettempdir()) / f"relax-hf-memory-{os.getuid()}"


class Exchange:
    """Parked chunks of one GPU, handed to whichever engine on it resumes next.

    Each engine has one; its server thread starts with the first park. ``root`` is the
    directory of every GPU's sockets (default: one under the system's temporary directory,
    readable by this user only).
    """

    def __init__(
        self,
        gpu: str,
        *,
        device: int,
        root: Path | None = None,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.gpu = gpu
        self.device = device
        root = root or _default_root()
        self.dir = root / gpu
        for p in (root, self.dir):
            p.mkdir(exist_ok=True, mode=0o700)
            st = p.stat()
            if st.st_uid != os.getuid():
                raise PermissionError(
                    f"{p} belongs to another user: GPU memory is handed over only through a "
                    "directory of this user's (pass another root)"
                )
            if stat.S_IMODE(st.st_mode) & 0o077:
                os.chmod(p, 0o700)  # ours: only this user may take its GPU memory
        self.path = self.dir / f"{os.getpid()}.sock"
        self._log = log or (lambda _m: None)
        self._lock = threading.Lock()
        self._parked: list[Chunk] = []
        self._server: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self.handed_out_bytes = 0
        self.handed_in_bytes = 0

    # -- the giving side ---------------------------------------------------------------------

    @property
    def parked_bytes(self) -> int:
        with self._lock:
            return sum(c.nbytes for c in self._parked)

    def park(self, chunks: Sequence[Chunk]) -> None:
        """Keep ``chunks`` (unmapped) for the next engine that resumes on this GPU."""
        with self._lock:
            self._parked.extend(chunks)
            if self._server is None and not self._closed:
                self._listen()

    def _listen(self) -> None:
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        server.bind(str(self.path))
        server.listen(8)
        self._server = server
        self._thread = threading.Thread(
            target=self._serve, name=f"memory-exchange-{self.gpu[:12]}", daemon=True
        )
        self._thread.start()

    def _serve(self) -> None:
        server = self._server
        assert server is not None
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return  # closed
            with conn:
                try:
                    conn.settimeout(10.0)
                    self._give(conn)
                except Exception as exc:  # a taker that went away keeps nothing of ours
                    self._log(f"memory hand-over to a peer failed: {exc!r}")

    def _give(self, conn: socket.socket) -> None:
        want = json.loads(_recv_line(conn))
        with self._lock:
            given, self._parked = _cover(self._parked, int(want["bytes"]), bool(want["over"]))
        try:
            _send_line(conn, {"count": len(given), "sizes": [c.nbytes for c in given]})
            for i in range(0, len(given), _MAX_FDS_PER_MESSAGE):
                part = given[i : i + _MAX_FDS_PER_MESSAGE]
                socket.send_fds(conn, [b"c"], [c.fd for c in part])
            answer = json.loads(_recv_line(conn)) if given else {"imported": 0}
        except BaseException:
            with self._lock:
                self._parked[:0] = given
            raise
        imported = int(answer.get("imported", 0))
        _driver().bind_context(self.device)
        for c in given[:imported]:
            c.free()  # the taker holds its own references now
        with self._lock:
            self._parked[:0] = given[imported:]
            self.handed_out_bytes += sum(c.nbytes for c in given[:imported])
        if given:
            _send_line(conn, {"released": imported})  # the taker's take() returns after this

    def return_parked(self) -> int:
        """Give every parked chunk back to the driver; the bytes freed."""
        with self._lock:
            chunks, self._parked = self._parked, []
        if chunks:
            _driver().bind_context(self.device)
        for c in chunks:
            c.free()
        return sum(c.nbytes for c in chunks)

    def close(self) -> None:
        """Stop serving and free what is parked."""
        with self._lock:
            self._closed = True
            server, self._server = self._server, None
        if server is not None:
            try:
                server.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            server.close()
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
        if self._thread is not None:
            self._thread.join(timeout=10.0)
        self.return_parked()

    # -- the taking side ---------------------------------------------------------------------

    def take(self, nbytes: int) -> list[Chunk]:
        """Parked chunks for ``nbytes`` of a segment: this engine's own first, then other
        engines' on the GPU, each side's largest first while they fit. A segment of a bulk
        chunk or more then takes one that passes what is left rather than none (the memory is
        held on the GPU either way: taken, none is created; a smaller one takes none, leaving
        it for a larger segment)."""
        over = nbytes >= BULK_CHUNK_BYTES
        with self._lock:
            got, self._parked = _cover(self._parked, nbytes, over)
        for peer in sorted(self.dir.glob("*.sock")):
            want = nbytes - sum(c.nbytes for c in got)
            if want <= 0:
                break
            if peer == self.path:
                continue
            try:
                got.extend(self._take_from(peer, want, over))
            except (ConnectionRefusedError, FileNotFoundError):
                try:  # its engine is gone
                    peer.unlink()
                except FileNotFoundError:
                    pass
            except (OSError, ValueError, DriverError) as exc:
                self._log(f"taking parked GPU memory from {peer.name} failed: {exc!r}")
        return got

    def _take_from(self, peer: Path, want: int, over: bool) -> list[Chunk]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(10.0)
            conn.connect(str(peer))
            _send_line(conn, {"bytes": want, "over": over})
            answer = json.loads(_recv_line(conn))
            count, sizes = int(answer.get("count", 0)), [int(x) for x in answer.get("sizes", ())]
            if len(sizes) != count or not _fits(sizes, want, over):
                raise ValueError(f"asked for chunks of {want} bytes, offered {sizes}")
            fds: list[int] = []
            while len(fds) < count:
                _, more, _, _ = socket.recv_fds(conn, 1, _MAX_FDS_PER_MESSAGE)
                if not more:
                    raise ConnectionError("the peer closed the connection mid-hand-over")
                fds.extend(more)
            chunks: list[Chunk] = []
            try:
                for fd, size in zip(fds, sizes, strict=True):
                    try:
                        chunks.append(Chunk.imported(fd, size))
                    except DriverError as exc:  # keep what was imported; the giver the rest
                        self._log(f"importing GPU memory from {peer.name} failed: {exc!r}")
                        break
            finally:
                for fd in fds[len(chunks) :]:
                    os.close(fd)
            try:
                if count:
                    _send_line(conn, {"imported": len(chunks)})
            except OSError:
                for c in chunks:  # the giver, told nothing, keeps its references: drop ours
                    c.free()
                raise
            self.handed_in_bytes += sum(c.nbytes for c in chunks)
            if count:
                try:  # the giver has dropped its references (the chunks are ours either way)
                    json.loads(_recv_line(conn))
                except (OSError, ValueError) as exc:
                    self._log(f"{peer.name} did not confirm the hand-over: {exc!r}")
            return chunks


def _cover(parked: list[Chunk], nbytes: int, over: bool) -> tuple[list[Chunk], list[Chunk]]:
    """``parked`` split into the chunks for ``nbytes`` and the rest (in order): the largest
    first while they fit, then (``over``) the smallest of the others if some bytes are left."""
    left, picked = nbytes, set()
    for i in sorted(range(len(parked)), key=lambda i: -parked[i].nbytes):
        if 0 < parked[i].nbytes <= left:
            picked.add(i)
            left -= parked[i].nbytes
    if over and left > 0 and (rest := [i for i in range(len(parked)) if i not in picked]):
        picked.add(min(rest, key=lambda i: parked[i].nbytes))
    return [parked[i] for i in sorted(picked)], [c for i, c in enumerate(parked) if i not in picked]


def _fits(sizes: Sequence[int], want: int, over: bool) -> bool:
    """Whether chunks of ``sizes`` are what :func:`_cover` may give for ``want`` bytes: none
    over a bulk chunk, and past ``want`` only by the last one (``over``)."""
    if not sizes:
        return True
    total = sum(sizes)
    if max(sizes) > BULK_CHUNK_BYTES:
        return False
    return total - max(sizes) < want if over else total <= want


def _send_line(conn: socket.socket, obj: dict[str, Any]) -> None:
    conn.sendall(json.dumps(obj).encode() + b"\n")


def _recv_line(conn: socket.socket) -> str:
    buf = bytearray()
    while not buf.endswith(b"\n"):
        part = conn.recv(1)
        if not part:
            raise ConnectionError("the peer closed the connection")
        buf += part
    return buf.decode()
