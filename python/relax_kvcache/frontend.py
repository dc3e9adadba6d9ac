"""Model authors' frontend: the cache as an object of ``tvm.relax.frontend.nn`` model code.

:class:`PagedKVCache` methods emit the ``vm.builtin.attention_kv_cache_*`` calls of TVM's own
frontend; :meth:`PagedKVCache.create` adds our kernels to the model's IRModule, which one
:func:`compile` builds. ``import relax_kvcache`` before creating the ``VirtualMachine``. An
example: docs/getting-started.md.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Sequence, Tuple, Union

import numpy as np
import tvm
from tvm import relax as rx
from tvm.s_tir import dlight as dl
from tvm.relax.frontend import nn

from . import launch, tensor_core_matmul
from .build import AnyKernelSetSpec, _pass_config, kernel_set_spec
from .config import KV_DTYPE_CODES, AttnKind, KVCacheConfig, RopeMode
from .errors import ConfigError
from .tir_kernels.schedule import GpuSchedule, schedule_for

#: The creation function the model's ``create_kv_cache`` calls.
CREATE = "relax_kvcache.paged_attention_kv_cache_create"

IntOrVar = Union[int, tvm.tirx.Expr]


@dataclasses.dataclass(frozen=True, kw_only=True)
class CacheLayout:
    """What a model fixes about its cache at compile time: the fields of
    :class:`~relax_kvcache.KVCacheConfig` but its capacities (arguments of
    :meth:`PagedKVCache.create`); the model's module holds ``rope_ext_factors`` as a constant.

    Parameters
    ----------
    sliding_window : bool
        Whether sequences may get sliding windows (``KVCacheConfig.support_sliding_window``).
    kv_dtype : str, optional
        What the pages store (``KVCacheConfig.kv_dtype``): None for ``dtype``, or an 8-bit float
        format; passed as an 8th ``cache_config`` entry.
    prefix_caching : bool
        Automatic prefix caching (``KVCacheConfig.prefix_caching``, docs/prefix-caching.md);
        passed as a 9th ``cache_config`` entry.
    """

    num_layers: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: Optional[int] = None
    page_size: int = 16
    rope_mode: RopeMode = RopeMode.NORMAL
    rope_theta: float = 10000.0
    rope_scale: float = 1.0
    rope_rotary_dim: Optional[int] = None
    rope_interleaved: bool = False
    rope_ext_factors: Optional[Sequence[float]] = None
    rope_original_max_position_embeddings: Optional[int] = None
    rope_attention_factor: float = 1.0
    dtype: str = "float16"
    attn_kinds: Optional[Sequence[AttnKind]] = None
    layer_sliding_window_size: int = 1024
    attention_chunk_size: Optional[int] = None
    sliding_window: bool = False
    mla_original_qk_head_dim: Optional[int] = None
    mla_original_v_head_dim: Optional[int] = None
    kv_dtype: Optional[str] = None
    prefix_caching: bool = False

    def kernel_spec(self) -> AnyKernelSetSpec:
        """The kernels of this layout (capacities do not enter the kernels)."""
        fields = dataclasses.asdict(self)
        fields["support_sliding_window"] = fields.pop("sliding_window")
        return kernel_set_spec(KVCacheConfig(**fields, max_num_seqs=1, prefill_chunk_size=1,
                                             max_total_seq_len=self.page_size))


class PagedKVCache(nn.Object):
    """The paged KV cache inside ``tvm.relax.frontend.nn`` model code; tensors are ``(batch, seq,
    heads, dim)``, flattened to the cache's token axis."""

    @classmethod
    def create(cls, layout: CacheLayout, target: Union[str, dict, tvm.target.Target], *,
               max_batch_size: IntOrVar, max_total_seq_len: IntOrVar, prefill_chunk_size: IntOrVar,
               host_cache_pages: IntOrVar = 0, name: str = "paged_kv_cache") -> "PagedKVCache":
        """Emit the cache's creation (inside a function being built), adding our kernels to the
        IRModule as ``relax_kvcache_<role>``.

        Parameters
        ----------
        layout : CacheLayout
        target : str, dict or Target
            The target the model is compiled for (it picks the kernel schedules).
        max_batch_size, max_total_seq_len, prefill_chunk_size
            Capacities: ints, or symbolic ``tirx.Var`` given when the model's function runs.
        host_cache_pages
            Prefix caching's host tier (``KVCacheConfig.host_cache_pages``; a layout with
            ``prefix_caching``): an int or a ``tirx.Var``, passed as a 10th ``cache_config`` entry.
        """
        target = tvm.target.Target(target)
        bb = rx.BlockBuilder.current()
        if bb is None:
            raise RuntimeError("PagedKVCache.create emits Relax code: call it inside a function "
                               "being built (an nn.Module method exported with export_tvm)")
        if isinstance(host_cache_pages, int) and host_cache_pages and not layout.prefix_caching:
            raise ConfigError(f"host_cache_pages={host_cache_pages} needs a layout with prefix_caching=True")
        kinds = layout.attn_kinds
        kinds = [AttnKind.MHA] * layout.num_layers if kinds is None else kinds
        kernels = _add_kernels(bb, layout, target)

        def attention(role: str):
            return rx.Tuple([tvm.ir.StringImm("tirx"), kernels[role]] if role in kernels else [])

        def function(role: str):
            return kernels[role] if role in kernels else rx.op.null_value()

        merges = [kernels[role] for role in ("merge_inplace", "merge_general") if role in kernels]
        args = [
            rx.ShapeExpr([max_batch_size, max_total_seq_len, prefill_chunk_size, layout.page_size,
                          int(layout.sliding_window), layout.layer_sliding_window_size,
                          layout.attention_chunk_size or 0,  # 7th to 10th entries: ours (TVM reads 6)
                          KV_DTYPE_CODES.index(layout.kv_dtype), int(layout.prefix_caching), host_cache_pages]),
            rx.ShapeExpr([0, layout.num_layers]),
            rx.prim_value(layout.num_qo_heads), rx.prim_value(layout.num_kv_heads),
            rx.prim_value(layout.head_dim), rx.prim_value(layout.v_head_dim or layout.head_dim),
            rx.ShapeExpr([int(kind) for kind in kinds]),
            rx.prim_value(False),  # KV transfer
            rx.prim_value(int(layout.rope_mode)), rx.prim_value(float(layout.rope_scale)),
            rx.prim_value(float(layout.rope_theta)),
            rx.op.null_value() if layout.rope_ext_factors is None else
            rx.const(np.array(layout.rope_ext_factors, dtype=np.float32)),  # rope_ext_factors
            rx.op.zeros((), layout.dtype),  # the cache's dtype and device
            function("transpose_append"), function("transpose_append_mla"),
            attention("attention_prefill_ragged"), attention("attention_prefill"),
            attention("attention_decode"), attention("attention_prefill_sliding_window"),
            attention("attention_decode_sliding_window"), attention("attention_prefill_tree"),
            attention("attention_prefill_ragged_tree"), attention("attention_prefill_mla"),
            rx.Tuple(merges),
            function("split_rotary"), kernels["copy_single_page"], kernels["debug_get_kv"],
            function("compact_copy"),
            # 29th to 31st arguments (TVM's creation ignores them): the windowed ragged kernel of
            # local layers, the prefixed prefill kernel, the check of attention_with_fused_qkv
            attention("attention_prefill_ragged_sliding_window"), attention("attention_prefill_prefixed"),
            function("check_fused_qkv"),
        ]
        return cls(_expr=rx.call_pure_packed(CREATE, *args, ty_args=rx.AnyType()), _name=name)

    def attention_with_fused_qkv(self, layer_id: int, qkv: nn.Tensor, num_qo_heads: int,
                                 sm_scale: float) -> nn.Tensor:
        """Append the new tokens' K/V and attend over the sequence: ``qkv (b, s, num_qo_heads + 2 *
        num_kv_heads, d)`` -> ``(b, s, num_qo_heads, d)``."""
        b, s, heads, d = qkv.shape
        o = _dps("attention_with_fused_qkv", [self._expr, layer_id, sm_scale,
                                              qkv.reshape(b * s, heads, d)._expr],
                 [rx.TensorType((b * s, num_qo_heads, d), qkv.dtype)])
        return o.reshape(b, s, num_qo_heads, d)

    def self_attention(self, layer_id: int, q: nn.Tensor, k: nn.Tensor, v: nn.Tensor,
                       sm_scale: float) -> Tuple[nn.Tensor, nn.Tensor]:
        """Causal attention among the step's new tokens only (nothing is appended): ``o (b, s,
        Hq, dv)`` and base-2 ``lse (b, s, Hq)``."""
        b, s, hq, dqk = q.shape
        hkv, dv = v.shape[2], v.shape[3]
        args = [q.reshape(b * s, hq, dqk), k.reshape(b * s, hkv, dqk), v.reshape(b * s, hkv, dv)]
        return _state_pair(_dps("self_attention", [self._expr, layer_id, sm_scale,
                                                   *(t._expr for t in args)],
                                _state_types(b * s, hq, dv, q.dtype)), b, s)

    def cross_attention(self, layer_id: int, q: nn.Tensor, v_head_dim: int,
                        sm_scale: float) -> Tuple[nn.Tensor, nn.Tensor]:
        """Attention of the new tokens over the sequence's cached tokens; ``(o, lse)``."""
        b, s, hq, dqk = q.shape
        return _state_pair(_dps("cross_attention", [self._expr, layer_id, sm_scale,
                                                    q.reshape(b * s, hq, dqk)._expr],
                                _state_types(b * s, hq, v_head_dim, q.dtype)), b, s)

    def append_mla_kv(self, layer_id: int, kv: nn.Tensor) -> "PagedKVCache":
        """Write the step's latent rows ``kv (b, s, 1, kv_lora_rank + rope dim)`` of an MLA
        layer; returns the cache (thread it on, as TVM's frontend does)."""
        b, s, _, width = kv.shape
        return PagedKVCache(_expr=rx.call_pure_packed(
            "vm.builtin.attention_kv_cache_append_mla_kv", self._expr, rx.prim_value(layer_id),
            kv.reshape(b * s, width)._expr, ty_args=rx.AnyType()), _name="paged_kv_cache")

    def merge_attn_output_inplace(self, o_a: nn.Tensor, lse_a: nn.Tensor, o_b: nn.Tensor,
                                  lse_b: nn.Tensor) -> Tuple[nn.Tensor, nn.Tensor]:
        """Merge two attention states by LSE into ``(o_a, lse_a)`` (returned)."""
        b, s, h, dv = o_a.shape
        flat = [o_a.reshape(b * s, h, dv), lse_a.reshape(b * s, h),
                o_b.reshape(b * s, h, dv), lse_b.reshape(b * s, h)]
        merged = rx.BlockBuilder.current().emit(rx.call_pure_packed(
            "vm.builtin.attention_kv_cache_merge_attn_output_inplace", self._expr,
            *(t._expr for t in flat), ty_args=rx.TupleType([flat[0]._expr.ty, flat[1]._expr.ty])))
        return _state_pair(merged, b, s)

    def get_query_positions(self, total_length: IntOrVar) -> nn.Tensor:
        """Position in its sequence of each of the step's ``total_length`` new tokens (int32)."""
        return nn.Tensor(_expr=rx.BlockBuilder.current().emit(rx.call_pure_packed(
            "vm.builtin.attention_kv_cache_get_query_positions", self._expr,
            ty_args=rx.TensorType((total_length,), "int32"))))


