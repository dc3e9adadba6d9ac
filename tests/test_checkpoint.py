"""Checkpoint export / import (TVM 0.27's ``get_checkpoint_metadata`` ... ``finish_import``).

Against TVM's native cache: the layout hash and the metadata string are TVM's exactly, and
checkpoints move both ways (TVM -> ours, ours -> TVM) with the contents intact; after an import
the sequence decodes as the original does. Beyond TVM: any sequence id, sequences whose blocks
come from forks at positions inside pages, imports while other sequences keep stepping.
Every refused call leaves the cache unchanged (``support.snapshot``).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import tvm

import relax_kvcache as rk

import native_baseline as tb
from support.snapshot import assert_same, snapshot
from support.small_cache import tiny_cache

pytestmark = pytest.mark.tvm_native

_B = tb.Builtins()


def _builtins():
    return _B


def _g(name):
    return tvm.get_global_func("vm.builtin.attention_kv_cache_" + name)


def _step(cache, shape: tb.Shape, batch, rng, sm_scale=None):
    """One step of random inputs through the builtins; returns the outputs per layer."""
    n = sum(length for _, length in batch)
    sm_scale = sm_scale or 1 / math.sqrt(shape.head_dim)
    qkv = [rng.standard_normal((n, shape.num_qo_heads + 2 * shape.num_kv_heads, shape.head_dim))
           .astype(shape.dtype) for _ in range(shape.num_layers)]
    return _run_step(cache, shape, batch, qkv, sm_scale), qkv


def _run_step(cache, shape, batch, qkv, sm_scale):
    b = _builtins()
    n = sum(length for _, length in batch)
    b.begin(cache, [s for s, _ in batch], [length for _, length in batch])
    outs = []
    for layer in range(shape.num_layers):
        o = tvm.runtime.tensor(np.full((n, shape.num_qo_heads, shape.head_dim), np.nan, shape.dtype))
        b.attention(cache, layer, sm_scale, tvm.runtime.tensor(qkv[layer]), o)
        outs.append(o.numpy())
    b.end(cache)
    return outs


def _kv(cache, shape, seq_id, length):
    dims = (shape.num_layers, length, shape.num_kv_heads, shape.head_dim)
    k, v = tvm.runtime.empty(dims, shape.dtype), tvm.runtime.empty(dims, shape.dtype)
    _builtins().debug_get_kv(cache, seq_id, 0, length, k, v)
    return k.numpy(), v.numpy()


def _export(cache, seq_id):
    meta = str(_g("get_checkpoint_metadata")(cache, seq_id))
    groups = []
    for group in json.loads(meta)["groups"]:
        out = tvm.runtime.tensor(np.full(group["shape"], np.nan, group["dtype"]))
        _g("export_page_group")(cache, seq_id, group["group_index"], out)
        groups.append(out.numpy())
    return meta, groups


def _import(cache, seq_id, meta, groups, order=None):
    _g("prepare_import")(cache, seq_id, meta)
    for index in order or range(len(groups)):
        _g("import_page_group")(cache, seq_id, index, tvm.runtime.tensor(groups[index]))
    _g("finish_import")(cache, seq_id)


SHAPES = {
    "normal": tb.Shape(rope_mode=1),
    "none-f16": tb.Shape(rope_mode=0, dtype="float16", num_layers=3, rope_theta=5e5, rope_scale=0.5),
    "inline": tb.Shape(rope_mode=2, rope_theta=1e6, rope_scale=1 / 3, num_kv_heads=8, page_size=8),
}
#: layouts TVM cannot checkpoint (its get_layout_hash refuses them); ours can
WINDOW_SHAPES = {
    "inline-sw": tb.Shape(rope_mode=2, support_sliding_window=True, rope_theta=1e6),
    "layer-window": tb.Shape(rope_mode=1, attn_kinds=(0, 3), layer_window=64),
}


@pytest.mark.parametrize("name", list(SHAPES))
def test_layout_hash_and_metadata_are_tvms(name):
    shape = SHAPES[name]
    ours, theirs = tb.create_ours_direct(shape), tb.create_native(shape)
    assert _g("get_layout_hash")(ours) == _g("get_layout_hash")(theirs)
    for cache in (ours, theirs):
        _builtins().add(cache, 0)
    assert _g("get_checkpoint_metadata")(ours, 0) == _g("get_checkpoint_metadata")(theirs, 0)


@pytest.mark.parametrize("name", list(WINDOW_SHAPES))
def test_window_layouts_round_trip(name):
    """Beyond TVM: caches with sliding-window support or MHA_SLIDING layers checkpoint their
    sequences without a window; a sequence with one is refused."""
    shape = WINDOW_SHAPES[name]
    src, dst = tb.create_ours_direct(shape), tb.create_ours_direct(shape)
    b, rng = _builtins(), np.random.default_rng(6)
    b.add(src, 0)
    _step(src, shape, [(0, 70)], rng)
    meta, groups = _export(src, 0)
    _import(dst, 0, meta, groups)
    for x, y in zip(_kv(src, shape, 0, 70), _kv(dst, shape, 0, 70)):
        np.testing.assert_array_equal(x, y)
    qkv = [rng.standard_normal((3, 12, 64)).astype("float32") for _ in range(shape.num_layers)]
    for x, y in zip(_run_step(src, shape, [(0, 3)], qkv, 0.125), _run_step(dst, shape, [(0, 3)], qkv, 0.125)):
        np.testing.assert_array_equal(x, y)
    if shape.support_sliding_window:
        b.enable_window(src, 0, 40, 4)
        with pytest.raises(rk.SequenceError, match="sliding window, which checkpoints do not hold"):
            _g("get_checkpoint_metadata")(src, 0)


def test_metadata_and_groups_match_tvms():
    """Same inputs into TVM's native cache and ours: the same metadata string, page groups equal
    up to the RoPE kernels' rounding (K is stored rotated), the last page's tail zero."""
    shape = SHAPES["normal"]
    caches = [tb.create_native(shape), tb.create_ours_direct(shape)]
    for cache in caches:
        _builtins().add(cache, 0)
        _step(cache, shape, [(0, 37)], np.random.default_rng(0))
    (meta_tvm, groups_tvm), (meta_ours, groups_ours) = (_export(c, 0) for c in caches)
    assert meta_ours == meta_tvm
    for theirs, ours in zip(groups_tvm, groups_ours):
        np.testing.assert_allclose(ours, theirs, atol=1e-5)
        assert not np.isnan(ours).any() and (ours[0, 2, :, :, 5:] == 0).all()


@pytest.mark.parametrize("direction", ["tvm->ours", "ours->tvm", "ours->ours", "tvm->ours_tvmk", "ours_tvmk->ours"])
def test_checkpoints_move_between_tvm_and_ours(direction):
    """Export from one cache, import into another (fresh), then both decode the same tokens:
    the imported contents equal the exported ones and attention over them matches. Our cache on
    TVM's kernels moves page groups with TVM's debug_get_kv (compiled for all layers)."""
    shape = tb.Shape(rope_mode=0, num_layers=2, page_size=16)  # no RoPE: K bit-identical across kernels
    make = {"tvm": tb.create_native, "ours": tb.create_ours_direct,  # ours_tvmk: our cache on TVM's kernels
            "ours_tvmk": lambda s: tb.create_ours_packed(s, tvm_kernel_set=True)}
    src_name, dst_name = direction.split("->")
    src, dst = make[src_name](shape), make[dst_name](shape)
    rng = np.random.default_rng(1)
    _builtins().add(src, 0)
    _step(src, shape, [(0, 50)], rng)
    meta, groups = _export(src, 0)
    _import(dst, 0, meta, groups, order=[1, 0])
    for cache in (src, dst):
        assert _g("get_sequence_length")(cache, 0) == 50
    for a, b in zip(_kv(src, shape, 0, 50), _kv(dst, shape, 0, 50)):
        np.testing.assert_array_equal(a, b)
    assert _builtins().num_available_pages(dst) == _builtins().num_available_pages(src)
    for batch in ([(0, 1)], [(0, 14)], [(0, 1)]):  # the same new tokens into both
        qkv = [rng.standard_normal((batch[0][1], 12, 64)).astype("float32") for _ in range(shape.num_layers)]
        for a, b in zip(_run_step(src, shape, batch, qkv, 0.125), _run_step(dst, shape, batch, qkv, 0.125)):
            np.testing.assert_allclose(b, a, atol=2e-3)  # TVM's kernels vs ours


@pytest.mark.parametrize("direction", ["ours->ours_tvmk", "ours_tvmk->ours"])
def test_page_groups_move_in_chunks(direction):
    """Sequences longer than the gather buffers (about one prefill chunk of one layer) move in
    several chunks, with our debug_get_kv (one-layer buffers) and TVM's (all-layer ones)."""
    shape = tb.Shape(rope_mode=0, prefill_chunk_size=16)
    make = {"ours": tb.create_ours_direct, "ours_tvmk": lambda s: tb.create_ours_packed(s, tvm_kernel_set=True)}
    src_name, dst_name = direction.split("->")
    src, dst = make[src_name](shape), make[dst_name](shape)
    rng = np.random.default_rng(7)
    _builtins().add(src, 0)
    for n in (16, 16, 16, 5):
        _step(src, shape, [(0, n)], rng)
    meta, groups = _export(src, 0)
    _import(dst, 0, meta, groups)
    assert src._checkpoints._mover._buffers[0].shape[1] < 53  # more than one chunk
    for a, b in zip(_kv(src, shape, 0, 53), _kv(dst, shape, 0, 53)):
        np.testing.assert_array_equal(a, b)


