"""Absorbed MLA attention over latent pages: the kernel factory and its CPU grid (the GPU grid
is :mod:`.attention_gpu_mla`). Every query head attends to the one latent head with the MHA
work item of :mod:`.attention` reading latent rows."""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from .attention import make_attend_sequence
from .macros import latent_kv_access, paged_kv_len, with_kv_scales, without_param
from .schedule import GpuSchedule, Schedule
from .spec import AttentionSpec


def _cpu_mla_grid(spec: AttentionSpec, sched: Schedule):
    """Macro running absorbed MLA attention on CPU: one parallel work item per sequence, the
    MHA work item with the latent accessor."""
    ps = spec.page_size
    # All Hq heads share each latent chunk: tiles of about 32 rows, staged once per chunk.
    attend_sequence = make_attend_sequence(spec, sched, q_tile=max(1, 32 // spec.num_qo_heads), chunk=ps,
                                            kv_elem=latent_kv_access(spec))

    @T.macro
    def run(q, qo_indptr, pages, page_indptr, page_indices, length_info, o, lse, causal, sm_scale, B, total_q,
            kv_scales):
        for b in T.parallel(B):
            with T.sblock("work"):
                T.reads()
                T.writes()
                # no RoPE and no window: the q_rope_position argument (qo_indptr here) is not read
                attend_sequence(q, o, lse, qo_indptr,
                                with_kv_scales(spec, (pages, page_indices, page_indptr[b], length_info, b), kv_scales),
                                0, qo_indptr[b], qo_indptr[b + 1] - qo_indptr[b],
                                paged_kv_len(page_indptr[b + 1] - page_indptr[b], ps, length_info, b, False),
                                0, causal, 0, T.float32(1), T.float32(1), sm_scale, ())

    return run


def make_paged_mla(spec: AttentionSpec, sched: Schedule) -> tirx.PrimFunc:
    """Absorbed MLA attention over latent pages (TVM's ``attention_prefill_mla`` convention).

    Arguments: ``q (total_q, Hq, W), qo_indptr, pages (P, page_size, W), page_indptr,
    page_indices, length_info (B,), o (total_q, Hq, v_head_dim), lse (total_q, Hq), causal,
    sm_scale`` with ``W = qk_head_dim = kv_lora_rank + rope dim`` and ``v_head_dim =
    kv_lora_rank``. Queries arrive multiplied by W_UK and RoPE'd; every query head attends to
    the one latent head: score = q . latent row, output = probabilities @ latent[:, :v_head_dim].
    Serves decode (one query per sequence) and prefill alike, as in TVM. 8-bit pages
    (``spec.kv_dtype``) take a last argument ``kv_scales (2, 1) float32``: latent rows are read as
    ``stored * kv_scales[0, 0]``.
    """
    Hq, W, DV, ps, dtype = spec.num_qo_heads, spec.qk_head_dim, spec.v_head_dim, spec.page_size, spec.dtype
    if spec.num_kv_heads != 1 or DV > W or spec.sliding_window or spec.span:
        raise ValueError(f"MLA attention needs one latent head, v_head_dim <= qk_head_dim and no windows; "
                         f"got {spec}")
    if isinstance(sched, GpuSchedule):
        from .attention_gpu_mla import mla_grid

        run = mla_grid(spec, sched)
    else:
        run = _cpu_mla_grid(spec, sched)

    @T.prim_func(s_tir=True)
    def paged_mla(var_q: T.handle, var_qo_indptr: T.handle, var_pages: T.handle, var_page_indptr: T.handle,
                  var_page_indices: T.handle, var_length_info: T.handle, var_o: T.handle, var_lse: T.handle,
                  causal: T.int32, sm_scale: T.float32, var_kv_scales: T.handle):
        T.func_attr({"tirx.noalias": True})
        B = T.int32()
        total_q = T.int32()
        P = T.int64()
        nnz = T.int32()
        off_qo = T.int32()
        off_indptr = T.int32()
        off_indices = T.int32()
        off_len = T.int32()
        q = T.match_buffer(var_q, (total_q, Hq, W), dtype)
        qo_indptr = T.match_buffer(var_qo_indptr, (B + 1,), "int32", elem_offset=off_qo)
        pages = T.match_buffer(var_pages, (P, ps, W), spec.page_dtype)
        page_indptr = T.match_buffer(var_page_indptr, (B + 1,), "int32", elem_offset=off_indptr)
        page_indices = T.match_buffer(var_page_indices, (nnz,), "int32", elem_offset=off_indices)
        length_info = T.match_buffer(var_length_info, (B,), "int32", elem_offset=off_len)
        o = T.match_buffer(var_o, (total_q, Hq, DV), dtype)
        lse = T.match_buffer(var_lse, (total_q, Hq), "float32")
        kv_scales = T.match_buffer(var_kv_scales, (2, 1), "float32")
        run(q, qo_indptr, pages, page_indptr, page_indices, length_info, o, lse, causal, sm_scale, B, total_q,
            kv_scales)

    # pages of the model dtype: TVM's signature, without kv_scales (which the body then does not read)
    return paged_mla if spec.quantized else without_param(paged_mla, 10)
