"""Host runtime helpers: default targets for devices and the CPU thread pool size."""

from __future__ import annotations

import os

import tvm


def physical_core_count() -> int:
    """Physical cores this process may run on (SMT siblings counted once)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    cores = set()
    for cpu in cpus:
        base = f"/sys/devices/system/cpu/cpu{cpu}/topology"
        try:
            with open(f"{base}/physical_package_id") as f_pkg, open(f"{base}/core_id") as f_core:
                cores.add((f_pkg.read().strip(), f_core.read().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))
    return max(1, len(cores))


def configure_cpu_threads() -> None:
    """Let TVM's CPU thread pool use every physical core unless the user chose a size.

    TVM sizes its pool from ``TVM_NUM_THREADS`` / ``OMP_NUM_THREADS``, else from half the
    hardware threads (assuming SMT), which on a VM with one thread per core is half the cores.
    We set ``TVM_NUM_THREADS`` to the physical core count when neither variable is set; this must
    happen before the first parallel kernel runs in the process.
    """
    if "TVM_NUM_THREADS" not in os.environ and "OMP_NUM_THREADS" not in os.environ:
        os.environ["TVM_NUM_THREADS"] = str(physical_core_count())


def host_target() -> tvm.target.Target:
    """The ``llvm`` target of this machine's CPU: its model (``mcpu``) and physical core count."""
    config = {"kind": "llvm", "num-cores": physical_core_count()}
    cpu = tvm.target.codegen.llvm_get_system_cpu()
    if cpu and cpu != "generic":
        config["mcpu"] = cpu
    return tvm.target.Target(config)


def default_target(device: tvm.runtime.Device) -> tvm.target.Target:
    """The target to compile kernels for ``device``.

    Parameters
    ----------
    device : tvm.runtime.Device
        ``tvm.cpu()``: the host CPU model (:func:`host_target`). ``tvm.cuda(i)``: ``cuda`` with
        the architecture of that GPU (compute capability 9.0 -> ``sm_90a``, 8.0 -> ``sm_80``).

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
    if kind == tvm.cuda().dlpack_device_type():
        return _cuda_target(device)
    raise NotImplementedError(
        f"relax_kvcache picks default targets for CPU and CUDA devices only; got {device}. Pass "
        "target=relax_kvcache.targets.make_target(kind, arch=...) explicitly (kinds: llvm, cuda, "
        "rocm, metal, webgpu, opencl).")


def _cuda_target(device: tvm.runtime.Device) -> tvm.target.Target:
    from .targets import TargetUnavailableError, cuda_arch, make_target

    if not device.exist:
        raise TargetUnavailableError(
            f"{device} is not available in this process (no GPU, CUDA driver or TVM CUDA runtime), "
            "so its architecture is unknown; pass target=make_target('cuda', arch='sm_90a') "
            "(or your GPU's arch) explicitly")
    return make_target("cuda", arch=cuda_arch(device.compute_version))