def test_decoding_after_import_matches_the_original():
    """Attention outputs of the imported copy equal the original's for the same new tokens."""
    shape = SHAPES["normal"]
    src, dst = tb.create_ours_direct(shape), tb.create_ours_direct(shape)
    rng = np.random.default_rng(2)
    _builtins().add(src, 0)
    _step(src, shape, [(0, 40)], rng)
    _step(src, shape, [(0, 1)], rng)
    meta, groups = _export(src, 0)
    _import(dst, 0, meta, groups)
    for batch in ([(0, 1)], [(0, 9)], [(0, 1)]):
        qkv = [rng.standard_normal((batch[0][1], 12, 64)).astype("float32") for _ in range(2)]
        a = _run_step(src, shape, batch, qkv, 0.125)
        b = _run_step(dst, shape, batch, qkv, 0.125)
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)


def test_forked_sequences_and_other_ids_round_trip():
    """Beyond TVM: sequences that share prefixes through forks inside pages, any id; the import
    lands in a cache that holds other sequences, which keep stepping during the import."""
    shape = SHAPES["normal"]
    src, dst = tb.create_ours_direct(shape), tb.create_ours_direct(shape)
    b, rng = _builtins(), np.random.default_rng(3)
    b.add(src, 4)
    _step(src, shape, [(4, 21)], rng)
    b.fork(src, 4, 9, 13)  # inside page 0
    _step(src, shape, [(9, 30), (4, 2)], rng)
    b.fork(src, 9, 11, 37)
    _step(src, shape, [(11, 5)], rng)
    b.add(dst, 2)
    _step(dst, shape, [(2, 19)], rng)
    for seq_id, length in ((9, 43), (11, 42), (4, 23)):
        meta, groups = _export(src, seq_id)
        assert json.loads(meta)["seq_length"] == length
        _g("prepare_import")(dst, 77, meta)
        _step(dst, shape, [(2, 1)], rng)  # other sequences step while the import is open
        for index, group in enumerate(groups):
            _g("import_page_group")(dst, 77, index, tvm.runtime.tensor(group))
        _g("finish_import")(dst, 77)
        for x, y in zip(_kv(src, shape, seq_id, length), _kv(dst, shape, 77, length)):
            np.testing.assert_array_equal(x, y)
        b.remove(dst, 77)


