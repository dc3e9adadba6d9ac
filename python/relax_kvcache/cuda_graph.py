"""CUDA-graph capture and replay of decode steps, whose kernel arguments stay fixed
(`PagedAttentionKVCache.capturable_step`; SGLang's capture/replay). Usage: docs/api.md."""

from __future__ import annotations

import ctypes
from typing import Any, Callable, Dict, Optional

import tvm
import tvm_ffi

from .cache import PagedAttentionKVCache
from .aux_buffer import NON_BLOCKING, check_status, cudart

_CAPTURE_RELAXED = 2  # cudaStreamCaptureModeRelaxed


class DecodeGraphs:
    """Captures and replays the kernels of decode steps of a CUDA cache.

    Parameters
    ----------
    cache : PagedAttentionKVCache
        A cache on a CUDA device.
    any_batch : bool
        False (default): a graph replays for the batch it was captured on only, while that
        batch repeats step after step. True: a graph replays for every batch of the size and
        page-list structure it was captured on (``cache.capturable_step(any_batch=True)``), as
        SGLang's and vLLM's graphs per batch size do. The caller's ``forward`` must then read
        its own inputs from the same tensors for all batches of a size (it runs only when a
        graph is captured) and return its output, which a replay writes again (`output`).
    max_graphs : int
        Most graphs kept with ``any_batch`` (the least recently replayed goes first).
    """

    def __init__(self, cache: PagedAttentionKVCache, any_batch: bool = False, max_graphs: int = 16) -> None:
        if not isinstance(cache, PagedAttentionKVCache):
            raise TypeError(f"cache must be a PagedAttentionKVCache, got {type(cache).__name__}")
        if type(any_batch) is not bool:
            raise TypeError(f"any_batch must be a bool, got {type(any_batch).__name__}")
        if type(max_graphs) is not int or max_graphs < 1:
            raise ValueError(f"max_graphs must be a positive int, got {max_graphs!r}")
        if cache.device.dlpack_device_type() != tvm.cuda().dlpack_device_type():
            raise ValueError(f"CUDA graphs need a cache on a CUDA device, got {cache.device}")
        self._cache = cache
        self._device = cache.device
        self._any_batch, self._max_graphs = any_batch, max_graphs if any_batch else 1
        self._stream = ctypes.c_void_p()
        check_status(cudart().cudaStreamCreateWithFlags(ctypes.byref(self._stream), NON_BLOCKING),
                     "cudaStreamCreate")
        # by the capturable_step object of its arguments, least recently used first: None (its
        # arguments seen once, run eagerly) or (graph, graph exec, forward's output when captured)
        self._graphs: Dict[object, Optional[tuple]] = {}
        #: what ``forward`` returned in the last `run` (after a replay: its output when captured,
        #: which the replay wrote)
        self.output: Any = None

    def stream_context(self):
        """Context manager making the graphs' stream TVM's current stream for the device."""
        return tvm_ffi.use_raw_stream(self._device, self._stream.value)

    def run(self, forward: Callable[[], Any]) -> str:
        """Run the current step's ``forward`` (between ``begin_forward`` and ``end_forward``,
        inside :meth:`stream_context`): eagerly the first time it sees a set of kernel arguments
        (or for a step that is not capturable), captured the second time, replayed from then on.
        Returns ``"eager"``, ``"captured"`` or ``"replayed"``; `output` holds the step's output."""
        if tvm_ffi.get_raw_stream(self._device) != self._stream.value:
            raise RuntimeError("DecodeGraphs.run must be called inside graphs.stream_context() "
                               "(the whole step, begin_forward included, on the graphs' stream)")
        key = self._cache.capturable_step(any_batch=self._any_batch)
        graphs = self._graphs
        if key is None:
            self.output = forward()
            return "eager"
        if key not in graphs:  # new arguments
            graphs[key] = None
            self._evict(self._max_graphs)
            self.output = forward()
            return "eager"
        entry = graphs.pop(key)
        how = "replayed"
        if entry is None:
            entry, how = self._capture(forward), "captured"
        graphs[key] = entry  # the most recently used
        check_status(cudart().cudaGraphLaunch(entry[1], self._stream), "cudaGraphLaunch")
        self.output = entry[2]
        return how

    def _capture(self, forward: Callable[[], Any]) -> tuple:
        lib = cudart()
        check_status(lib.cudaStreamBeginCapture(self._stream, _CAPTURE_RELAXED), "cudaStreamBeginCapture")
        graph = ctypes.c_void_p()
        try:
            output = forward()
        finally:
            status = lib.cudaStreamEndCapture(self._stream, ctypes.byref(graph))
        check_status(status, "cudaStreamEndCapture")
        graph_exec = ctypes.c_void_p()
        status = lib.cudaGraphInstantiate(ctypes.byref(graph_exec), graph, ctypes.c_ulonglong(0))
        if status:
            lib.cudaGraphDestroy(graph)
        check_status(status, "cudaGraphInstantiate")
        return graph, graph_exec, output

    def synchronize(self) -> None:
        """Wait for everything issued on the graphs' stream."""
        check_status(cudart().cudaStreamSynchronize(self._stream), "cudaStreamSynchronize")

    def _evict(self, keep: int) -> None:
        """Destroy the least recently used graphs beyond ``keep`` (with ``any_batch`` off, the
        old arguments never come back)."""
        graphs = self._graphs
        while len(graphs) > keep:
            entry = graphs.pop(next(iter(graphs)))
            if entry is not None:
                lib = cudart()
                lib.cudaStreamSynchronize(self._stream)  # a replay may still be running
                lib.cudaGraphExecDestroy(entry[1])
                lib.cudaGraphDestroy(entry[0])

    def close(self) -> None:
        """Destroy the graphs and the stream."""
        lib = cudart()
        self._evict(0)
        self.output = None
        if self._stream.value:
            lib.cudaStreamSynchronize(self._stream)
            lib.cudaStreamDestroy(self._stream)
            self._stream = ctypes.c_void_p()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
