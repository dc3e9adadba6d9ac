"""A cache over 8-bit float pages (``KVCacheConfig.kv_dtype``), on the CPU.

Each step's outputs are compared with float64 attention over what the cache stored, read back
dequantized by ``debug_get_kv`` (the kernels add no error of their own): the cached rows as
stored, and a prefill step's own rows as computed (decode steps store their token first, so it
too is read as stored). The stored values are compared with float64 quantization of the step's
K/V (the cache stores what the format's rounding gives).
Forks keep the stored bytes; ``set_kv_scales`` refuses what it cannot take and changes nothing.
"""

from __future__ import annotations

import json
import math

import ml_dtypes
import numpy as np
import pytest
import tvm

import relax_kvcache as rk
from relax_kvcache import reference as ref
from relax_kvcache.errors import ArgumentError, KVCacheError
from relax_kvcache.tir_kernels.spec import FP8_MAX

HQ, H, D, THETA = 8, 2, 64, 1e4
SM_SCALE = 1 / math.sqrt(D)
FORMATS = ("float8_e4m3fn", "float8_e5m2")


def config(fmt, **fields):
    base = dict(num_layers=2, num_qo_heads=HQ, num_kv_heads=H, head_dim=D, page_size=16, max_num_seqs=8,
                max_total_seq_len=1024, prefill_chunk_size=64, dtype="float16", kv_dtype=fmt, rope_theta=THETA)
    base.update(fields)
    return rk.KVCacheConfig(**base)


def nan(shape):
    return tvm.runtime.tensor(np.full(shape, np.nan, np.float16))


class Driver:
    """Runs fused-QKV steps on a cache and checks each against float64 attention over the
    cache's stored K/V (dequantized) and the step's queries."""

    def __init__(self, cache, rng, scales):
        self.cache, self.rng, self.scales = cache, rng, scales  # scales: (layers, 2, H)

    def stored(self, seq):
        n = self.cache.get_sequence_length(seq)
        k, v = nan((2, n, H, D)), nan((2, n, H, D))
        self.cache.debug_get_kv(seq, 0, n, k, v)
        return k.numpy(), v.numpy()

    def step(self, seqs, lengths, scale_inputs=1.0):
        n = sum(lengths)
        qkvs = [(self.rng.standard_normal((n, HQ + 2 * H, D)) * scale_inputs).astype(np.float16) for _ in range(2)]
        outs = [nan((n, HQ, D)) for _ in range(2)]
        self.cache.begin_forward(seqs, lengths)
        for layer in range(2):
            self.cache.attention_with_fused_qkv(layer, tvm.runtime.tensor(qkvs[layer]), outs[layer], SM_SCALE)
        self.cache.end_forward()
        row, decode = 0, all(length == 1 for length in lengths)
        for seq, length in zip(seqs, lengths):
            total = self.cache.get_sequence_length(seq)
            k, v = self.stored(seq)
            positions = np.arange(total - length, total)
            for layer in range(2):
                q = ref.rope(qkvs[layer][row:row + length, :HQ], positions, THETA, 1.0)
                new_k = ref.rope(qkvs[layer][row:row + length, HQ:HQ + H], positions, THETA, 1.0)
                new_v = qkvs[layer][row:row + length, HQ + H:].astype(np.float64)
                keys, values = k[layer].astype(np.float64), v[layer].astype(np.float64)
                if not decode:  # a prefill step attends its own rows as computed
                    keys[total - length:], values[total - length:] = new_k, new_v
                exp, _ = ref.attention(q, keys, values, SM_SCALE, causal=True)
                got = outs[layer].numpy()[row:row + length].astype(np.float64)
                np.testing.assert_allclose(got, exp, atol=2e-2, rtol=0, err_msg=f"seq {seq} layer {layer}")
                # the new rows are the float64 quantization of the step's K / V (after RoPE)
                for kv, new, stored in ((0, new_k, k), (1, new_v, v)):
                    s = self.scales[layer, kv][None, :, None]
                    fmax = FP8_MAX[self.cache.config.kv_dtype]
                    expect = np.clip(new / s, -fmax, fmax) * s
                    got_kv = stored[layer, total - length:].astype(np.float64)
                    # one step of the format's grid at most (RoPE in float32 and float16 rounding
                    # of k may move a value across a rounding boundary)
                    step_size = np.abs(expect) * 2.0 ** -(3 if "e4m3" in self.cache.config.kv_dtype else 2) + 1e-2 * s
                    assert (np.abs(got_kv - expect) <= step_size + 1e-3).all(), f"seq {seq} layer {layer} kv {kv}"
            row += length
        return outs