def test_an_empty_sequence_round_trips():
    shape = SHAPES["normal"]
    src, dst = tb.create_ours_direct(shape), tb.create_ours_direct(shape)
    _builtins().add(src, 0)
    meta, groups = _export(src, 0)
    assert json.loads(meta)["seq_length"] == 0 and groups[0].shape == (1, 0, 2, 2, 16, 64)
    _import(dst, 3, meta, groups)
    assert _g("get_sequence_length")(dst, 3) == 0


# ---------------------------------------------------------------------------- refusals


@pytest.fixture
def ready():
    """(source cache with sequence 0 of 37 tokens and 1 of 5, its checkpoint of 0, a fresh
    destination cache holding sequence 5 of 3 tokens)."""
    shape = SHAPES["normal"]
    src, dst = tb.create_ours_direct(shape), tb.create_ours_direct(shape)
    rng = np.random.default_rng(4)
    for seq_id, n in ((0, 37), (1, 5)):
        _builtins().add(src, seq_id)
        _step(src, shape, [(seq_id, n)], rng)
    _builtins().add(dst, 5)
    _step(dst, shape, [(5, 3)], rng)
    meta, groups = _export(src, 0)
    return src, dst, meta, groups


def _refused(cache, call, error, match):
    before = snapshot(cache, pages=True)
    with pytest.raises(error, match=match):
        call()
    assert_same(before, snapshot(cache, pages=True))


