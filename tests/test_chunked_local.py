"""Chunked local attention (``AttnKind.MHA_CHUNKED_LOCAL``, Llama 4's ``attention_chunk_size``)
against the float64 reference model: a query at position p sees the keys at positions
``[p - p % C, p]`` of its own sequence, across prefill chunks, decode steps, forks and popn."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import tvm

import relax_kvcache as rk
from relax_kvcache import metadata as md
from relax_kvcache.reference import attention

from support.harness import Harness, make_config

CHUNKED, MHA = rk.AttnKind.MHA_CHUNKED_LOCAL, rk.AttnKind.MHA


def _chunked_config(**overrides) -> rk.KVCacheConfig:
    base = dict(num_layers=3, page_size=8, attention_chunk_size=20, max_total_seq_len=2048, prefill_chunk_size=128,
                attn_kinds=[CHUNKED, MHA, CHUNKED])
    base.update(overrides)
    return make_config(**base)


class ChunkHarness(Harness):
    """Harness whose reference applies the cache's attention chunks."""

    def __post_init__(self):
        super().__post_init__()
        cfg = self.cache.config
        self.ref.layer_chunks = [cfg.attention_chunk_size if kind == CHUNKED else 0 for kind in cfg.attn_kinds]


def _cache(**overrides) -> rk.PagedAttentionKVCache:
    return rk.PagedAttentionKVCache(_chunked_config(**overrides), tvm.cpu())


