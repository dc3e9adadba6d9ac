"""Check kernels that carry no record of their config before a cache relies on them.

Our kernel libraries name the config they were built for (``build.kernel_identity``); kernels
passed through TVM's creation arguments (TVM's own, or ours compiled into a model's module by
the frontend) do not. A cache built on them runs each kernel it calls in the middle of a
mutating operation once at construction, on inputs where the right answer is known, so kernels
of another shape or dtype fail there with a `ConfigError` instead of halfway through a fork, a
commit or a step.
"""

from __future__ import annotations

from typing import Callable, List, Tuple

import numpy as np
import tvm

from .config import KVCacheConfig, RopeMode
from .errors import ConfigError
from .kernel_set import KernelSet
from .tensors import numpy_dtype

# token positions of the split_rotary probe (rotations by different angles)
_PROBE_POSITIONS = (7, 1000)


def probe_foreign_kernels(config: KVCacheConfig, kernels: KernelSet, pages: tvm.runtime.Tensor,
                          device: tvm.runtime.Device) -> None:
    """Run the page copies (page 0, free now, onto itself), the append (one token into page 0)
    and ``split_rotary`` once.

    Raises
    ------
    ConfigError
        A kernel raises on this cache's tensors, or ``split_rotary`` does not copy v, or
        changes the length of q / k head vectors (RoPE only rotates them).
    """
    probes: List[Tuple[str, Callable[[], None]]] = [
        ("copy_single_page", lambda: kernels.copy_single_page(pages, 0, 0, 1))]
    if kernels.compact_copy is not None:
        indptr = tvm.runtime.tensor(np.array([0, 1], dtype=np.int32), device)
        positions = tvm.runtime.tensor(np.zeros((2, 1), dtype=np.int32), device)
        probes.append(("compact_copy", lambda: kernels.compact_copy(pages, indptr, positions, 1)))
    if config.is_mla:
        if kernels.transpose_append_mla is not None:
            probes.append(("transpose_append_mla", lambda: _probe_append_mla(config, kernels, pages, device)))
    else:
        probes.append(("transpose_append", lambda: _probe_append(config, kernels, pages, device)))
        probes.append(("split_rotary", lambda: _probe_split_rotary(config, kernels, device)))
    shape = "x".join(map(str, pages.shape))
    for role, probe in probes:
        try:
            probe()
        except ConfigError:
            raise
        except Exception as err:  # noqa: BLE001 - any failure of a foreign kernel
            first_line = str(err).splitlines()[0] if str(err) else ""
            raise ConfigError(f"the {role} kernel fails on this cache's tensors ({config.dtype} pages of shape "
                              f"{shape}; {type(err).__name__}: {first_line}); expected kernels built for "
                              "this config") from err


def _probe_append(config: KVCacheConfig, kernels: KernelSet, pages: tvm.runtime.Tensor,
                  device: tvm.runtime.Device) -> None:
    """Append one token's K/V to slot 0 of page 0 (free now)."""
    hkv = config.num_kv_heads
    k = tvm.runtime.empty((1, hkv, config.head_dim), config.dtype, device)
    v = tvm.runtime.empty((1, hkv, config.v_head_dim), config.dtype, device)
    kernels.transpose_append(pages, k, v, tvm.runtime.tensor(np.zeros(1, dtype=np.int32), device))


def _probe_append_mla(config: KVCacheConfig, kernels: KernelSet, pages: tvm.runtime.Tensor,
                      device: tvm.runtime.Device) -> None:
    kv = tvm.runtime.empty((1, config.head_dim), config.dtype, device)
    kernels.transpose_append_mla(pages, kv, tvm.runtime.tensor(np.zeros(1, dtype=np.int32), device))


def _probe_split_rotary(config: KVCacheConfig, kernels: KernelSet, device: tvm.runtime.Device) -> None:
    """Split a random fused QKV of two tokens: v must be copied; q and k copied (no RoPE at
    append time) or rotated. Any rotation passes, each head vector keeping its length: with
    RoPE at append time the kernel defines the rotation (as in TVM: it may implement Llama-3
    frequency scaling or a partial rotary dim, which the config does not describe)."""
    hq, hkv, d = config.num_qo_heads, config.num_kv_heads, config.head_dim
    n = len(_PROBE_POSITIONS)
    # multiples of 1/8 in [-2, 2]: exact in every cache dtype
    qkv = np.random.default_rng(0).integers(-16, 17, size=(n, hq + 2 * hkv, d)) / 8.0
    tensors = [_tensor(qkv, config.dtype, device)]
    tensors.append(tvm.runtime.tensor(np.array(_PROBE_POSITIONS, dtype=np.int32), device))
    tensors += [tvm.runtime.empty((n, h, d), config.dtype, device) for h in (hq, hkv, hkv)]
    applies_rope = config.effective_rope_mode == RopeMode.NORMAL
    kernels.split_rotary(*tensors, int(applies_rope))
    q, k, v = (t.numpy().astype(np.float64) for t in tensors[2:])
    given = {"q": qkv[:, :hq], "k": qkv[:, hq:hq + hkv], "v": qkv[:, hq + hkv:]}
    tol = 1e-3 if config.dtype == "float32" else 5e-2
    for name, got in (("q", q), ("k", k), ("v", v)):
        if name == "v" or not applies_rope:
            _expect_close(f"{name} (a copy of the fused input)", got, given[name], tol)
        else:  # a rotation: every head vector keeps its length
            ratio = np.linalg.norm(got, axis=-1) / np.maximum(np.linalg.norm(given[name], axis=-1), 1e-6)
            _expect_close(f"{name} as a rotation (head vectors keep their length)", ratio, np.ones_like(ratio), tol)


def _expect_close(what: str, got: np.ndarray, want: np.ndarray, tol: float) -> None:
    err = float(np.abs(got - want).max())
    if not err <= tol:
        raise ConfigError(f"the split_rotary kernel does not compute {what}: max error {err:.3g}; expected kernels "
                          "built for this config")


def _tensor(values: np.ndarray, dtype: str, device: tvm.runtime.Device) -> tvm.runtime.Tensor:
    out = tvm.runtime.empty(values.shape, dtype, device)
    out.copyfrom(values.astype(numpy_dtype(dtype)))
    return out