def fresh(fmt, rng):
    cache = rk.PagedAttentionKVCache(config(fmt))
    scales = rng.uniform(0.002, 0.05, (2, 2, H)).astype(np.float32)
    for layer in range(2):
        cache.set_kv_scales(layer, scales[layer, 0], scales[layer, 1])
    return cache, Driver(cache, rng, scales)


@pytest.mark.parametrize("fmt", FORMATS)
def test_steps_fork_popn(fmt):
    rng = np.random.default_rng(7)
    cache, drv = fresh(fmt, rng)
    for seq in (0, 1):
        cache.add_sequence(seq)
    drv.step([0, 1], [37, 20])  # prefill
    drv.step([0, 1], [30, 9])  # a chunk over a cached prefix (one causal pass over the grown pages)
    for _ in range(3):
        drv.step([0, 1], [1, 1])  # decode
    parent_k, parent_v = drv.stored(0)
    cache.fork_sequence(0, 2, 45)  # inside a page: the child copies the shared page's rows
    child_k, child_v = drv.stored(2)
    assert np.array_equal(child_k.view(np.uint16), parent_k[:, :45].view(np.uint16))
    assert np.array_equal(child_v.view(np.uint16), parent_v[:, :45].view(np.uint16))
    drv.step([2, 0], [4, 1])
    cache.popn(0, 5)
    drv.step([0, 2], [2, 1])
    cache.remove_sequence(1)
    drv.step([0], [1])


@pytest.mark.parametrize("fmt", FORMATS)
def test_saturation_at_the_format_maximum(fmt):
    rng = np.random.default_rng(3)
    cache = rk.PagedAttentionKVCache(config(fmt, num_layers=1))
    cache.set_kv_scales(0, 1e-3, 1e-3)  # values of ~1e2 lie far beyond 448e-3 / 57.3
    cache.add_sequence(0)
    qkv = (rng.standard_normal((8, HQ + 2 * H, D)) * 100).astype(np.float16)
    cache.begin_forward([0], [8])
    out = nan((8, HQ, D))
    cache.attention_with_fused_qkv(0, tvm.runtime.tensor(qkv), out, SM_SCALE)
    cache.end_forward()
    k, v = nan((1, 8, H, D)), nan((1, 8, H, D))
    cache.debug_get_kv(0, 0, 8, k, v)
    limit = np.float16(FP8_MAX[fmt] * 1e-3)
    assert np.isfinite(out.numpy()).all() and np.isfinite(k.numpy()).all()
    assert np.abs(v.numpy()).max() == limit and (np.abs(v.numpy()) == limit).mean() > 0.5


def test_pages_take_one_byte_per_element():
    cfg = config("float8_e4m3fn")
    cache = rk.PagedAttentionKVCache(cfg)
    pages = cache._pages[0]
    assert pages.dtype == "float8_e4m3fn"
    half = rk.PagedAttentionKVCache(config(None))._pages[0]
    assert pages.numpy().nbytes * 2 == half.numpy().nbytes


