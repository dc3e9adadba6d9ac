"""CUDA-graph capture and replay of repeated decode steps, whose kernel arguments stay fixed
(`PagedAttentionKVCache.capturable_step`; SGLang's capture/replay). Usage: docs/api.md."""

from __future__ import annotations

import ctypes
from typing import Callable, Optional

import tvm
import tvm_ffi

from .cache import PagedAttentionKVCache
from .aux_buffer import NON_BLOCKING, check_status, cudart

_CAPTURE_RELAXED = 2  # cudaStreamCaptureModeRelaxed


class DecodeGraphs:
    """Captures and replays the kernels of repeated decode steps of a CUDA cache.

    Parameters
    ----------
    cache : PagedAttentionKVCache
        A cache on a CUDA device.
    """

    def __init__(self, cache: PagedAttentionKVCache) -> None:
        if not isinstance(cache, PagedAttentionKVCache):
            raise TypeError(f"cache must be a PagedAttentionKVCache, got {type(cache).__name__}")
        if cache.device.dlpack_device_type() != tvm.cuda().dlpack_device_type():
            raise ValueError(f"CUDA graphs need a cache on a CUDA device, got {cache.device}")
        self._cache = cache
        self._device = cache.device
        self._stream = ctypes.c_void_p()
        check_status(cudart().cudaStreamCreateWithFlags(ctypes.byref(self._stream), NON_BLOCKING),
                     "cudaStreamCreate")
        self._views: object = None  # the kernel arguments of the last capturable step
        self._graph: Optional[tuple] = None  # (graph, graph exec) captured on self._views

    def stream_context(self):
        """Context manager making the graphs' stream TVM's current stream for the device."""
        return tvm_ffi.use_raw_stream(self._device, self._stream.value)

    def run(self, forward: Callable[[], None]) -> str:
        """Run the current step's ``forward`` (between ``begin_forward`` and ``end_forward``,
        inside :meth:`stream_context`): eagerly the first time it sees a set of kernel arguments
        (or for a step that is not capturable), captured the second time, replayed from then on.
        Returns ``"eager"``, ``"captured"`` or ``"replayed"``."""
        if tvm_ffi.get_raw_stream(self._device) != self._stream.value:
            raise RuntimeError("DecodeGraphs.run must be called inside graphs.stream_context() "
                               "(the whole step, begin_forward included, on the graphs' stream)")
        views = self._cache.capturable_step()
        if views is None:
            forward()
            return "eager"
        if views is not self._views:  # new arguments: the old ones never come back
            self._destroy_graph()
            self._views = views
            forward()
            return "eager"
        how = "replayed"
        if self._graph is None:
            self._graph, how = self._capture(forward), "captured"
        check_status(cudart().cudaGraphLaunch(self._graph[1], self._stream), "cudaGraphLaunch")
        return how

    def _capture(self, forward: Callable[[], None]) -> tuple:
        lib = cudart()
        check_status(lib.cudaStreamBeginCapture(self._stream, _CAPTURE_RELAXED), "cudaStreamBeginCapture")
        graph = ctypes.c_void_p()
        try:
            forward()
        finally:
            status = lib.cudaStreamEndCapture(self._stream, ctypes.byref(graph))
        check_status(status, "cudaStreamEndCapture")
        graph_exec = ctypes.c_void_p()
        check_status(lib.cudaGraphInstantiate(ctypes.byref(graph_exec), graph, ctypes.c_ulonglong(0)),
                     "cudaGraphInstantiate")
        return graph, graph_exec

    def synchronize(self) -> None:
        """Wait for everything issued on the graphs' stream."""
        check_status(cudart().cudaStreamSynchronize(self._stream), "cudaStreamSynchronize")

    def _destroy_graph(self) -> None:
        if self._graph is not None:
            lib = cudart()
            lib.cudaStreamSynchronize(self._stream)  # a replay may still be running
            lib.cudaGraphExecDestroy(self._graph[1])
            lib.cudaGraphDestroy(self._graph[0])
            self._graph = None

    def close(self) -> None:
        """Destroy the graph and the stream."""
        lib = cudart()
        self._destroy_graph()
        self._views = None
        if self._stream.value:
            lib.cudaStreamSynchronize(self._stream)
            lib.cudaStreamDestroy(self._stream)
            self._stream = ctypes.c_void_p()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