def _with(meta, **changes):
    data = json.loads(meta)
    data.update(changes)
    return json.dumps(data)


def test_bad_metadata_is_refused_and_changes_nothing(ready):
    _, dst, meta, _ = ready
    prepare = _g("prepare_import")
    cases = [
        ("{", rk.ArgumentError, "not valid JSON"),
        ("[1]", rk.ArgumentError, "must be a JSON object"),
        (_with(meta, format_version=2), rk.ArgumentError, "format_version 2 is not supported"),
        (_with(meta, layout_hash="0" * 16), rk.ConfigError, "layout hash mismatch: expected 94148c4b104dec4f"),
        (_with(meta, page_size=8), rk.ConfigError, "checkpoint's page_size is 8, this cache's 16"),
        (_with(meta, dtype="float16"), rk.ConfigError, "checkpoint's dtype"),
        (_with(meta, num_kv_heads=4), rk.ConfigError, "checkpoint's num_kv_heads"),
        (_with(meta, rotary_theta=500000.0), rk.ConfigError, "rotary_theta"),
        (_with(meta, seq_length=-1), rk.ArgumentError, r"seq_length must be in \[0, 2147483647\], got -1"),
        (_with(meta, seq_length=36), rk.ArgumentError, "'logical_pages' does not describe"),
        (_with(meta, seq_length=True), rk.ArgumentError, "'seq_length' must be an int"),
        (_with(meta, seq_length=1e3), rk.ArgumentError, "'seq_length' must be an int"),
        (_with(meta, reserved_num_seqs=0), rk.ArgumentError, "reserved_num_seqs' must be positive"),
        (_with(meta, groups=[]), rk.ArgumentError, "'groups' does not describe"),
        (_with(meta, seq_id="0"), rk.ArgumentError, "'seq_id' must be an int"),
        # integers beyond int64 (TVM holds these fields as int64)
        (_with(meta, seq_id=2**80), rk.ArgumentError, "'seq_id' must be an int64, got 1208925819614629174706176"),
        (_with(meta, seq_id=-2**63 - 1), rk.ArgumentError, "'seq_id' must be an int64"),
        (_with(meta, reserved_num_seqs=2**100), rk.ArgumentError, "'reserved_num_seqs' must be an int64"),
        (_with(meta, format_version=2**64), rk.ArgumentError, "'format_version' must be an int64"),
    ]
    for text, error, match in cases:
        _refused(dst, lambda: prepare(dst, 0, text), error, match)
    _refused(dst, lambda: prepare(dst, 5, meta), rk.SequenceError, "sequence 5 has 3 token")
    _refused(dst, lambda: rk.PagedAttentionKVCache.prepare_import(dst, 0, 3), rk.ArgumentError, "JSON string")
    big = _with(meta, seq_length=16 * 70, num_total_pages=200, logical_pages=[
        {"logical_page_index": i, "start_pos": 16 * i, "length": 16} for i in range(70)],
        groups=[{**g, "num_logical_pages": 70, "shape": [1, 70, 2, 2, 16, 64], "nbytes": 70 * 2 * 2 * 16 * 64 * 4}
                for g in json.loads(meta)["groups"]])
    _refused(dst, lambda: prepare(dst, 0, big), rk.CacheFullError, "needs 70 pages; this cache holds 65")
    _refused(dst, lambda: prepare(dst, 0, _with(big, num_total_pages=65)), rk.ArgumentError,
             "more than its num_total_pages 65")
    free = _with(meta, seq_length=16 * 65, logical_pages=[  # fits the cache (65 pages), not its 64 free ones
        {"logical_page_index": i, "start_pos": 16 * i, "length": 16} for i in range(65)],
        groups=[{**g, "num_logical_pages": 65, "shape": [1, 65, 2, 2, 16, 64], "nbytes": 65 * 2 * 2 * 16 * 64 * 4}
                for g in json.loads(meta)["groups"]])
    _refused(dst, lambda: prepare(dst, 0, free), rk.CacheFullError, "65 page.*64 free")


