"""The TIR pipeline the kernels are compiled with: TVM's default one, plus programmatic
dependent launch for the CUDA kernels that take part in it.

A kernel takes part when it opens with ``griddepcontrol.wait`` (see
``tir_kernels.macros.grid_dependency``): TVM 0.27's CUDA runtime then launches it with
``cuLaunchKernelEx`` and programmatic stream serialization, so it may start while the grid
before it finishes, and waits for that grid's results in the wait. Kernels compiled through
another pipeline run the same instructions without the overlap (the wait returns at once).
"""

from __future__ import annotations

#: Name of the pipeline in TVM's registry (``tvm.compile(..., tir_pipeline=PIPELINE)``,
#: ``tvm.tirx.build(..., pipeline=PIPELINE)``); registered by :func:`register`.
PIPELINE = "relax_kvcache"

_LAUNCH_PARAMS = "tirx.kernel_launch_params"
_DEPENDENT = "tirx.use_programtic_dependent_launch"  # TVM 0.27's spelling
_DYNAMIC_SHARED = "tirx.use_dyn_shared_memory"  # must stay the last tag


def _mark_dependent_launch(mod, _ctx):
    """Add the dependent-launch tag to the launch parameters of each CUDA kernel that waits."""
    import tvm

    from .tir_kernels.schedule import GPU_TARGET_KINDS, schedule_for

    for gvar, func in list(mod.functions_items()):
        attrs = func.attrs if isinstance(func, tvm.tirx.PrimFunc) and func.attrs else {}
        if _LAUNCH_PARAMS not in attrs or attrs["target"].kind.name not in GPU_TARGET_KINDS:
            continue
        if not schedule_for(attrs["target"]).dependent_launch:  # no kernel of this target waits
            continue
        tags = [str(t) for t in attrs[_LAUNCH_PARAMS]]
        if _DEPENDENT in tags or 'griddepcontrol("wait"' not in func.script():
            continue
        tags.insert(len(tags) - (tags[-1:] == [_DYNAMIC_SHARED]), _DEPENDENT)
        mod[gvar] = func.with_attr(_LAUNCH_PARAMS, tags)
    return mod


def _pipeline(**kwargs):
    import tvm
    from tvm.tirx import compilation_pipeline

    lower, finalize_host, finalize_device = compilation_pipeline.get_tir_pipeline("s_tir", **kwargs)
    mark = tvm.transform.module_pass(_mark_dependent_launch, opt_level=0, name="MarkDependentLaunch")
    return tvm.transform.Sequential([lower, mark]), finalize_host, finalize_device


def register() -> str:
    """Register :data:`PIPELINE` with TVM (idempotent) and return its name."""
    from tvm.tirx import compilation_pipeline

    compilation_pipeline.PIPELINE_MAP.setdefault(PIPELINE, _pipeline)
    return PIPELINE
