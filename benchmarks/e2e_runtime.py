"""What ``e2e_bench.py`` runs on: the model shapes, the measurement plans, the device (weights,
synchronisation, free memory) and :class:`Runner`, one side's VM functions and ``kv_state``
builtins."""

from __future__ import annotations

import dataclasses
import gc
from typing import Dict, List, Optional, Sequence

import numpy as np
import tvm
import tvm_ffi
from tvm.runtime.vm import VirtualMachine

from relax_kvcache.ffi_registry.builtins import ORIGINAL_PREFIX
from relax_kvcache.models import LlamaConfig

PAGE = 16
SEED = 0
_LLAMA3 = dict(vocab_size=128256, num_heads=32, num_kv_heads=8, rope_theta=5e5, dtype="float16")
MODELS: Dict[str, LlamaConfig] = {
    "1b": LlamaConfig(hidden_size=2048, intermediate_size=8192, num_layers=16, head_dim=64, **_LLAMA3),
    "8b": LlamaConfig(hidden_size=4096, intermediate_size=14336, num_layers=32, head_dim=128, **_LLAMA3),
}
SMOKE_MODEL = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=16, rope_theta=5e5, dtype="float16")
#: max |ours - native| / max |native| allowed over the checked logits: each side's float16 error
#: against exact logits is ~1e-2 of their scale (the demo model measures it), twice that apart at most
TOLERANCE = 4e-2
RESERVE = 3 << 30  # GPU bytes kept free beside the caches and prefill activations


@dataclasses.dataclass(frozen=True)
class Plan:
    """What is measured (token counts per phase)."""

    ttft: Sequence[int]  # prompt lengths
    batches: Sequence[int]
    contexts: Sequence[int]
    steps: int  # timed decode steps per configuration
    warmup: int
    chunk: int  # prefill chunk (tokens per fill step; at least the longest TTFT prompt)
    ttft_reps: int
    check_prompt: int
    check_steps: int
    #: wait for the GPU before every decode step, on both sides (TVM's native cache races when its
    #: steps queue up: results/e2e_native_race_h100.log); step time then includes the host's part
    sync_steps: bool = False
    #: how decode contexts are filled: "model" (prefill through the model) or "attention" (each
    #: layer's attention call on random q/k/v: the same KV bytes without the model's matmuls)
    fill: str = "model"

    @property
    def extra(self) -> int:
        """Tokens a sequence may gain during one decode configuration (eager and graph passes)."""
        return 2 * (self.warmup + 2 * self.steps)


GPU_PLAN = Plan(ttft=(512, 2048, 8192), batches=(1, 8, 32, 128), contexts=(1024, 4096), steps=32, warmup=3,
                chunk=8192, ttft_reps=3, check_prompt=100, check_steps=6)
SMOKE_PLAN = Plan(ttft=(24, 70), batches=(1, 3), contexts=(40, 100), steps=4, warmup=3, chunk=128, ttft_reps=2,
                  check_prompt=37, check_steps=6)


def round_up(n: int) -> int:
    return -(-n // PAGE) * PAGE


def shape_tuple(values) -> tvm.runtime.ShapeTuple:
    return tvm.runtime.ShapeTuple([int(v) for v in values])


# ----------------------------------------------------------------------------- device

class Device:
    """The device the VMs run on: CUDA (needs PyTorch for weights, synchronisation, free memory) or CPU."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.dev = tvm.cuda(0) if cuda else tvm.cpu()
        self._keep: list = []
        if cuda:
            import torch

            self.torch = torch

    def sync(self) -> None:
        """Wait for all work on the device (every stream: CUDA-graph replays run on their own)."""
        if self.cuda:
            self.torch.cuda.synchronize()

    def free_bytes(self) -> Optional[int]:
        return int(self.torch.cuda.mem_get_info()[0]) if self.cuda else None

    def used_bytes(self) -> Optional[int]:
        """Device memory in use by every process (CUDA), or None (CPU: host memory is sampled)."""
        if not self.cuda:
            return None
        free, total = self.torch.cuda.mem_get_info()
        return int(total - free)

    def describe(self) -> str:
        if not self.cuda:
            return "CPU (llvm)"
        props = self.torch.cuda.get_device_properties(0)
        return f"{props.name}, {props.total_memory / 2**30:.0f} GiB"

    def tokens(self, ids: np.ndarray) -> tvm.runtime.Tensor:
        return tvm.runtime.tensor(np.ascontiguousarray(ids, dtype="int32"), self.dev)

    def weights(self, cfg: LlamaConfig, seed: int) -> List[tvm.runtime.Tensor]:
        """Random weights in ``cfg.param_shapes()`` order: linear N(0, 1/fan_in), norms 1. On
        CUDA made by PyTorch on the GPU and handed over by DLPack (no host copy)."""
        out = []
        if self.cuda:
            torch = self.torch
            torch.manual_seed(seed)
            dtype = getattr(torch, cfg.dtype)
            for name, shape in cfg.param_shapes():
                if name.endswith("norm.weight"):
                    t = torch.ones(shape, dtype=dtype, device="cuda")
                else:
                    t = torch.randn(shape, dtype=dtype, device="cuda").mul_(shape[1] ** -0.5)
                self._keep.append(t)
                out.append(tvm.runtime.from_dlpack(t))
            torch.cuda.synchronize()
            return out
        rng = np.random.default_rng(seed)
        for name, shape in cfg.param_shapes():
            w = np.ones(shape) if name.endswith("norm.weight") else rng.standard_normal(shape) * shape[1] ** -0.5
            out.append(tvm.runtime.tensor(w.astype(cfg.dtype), self.dev))
        return out

    def release(self) -> None:
        self._keep.clear()
        gc.collect()
        if self.cuda:
            self.torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- one side

class Runner:
    """One side's VM functions and the ``kv_state`` builtins it is driven with (ours: the
    dispatchers, as an engine calls them; native: TVM's functions)."""

    def __init__(self, side: str, vm: VirtualMachine, weights: List[tvm.runtime.Tensor],
                 calibrate: bool = False) -> None:
        prefix = "" if side == "ours" else ORIGINAL_PREFIX
        get = lambda name: tvm_ffi.get_global_func(prefix + "vm.builtin." + name)  # noqa: E731
        self.side, self.weights, self.calibrate = side, weights, calibrate  # calibrate: 8-bit pages' scales
        self.add, self.remove = get("kv_state_add_sequence"), get("kv_state_remove_sequence")
        self.popn = get("kv_state_popn")
        self.begin, self.end = get("kv_state_begin_forward"), get("kv_state_end_forward")
        self.attention = get("attention_kv_cache_attention_with_fused_qkv")
        self.prefill_fn, self.decode_fn, self.create_fn = vm["prefill"], vm["decode"], vm["create_kv_cache"]

    def create(self, max_batch: int, max_total: int, chunk: int):
        cache = self.create_fn(shape_tuple([max_batch]), shape_tuple([max_total]), shape_tuple([chunk]))
        if self.calibrate:  # 8-bit pages: scales from the first step's K / V
            cache.calibrate_kv_scales()
        return cache

    def forward(self, cache, fn, ids: tvm.runtime.Tensor, seq_ids, lengths) -> tvm.runtime.Tensor:
        self.begin(cache, shape_tuple(seq_ids), shape_tuple(lengths))
        try:
            return fn(ids, cache, *self.weights)
        finally:
            self.end(cache)