def compile(mod: tvm.IRModule, target: Union[str, dict, tvm.target.Target],  # noqa: A001
            upper_bounds: Optional[Dict[str, int]] = None, **kwargs):
    """``tvm.compile`` of a model holding the cache's kernels, with the pass configuration the GPU
    kernels need. ``upper_bounds`` (e.g. ``{"n": prefill_chunk_size, "b": max_batch_size}``):
    the largest values of the entry points' symbolic dimensions, by name, so that TVM plans their
    activations once at those sizes (``tir_var_upper_bound``, as MLC-LLM does) instead of
    allocating per shape at run time; function outputs are still allocated per call. On CUDA
    sm_80 and newer, the model's float16 / bfloat16 matmuls run on tensor cores
    (:mod:`relax_kvcache.tensor_core_matmul`, float32 accumulation) past one row, as dlight's
    ``LowBatchGEMV`` for one, unless ``relax_pipeline`` is given (docs/troubleshooting.md)."""
    target = tvm.target.Target(target)
    if upper_bounds:
        bounds = {str(k): int(v) for k, v in upper_bounds.items()}
        mod = tvm.IRModule({gv: f.with_attr("tir_var_upper_bound", bounds) if isinstance(f, rx.Function) else f
                            for gv, f in mod.functions_items()}, attrs=mod.attrs)
    kwargs.setdefault("tir_pipeline", launch.register())
    if target.kind.name == "cuda" and "relax_pipeline" not in kwargs:
        kwargs["relax_pipeline"] = _cuda_relax_pipeline(target)
    with tvm.transform.PassContext(opt_level=3, config=_pass_config(target)):
        return tvm.compile(mod, target=target, **kwargs)


