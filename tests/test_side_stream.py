"""The CUDA branches of `AuxBuffer` (`PinnedUpload`) and `HostPages` (`SideStream`) against a
fake CUDA runtime.

The fake records every call and carries out the copies with ``memmove`` on host memory, so the
tests check, without a GPU, the data that arrives and the order of the stream and event calls:
metadata is copied on the compute stream (another stream waits for it), the host tier's copy
stream waits for the compute stream's work so far and the compute stream then waits for its
copies, and the host blocks only before overwriting pinned memory a copy may still read.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import tvm
import tvm_ffi

from relax_kvcache import aux_buffer
from relax_kvcache.cache.host_pages import HostPages
from relax_kvcache.errors import ConfigError
from relax_kvcache.paging.host_tier import HostMove

COMPUTE = 0xC0  # the compute stream the fake `tvm_ffi.get_raw_stream` returns


class FakeCudart:
    """Records ``(name, args)``; handles are 0x1000, 0x1001, ...; ``fail`` fails cudaMallocHost."""

    def __init__(self, fail: int = 0) -> None:
        self.calls, self.memory, self.fail, self.handles = [], [], fail, 0x1000

    def __getattr__(self, name):
        def call(*args):
            self.calls.append((name, [a._obj if type(a).__name__ == "CArgObject" else a for a in args]))
            if name == "cudaMallocHost":
                if self.fail:
                    return self.fail
                self.memory.append(ctypes.create_string_buffer(args[1].value))
                args[0]._obj.value = ctypes.addressof(self.memory[-1])
            elif name.endswith("CreateWithFlags"):
                args[0]._obj.value, self.handles = self.handles, self.handles + 1
            elif name == "cudaMemcpyAsync":
                ctypes.memmove(args[0].value, args[1].value, args[2].value)
            return b"fake error" if name == "cudaGetErrorString" else 0
        return call

    def take(self):
        """The calls since the last `take`, as ``(name, values)``."""
        calls, self.calls = self.calls, []
        return [(name, [getattr(a, "value", a) for a in args]) for name, args in calls]


class FakeCuda:
    def dlpack_device_type(self):
        return tvm.cuda().dlpack_device_type()


@pytest.fixture
def lib(monkeypatch):
    fake = FakeCudart()
    empty = tvm.runtime.empty
    monkeypatch.setattr(aux_buffer, "_LIB", fake)
    monkeypatch.setattr(tvm_ffi, "get_raw_stream", lambda device: COMPUTE)
    monkeypatch.setattr(tvm.runtime, "empty", lambda shape, dtype, device: empty(shape, dtype, tvm.cpu()))
    return fake


def test_metadata_upload_runs_between_the_compute_streams_work(lib, monkeypatch):
    buffer = aux_buffer.AuxBuffer(FakeCuda(), 100)
    (_, (pinned, size)), (_, (copied, _)) = lib.take()
    assert size == 4 * 1024  # the least capacity
    arrays = [np.random.default_rng(0).integers(-9, 9, size=s).astype(np.int32) for s in ((3,), (2, 4))]
    views = buffer.upload(arrays)
    device, calls = views[0].data_ptr(), lib.take()
    assert calls == [("cudaMemcpyAsync", [device, pinned, 44, 1, COMPUTE]), ("cudaEventRecord", [copied, COMPUTE])]
    for view, array in zip(views, arrays):
        np.testing.assert_array_equal(view.numpy(), array)
    buffer.wait()  # kernels on the stream of the copy: ordered after it already
    assert lib.take() == []
    buffer.upload(arrays)
    assert lib.take()[0] == ("cudaEventSynchronize", [copied])  # before the pinned memory is overwritten
    monkeypatch.setattr(tvm_ffi, "get_raw_stream", lambda device: COMPUTE + 1)
    buffer.wait()
    buffer.wait()  # once per upload
    assert lib.take() == [("cudaStreamWaitEvent", [COMPUTE + 1, copied, 0])]  # another stream waits for it
    buffer.upload([np.arange(2000, dtype=np.int32)])  # a larger buffer: the old one is freed
    assert [name for name, _ in lib.take()[:6]] == ["cudaEventSynchronize", "cudaEventSynchronize", "cudaEventDestroy",
                                                    "cudaFreeHost", "cudaMallocHost", "cudaEventCreateWithFlags"]


def test_host_pages_copy_on_the_side_stream(lib):
    rng = np.random.default_rng(1)
    pages = [tvm.runtime.tensor(rng.standard_normal((6, 2, 3)).astype(np.float32)) for _ in range(2)]
    before = [p.numpy() for p in pages]
    host = HostPages(pages, 4, FakeCuda())
    (_, (pinned, size)), (_, (stream, _)), (_, (event, _)), (_, (other, _)) = lib.take()
    assert size == 2 * 4 * 24
    host.run([HostMove(True, 1, 0), HostMove(True, 2, 1), HostMove(True, 5, 3)])
    calls = lib.take()
    computed, copied = (event, other) if calls[0][1][0] == event else (other, event)
    assert calls[:2] == [("cudaEventRecord", [computed, COMPUTE]), ("cudaStreamWaitEvent", [stream, computed, 0])]
    assert calls[2] == ("cudaMemcpyAsync", [pinned, pages[0].data_ptr() + 24, 48, 2, stream])
    assert [name for name, _ in calls[2:6]] == ["cudaMemcpyAsync"] * 4  # one per layer and run
    assert calls[6:] == [("cudaEventRecord", [copied, stream]), ("cudaStreamWaitEvent", [COMPUTE, copied, 0])]
    for layer in range(2):
        for slot, page in ((0, 1), (1, 2), (3, 5)):
            np.testing.assert_array_equal(host.read(layer, slot).view(np.float32), before[layer][page].reshape(-1))
    for p in pages:
        p.copyfrom(np.full((6, 2, 3), np.nan, dtype=np.float32))
    host.run([HostMove(False, 0, 3), HostMove(False, 4, 0)])
    for layer in range(2):
        np.testing.assert_array_equal(pages[layer].numpy()[[0, 4]], before[layer][[5, 1]])
    lib.take()
    host.close()
    host.close()
    calls = lib.take()
    assert calls[0] == ("cudaStreamSynchronize", [stream]) and calls[3:] == [("cudaStreamDestroy", [stream]),
                                                                             ("cudaFreeHost", [pinned])]
    assert sorted(calls[1:3]) == sorted([("cudaEventDestroy", [copied]), ("cudaEventDestroy", [computed])])


def test_pinned_memory_failures_name_the_cause(lib):
    lib.fail = 2
    with pytest.raises(RuntimeError, match=r"^cudaMallocHost failed: CUDA error 2 \(fake error\)$"):
        aux_buffer.AuxBuffer(FakeCuda(), 100)
    pages = [tvm.runtime.empty((6, 2, 3), "float32", tvm.cpu())]
    with pytest.raises(ConfigError, match=r"host_cache_pages 4: 96 bytes of pinned host memory could not be "
                                          r"allocated \(CUDA error 2\)"):
        HostPages(pages, 4, FakeCuda())
