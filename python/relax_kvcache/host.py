"""The host machine: its physical cores, and the size of TVM's CPU thread pool.

Imports no TVM: :func:`configure_cpu_threads` runs before TVM starts its pool.
"""

from __future__ import annotations

import os


def physical_core_count() -> int:
    """Physical cores this process may run on (SMT siblings counted once)."""
    cpus = (sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else range(os.cpu_count() or 1))
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
    """Set ``TVM_NUM_THREADS`` to the physical core count unless it or ``OMP_NUM_THREADS`` is set
    (TVM otherwise takes half the hardware threads, half the cores of a VM without SMT). Must run
    before the first parallel kernel."""
    if "TVM_NUM_THREADS" not in os.environ and "OMP_NUM_THREADS" not in os.environ:
        os.environ["TVM_NUM_THREADS"] = str(physical_core_count())