def test_the_import_protocol_is_enforced(ready):
    _, dst, meta, groups = ready
    b = _builtins()
    tensor = [tvm.runtime.tensor(g) for g in groups]
    _g("prepare_import")(dst, 0, meta)
    for call, error, match in [
            (lambda: _g("prepare_import")(dst, 6, meta), rk.SequenceError, "import into sequence 0 is not finished"),
            (lambda: _g("finish_import")(dst, 0), rk.SequenceError, r"missing page group\(s\) \[0, 1\]"),
            (lambda: _g("import_page_group")(dst, 0, 2, tensor[0]), rk.ArgumentError, r"group_id 2 is out of range"),
            (lambda: _g("import_page_group")(dst, 5, 0, tensor[0]), rk.SequenceError, "no checkpoint import into "
                                                                                      "sequence 5"),
            (lambda: _g("import_page_group")(dst, 0, 0, tvm.runtime.empty((1, 2, 2, 2, 16, 64), "float32")),
             rk.KVCacheError, r"group has shape \(1, 2, 2, 2, 16, 64\), expected \(1, 3, 2, 2, 16, 64\)"),
            (lambda: _g("import_page_group")(dst, 0, 0, tvm.runtime.empty((1, 3, 2, 2, 16, 64), "float16")),
             rk.KVCacheError, "group .*float16"),
            (lambda: b.begin(dst, [5, 0], [1, 1]), rk.ForwardError, "importing a checkpoint"),
            (lambda: _g("get_sequence_length")(dst, 0), rk.SequenceError, "importing a checkpoint"),
            (lambda: b.fork(dst, 0, 8, -1), rk.SequenceError, "importing a checkpoint"),
            (lambda: b.popn(dst, 0, 1), rk.SequenceError, "importing a checkpoint"),
            (lambda: _g("get_checkpoint_metadata")(dst, 0), rk.SequenceError, "importing a checkpoint"),
            (lambda: b.debug_get_kv(dst, 0, 0, 2, tvm.runtime.empty((2, 2, 2, 64), "float32"),
                                    tvm.runtime.empty((2, 2, 2, 64), "float32")), rk.SequenceError, "importing")]:
        _refused(dst, call, error, match)
    _g("import_page_group")(dst, 0, 1, tensor[1])
    _refused(dst, lambda: _g("import_page_group")(dst, 0, 1, tensor[1]), rk.SequenceError, "already imported")
    _step(dst, SHAPES["normal"], [(5, 2)], np.random.default_rng(5))  # others keep working
    _g("import_page_group")(dst, 0, 0, tensor[0])
    _g("finish_import")(dst, 0)
    assert _g("get_sequence_length")(dst, 0) == 37


def test_removing_the_sequence_abandons_the_import(ready):
    _, dst, meta, groups = ready
    free = _builtins().num_available_pages(dst)
    _g("prepare_import")(dst, 0, meta)
    assert _builtins().num_available_pages(dst) == free - 3
    _g("import_page_group")(dst, 0, 0, tvm.runtime.tensor(groups[0]))
    _builtins().remove(dst, 0)
    assert _builtins().num_available_pages(dst) == free
    _import(dst, 0, meta, groups)  # a new import works
    _builtins().clear(dst)
    _g("prepare_import")(dst, 0, meta)
    _builtins().clear(dst)
    assert _builtins().empty(dst)


