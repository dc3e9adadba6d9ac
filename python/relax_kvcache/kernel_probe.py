"""Check kernels that carry no record of their config before a cache relies on them.

Our kernel libraries name the config they were built for (``build.kernel_identity``); kernels
passed through TVM's creation arguments (TVM's own, or ours compiled into a model's module by
the frontend) do not. A cache built on them runs each kernel it calls in the middle of a
mutating operation once at construction, on inputs where the right answer is known, so kernels
of another shape, dtype or RoPE constant fail there with a `ConfigError` instead of halfway
through a fork, a commit or a step (or not at all, giving wrong results).
"""

from __future__ import annotations

from typing import Callable, List, Tuple

import numpy as np
import tvm

from .config import KVCacheConfig, RopeMode
from .errors import ConfigError
from .kernel_set import KernelSet
from .reference import rope

# positions of the RoPE probe: a small one and one where other theta/scale values differ widely
_PROBE_POSITIONS = (7, 1000)


def probe_foreign_kernels(config: KVCacheConfig, kernels: KernelSet, pages: tvm.runtime.Tensor,
                          device: tvm.runtime.Device) -> None:
    """Run the page copies (page 0, free now, onto itself) and ``split_rotary`` once.

    Raises
    ------
    ConfigError
        A kernel raises on this cache's tensors, or ``split_rotary`` (RoPE applied at append
        time, ``RopeMode.NORMAL``) rotates with other constants than ``config.rope_theta`` /
        ``rope_scale``.
    """
    probes: List[Tuple[str, Callable[[], None]]] = [
        ("copy_single_page", lambda: kernels.copy_single_page(pages, 0, 0, 1))]
    if kernels.compact_copy is not None:
        indptr = tvm.runtime.tensor(np.array([0, 1], dtype=np.int32), device)
        positions = tvm.runtime.tensor(np.zeros((2, 1), dtype=np.int32), device)
        probes.append(("compact_copy", lambda: kernels.compact_copy(pages, indptr, positions, 1)))
    if not config.is_mla:
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


def _probe_split_rotary(config: KVCacheConfig, kernels: KernelSet, device: tvm.runtime.Device) -> None:
    """Split a random fused QKV of two tokens; with NORMAL RoPE, compare q/k with float64 RoPE."""
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
    expect_q, expect_k, expect_v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    if applies_rope:
        expect_q, expect_k = (rope(x, np.array(_PROBE_POSITIONS), config.rope_theta, config.rope_scale)
                              for x in (expect_q, expect_k))
    tol = 1e-3 if config.dtype == "float32" else 5e-2
    for name, got, want in (("q", q, expect_q), ("k", k, expect_k), ("v", v, expect_v)):
        err = float(np.abs(got - want).max())
        if not err <= tol:
            raise ConfigError(
                f"the split_rotary kernel does not compute this config's {name}: max error {err:.3g} "
                f"against RoPE with rope_theta {config.rope_theta}, rope_scale {config.rope_scale} "
                f"(rope_mode {config.effective_rope_mode.name}); expected kernels built for this config")


def _tensor(values: np.ndarray, dtype: str, device: tvm.runtime.Device) -> tvm.runtime.Tensor:
    if dtype == "bfloat16":
        import ml_dtypes

        host = values.astype(ml_dtypes.bfloat16)
    else:
        host = values.astype(dtype)
    out = tvm.runtime.empty(values.shape, dtype, device)
    out.copyfrom(host)
    return out