#: Row counts up to which a matmul whose rows are its one dynamic extent (decode: the batch) runs as
#: dlight's ``LowBatchGEMV`` padded to that many rows, past the last dlight's ``Matmul``, where our
#: tensor-core kernel does not apply (where it does, only the first: :func:`_row_dispatch`).
LOW_BATCH_BUCKETS = (1, 4, 8)


def _cuda_relax_pipeline(target: tvm.target.Target) -> tvm.transform.Pass:
    """TVM's default CUDA Relax pipeline with the model's matmuls scheduled as MLC-LLM's does:
    ``FuseTransposeMatmul`` makes ``x @ W.T`` one matmul reading ``W`` in place, matmuls with a
    dynamic row count dispatch on it (:func:`_dispatch_rows`), static vector products run as GEMV.
    Matmuls get our tensor-core kernel where it applies (:class:`_TensorCoreMatmul`), else dlight's
    ``Matmul`` without tensor cores (TVM 0.27's ``MatmulTensorization`` fails on these models)."""
    from tvm.relax.backend.cuda import pipeline as cuda

    legalize = [rx.transform.FuseTransposeMatmul(), rx.transform.LegalizeOps(),
                rx.transform.AnnotateTIROpPattern(), rx.transform.FoldConstant(),
                rx.transform.FuseOps(), rx.transform.FuseTIR(), _dispatch_rows,
                dl.ApplyDefaultSchedule(_TensorCoreMatmul(), _MatmulWithoutTensorCores(), dl.gpu.GEMV(),
                                        dl.gpu.Reduction(), dl.gpu.GeneralReduction(),
                                        dl.gpu.Fallback())]

    @tvm.transform.module_pass(opt_level=0)
    def pipeline(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        with target:
            passes = (cuda.library_dispatch_passes(target) + legalize
                      + cuda.dataflow_lower_passes(target) + cuda.finalize_passes(target))
            return tvm.transform.Sequential(passes)(mod)

    return pipeline


@tvm.transform.module_pass(opt_level=0, name="DispatchMatmulRows")
def _dispatch_rows(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
    """Each unscheduled matmul whose one dynamic extent is its row count becomes kernels chosen at
    run time on the row count: where our tensor-core kernel applies, ``LowBatchGEMV`` for one row,
    then the tensor-core tiles for up to each of ``tensor_core_matmul.SMALL_ROWS`` rows (k split)
    and past them; elsewhere one ``LowBatchGEMV`` per :data:`LOW_BATCH_BUCKETS` entry (each block
    reads its weight rows once for the bucket's rows), then dlight's ``Matmul``."""
    for gvar, func in list(mod.functions_items()):
        if isinstance(func, tvm.tirx.PrimFunc) and "tirx.is_scheduled" not in func.attrs:
            dispatched = _row_dispatch(func)
            if dispatched is not None:
                mod[gvar] = dispatched
    return mod


def _row_dispatch(func: tvm.tirx.PrimFunc) -> Optional[tvm.tirx.PrimFunc]:
    dims = {d for p in func.params if isinstance(p.ty, tvm.tirx.BufferType) for d in p.shape
            if isinstance(d, tvm.tirx.Var)}
    if len(dims) != 1:
        return None
    # None for all but matmuls: tried first
    tensor_cores = _scheduled(func, _TensorCoreMatmul())
    body = tensor_cores or _scheduled(func, _MatmulWithoutTensorCores())
    if body is None:
        return None
    # with tensor cores: GEMV for one row, then tiles for few rows, k split (tensor_core_matmul)
    gemv_rows = LOW_BATCH_BUCKETS[:1] if tensor_cores is not None else LOW_BATCH_BUCKETS
    low = [_scheduled(func, dl.gpu.LowBatchGEMV(rows)) for rows in gemv_rows]
    if any(f is None for f in low):
        return None
    (rows,) = dims
    buckets = list(zip(gemv_rows, [f.body for f in low]))
    if tensor_cores is not None:
        buckets += [(limit, tensor_core_matmul.schedule(func, limit).body) for limit in tensor_core_matmul.SMALL_ROWS]
    body = body.body
    for limit, branch in reversed(buckets):
        body = tvm.tirx.IfThenElse(tvm.tirx.op.tvm_thread_invariant(rows <= limit), branch, body)
    body = tvm.s_tir.SBlockRealize([], True, tvm.s_tir.SBlock([], [], [], "root", body))
    return func.with_body(body).with_attrs({"tirx.is_scheduled": True, "tirx.HoistIfThenElseExprWithBlock": 1})


def _scheduled(func: tvm.tirx.PrimFunc, rule: dl.ScheduleRule) -> Optional[tvm.tirx.PrimFunc]:
    """``func`` scheduled by ``rule`` (under the current target), or None where it does not apply."""
    func = dl.ApplyDefaultSchedule(rule)(tvm.IRModule({"main": func}))["main"]
    return func if "tirx.is_scheduled" in func.attrs else None


class _TensorCoreMatmul(dl.ScheduleRule):
    """:mod:`relax_kvcache.tensor_core_matmul` on targets with ``mma.sync`` (CUDA sm_80+), for the
    matmuls it takes (a static row count only past :data:`LOW_BATCH_BUCKETS`' last)."""

    def apply(self, func, target, tunable):  # noqa: D102
        if not isinstance(func, tvm.tirx.PrimFunc) or not getattr(schedule_for(target), "mma", False):
            return None
        mm = tensor_core_matmul.match(func)
        if mm is None or (isinstance(mm.rows, tvm.tirx.IntImm) and int(mm.rows) <= LOW_BATCH_BUCKETS[-1]):
            return None
        return tvm.s_tir.Schedule(tensor_core_matmul.schedule(func))


class _MatmulWithoutTensorCores(dl.gpu.Matmul):
    """dlight's Matmul rule, deciding as for an sm_50 GPU (no tensor-core path)."""

    def apply(self, func, target, tunable):  # noqa: D102
        config = dict(target.export())
        config["arch"] = "sm_50"
        return super().apply(func, tvm.target.Target(config), tunable)


def _add_kernels(bb: rx.BlockBuilder, layout: CacheLayout, target: tvm.target.Target) -> dict:
    """Add the kernels of ``layout`` to the module being built; role -> GlobalVar."""
    sched = schedule_for(target)
    spec = layout.kernel_spec()
    kernels = {}
    for role, func in spec.kernel_functions(sched).items():
        name = f"relax_kvcache_{role}"
        func = func.with_attr("global_symbol", name)
        if isinstance(sched, GpuSchedule):  # already scheduled: keep dlight's default schedules off
            func = func.with_attr("tirx.is_scheduled", True)
        kernels[role] = bb.add_func(func, name)
    return kernels


def _dps(builtin: str, args: list, out_types: list):
    """Emit ``call_dps_packed`` of ``vm.builtin.attention_kv_cache_<builtin>``: the tensor, or the
    tuple of several outputs."""
    args = [rx.prim_value(a) if isinstance(a, (int, float)) else a for a in args]
    call = rx.call_dps_packed(f"vm.builtin.attention_kv_cache_{builtin}", args,
                              out_ty=out_types[0] if len(out_types) == 1 else out_types)
    result = rx.BlockBuilder.current().emit(call)
    return nn.Tensor(_expr=result) if len(out_types) == 1 else result


def _state_types(n: IntOrVar, heads: int, dv: int, dtype: str) -> list:
    return [rx.TensorType((n, heads, dv), dtype), rx.TensorType((n, heads), "float32")]


def _state_pair(result, b, s) -> Tuple[nn.Tensor, nn.Tensor]:
    bb = rx.BlockBuilder.current()
    o = nn.Tensor(_expr=bb.emit(rx.TupleGetItem(result, 0)))
    lse = nn.Tensor(_expr=bb.emit(rx.TupleGetItem(result, 1)))
    return o.reshape(b, s, *o.shape[1:]), lse.reshape(b, s, lse.shape[1])