def test_export_refusals(ready):
    src, _, _, _ = ready
    out = tvm.runtime.empty((1, 3, 2, 2, 16, 64), "float32")
    for call, error, match in [
            (lambda: _g("get_checkpoint_metadata")(src, 3), rk.SequenceError, "3"),
            (lambda: _g("export_page_group")(src, 0, -1, out), rk.ArgumentError, "group_id -1 is out of range"),
            (lambda: _g("export_page_group")(src, 0, 0, tvm.runtime.empty((1, 2, 2, 2, 16, 64), "float32")),
             rk.KVCacheError, "out has shape"),
            (lambda: _g("export_page_group")(src, 0, 0, None), rk.KVCacheError, "out")]:
        _refused(src, call, error, match)
    _builtins().begin(src, [1], [1])
    with pytest.raises(rk.ForwardError, match="not allowed while a forward step is active"):
        _g("get_checkpoint_metadata")(src, 0)
    _builtins().end(src)


def test_layouts_without_checkpoints():
    mla = rk.KVCacheConfig(num_layers=1, num_qo_heads=4, num_kv_heads=1, head_dim=48, v_head_dim=32,
                           attn_kinds=[rk.AttnKind.MLA], mla_original_qk_head_dim=24, mla_original_v_head_dim=16,
                           dtype="float32", max_total_seq_len=64, prefill_chunk_size=16)
    cache = rk.PagedAttentionKVCache(mla, tvm.cpu())
    cache.add_sequence(0)
    with pytest.raises(NotImplementedError, match="checkpoints of caches with MLA layers"):
        cache.get_checkpoint_metadata(0)


# ---------------------------------------------------------------------------- refused metadata, other layouts


def _filled(cache, n=6):
    cfg, rng = cache.config, np.random.default_rng(19)
    cache.add_sequence(0)
    cache.begin_forward([0], [n])
    for layer in range(cfg.num_layers):
        qkv = rng.standard_normal((n, cfg.num_qo_heads + 2 * cfg.num_kv_heads, cfg.head_dim)).astype("float32")
        cache.attention_with_fused_qkv(layer, tvm.runtime.tensor(qkv), tvm.runtime.empty((n, 4, cfg.head_dim)), 0.3)
    cache.end_forward()
    return cache


