"""Host runtime helpers: default targets for devices and the CPU thread pool size."""

from __future__ import annotations

import tvm

from .host import configure_cpu_threads, physical_core_count
from .targets import TargetUnavailableError, cuda_arch, host_target, make_target

__all__ = ["configure_cpu_threads", "default_target", "host_target", "physical_core_count"]


def default_target(device: tvm.runtime.Device) -> tvm.target.Target:
    """The target to compile kernels for ``device``.

    Parameters
    ----------
    device : tvm.runtime.Device
        ``tvm.cpu()``: :func:`host_target`; ``tvm.cuda(i)``: ``cuda`` with that GPU's arch.

    Raises
    ------
    TargetUnavailableError
        A CUDA device that this process cannot see (no GPU, driver or TVM CUDA runtime).
    NotImplementedError
        Other device types: pass a target explicitly (:func:`relax_kvcache.targets.make_target`).
    """
    kind = device.dlpack_device_type()
    if kind == tvm.cpu().dlpack_device_type():
        return host_target()
    if kind != tvm.cuda().dlpack_device_type():
        raise NotImplementedError(
            f"relax_kvcache picks default targets for CPU and CUDA devices only; got {device}. "
            "Pass target=relax_kvcache.targets.make_target(kind, arch=...) explicitly (kinds: "
            "llvm, cuda, rocm, metal, webgpu, opencl).")
    if not device.exist:
        raise TargetUnavailableError(
            f"{device} is not available in this process (no GPU, CUDA driver or TVM CUDA runtime), "
            "so its architecture is unknown; pass target=make_target('cuda', arch='sm_90a') "
            "(or your GPU's arch) explicitly")
    return make_target("cuda", arch=cuda_arch(device.compute_version))
