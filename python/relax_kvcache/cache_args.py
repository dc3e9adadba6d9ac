"""Checks of the cache's runtime arguments: its device, kernels, layer offset and target."""

from __future__ import annotations

from typing import Any

import tvm

from .args import INT32_MAX, as_int, describe
from .errors import ArgumentError, ConfigError
from .kernel_set import KernelSet


def check_cache_args(device: Any, kernels: Any, layer_offset: Any, target: Any = None) -> int:
    """Check ``PagedAttentionKVCache``'s device, kernels, layer_offset and target (``ArgumentError``
    for a wrong type, ``ConfigError`` for a bad value); return the offset."""
    if not isinstance(device, tvm.runtime.Device):
        raise ArgumentError(f"device must be a tvm.runtime.Device or None, got {describe(device)} "
                            f"of type {type(device).__name__}")
    if device.index < 0:
        raise ConfigError(f"device {device} has a negative index {device.index}; expected a device that exists")
    if not device.exist:
        raise ConfigError(f"device {device} does not exist in this process (no such GPU, driver or TVM runtime "
                          "for it); expected a device this process can use (deploy.prepare_cuda loads TVM's "
                          "CUDA runtime on a runtime-only install)")
    if kernels is not None and not isinstance(kernels, KernelSet):
        raise ArgumentError(f"kernels must be a KernelSet or None, got {type(kernels).__name__}")
    offset = as_int("layer_offset", layer_offset)
    if not 0 <= offset <= INT32_MAX:
        raise ConfigError(f"layer_offset must be in [0, {INT32_MAX}], got {offset}")
    if target is not None and not isinstance(target, tvm.target.Target):
        raise ArgumentError(f"target must be a tvm.target.Target or None, got {describe(target)} of type "
                            f"{type(target).__name__} (e.g. relax_kvcache.targets.make_target('cuda'))")
    if target is not None and target.get_target_device_type() != int(device.dlpack_device_type()):
        raise ConfigError(f"target {target.kind.name} compiles for another kind of device than {device}; expected "
                          "a target of the device's kind (or None: the device's default target)")
    return offset