def test_the_same_page_memory_holds_twice_the_4k_sequences():
    """Caches sized to the same page bytes: 8-bit pages hold twice the 4096-token sequences."""
    def held(cache):
        seq = 0
        while True:
            cache.add_sequence(seq)
            try:
                for _ in range(4096 // 64):
                    cache.begin_forward([seq], [64])
                    cache.end_forward()
            except rk.errors.CacheFullError:
                return seq
            seq += 1

    tokens = 4 * 4096
    half, quarter = (rk.PagedAttentionKVCache(config(fmt, max_total_seq_len=n, max_num_seqs=16))
                     for fmt, n in ((None, tokens), ("float8_e4m3fn", 2 * tokens)))
    assert sum(p.numpy().nbytes for p in quarter._pages) <= sum(p.numpy().nbytes for p in half._pages)
    assert (held(half), held(quarter)) == (4, 8)


def test_set_kv_scales_refuses_and_changes_nothing():
    cache = rk.PagedAttentionKVCache(config("float8_e5m2", num_layers=1))
    for k_scale, v_scale, match in ((0.0, 1.0, "k_scale of layer 0 must be positive"),
                                    (1.0, [1.0, float("nan")], "v_scale of layer 0 must be positive"),
                                    ([1.0, 2.0, 3.0], 1.0, "k_scale must be a number or 2 numbers"),
                                    ("1.0", 1.0, "k_scale must be a number or 2 numbers"),
                                    (1.0, 1e39, "v_scale of layer 0 must be positive finite float32")):
        with pytest.raises(ArgumentError, match=match):
            cache.set_kv_scales(0, k_scale, v_scale)
    with pytest.raises(rk.ForwardError, match="layer_id 3 is out of range"):
        cache.set_kv_scales(3, 1.0, 1.0)
    cache.set_kv_scales(0, [0.5, 0.25], 2.0)
    cache.add_sequence(0)
    cache.begin_forward([0], [1])
    with pytest.raises(rk.ForwardError, match="set_kv_scales is not allowed while a forward step is active"):
        cache.set_kv_scales(0, 1.0, 1.0)
    cache.attention_with_fused_qkv(0, tvm.runtime.tensor(np.ones((1, HQ + 2 * H, D), np.float16)), nan((1, HQ, D)),
                                   SM_SCALE)
    cache.end_forward()
    with pytest.raises(KVCacheError, match=r"while the cache holds 1 tokens stored with the current scales"):
        cache.set_kv_scales(0, 1.0, 1.0)
    np.testing.assert_array_equal(cache._kv_scales.host[0], [[0.5, 0.25], [2.0, 2.0]])
    with pytest.raises(KVCacheError, match="set_kv_scales needs a cache over 8-bit pages"):
        rk.PagedAttentionKVCache(config(None, num_layers=1)).set_kv_scales(0, 1.0, 1.0)


def test_config_refuses_what_it_cannot_serve():
    with pytest.raises(rk.ConfigError, match="kv_dtype must be None .* got 'int8'"):
        config("int8")
    assert config(np.dtype(ml_dtypes.float8_e5m2)).kv_dtype == "float8_e5m2"


def raw_kv(cache, seq):
    """The stored bytes of a sequence's positions, per layer ``(2, H, n, D)`` uint8, read from
    the page tensors directly."""
    ps, slots = cache.config.page_size, cache._paging.position_map(seq)
    return [pages.numpy().view(np.uint8)[slots // ps, :, :, slots % ps].transpose(1, 2, 0, 3)
            for pages in cache._pages]


def export(cache, seq, host=True):
    meta = cache.get_checkpoint_metadata(seq)
    groups = []
    for group in json.loads(meta)["groups"]:
        out = tvm.runtime.tensor(np.full(group["shape"], np.nan, getattr(ml_dtypes, group["dtype"])))
        cache.export_page_group(seq, group["group_index"], out)
        groups.append(out)
    return meta, groups


def import_(cache, seq, meta, groups):
    cache.prepare_import(seq, meta)
    for index in (1, 0):
        cache.import_page_group(seq, index, groups[index])
    cache.finish_import(seq)


@pytest.mark.parametrize("fmt", FORMATS)
def test_checkpoints_move_the_stored_bytes_and_scales(fmt):
    """Export / import of 8-bit caches copies the stored bytes exactly (also of a sequence
    forked inside a page) and the scales: a fresh cache takes the checkpoint's scales; the
    exported groups hold the bytes at page p // page_size, slot p % page_size, zeros after the
    end; the imported sequence decodes as the original (to float16 rounding: its blocks differ)."""
    rng = np.random.default_rng(31)
    src, drv = fresh(fmt, rng)
    for seq in (0, 1):
        src.add_sequence(seq)
    drv.step([0, 1], [37, 20])
    drv.step([0, 1], [1, 1])
    src.fork_sequence(0, 2, 21)  # inside a page: the child's first block ends in a copied page
    drv.step([2, 0], [9, 1])
    dst = rk.PagedAttentionKVCache(config(fmt))  # no tokens, scales 1.0
    for seq, length in ((2, 30), (0, 39)):
        meta, groups = export(src, seq)
        parsed = json.loads(meta)
        assert (parsed["kv_dtype"], parsed["groups"][0]["dtype"], parsed["groups"][0]["nbytes"]) == (
            fmt, fmt, 2 * 2 * H * 16 * D * (-(-length // 16)) // 2)
        np.testing.assert_array_equal(np.array([parsed["k_scales"], parsed["v_scales"]], np.float32),
                                      drv.scales.transpose(1, 0, 2))
        for layer, (stored, group) in enumerate(zip(raw_kv(src, seq), groups)):
            pages = group.numpy().view(np.uint8)[0]  # (P, 2, H, ps, D)
            flat = pages.transpose(1, 2, 0, 3, 4).reshape(2, H, -1, D)
            assert np.array_equal(flat[:, :, :length], stored), f"layer {layer}: exported bytes"
            assert not flat[:, :, length:].any(), "slots after the end must be zero"
        import_(dst, 7, meta, groups)
        np.testing.assert_array_equal(dst._kv_scales.host, drv.scales)
        for a, b in zip(raw_kv(src, seq), raw_kv(dst, 7)):
            assert np.array_equal(a, b), "imported bytes differ"
        before, after = Driver(src, rng, drv.scales).stored(seq), Driver(dst, rng, drv.scales).stored(7)
        for a, b in zip(before, after):
            assert np.array_equal(a.view(np.uint16), b.view(np.uint16))
        qkv = tvm.runtime.tensor(rng.standard_normal((1, HQ + 2 * H, D)).astype(np.float16))
        outs = []
        for cache, sid in ((src, seq), (dst, 7)):
            out = nan((1, HQ, D))
            cache.begin_forward([sid], [1])
            cache.attention_with_fused_qkv(0, qkv, out, SM_SCALE)
            cache.end_forward()
            cache.popn(sid, 1)
            outs.append(out.numpy())
        assert np.isfinite(outs[1]).all()  # the same keys, split into blocks differently: float16 rounding apart
        np.testing.assert_allclose(outs[1].astype(np.float64), outs[0].astype(np.float64), atol=2e-3, rtol=0)
        dst.remove_sequence(7)


def test_checkpoint_refusals_of_8_bit_caches_change_nothing():
    """An 8-bit checkpoint imports only into a cache of the same kv_dtype (not into pages of the
    model dtype or of the other format) and a 16-bit one not into 8-bit pages, naming both
    dtypes; scales that differ from those of a cache holding tokens are refused; bad scale
    fields are argument errors. Each refusal leaves the cache (and its scales) as it was."""
    from support.snapshot import assert_same, snapshot

    rng = np.random.default_rng(32)
    src, drv = fresh("float8_e4m3fn", rng)
    src.add_sequence(0)
    drv.step([0], [20])
    meta, groups = export(src, 0)
    def store_ones(cache, seq, n):
        cache.add_sequence(seq)
        cache.begin_forward([seq], [n])
        for layer in range(2):
            cache.attention_with_fused_qkv(layer, tvm.runtime.tensor(np.ones((n, HQ + 2 * H, D), np.float16)),
                                           nan((n, HQ, D)), SM_SCALE)
        cache.end_forward()

    plain = rk.PagedAttentionKVCache(config(None))
    store_ones(plain, 0, 3)
    e5m2 = rk.PagedAttentionKVCache(config("float8_e5m2"))
    held, _ = fresh("float8_e4m3fn", rng)  # other scales, and a token stored with them
    store_ones(held, 3, 1)

    def edited(**changes):
        data = json.loads(meta)
        data.update(changes)
        return json.dumps(data)

    k_scales = json.loads(meta)["k_scales"]
    cases = [
        (plain, meta, rk.ConfigError, "checkpoint stores float8_e4m3fn pages, this cache float16 pages"),
        (e5m2, meta, rk.ConfigError, "checkpoint stores float8_e4m3fn pages, this cache float8_e5m2 pages"),
        (e5m2, plain.get_checkpoint_metadata(0), rk.ConfigError,
         "checkpoint stores float16 pages, this cache float8_e5m2 pages"),
        (held, meta, KVCacheError, r"scales of layer 0 \(K .*\) differ from this cache's .* 1 stored tokens"),
        (held, edited(kv_dtype=7), ArgumentError, "'kv_dtype' must be a string, got 7"),
        (held, edited(k_scales=k_scales[:1]), ArgumentError, "'k_scales' must hold 2 list"),
        (held, edited(v_scales=[[1.0, "1"], [1.0, 1.0]]), ArgumentError, "'v_scales' must hold 2 list"),
        (held, edited(k_scales=[[1.0, 0.0], [1.0, 1.0]]), ArgumentError, "'k_scales': layer 0 head 1 must be a pos"),
        (held, edited(k_scales=[[1.0, 1.0], [0.1, 1.0]]), ArgumentError, "layer 1 head 0 .* float32 number, got 0.1"),
        (held, edited(k_scales=[[1.0, 1.0], [1.0, 10**400]]), ArgumentError, "layer 1 head 1"),
    ]
    for cache, text, error, match in cases:
        before, scales = snapshot(cache, pages=True), cache._kv_scales.host.copy()
        with pytest.raises(error, match=match):
            cache.prepare_import(5, text)
        assert_same(before, snapshot(cache, pages=True))
        np.testing.assert_array_equal(scales, cache._kv_scales.host)
    group = tvm.runtime.tensor(np.zeros(groups[0].shape, np.float16))
    other = rk.PagedAttentionKVCache(config("float8_e4m3fn"))
    other.prepare_import(1, meta)
    with pytest.raises(rk.ForwardError, match="group has dtype float16, expected float8_e4m3fn"):
        other.import_page_group(1, 0, group)
    same = edited(k_scales=held._kv_scales.host[:, 0].tolist(), v_scales=held._kv_scales.host[:, 1].tolist())
    import_(held, 5, same, groups)  # the cache's own scales: taken with its tokens


def prefill(cache, qkv, seqs=(0,)):
    """One step of ``qkv (layers, n, heads, D)`` split evenly over ``seqs``; the outputs."""
    layers, n = qkv.shape[:2]
    cache.begin_forward(list(seqs), [n // len(seqs)] * len(seqs))
    outs = [nan((n, HQ, D)) for _ in range(layers)]
    for layer in range(layers):
        cache.attention_with_fused_qkv(layer, tvm.runtime.tensor(qkv[layer]), outs[layer], SM_SCALE)
    cache.end_forward()
    return [o.numpy() for o in outs]


def outlier_qkv(rng, n, layers=2):
    qkv = rng.standard_normal((layers, n, HQ + 2 * H, D))
    for layer in range(layers):
        channels = rng.choice(D, 4, replace=False)
        qkv[layer][:, HQ:HQ + H, channels] += rng.uniform(50, 200, (1, H, 4)) * rng.choice([-1, 1], (1, H, 4))
    return qkv.astype(np.float16)


@pytest.mark.parametrize("fmt,fields", [
    ("float8_e4m3fn", {}), ("float8_e5m2", {}),  # NORMAL RoPE: K stored rotated
    ("float8_e4m3fn", dict(rope_mode=rk.RopeMode.INLINE)),  # K stored as given
    ("float8_e5m2", dict(rope_rotary_dim=32, rope_interleaved=True)),
])
def test_calibrated_scales_from_the_first_step(fmt, fields):
    """calibrate_kv_scales: the first step sets, per layer and head, K / V scales of
    ``margin * amax / format max`` (numpy), K's amax bounding its rotation at any position
    (per rotary pair sqrt(a^2 + b^2)); a zero head gets the floor; nothing saturates; later steps
    keep the scales; the outputs are those of float64 attention over the stored values."""
    rng = np.random.default_rng(41)
    cache = rk.PagedAttentionKVCache(config(fmt, **fields))
    cache.calibrate_kv_scales(margin=1.5)
    for seq in (0, 1):
        cache.add_sequence(seq)
    qkv = outlier_qkv(rng, 40)
    qkv[1, :, HQ + H + 1] = 0  # layer 1: V of head 1 all zeros
    outs = prefill(cache, qkv, (0, 1))
    k, v = qkv[:, :, HQ:HQ + H].astype(np.float64), qkv[:, :, HQ + H:].astype(np.float64)
    if cache.config.effective_rope_mode == rk.RopeMode.NORMAL:
        r = cache.config.rotary_dim
        pairs = (k[..., 0:r:2], k[..., 1:r:2]) if cache.config.rope_interleaved else (k[..., :r // 2], k[..., r // 2:r])
        k_amax = np.maximum(np.sqrt(pairs[0] ** 2 + pairs[1] ** 2).max(axis=(1, 3)), np.abs(k[..., r:]).max(
            axis=(1, 3), initial=0))
    else:
        k_amax = np.abs(k).max(axis=(1, 3))
    v_amax = np.maximum(np.abs(v).max(axis=(1, 3)), 1e-6)
    fmax = FP8_MAX[fmt]
    for layer in range(2):
        got = cache.get_kv_scales(layer)
        np.testing.assert_allclose(got[0], 1.5 * k_amax[layer] / fmax, rtol=1e-6)
        np.testing.assert_allclose(got[1], 1.5 * v_amax[layer] / fmax, rtol=1e-6)
    assert cache.get_kv_scales(1)[1][1] == np.float32(1.5e-6 / fmax)
    drv = Driver(cache, rng, np.stack([np.stack(cache.get_kv_scales(layer)) for layer in range(2)]))
    for seq in (0, 1):
        stored_k, stored_v = drv.stored(seq)
        limit = drv.scales[:, :, None, :, None].astype(np.float64) * fmax  # saturation: amax maps to fmax / 1.5
        assert (np.abs(stored_k) < limit[:, 0] / 1.2).all() and (np.abs(stored_v) < limit[:, 1] / 1.2).all()
    for seq, rows in ((0, slice(0, 20)), (1, slice(20, 40))):
        stored_k, stored_v = drv.stored(seq)
        for layer in range(2):
            positions = np.arange(20)
            q = qkv[layer, rows, :HQ].astype(np.float64)
            keys, values = stored_k[layer].astype(np.float64), qkv[layer, rows, HQ + H:].astype(np.float64)
            if cache.config.effective_rope_mode == rk.RopeMode.NORMAL and not fields:
                q, keys = ref.rope(q, positions, THETA, 1.0), ref.rope(qkv[layer, rows, HQ:HQ + H], positions, THETA,
                                                                      1.0)
                exp, _ = ref.attention(q, keys, values, SM_SCALE, causal=True)  # own rows as computed
                np.testing.assert_allclose(outs[layer][rows].astype(np.float64), exp, atol=2e-2, rtol=0)
    before = [np.stack(cache.get_kv_scales(layer)) for layer in range(2)]
    prefill(cache, outlier_qkv(rng, 2) * 4, (0, 1))  # larger values: the scales stay
    for layer in range(2):
        np.testing.assert_array_equal(np.stack(cache.get_kv_scales(layer)), before[layer])


def test_calibration_refusals_and_cancellation():
    rng = np.random.default_rng(42)
    plain = rk.PagedAttentionKVCache(config(None, num_layers=1))
    with pytest.raises(KVCacheError, match="calibrate_kv_scales needs a cache over 8-bit pages"):
        plain.calibrate_kv_scales()
    with pytest.raises(KVCacheError, match="get_kv_scales needs a cache over 8-bit pages"):
        plain.get_kv_scales(0)
    cache = rk.PagedAttentionKVCache(config("float8_e4m3fn"))
    for margin in (0.0, -1.0, float("inf"), "2"):
        with pytest.raises(ArgumentError, match="margin"):
            cache.calibrate_kv_scales(margin)
    assert not cache._kv_scales.pending
    cache.calibrate_kv_scales()
    cache.set_kv_scales(1, 0.25, 0.5)  # cancels layer 1's calibration
    cache.add_sequence(0)
    prefill(cache, outlier_qkv(rng, 8))
    np.testing.assert_array_equal(np.stack(cache.get_kv_scales(1)), [[0.25, 0.25], [0.5, 0.5]])
    assert (np.stack(cache.get_kv_scales(0)) != 1.0).all()
    with pytest.raises(KVCacheError, match="calibrate_kv_scales while the cache holds 8 tokens"):
        cache.calibrate_kv_scales()
    assert not cache._kv_scales.pending
    with pytest.raises(rk.ForwardError, match="layer_id 2 is out of range"):
        cache.get_kv_scales(2)


def test_frontend_model_creates_the_fp8_cache():
    """A model compiled with ``CacheLayout(kv_dtype=...)`` creates a cache over 8-bit pages with
    its own kernels (8th ``cache_config`` entry): it stores the same bytes as a cache made
    directly, and its outputs agree (the model's build may compile the kernels' float math
    slightly differently)."""
    from relax_kvcache import frontend
    from support.frontend_program import create, fused_vm

    layout = frontend.CacheLayout(num_layers=2, num_qo_heads=HQ, num_kv_heads=H, head_dim=D, rope_theta=THETA,
                                  dtype="float16", kv_dtype="float8_e5m2")
    vm = fused_vm(layout, SM_SCALE, "float16")
    model_cache = create(vm, 4, 256, 32)
    assert model_cache.config.kv_dtype == "float8_e5m2"
    direct = rk.PagedAttentionKVCache(config("float8_e5m2", max_num_seqs=4, max_total_seq_len=256,
                                             prefill_chunk_size=32))
    rng = np.random.default_rng(5)
    for cache in (model_cache, direct):
        cache.set_kv_scales(1, 0.01, [0.02, 0.005])
        cache.add_sequence(0)
    for n in (13, 1, 1):
        qkv = (rng.standard_normal((2, 1, n, HQ + 2 * H, D))).astype(np.float16)
        model_cache.begin_forward([0], [n])
        got = [o.numpy()[0] for o in vm["fused"](tvm.runtime.tensor(qkv), model_cache)]
        model_cache.end_forward()
        direct.begin_forward([0], [n])
        for layer in range(2):
            out = nan((n, HQ, D))
            direct.attention_with_fused_qkv(layer, tvm.runtime.tensor(qkv[layer, 0]), out, SM_SCALE)
            np.testing.assert_allclose(got[layer].astype(np.float64), out.numpy().astype(np.float64), atol=2e-3,
                                       rtol=0, err_msg=f"n={n} layer {layer}")
        direct.end_forward()
    stored = []
    for cache in (model_cache, direct):
        k, v = nan((2, 15, H, D)), nan((2, 15, H, D))
        cache.debug_get_kv(0, 0, 15, k, v)
        stored.append((k.numpy().view(np.uint16), v.numpy().view(np.uint16)))
    assert all(np.array_equal(a, b) for a, b in zip(*stored))


class Twins:
    """An 8-bit cache and a float16 one driven with the same operations, on inputs whose K / V
    lie on the 8-bit grid times the (power-of-two) scales and without RoPE: storing them loses
    nothing, so every output of the 8-bit cache must match the float16 cache's (a scale the
    kernels ignored or applied twice, a dequantization error or a feature's kernel reading the
    wrong bytes would not)."""

    SCALES = (0.25, 2.0)  # K, V

    def __init__(self, fmt, rng, **fields):
        fields = dict(dict(rope_mode=rk.RopeMode.NONE), **fields)
        self.fmt, self.rng = fmt, rng
        self.fp8 = rk.PagedAttentionKVCache(config(fmt, **fields))
        self.fp16 = rk.PagedAttentionKVCache(config(None, **fields))
        for layer in range(self.fp8.config.num_layers):
            self.fp8.set_kv_scales(layer, *self.SCALES)

    def both(self, method, *args):
        for cache in (self.fp8, self.fp16):
            getattr(cache, method)(*args)

    def grid(self, shape, scale):
        """Values of the 8-bit format (moderate exponents) times ``scale``, exact in float16."""
        vals = self.rng.standard_normal(shape) * np.exp2(self.rng.integers(-3, 3, shape))
        return (vals.astype(getattr(ml_dtypes, self.fmt)).astype(np.float32) * scale).astype(np.float16)

    def qkv(self, n):
        cfg = self.fp8.config
        q = self.rng.standard_normal((n, cfg.num_qo_heads, D)).astype(np.float16)
        k = self.grid((n, cfg.num_kv_heads, D), self.SCALES[0])
        v = self.grid((n, cfg.num_kv_heads, D), self.SCALES[1])
        return np.concatenate([q, k, v], axis=1)

    def step(self, seqs, lengths, parents=None, shared_from=None):
        """One step; every layer fused, or (``shared_from``) layer 1 reading layer 0's KV."""
        n, layers = sum(lengths), self.fp8.config.num_layers
        qkvs = [self.qkv(n) for _ in range(layers)]
        outs = {}
        for name, cache in (("fp8", self.fp8), ("fp16", self.fp16)):
            cache.begin_forward(seqs, lengths, parents)
            outs[name] = [nan((n, HQ, D)) for _ in range(layers)]
            for layer in range(layers):
                if shared_from is not None and layer == 1:
                    q, k, v = (tvm.runtime.tensor(np.ascontiguousarray(x)) for x in
                               (qkvs[1][:, :HQ], qkvs[1][:, HQ:HQ + H], qkvs[1][:, HQ + H:]))
                    cache.attention_with_shared_kv(shared_from, q, k, v, outs[name][layer], SM_SCALE)
                else:
                    cache.attention_with_fused_qkv(layer, tvm.runtime.tensor(qkvs[layer]), outs[name][layer],
                                                   SM_SCALE)
            cache.end_forward()
        for layer in range(layers):
            got, want = (outs[name][layer].numpy().astype(np.float64) for name in ("fp8", "fp16"))
            assert np.isfinite(got).all(), f"layer {layer}: output not fully written"
            np.testing.assert_allclose(got, want, atol=2e-2, rtol=0, err_msg=f"{seqs} {lengths} layer {layer}")

    def check_stored(self, seq, layers=None):
        """The two caches store the same values (``layers``: only these; a layer whose K/V a
        shared-KV step did not write holds whatever its pages held)."""
        n = self.fp8.get_sequence_length(seq)
        assert n == self.fp16.get_sequence_length(seq)
        got = []
        for cache in (self.fp8, self.fp16):
            k, v = nan((cache.config.num_layers, n, H, D)), nan((cache.config.num_layers, n, H, D))
            cache.debug_get_kv(seq, 0, n, k, v)
            picked = slice(None) if layers is None else list(layers)
            got.append(np.concatenate([k.numpy()[picked], v.numpy()[picked]]).view(np.uint16))
        assert np.array_equal(*got), f"seq {seq}: stored K/V differ"


@pytest.mark.parametrize("fmt", FORMATS)
def test_token_trees_forks_and_shared_kv_on_the_grid(fmt):
    twins = Twins(fmt, np.random.default_rng(11))
    for seq in (0, 1):
        twins.both("add_sequence", seq)
    twins.step([0, 1], [30, 18])
    twins.step([0, 1], [1, 1])
    twins.step([0, 1], [4, 3], parents=[-1, 0, 0, 1, -1, 0, 1])  # token trees
    twins.step([0, 1], [2, 1], parents=[2, 4, 2])  # grown over another step
    twins.both("commit_accepted_token_tree_nodes", [0, 1], [4, 2])  # compact_copy moves the path
    for seq in (0, 1):
        twins.check_stored(seq)
    twins.both("fork_sequence", 0, 2, 21)
    twins.step([2, 0, 1], [5, 1, 1])
    twins.step([0, 2], [6, 1], shared_from=0)  # layer 1 over layer 0's KV
    twins.both("popn", 2, 3)
    twins.step([2], [1])
    for seq in (0, 1, 2):
        twins.check_stored(seq, layers=[0])


@pytest.mark.parametrize("fmt", FORMATS)
def test_windows_sinks_and_local_layers_on_the_grid(fmt):
    kinds = [rk.AttnKind.MHA, rk.AttnKind.MHA_SLIDING]
    twins = Twins(fmt, np.random.default_rng(12), support_sliding_window=True, attn_kinds=kinds,
                  layer_sliding_window_size=24)
    for seq in (0, 1):
        twins.both("add_sequence", seq)
    twins.both("enable_sliding_window_for_seq", 0, 40, 4)
    twins.step([0, 1], [44, 20])
    for _ in range(3):
        twins.step([0, 1], [1, 1])
    twins.step([0, 1], [17, 33])
    twins.check_stored(1)
    chunked = Twins(fmt, np.random.default_rng(13), attn_kinds=[rk.AttnKind.MHA_CHUNKED_LOCAL, rk.AttnKind.MHA],
                    attention_chunk_size=32)
    chunked.both("add_sequence", 0)
    chunked.step([0], [45])
    chunked.step([0], [1])
    chunked.step([0], [30])
    chunked.check_stored(0)


@pytest.mark.parametrize("fmt,mean_bound,max_bound", [("float8_e4m3fn", 5e-3, 0.1), ("float8_e5m2", 1e-2, 0.15)])
def test_accuracy_against_unquantized_float64(fmt, mean_bound, max_bound):
    """Realistic inputs (unit-variance q / k / v; keys with four outlier channels offset by 50-200),
    decode over 200 stored tokens: the error against float64 attention over the unquantized K/V
    is the format's rounding error (float64 attention over the rounded K/V, ``inherent``), plus
    no more than the model dtype's; for unit-variance inputs it stays within the bounds in
    docs/fp8.md (mean / max abs error: e4m3 5e-3 / 0.1, e5m2 1e-2 / 0.15)."""
    rng = np.random.default_rng(21)
    n = 200
    q, k, v = (rng.standard_normal((n, heads, D)) for heads in (HQ, H, H))
    for outliers in (False, True):
        if outliers:
            k[:, :, rng.choice(D, 4, replace=False)] += rng.uniform(50, 200, (1, H, 4)) * rng.choice([-1, 1], (1, H, 4))
        q16, k16, v16 = (x.astype(np.float16) for x in (q, k, v))
        cache = rk.PagedAttentionKVCache(config(fmt, num_layers=1, rope_mode=rk.RopeMode.NONE, prefill_chunk_size=256))
        cache.add_sequence(0)
        qkv = np.concatenate([q16, k16, v16], axis=1)
        cache.begin_forward([0], [n - 8])
        cache.attention_with_fused_qkv(0, tvm.runtime.tensor(qkv[:n - 8]), nan((n - 8, HQ, D)), SM_SCALE)
        cache.end_forward()
        fmax = FP8_MAX[fmt]
        rounded = [(np.clip(x.astype(np.float32), -fmax, fmax).astype(getattr(ml_dtypes, fmt)).astype(np.float32)
                    .astype(np.float16).astype(np.float64)) for x in (k16, v16)]
        errors = []
        for i in range(n - 8, n):  # decode: every key read as stored
            out = nan((1, HQ, D))
            cache.begin_forward([0], [1])
            cache.attention_with_fused_qkv(0, tvm.runtime.tensor(qkv[i:i + 1]), out, SM_SCALE)
            cache.end_forward()
            got = out.numpy()[0].astype(np.float64)
            exact, _ = ref.attention(q16[i:i + 1], k16[:i + 1], v16[:i + 1], SM_SCALE, causal=True)
            inherent, _ = ref.attention(q16[i:i + 1], rounded[0][:i + 1], rounded[1][:i + 1], SM_SCALE, causal=True)
            assert np.abs(got - inherent[0]).max() < 2e-3, "the kernels added error of their own"
            errors.append(np.abs(got - exact[0]))
        if not outliers:
            assert np.mean(errors) < mean_bound and np.max(errors) < max_bound


def test_creation_refuses_a_bad_kv_dtype_code_and_16_bit_kernels():
    """``cache_config[7]``: an unknown code is refused naming the entry; 8-bit pages refuse
    kernels without the ``kv_scales`` argument, naming the creation argument."""
    from support.small_cache import create_with, one_sequence_cache

    kernels = one_sequence_cache()._kernels  # kernels of pages of the model dtype
    shape = tvm.runtime.ShapeTuple
    with pytest.raises(rk.ConfigError, match=r"cache_config\[7\] \(kv_dtype\) must be 0 .* got 3"):
        create_with(kernels, a0=shape([8, 200, 64, 8, 0, 1024, 0, 3]))
    with pytest.raises(rk.ConfigError, match=r"argument 13 \(f_transpose_append_mha\) is a kernel of 4 parameters"
                                             r".* with kv_scales"):
        create_with(kernels, a0=shape([8, 200, 64, 8, 0, 1024, 0, 1]))
    assert create_with(kernels, a0=shape([8, 200, 64, 8, 0, 1024, 0, 0])).config.kv_dtype is None
