"""``--memory-handoff``: GPU memory parked by one engine's release, taken over by another's.

Skipped without a CUDA device (the hand-over is CUDA's virtual memory API); the H200 run of
``relax run`` (docs/benchmarks.md) uses it between three roles on one GPU. The option's error
off CUDA is tested on every machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from relax_hf.testing import EngineServer

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPTS = ["Once upon a time", "def add(a, b):"]
ARGS = ("--mem-fraction-static", "0.2", "--memory-handoff", "--disable-cuda-graph")


def _greedy(server: EngineServer) -> list[list[int]]:
    body = {"text": PROMPTS, "sampling_params": {"max_new_tokens": 16, "temperature": 0.0}}
    return [o["output_ids"] for o in server.http.ok("/generate", body)]


def _handoff(server: EngineServer) -> dict[str, Any]:
    memory = server.http.ok("/server_info")["memory"]
    return {**memory["memory_handoff"], "pool_bytes": memory["kv_cache"]["pool_bytes"]}


@cuda
def test_a_released_engines_memory_is_taken_over_by_the_next_and_back(start_server: Any) -> None:
    a = start_server("hf-handoff-a", device="cuda", weights_cpu_backup=True, extra_args=ARGS)
    expected = _greedy(a)
    a.http.ok("/release_memory_occupation", {"tags": ["weights", "kv_cache"]})
    parked = _handoff(a)
    assert parked["mapped_bytes"] == 0
    assert parked["parked_bytes"] >= parked["pool_bytes"]
    # A new engine on the same GPU starts on A's parked memory instead of the driver's.
    b = start_server("hf-handoff-b", device="cuda", extra_args=ARGS)
    taken = _handoff(b)
    assert taken["handed_in_bytes"] >= parked["pool_bytes"]
    assert _handoff(a)["handed_out_bytes"] == taken["handed_in_bytes"]
    assert _greedy(b) == expected  # the same tiny model: its weights and pool work
    b.http.ok("/release_memory_occupation", {"tags": ["weights", "kv_cache"]})
    a.http.ok("/resume_memory_occupation", {"tags": ["weights", "kv_cache"]})
    back = _handoff(a)
    assert back["handed_in_bytes"] > 0 and back["mapped_bytes"] >= back["pool_bytes"]
    # The weights came back from the host backup into memory B used: the same outputs.
    assert _greedy(a) == expected
    detail = a.http.ok("/server_info")["memory_log"][-1]["detail"]
    assert detail["weights"]["copy_overlaps"] == "kv_cache"


def test_memory_handoff_off_cuda_is_refused_naming_the_option(tiny_model: Any) -> None:
    code = (
        "from relax_hf.runner import ModelRunner\n"
        f"ModelRunner({str(tiny_model)!r}, device='cpu', memory_handoff=True)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "--memory-handoff" in out.stderr and "cuda" in out.stderr.lower()


# The exchange's protocol and the warm-up's schedule without a GPU: a mock of the driver calls
# they make (import, release, context), which this machine has no CUDA driver for. Chunks are
# memfd descriptors, so what travels between two processes is a real kernel object, checked by
# its contents; one marked "bad" fails to import. The source runs in the giving process too.
FAKE_DRIVER = """
import os
from relax_hf import vmm

class FakeDriver:
    def bind_context(self, device):
        pass

    def call(self, name, *args):
        if name == "cuMemImportFromShareableHandle":
            if os.pread(args[1].value, 3, 0) == b"bad":
                raise vmm.DriverError("cuMemImportFromShareableHandle failed: (1)")
            args[0]._obj.value = 1000 + args[1].value
        elif name != "cuMemRelease":
            raise AssertionError(name)

def memfd_chunk(mark):
    # "bulk-…" marks a bulk chunk, any other mark a small one
    fd = os.memfd_create(f"chunk-{mark}")
    os.write(fd, mark.encode())
    size = vmm.BULK_CHUNK_BYTES if mark.startswith("bulk") else vmm.CHUNK_BYTES
    return vmm.Chunk(handle=1, fd=fd, nbytes=size)