@pytest.mark.parametrize("rope_mode", [rk.RopeMode.NONE, rk.RopeMode.NORMAL, rk.RopeMode.INLINE])
@pytest.mark.parametrize("chunk", [20, 16])  # boundaries mid-page / at page boundaries
def test_chunked_layers_match_reference(rope_mode, chunk):
    """Prefill across several chunk boundaries, decode across one, forks inside and before the
    current chunk (prefixes at several depths), popn back across a boundary."""
    h = ChunkHarness(_cache(rope_mode=rope_mode, attention_chunk_size=chunk),
                     np.random.default_rng(int(rope_mode) * 7 + chunk))
    h.add(0)
    h.add(1)
    h.step([(0, 50), (1, 7)])          # 50 tokens: chunks [0, C), [C, 2C), [2C, 50) inside one step
    for _ in range(chunk // 2):        # decode steps; sequence 1 crosses into its second chunk
        h.step([(0, 1), (1, 1)])
    h.fork(0, 2, 33)                   # mid-page fork inside the current chunk of 0
    h.fork(2, 3, -1)
    h.step([(2, 30), (3, 4), (1, 12)])
    for _ in range(3):
        h.step([(0, 1), (2, 1), (3, 1)])
    h.fork(1, 4, 8)                    # page-aligned fork
    h.step([(4, 3), (1, 25), (0, 2)])
    h.popn(0, 5)
    h.popn(2, 2 * chunk)               # back across a chunk boundary into the shared prefix
    h.step([(0, 1), (4, 1), (2, 3)])
    h.check_contents()


def test_chunk_longer_than_everything_is_plain_attention():
    """A chunk longer than every sequence sees everything: equal to plain MHA layers."""
    h = ChunkHarness(_cache(attention_chunk_size=4096, rope_mode=rk.RopeMode.NORMAL),
                     np.random.default_rng(3))
    h.ref.layer_chunks = [0, 0, 0]
    h.add(0)
    h.step([(0, 40)])
    h.step([(0, 1)])
    h.fork(0, 1, 17)
    h.step([(1, 9), (0, 3)])


def test_first_token_of_a_chunk_sees_only_itself():
    """The query at position C (the first of the second chunk) attends to its own key alone:
    its output is its own V row, exactly."""
    cache = rk.PagedAttentionKVCache(_chunked_config(num_layers=1, attn_kinds=[CHUNKED], attention_chunk_size=8,
                                                     rope_mode=rk.RopeMode.NONE), tvm.cpu())
    rng = np.random.default_rng(5)
    hq, hkv, d = 8, 2, 64
    cache.add_sequence(0)
    for n, first_alone in [(8, 0), (1, 0), (7, None), (3, 0)]:  # positions 0-7, 8, 9-15, 16-18
        qkv = rng.standard_normal((n, hq + 2 * hkv, d)).astype("float32")
        out = tvm.runtime.tensor(np.full((n, hq, d), np.nan, "float32"))
        cache.begin_forward([0], [n])
        cache.attention_with_fused_qkv(0, tvm.runtime.tensor(qkv), out, 0.2)
        cache.end_forward()
        if first_alone is not None:  # the step's first token starts a chunk
            v = np.repeat(qkv[first_alone, hq + hkv:], hq // hkv, axis=0)
            np.testing.assert_allclose(out.numpy()[first_alone], v, atol=1e-6, rtol=0)


def test_window_pages_skip_earlier_chunks():
    """Local layers read only the pages of the queries' chunks: a decode step in the fourth chunk
    of 16 tokens (page size 8) reads two pages of its block, not the first six."""
    cache = rk.PagedAttentionKVCache(_chunked_config(attention_chunk_size=16), tvm.cpu())
    h = ChunkHarness(cache, np.random.default_rng(6))
    h.add(0)
    h.step([(0, 50)])
    structure = md.BatchStructure.collect(cache._paging, [0], [1], None)
    depths = md.build_depths(cache._paging, structure, sliding_window=False,
                             layer_span=cache.config.layer_span)
    window = depths[0].window
    assert depths[0].page_indices.size == 7  # 50 tokens: all of them for plain layers
    # the query at 50 sees [48, 50]: the sixth and seventh pages, from row 0 of the seventh
    assert list(window.page_indices) == list(depths[0].page_indices[6:])
    assert int(window.k_rope_pos_offset[0]) == 48 and int(window.length_info[1, 0]) == 0
    h.step([(0, 1)])


def test_attention_with_shared_kv_on_a_chunked_source():
    """A layer attending with its own queries over the KV a chunked layer wrote this step."""
    chunk = 6
    cfg = make_config(num_layers=2, rope_mode=rk.RopeMode.NONE, attention_chunk_size=chunk,
                  attn_kinds=[CHUNKED, MHA], page_size=8)
    cache = rk.PagedAttentionKVCache(cfg, tvm.cpu())
    rng = np.random.default_rng(1)
    hq, hkv, d = cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim
    cache.add_sequence(0)
    keys, values = np.zeros((0, hkv, d)), np.zeros((0, hkv, d))
    for n in [9, 3, 1, 1, 12, 1]:
        past = keys.shape[0]
        q, k, v, q_shared = (rng.standard_normal(shape).astype("float32")
                             for shape in [(n, hq, d), (n, hkv, d), (n, hkv, d), (n, hq, d)])
        cache.begin_forward([0], [n])
        out = tvm.runtime.empty((n, hq, d), "float32")
        cache.attention_with_fused_qkv(0, tvm.runtime.tensor(np.concatenate([q, k, v], axis=1)), out, 0.3)
        shared = tvm.runtime.tensor(np.full((n, hq, d), np.nan, "float32"))
        tvm.get_global_func("vm.builtin.attention_kv_cache_attention_with_shared_kv")(
            cache, 0, 0.3, tvm.runtime.tensor(q_shared), tvm.runtime.tensor(k), tvm.runtime.tensor(v), shared)
        cache.end_forward()
        keys, values = np.concatenate([keys, k]), np.concatenate([values, v])
        positions = np.arange(keys.shape[0])
        mask = positions[None, :] // chunk == ((past + np.arange(n)) // chunk)[:, None]
        expected, _ = attention(q_shared, keys, values, 0.3, causal=True, mask=mask)
        np.testing.assert_allclose(shared.numpy(), expected, atol=2e-3, rtol=0)


CONFIG_ERRORS = {
    "chunk missing": (dict(attention_chunk_size=None), "attention_chunk_size is required"),
    "chunk zero": (dict(attention_chunk_size=0), "attention_chunk_size must be a positive int"),
    "chunk float": (dict(attention_chunk_size=8.0), "attention_chunk_size must be a positive int"),
    "chunk without layers": (dict(attn_kinds=[MHA, MHA, MHA]), "applies to AttnKind.MHA_CHUNKED_LOCAL layers only"),
    "mixed with sliding": (dict(attn_kinds=[CHUNKED, rk.AttnKind.MHA_SLIDING, MHA]),
                           "mixes MHA_SLIDING and MHA_CHUNKED_LOCAL"),
    "kind 5": (dict(attn_kinds=[CHUNKED, 5, MHA]), "4 (MHA_CHUNKED_LOCAL)"),
}


@pytest.mark.parametrize("name", list(CONFIG_ERRORS))
def test_config_errors(name):
    overrides, fragment = CONFIG_ERRORS[name]
    with pytest.raises(rk.ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        _chunked_config(**overrides)


def test_token_trees_are_refused_and_leave_the_cache_unchanged():
    cache = rk.PagedAttentionKVCache(_chunked_config(), tvm.cpu())
    cache.add_sequence(0)
    before = cache._paging.debug_snapshot()
    with pytest.raises(rk.ForwardError, match="chunked local layers"):
        cache.begin_forward([0], [3], [-1, 0, 0])
    assert cache._paging.debug_snapshot() == before


def test_chunked_layers_need_the_windowed_ragged_kernel():
    """Without the windowed ragged kernel (TVM's creation arguments lack it) a step's new tokens
    could not be split at chunk boundaries: such a kernel set is refused at construction."""
    full = rk.PagedAttentionKVCache(_chunked_config(), tvm.cpu())
    kernels = dataclasses.replace(full._kernels, attention_prefill_ragged_sliding_window=None)
    with pytest.raises(rk.ConfigError, match="attention_prefill_ragged_sliding_window"):
        rk.PagedAttentionKVCache(_chunked_config(), tvm.cpu(), kernels=kernels)


def test_relax_program_with_chunked_layers_matches_float64():
    """A compiled Relax program (``relax_kvcache.frontend``, creation through TVM's argument
    convention with the 7th ``cache_config`` entry) over a chunked and a plain layer."""
    import native_baseline as tb
    from reference_model import CacheModel
    from support.frontend_program import create, fused_vm
    from relax_kvcache import frontend

    hq, hkv, d, chunk = 4, 2, 32, 12
    layout = frontend.CacheLayout(num_layers=2, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=8,
                                  rope_mode=rk.RopeMode.NORMAL, dtype="float32", attn_kinds=[CHUNKED, MHA],
                                  attention_chunk_size=chunk)
    vm = fused_vm(layout, sm_scale=0.3)
    cache = create(vm, 4, 256, 64)
    assert cache.config.attention_chunk_size == chunk and cache.config.attn_kinds == (CHUNKED, MHA)
    model = CacheModel(2, hq, hkv, d, 1, 1e4, 1.0)
    model.layer_chunks = [chunk, 0]
    b, rng = tb.Builtins(), np.random.default_rng(2)
    b.add(cache, 0)
    model.add(0)
    for n in (30, 1, 5, 1, 17):
        qkv = rng.standard_normal((2, 1, n, hq + 2 * hkv, d)).astype(np.float32)
        b.begin(cache, [0], [n])
        got = vm["fused"](tvm.runtime.tensor(qkv), cache)
        b.end(cache)
        expected = model.step([(0, n)], [qkv[0, 0], qkv[1, 0]], 0.3)
        for layer in range(2):
            np.testing.assert_allclose(got[layer].numpy()[0], expected[layer], atol=2e-3, rtol=0)


# ------------------------------------------------------------------ regressions

def _creation_args(cache_config, kinds, k, indptr=(0, 2)):
    """TVM's creation arguments (29, the windowed ragged kernel last) for a 4 / 2-head, D 16 cache."""
    shape = tvm.runtime.ShapeTuple

    def attention(f):
        return ["tirx", f] if f is not None else []

    return [shape(cache_config), shape(list(indptr)), 4, 2, 16, 16, shape(kinds), False, 0, 1.0, 1e4,
            None, tvm.runtime.empty((), "float32"), k.transpose_append, None, attention(k.attention_prefill_ragged),
            attention(k.attention_prefill), attention(k.attention_decode),
            attention(k.attention_prefill_sliding_window), attention(k.attention_decode_sliding_window),
            [], [], [], [k.merge_inplace, k.merge_general], k.split_rotary, k.copy_single_page, k.debug_get_kv,
            k.compact_copy, attention(k.attention_prefill_ragged_sliding_window)]


def _small(**overrides) -> rk.KVCacheConfig:
    base = dict(num_layers=2, num_qo_heads=4, num_kv_heads=2, head_dim=16, page_size=8, max_num_seqs=8,
                max_total_seq_len=256, prefill_chunk_size=64, rope_mode=rk.RopeMode.NONE, dtype="float32")
    base.update(overrides)
    return rk.KVCacheConfig(**base)


def test_creation_probe_refuses_kernels_of_another_chunk():
    """Kernels compiled for chunks of 3 (or windowed kernels without a chunk) passed for a cache
    with chunks of 6 were accepted and attended by their own rule: the probe compared chunked
    layers with float64 only while the chunk spanned its sequence."""
    create = rk.paged_attention_kv_cache_create
    chunk3 = rk.PagedAttentionKVCache(_small(attn_kinds=[CHUNKED, MHA], attention_chunk_size=3), tvm.cpu())._kernels
    unchunked = rk.PagedAttentionKVCache(_small(attn_kinds=[rk.AttnKind.MHA_SLIDING, MHA],
                                                layer_sliding_window_size=4096), tvm.cpu())._kernels
    for kernels in (chunk3, unchunked):
        with pytest.raises(rk.ConfigError, match="float64 attention"):
            create(*_creation_args([8, 256, 64, 8, 0, 1024, 6], [4, 0], kernels))
    chunk6 = rk.PagedAttentionKVCache(_small(attn_kinds=[CHUNKED, MHA], attention_chunk_size=6), tvm.cpu())._kernels
    assert create(*_creation_args([8, 256, 64, 8, 0, 1024, 6], [4, 0], chunk6)).config.attention_chunk_size == 6


def test_creation_of_a_group_without_chunked_layers_ignores_the_chunk_entry():
    """cache_config is shared by a model's layer groups: a group with no chunked layer was refused
    ("attention_chunk_size applies to ... only") when the entry held the chunk."""
    create = rk.paged_attention_kv_cache_create
    plain = rk.PagedAttentionKVCache(_small(), tvm.cpu())._kernels
    cache = create(*_creation_args([8, 256, 64, 8, 0, 1024, 3], [4, 4, 0, 0], plain, indptr=(2, 4)))
    assert cache.config.attention_chunk_size is None and cache.config.attn_kinds == (MHA, MHA)
    with pytest.raises(rk.ConfigError, match=r"cache_config\[6\] \(attention_chunk_size\)"):
        create(*_creation_args([8, 256, 64, 8, 0, 1024, -3], [4, 4, 0, 0], plain, indptr=(2, 4)))


def test_checkpoints_move_only_between_caches_of_the_same_chunk():
    """A checkpoint of a cache with chunks of 3 imported silently into one with chunks of 5 (its
    K/V come from another model); the metadata now carries the chunk (our field)."""
    src = rk.PagedAttentionKVCache(_small(attn_kinds=[CHUNKED, MHA], attention_chunk_size=3), tvm.cpu())
    src.add_sequence(0)
    meta = src.get_checkpoint_metadata(0)
    assert '"attention_chunk_size":3' in meta
    dst = rk.PagedAttentionKVCache(_small(attn_kinds=[CHUNKED, MHA], attention_chunk_size=5), tvm.cpu())
    before = dst._paging.debug_snapshot()
    with pytest.raises(rk.ConfigError, match="attention_chunk_size is 3, this cache's 5"):
        dst.prepare_import(0, meta)
    assert dst._paging.debug_snapshot() == before
    same = rk.PagedAttentionKVCache(_small(attn_kinds=[CHUNKED, MHA], attention_chunk_size=3), tvm.cpu())
    same.prepare_import(0, meta)