def test_checkpoint_metadata_sizes_are_bounded_before_anything_is_built():
    """A huge seq_length made prepare_import build its expected page lists first
    (seconds and gigabytes, a hang at 2**40); it is now refused at once."""
    import time

    cache = _filled(tiny_cache())
    meta = cache.get_checkpoint_metadata(0)
    target = tiny_cache()
    start = time.perf_counter()
    for length, error, match in ((2**40, rk.ArgumentError, r"seq_length must be in \[0, 2147483647\]"),
                                 (10**7, rk.ArgumentError, "more than its num_total_pages"),
                                 (4 * 17 + 1, rk.CacheFullError, "this cache holds 17 in all")):
        pages = -(-length // 4)
        edited = _with(meta, seq_length=length, num_total_pages=max(pages, 17) if length == 69 else 17)
        _refused(target, lambda: target.prepare_import(1, edited), error, match)
    assert time.perf_counter() - start < 5


def test_checkpoint_groups_name_global_layers():
    """A cache whose layers start past 0 named its groups' layers from 0 (TVM: the
    global ids); each side then refused the other's checkpoint."""
    import json

    config = rk.KVCacheConfig(num_layers=2, num_qo_heads=4, num_kv_heads=2, head_dim=16, page_size=4,
                              max_total_seq_len=64, prefill_chunk_size=32, dtype="float32")
    src = rk.PagedAttentionKVCache(config, tvm.cpu(), layer_offset=1)
    src.add_sequence(0)
    meta = json.loads(src.get_checkpoint_metadata(0))
    assert [(g["layer_begin"], g["layer_end"]) for g in meta["groups"]] == [(1, 2), (2, 3)]
    dst = rk.PagedAttentionKVCache(config, tvm.cpu(), layer_offset=1)
    dst.prepare_import(0, json.dumps(meta))
    for group in range(2):
        dst.import_page_group(0, group, tvm.runtime.empty((1, 0, 2, 2, 4, 16), "float32"))
    dst.finish_import(0)


def test_checkpoint_json_edge_cases_are_refused_as_argument_errors():
    """Deeply nested JSON raised RecursionError; floats where TVM requires ints or
    bools were accepted (Python's 1.0 == 1)."""
    cache = _filled(tiny_cache())
    meta = cache.get_checkpoint_metadata(0)
    target = tiny_cache()
    deep = meta[:-1] + ',"x":' + "[" * 100000 + "]" * 100000 + "}"
    _refused(target, lambda: target.prepare_import(1, deep), rk.ArgumentError, "not valid JSON: RecursionError")
    import json

    data = json.loads(meta)
    for field, value, error in (("page_size", 4.0, rk.ConfigError), ("support_sliding_window", 0.0, rk.ConfigError),
                                ("num_layers", 2.0, rk.ConfigError)):
        _refused(target, lambda: target.prepare_import(1, _with(meta, **{field: value})), error, field)
    pages = [dict(p) for p in data["logical_pages"]]
    pages[0]["length"] = 4.0
    _refused(target, lambda: target.prepare_import(1, _with(meta, logical_pages=pages)), rk.ArgumentError,
               "logical_pages")
    target.prepare_import(1, _with(meta, has_rope_ext_factors=False))  # the values TVM writes pass


def test_caches_without_checkpoints_refuse_every_checkpoint_call():
    """Get_layout_hash answered on LongRoPE and MLA caches (TVM refuses), and
    import_page_group / finish_import raised SequenceError there."""
    cache = tiny_cache(rope_ext_factors=(1.0,) * 16, rope_original_max_position_embeddings=8)
    cache.add_sequence(0)
    group = tvm.runtime.empty((1, 0, 2, 2, 4, 16), "float32")
    for call in (cache.get_layout_hash, lambda: cache.import_page_group(0, 0, group), lambda: cache.finish_import(0),
                 lambda: cache.get_checkpoint_metadata(0), lambda: cache.prepare_import(0, "{}")):
        with pytest.raises(NotImplementedError, match="RoPE extension factors"):
            call()


@pytest.mark.tvm_native
def test_checkpoint_float_format_is_tvms_for_large_whole_numbers():
    """A whole theta in [2**53, 1e17) was written with a trailing .0 (TVM: none)."""
    shape = tb.Shape(rope_mode=1, rope_theta=1.2345678901234568e16, rope_scale=2.0 ** 60)
    caches = [tb.create_native(shape), tb.create_ours_direct(shape)]
    for c in caches:
        tb.Builtins().add(c, 0)
    metadata = tvm.get_global_func("vm.builtin.attention_kv_cache_get_checkpoint_metadata")
    assert metadata(caches[0], 0) == metadata(caches[1], 0)


def test_checkpoints_of_another_rotary_dim_are_refused():
    """The layout hash (TVM's) has no rotary dim, so a partial-rotary checkpoint moved
    silently into a full-rotary cache (keys stored rotated differently); partial-rotary
    checkpoints now carry the dim in an extra field (TVM ignores unknown fields)."""
    import json

    src = _filled(tiny_cache(rope_rotary_dim=8))
    meta = src.get_checkpoint_metadata(0)
    assert json.loads(meta)["rope_rotary_dim"] == 8
    target = tiny_cache()
    _refused(target, lambda: target.prepare_import(0, meta), rk.ConfigError, "rope_rotary_dim is 8, this cache's 16")
    partial = tiny_cache(rope_rotary_dim=8)
    _refused(partial, lambda: partial.prepare_import(0, _filled(tiny_cache()).get_checkpoint_metadata(0)),
               rk.ConfigError, "rope_rotary_dim is 16, this cache's 8")
    partial.prepare_import(0, meta)
    gptj = _filled(tiny_cache(rope_interleaved=True)).get_checkpoint_metadata(0)
    assert json.loads(gptj)["rope_interleaved"] is True
    _refused(target, lambda: target.prepare_import(0, gptj), rk.ConfigError, "rope_interleaved is true")
    tiny_cache(rope_interleaved=True).prepare_import(0, gptj)