"""
_fake: dict[str, Any] = {}
exec(FAKE_DRIVER, _fake)
FakeDriver = _fake["FakeDriver"]


def _mark(chunk: Any) -> str:
    return os.pread(chunk.fd, 16, 0).decode()


def _giver(root: Path, marks: list[str]) -> subprocess.Popen[str]:
    """A process that parks memfd chunks marked ``marks`` and, after a line on its stdin,
    prints its parked and handed-out bytes in small chunks; started once it has parked."""
    code = FAKE_DRIVER + textwrap.dedent(f"""
        import sys, pathlib
        vmm._driver = FakeDriver
        ex = vmm.Exchange("GPU-test", device=0, root=pathlib.Path({str(root)!r}))
        ex.park([memfd_chunk(m) for m in {marks!r}])
        print("parked", flush=True)
        sys.stdin.readline()
        n = vmm.CHUNK_BYTES
        print(ex.parked_bytes // n, ex.handed_out_bytes // n, flush=True)
        ex.close()
    """)
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None and child.stdout.readline().strip() == "parked"
    return child


def _counts(child: subprocess.Popen[str]) -> list[str]:
    assert child.stdin is not None and child.stdout is not None
    child.stdin.write("\n")
    child.stdin.flush()
    counts = child.stdout.readline().split()
    assert child.wait(timeout=30) == 0
    return counts


def test_the_exchange_passes_parked_chunks_to_another_process_and_skips_a_gone_peer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from relax_hf import vmm

    monkeypatch.setattr(vmm, "_driver", FakeDriver)  # this process takes, with the same mock
    root = tmp_path / "exchange"
    child = _giver(root, ["chunk-0", "chunk-1", "chunk-2"])
    try:
        gone = root / "GPU-test" / "0.sock"  # sorted first
        gone.touch()  # the socket file of an engine that died: nobody listens
        ex = vmm.Exchange("GPU-test", device=0, root=root)
        got = ex.take(2 * vmm.CHUNK_BYTES)
        assert sorted(_mark(c) for c in got) == ["chunk-0", "chunk-1"]
        assert not gone.exists()  # removed, and the live peer still served
        assert ex.handed_in_bytes == 2 * vmm.CHUNK_BYTES
        assert _counts(child) == ["1", "2"]  # one left, two handed out
        for c in got:
            c.free()
        assert oct((root / "GPU-test").stat().st_mode & 0o777) == "0o700"
    finally:
        child.kill()
        child.communicate(timeout=30)


def test_a_chunk_that_fails_to_import_stays_with_the_giver_and_the_imported_ones_are_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from relax_hf import vmm

    monkeypatch.setattr(vmm, "_driver", FakeDriver)
    root = tmp_path / "exchange"
    child = _giver(root, ["chunk-0", "bad", "chunk-2"])
    try:
        logged: list[str] = []
        ex = vmm.Exchange("GPU-test", device=0, root=root, log=logged.append)
        got = ex.take(3 * vmm.CHUNK_BYTES)
        assert [_mark(c) for c in got] == ["chunk-0"]
        assert ex.handed_in_bytes == vmm.CHUNK_BYTES
        assert any("importing GPU memory" in m for m in logged), logged
        assert _counts(child) == ["2", "1"]  # the bad one and the one after it: still parked
        for c in got:
            c.free()
    finally:
        child.kill()
        child.communicate(timeout=30)


def test_parked_chunks_are_taken_largest_first_and_only_a_bulk_sized_segment_takes_more(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from relax_hf import vmm

    bulk, small = vmm.BULK_CHUNK_BYTES, vmm.CHUNK_BYTES
    # New memory: bulk chunks while they fit, then halves of one down to a small one.
    assert vmm.chunk_layout(2 * bulk + small + 1) == [bulk, bulk, 2 * small]
    assert vmm.chunk_layout(bulk - small) == [bulk // 2, bulk // 4, bulk // 8]
    assert vmm.chunk_layout(bulk - 1) == [bulk]  # rounded up to a whole small chunk
    assert vmm.chunk_layout(1) == [small]
    monkeypatch.setattr(vmm, "_driver", FakeDriver)
    root = tmp_path / "exchange"
    child = _giver(root, ["chunk-0", "bulk-1", "chunk-2", "bulk-3", "chunk-4"])
    try:
        logged: list[str] = []
        ex = vmm.Exchange("GPU-test", device=0, root=root, log=logged.append)
        # A segment smaller than a bulk chunk takes only what fits: two small ones.
        got = ex.take(2 * small)
        assert sorted(_mark(c) for c in got) == ["chunk-0", "chunk-2"]
        # A pool of a bulk chunk and two small: the bulk one, the small one left, then the
        # other bulk one for the last GiB rather than a new GiB beside a parked bulk chunk.
        pool = ex.take(bulk + 2 * small)
        assert sorted(_mark(c) for c in pool) == ["bulk-1", "bulk-3", "chunk-4"], logged
        assert ex.handed_in_bytes == 2 * bulk + 3 * small
        assert _counts(child) == ["0", str((2 * bulk + 3 * small) // small)]
        for c in (*got, *pool):
            c.free()
    finally:
        child.kill()
        child.communicate(timeout=30)


class RecordingDriver:
    """A mock of the driver calls a segment makes (no CUDA driver on this machine): addresses
    and handles are numbers, chunks memfd descriptors; every call is recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.handles = 0

    def bind_context(self, device: int) -> None:
        pass

    def call(self, name: str, *args: Any) -> None:
        value = [a.value if hasattr(a, "value") else a for a in args]
        if name == "cuMemAddressReserve":
            args[0]._obj.value = 1 << 40
            self.calls.append((name, value[1]))
        elif name == "cuMemCreate":
            self.handles += 1
            args[0]._obj.value = self.handles
            self.calls.append((name, value[1]))
        elif name == "cuMemExportToShareableHandle":
            args[0]._obj.value = os.memfd_create("chunk")
        elif name in ("cuMemMap", "cuMemUnmap", "cuMemSetAccess"):
            self.calls.append((name, value[0] - (1 << 40), value[1]))
        elif name != "cuMemRelease":
            raise AssertionError(name)


def test_a_segment_maps_taken_chunks_largest_first_then_new_ones_end_to_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from relax_hf import vmm

    driver = RecordingDriver()
    monkeypatch.setattr(vmm, "_driver", lambda: driver)
    bulk, small = vmm.BULK_CHUNK_BYTES, vmm.CHUNK_BYTES
    ex = vmm.Exchange("GPU-test", device=0, root=tmp_path / "exchange")
    try:
        seg = vmm.Segment(0, 2 * bulk + 3 * small - 5, exchange=ex, name="pool")
        # The reservation leaves room for one parked chunk taken past what it needs.
        assert driver.calls == [("cuMemAddressReserve", 3 * bulk + 3 * small)]
        first = seg.map()
        # New memory: two bulk chunks, then the 3 GiB left in a chunk of 2 and one of 1.
        assert [c[1] for c in driver.calls if c[0] == "cuMemCreate"] == [
            bulk,
            bulk,
            2 * small,
            small,
        ]
        maps = [c[1:] for c in driver.calls if c[0] == "cuMemMap"]
        assert maps == [
            (0, bulk),
            (bulk, bulk),
            (2 * bulk, 2 * small),
            (2 * bulk + 2 * small, small),
        ]
        assert driver.calls[-1] == ("cuMemSetAccess", 0, seg.size)
        assert first["chunks"] == 4 and first["handed_in_bytes"] == 0
        assert seg.size == 2 * bulk + 3 * small
        driver.calls.clear()
        released = seg.unmap(park=True)
        assert driver.calls == [("cuMemUnmap", 0, 2 * bulk + 3 * small)]
        assert released["parked_bytes"] == ex.parked_bytes == 2 * bulk + 3 * small
        # Its own parked chunks back, largest first at the lowest addresses, nothing new.
        driver.calls.clear()
        again = seg.map()
        assert again["handed_in_bytes"] == 2 * bulk + 3 * small and ex.parked_bytes == 0
        assert not [c for c in driver.calls if c[0] == "cuMemCreate"]
        assert [c[1:] for c in driver.calls if c[0] == "cuMemMap"] == maps
        seg.unmap(park=True)
        # Another segment takes what fits (8, 2, 1 of its 12 GiB), then the other bulk chunk
        # for the last GiB rather than a new GiB beside it, mapped within its reservation.
        other = vmm.Segment(0, bulk + 4 * small, exchange=ex, name="other")
        driver.calls.clear()
        taken = other.map()
        assert taken["handed_in_bytes"] == 2 * bulk + 3 * small and taken["chunks"] == 4
        assert not [c for c in driver.calls if c[0] == "cuMemCreate"]
        assert ex.parked_bytes == 0
        assert driver.calls[-1] == ("cuMemSetAccess", 0, 2 * bulk + 3 * small)
        assert other.size <= bulk + 4 * small + bulk  # its reservation
        other.unmap(park=False)
    finally:
        ex.close()


def test_the_driver_warmer_allocates_on_its_schedule_after_each_release() -> None:
    # The driver's allocation is mocked (no GPU here); what is tested is when it happens.
    from relax_hf import vmm

    calls: list[float] = []
    two, enough = threading.Event(), threading.Event()
    warmer = vmm.DriverWarmer(0, schedule=(0.0, 0.05))

    def allocate_once() -> float:
        calls.append(time.monotonic())
        (two if len(calls) == 2 else enough if len(calls) == 4 else threading.Event()).set()
        return 0.5

    warmer._allocate_once = allocate_once  # type: ignore[method-assign]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(vmm, "_driver", FakeDriver)
        began = time.monotonic()
        warmer.released()
        assert two.wait(30)
        assert calls[1] - began >= 0.05  # both, the second at its time
        warmer.released()  # a new release starts the schedule again
        assert enough.wait(30)
        warmer.stop()
    assert [ms for _, ms in warmer.log] == [0.5] * 4 and warmer.error is None


def test_the_driver_warmer_stops_at_a_driver_error_and_says_so() -> None:
    from relax_hf import vmm

    warmer = vmm.DriverWarmer(0, schedule=(0.0, 0.0))

    def refuse() -> float:
        raise vmm.DriverError("cuMemCreate failed: CUDA_ERROR_NOT_SUPPORTED (801)")

    warmer._allocate_once = refuse  # type: ignore[method-assign]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(vmm, "_driver", FakeDriver)
        warmer.released()
        assert warmer._thread is not None
        warmer._thread.join(30)
        assert "NOT_SUPPORTED" in (warmer.error or "") and warmer.log == []
        warmer.released()  # nothing starts again
        warmer.stop()
