"""LongRoPE (Phi-3 RoPE extension factors): config, split_rotary kernel, cache, creation, frontend.

References: ``reference_model.longrope`` (numpy float64, written from the LongRoPE formula) and
TVM's native cache fed TVM's own LongRoPE ``split_rotary`` (``native_baseline``, test-only).
TVM's kernel picks the long factors for a whole step when the step (all its sequences
together) has more tokens than ``original_max_position_embeddings``; ours per token by position (a token at position
``>= original`` uses them). The two agree where both pick the same factors: every step in the
short regime, and steps longer than ``original`` whose tokens all sit at or beyond it.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import tvm

import relax_kvcache as rk
from relax_kvcache.runtime import default_target

import native_baseline as tb
from support.small_cache import tiny_cache
from reference_model import CacheModel, longrope

HQ, HKV, D = 4, 2, 32
ORIGINAL, MAXIMUM = 24, 96  # original / extended max_position_embeddings (scaled down)
THETA, SCALE = 1e4, 1.0


def _factors(seed: int = 0) -> tuple:
    """Random long (1..8) and short (0.8..1.6) factors, TVM's layout, as float32 values."""
    rng = np.random.default_rng(seed)
    long = np.sort(rng.uniform(1.0, 8.0, D // 2))
    short = rng.uniform(0.8, 1.6, D // 2)
    return tuple(float(x) for x in np.concatenate([long, short]).astype(np.float32))


FACTORS = _factors()
ATTENTION = rk.longrope_attention_factor(MAXIMUM, ORIGINAL)


def _config(**overrides) -> rk.KVCacheConfig:
    fields = dict(num_layers=2, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=8, max_num_seqs=8,
                  max_total_seq_len=512, prefill_chunk_size=64, rope_mode=rk.RopeMode.NORMAL, rope_theta=THETA,
                  rope_scale=SCALE, dtype="float32", rope_ext_factors=FACTORS,
                  rope_original_max_position_embeddings=ORIGINAL, rope_attention_factor=ATTENTION)
    fields.update(overrides)
    return rk.KVCacheConfig(**fields)


def _reference(x, positions):
    return longrope(x, positions, THETA, SCALE, FACTORS, ORIGINAL, ATTENTION)


# ---------------------------------------------------------------------------- config


def test_attention_factor_is_phi3s():
    assert ATTENTION == pytest.approx(math.sqrt(1 + math.log(MAXIMUM / ORIGINAL) / math.log(ORIGINAL)))
    assert rk.longrope_attention_factor(4096, 4096) == 1.0
    with pytest.raises(rk.ConfigError, match="original_max_position_embeddings must be an int of at least 2"):
        rk.longrope_attention_factor(4096, 1)


@pytest.mark.parametrize("overrides, match", [
    (dict(rope_ext_factors=FACTORS[:-1]), "must hold rotary_dim=32 floats"),
    (dict(rope_ext_factors=FACTORS[:4] + (float("nan"),) + FACTORS[5:]), r"rope_ext_factors\[4\] must be a positive"),
    (dict(rope_ext_factors=(-1.0,) + FACTORS[1:]), r"rope_ext_factors\[0\] must be a positive finite"),
    (dict(rope_ext_factors=(0.0,) + FACTORS[1:]), r"rope_ext_factors\[0\]"),
    (dict(rope_ext_factors=(1e39,) + FACTORS[1:]), r"rope_ext_factors\[0\]"),
    (dict(rope_ext_factors="1.0"), "must be a sequence of 32 floats"),
    (dict(rope_ext_factors=3.0), "must be a sequence of 32 floats"),
    (dict(rope_ext_factors=["x"] * D), "must hold numbers"),
    (dict(rope_mode=rk.RopeMode.INLINE), "need rope_mode NORMAL"),
    (dict(rope_mode=rk.RopeMode.NONE), "need rope_mode NORMAL"),
    (dict(support_sliding_window=True), "need rope_mode NORMAL"),
    (dict(rope_ext_factors=None), "apply with rope_ext_factors only"),
    (dict(rope_ext_factors=None, rope_attention_factor=1.0), "apply with rope_ext_factors only"),
    (dict(rope_original_max_position_embeddings=0), "rope_original_max_position_embeddings must be a positive"),
    (dict(rope_original_max_position_embeddings=2.5), "rope_original_max_position_embeddings must be a positive"),
    (dict(rope_attention_factor=-1.0), "rope_attention_factor must be positive"),
    (dict(rope_attention_factor=float("inf")), "rope_attention_factor must be a finite"),
])
def test_bad_longrope_configs_are_refused(overrides, match):
    with pytest.raises(rk.ConfigError, match=match):
        _config(**overrides)


def test_factors_are_stored_as_float32_values():
    cfg = _config(rope_ext_factors=np.array(FACTORS, dtype=np.float64) + 1e-12)
    assert cfg.rope_ext_factors == FACTORS and hash(cfg) == hash(_config())


def test_building_needs_the_original_max_position():
    cfg = _config(rope_original_max_position_embeddings=None)
    with pytest.raises(rk.ConfigError, match="needs KVCacheConfig.rope_original_max_position_embeddings"):
        rk.build_kernels(cfg, default_target(tvm.cpu()))


# ---------------------------------------------------------------------------- kernel


@pytest.fixture(scope="module")
def longrope_cache_factory():
    """Caches of :func:`_config` (one kernel build per session through the on-disk cache)."""
    def make(**overrides):
        return rk.PagedAttentionKVCache(_config(**overrides), tvm.cpu())
    return make


def test_split_rotary_matches_float64():
    """Positions on both sides of ``original`` in one call: each token picks its factors
    (float16 / bfloat16 and GPUs: ``test_kernels.test_split_rotary_variants``)."""
    dtype = "float32"
    mod = rk.build_kernels(_config(), default_target(tvm.cpu()))
    split = mod["split_rotary"]
    rng = np.random.default_rng(1)
    positions = np.r_[rng.integers(0, ORIGINAL, 9), ORIGINAL - 1, ORIGINAL, rng.integers(ORIGINAL, 4000, 9)]
    n = len(positions)
    qkv = rng.standard_normal((n, HQ + 2 * HKV, D)).astype(dtype)
    outs = [tvm.runtime.tensor(np.full((n, h, D), np.nan, dtype)) for h in (HQ, HKV, HKV)]
    split(tvm.runtime.tensor(qkv), tvm.runtime.tensor(positions.astype(np.int32)), *outs,
          tvm.runtime.tensor(np.array(FACTORS, np.float32)))
    q, k, v = (o.numpy().astype(np.float64) for o in outs)
    x = qkv.astype(np.float64)
    tol = 8e-3  # float32 angles at positions up to 4000 (~1e-4 rad)
    np.testing.assert_allclose(q, _reference(x[:, :HQ], positions), atol=tol)
    np.testing.assert_allclose(k, _reference(x[:, HQ:HQ + HKV], positions), atol=tol)
    np.testing.assert_array_equal(v, x[:, HQ + HKV:])
    # the factors matter: plain RoPE (or swapped halves) would differ by far more
    swapped = FACTORS[D // 2:] + FACTORS[:D // 2]
    wrong = longrope(x[:, :HQ], positions, THETA, SCALE, swapped, ORIGINAL, ATTENTION)
    assert np.abs(q - wrong).max() > 0.5


# ---------------------------------------------------------------------------- cache


def _drive(cache, model: CacheModel, rng, batch, sm_scale=0.25):
    """One step of ``batch`` ((seq, n), ...) on our cache and the model; outputs compared."""
    ids, lengths = [s for s, _ in batch], [n for _, n in batch]
    total = sum(lengths)
    qkv = [rng.standard_normal((total, HQ + 2 * HKV, D)).astype(np.float32) for _ in range(2)]
    cache.begin_forward(ids, lengths)
    outs = []
    for layer in range(2):
        o = tvm.runtime.tensor(np.full((total, HQ, D), np.nan, np.float32))
        cache.attention_with_fused_qkv(layer, tvm.runtime.tensor(qkv[layer]), o, sm_scale)
        outs.append(o.numpy())
    cache.end_forward()
    want = model.step(batch, qkv, sm_scale)
    for layer in range(2):
        err = np.abs(outs[layer] - want[layer]).max()
        assert err < 2e-3, f"layer {layer} batch {batch}: max error {err:.3g}"


def _check_stored(cache, model: CacheModel):
    for seq_id, seq in model.seqs.items():
        if seq.length:
            shape = (2, seq.length, HKV, D)
            k, v = tvm.runtime.empty(shape, "float32"), tvm.runtime.empty(shape, "float32")
            cache.debug_get_kv(seq_id, 0, seq.length, k, v)
            np.testing.assert_allclose(k.numpy(), seq.k, atol=2e-3)
            np.testing.assert_allclose(v.numpy(), seq.v, atol=1e-6)


def _model() -> CacheModel:
    model = CacheModel(2, HQ, HKV, D, 1, THETA, SCALE)
    model.rope = _reference
    return model


def test_cache_across_the_original_max_position(longrope_cache_factory):
    """Prefill crossing ``original``, decode beyond it, a fork before and one after it, popn
    back across it, chunks of every size: stored K and attention match float64 LongRoPE."""
    cache, model, rng = longrope_cache_factory(), _model(), np.random.default_rng(2)
    for seq in (0, 1):
        cache.add_sequence(seq)
        model.add(seq)
    _drive(cache, model, rng, [(0, 30), (1, 10)])  # seq 0 crosses ORIGINAL=24 in one chunk
    _drive(cache, model, rng, [(1, 20)])           # seq 1 crosses in a later chunk
    for _ in range(3):
        _drive(cache, model, rng, [(0, 1), (1, 1)])
    cache.fork_sequence(0, 2, 12)  # fork inside the short part
    model.fork(0, 2, 12)
    cache.fork_sequence(1, 3, -1)
    model.fork(1, 3, -1)
    _drive(cache, model, rng, [(2, 17), (3, 1), (0, 2)])
    cache.popn(3, 15)  # back below ORIGINAL: later tokens there use the short factors again
    model.popn(3, 15)
    _drive(cache, model, rng, [(3, 5), (2, 1)])
    _check_stored(cache, model)


def test_chunking_does_not_change_the_stored_keys(longrope_cache_factory):
    """A token's rotation depends on its position only: one 40-token prefill and the same
    tokens in chunks of 7 store the same K."""
    rng = np.random.default_rng(3)
    qkv = [rng.standard_normal((40, HQ + 2 * HKV, D)).astype(np.float32) for _ in range(2)]
    stored = []
    for chunks in ([40], [7] * 5 + [5]):
        cache = longrope_cache_factory()
        cache.add_sequence(0)
        start = 0
        for n in chunks:
            cache.begin_forward([0], [n])
            for layer in range(2):
                o = tvm.runtime.empty((n, HQ, D), "float32")
                cache.attention_with_fused_qkv(layer, tvm.runtime.tensor(qkv[layer][start:start + n]), o, 0.3)
            cache.end_forward()
            start += n
        k, v = tvm.runtime.empty((2, 40, HKV, D), "float32"), tvm.runtime.empty((2, 40, HKV, D), "float32")
        cache.debug_get_kv(0, 0, 40, k, v)
        stored.append(k.numpy())
    np.testing.assert_allclose(stored[0], stored[1], atol=1e-6)


# ---------------------------------------------------------------------------- creation and TVM


def _shape() -> tb.Shape:
    return tb.Shape(num_layers=2, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=16, max_num_seqs=8,
                    max_total_seq_len=512, prefill_chunk_size=64, rope_mode=1, rope_theta=THETA, rope_scale=SCALE,
                    ext_factors=FACTORS, longrope_positions=(MAXIMUM, ORIGINAL))


@pytest.mark.tvm_native
def test_split_rotary_agrees_with_tvms_where_both_pick_the_same_factors():
    """Our kernel vs TVM's LongRoPE kernel: a short step below ``original`` (short factors in
    both) and a step of more than ``original`` tokens all at or beyond it (long in both)."""
    ours = rk.build_kernels(_config(), default_target(tvm.cpu()))["split_rotary"]
    theirs = tb.tvm_kernels(_shape())["split_rotary"]
    rng = np.random.default_rng(4)
    factors = tvm.runtime.tensor(np.array(FACTORS, np.float32))
    for positions in (rng.integers(0, ORIGINAL, ORIGINAL), rng.integers(ORIGINAL, 2000, ORIGINAL + 7)):
        n = len(positions)
        qkv = tvm.runtime.tensor(rng.standard_normal((n, HQ + 2 * HKV, D)).astype(np.float32))
        pos = tvm.runtime.tensor(positions.astype(np.int32))
        results = []
        for split in (ours, theirs):
            outs = [tvm.runtime.tensor(np.full((n, h, D), np.nan, np.float32)) for h in (HQ, HKV, HKV)]
            split(qkv, pos, *outs, factors)
            results.append([o.numpy() for o in outs])
        for got, want in zip(*results):
            np.testing.assert_allclose(got, want, atol=2e-3)
        np.testing.assert_allclose(results[0][0], _reference(qkv.numpy()[:, :HQ], positions), atol=2e-3)


@pytest.mark.tvm_native
def test_creation_with_factors_matches_tvms_native_cache():
    """TVM's creation arguments with a factors tensor: our cache (our kernels, or TVM's LongRoPE
    kernels) and TVM's native cache give the same attention and stored K in the short regime,
    and ours with TVM's kernels matches TVM's native cache everywhere (same kernels)."""
    shape = _shape()
    B = tb.Builtins()
    caches = {"tvm": tb.create_native(shape), "ours_tvmk": tb.create_ours_packed(shape, tvm_kernel_set=True),
              "ours_packed": tb.create_ours_packed(shape)}
    assert caches["ours_packed"].config.rope_ext_factors == FACTORS
    rng = np.random.default_rng(5)

    def step(names, batch):
        ids, lengths = [s for s, _ in batch], [n for _, n in batch]
        qkv = [rng.standard_normal((sum(lengths), HQ + 2 * HKV, D)).astype(np.float32) for _ in range(2)]
        outs = {}
        for name in names:
            B.begin(caches[name], ids, lengths)
            outs[name] = []
            for layer in range(2):
                o = tvm.runtime.tensor(np.full((sum(lengths), HQ, D), np.nan, np.float32))
                B.attention(caches[name], layer, 0.25, tvm.runtime.tensor(qkv[layer]), o)
                outs[name].append(o.numpy())
            B.end(caches[name])
        for name in names[1:]:
            for layer in range(2):
                np.testing.assert_allclose(outs[name][layer], outs["tvm"][layer], atol=2e-3, err_msg=name)

    for name in caches:
        B.add(caches[name], 0)
        B.add(caches[name], 1)
    every = tuple(caches)
    step(every, [(0, 12), (1, 10)])  # short regime in both rules (TVM: 22 step tokens <= 24)
    step(every, [(0, 1), (1, 1)])
    same_kernels = ("tvm", "ours_tvmk")
    step(same_kernels, [(0, 40)])  # TVM's rule: long factors for the whole step
    step(same_kernels, [(0, 1), (1, 3)])


def test_creation_refuses_bad_factor_tensors():
    shape = _shape()
    args = tb.create_args(shape, tb.our_kernels(shape))
    create = tvm.get_global_func(tb.CREATE_OURS)
    for value, error, match in [
            ([1.1] * D, rk.ArgumentError, "must be None, 0 .TVM's null value., a list of ones"),
            # ones in a list carry no factors (as in TVM): these LongRoPE kernels then lack theirs
            ([1.0] * D, rk.ConfigError, "split_rotary kernel fails"),
            (tvm.runtime.tensor(np.ones(D, np.float16)), rk.ConfigError, "1-D float32 tensor"),
            (tvm.runtime.tensor(np.ones((2, D // 2), np.float32)), rk.ConfigError, "1-D float32 tensor"),
            (tvm.runtime.tensor(np.ones(D - 1, np.float32)), rk.ConfigError, "holds 31 factors; expected an even count"),
            (tvm.runtime.tensor(np.ones(D + 2, np.float32)), rk.ConfigError, "at most qk_head_dim=32"),
            # 30 factors: a partial rotary dim of 30, which these kernels (full rotary dim) refuse
            (tvm.runtime.tensor(np.ones(D - 2, np.float32)), rk.ConfigError, "split_rotary kernel fails .*rope_ext"),
            (tvm.runtime.tensor(np.r_[np.ones(D - 1), np.inf].astype(np.float32)), rk.ConfigError,
             r"rope_ext_factors\[31\]")]:
        bad = list(args)
        bad[11] = value
        with pytest.raises(error, match=match):
            create(*bad)
    # plain RoPE kernels with factors: the probe calls split_rotary with them and names them
    plain = tb.Shape(**{**shape.__dict__, "ext_factors": None, "longrope_positions": (0, 0)})
    bad = tb.create_args(plain, tb.our_kernels(plain))
    bad[11] = tvm.runtime.tensor(np.array(FACTORS, np.float32))
    with pytest.raises(rk.ConfigError, match="split_rotary kernel fails .*rope_ext_factors tensor"):
        create(*bad)


def test_kernels_built_for_other_longrope_parameters_are_refused():
    mod = rk.build_kernels(_config(), default_target(tvm.cpu()))
    kernels = rk.KernelSet.from_module(mod)
    for overrides, field in ((dict(rope_original_max_position_embeddings=ORIGINAL + 1), "longrope_original_max_position"),
                             (dict(rope_attention_factor=1.0), "longrope_attention_factor")):
        with pytest.raises(rk.ConfigError, match=f"built for another configuration: {field}"):
            rk.PagedAttentionKVCache(_config(**overrides), tvm.cpu(), kernels=kernels)
    plain = _config(rope_ext_factors=None, rope_original_max_position_embeddings=None, rope_attention_factor=1.0)
    with pytest.raises(rk.ConfigError, match="built for another configuration"):
        rk.PagedAttentionKVCache(plain, tvm.cpu(), kernels=kernels)


# ---------------------------------------------------------------------------- frontend


def test_frontend_model_with_longrope_matches_float64():
    """A Relax program whose layout has LongRoPE factors: the module holds them as a constant,
    the created cache passes them to our LongRoPE split_rotary; attention across ``original``
    matches float64."""
    from support.frontend_program import create, fused_vm
    from relax_kvcache import frontend

    layout = frontend.CacheLayout(num_layers=2, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=8,
                                  rope_mode=rk.RopeMode.NORMAL, rope_theta=THETA, rope_scale=SCALE, dtype="float32",
                                  rope_ext_factors=FACTORS, rope_original_max_position_embeddings=ORIGINAL,
                                  rope_attention_factor=ATTENTION)
    vm = fused_vm(layout, sm_scale=0.25)
    cache = create(vm, 4, 256, 64)
    assert cache.config.rope_ext_factors == FACTORS
    B, model, rng = tb.Builtins(), _model(), np.random.default_rng(6)
    for seq in (0, 1):
        B.add(cache, seq)
        model.add(seq)
    for batch in ([(0, 30), (1, 5)], [(0, 1), (1, 1)], [(1, 25)], [(0, 2), (1, 1)]):
        n = sum(length for _, length in batch)
        qkv = rng.standard_normal((2, 1, n, HQ + 2 * HKV, D)).astype("float32")
        B.begin(cache, [s for s, _ in batch], [length for _, length in batch])
        got = [o.numpy()[0] for o in vm["fused"](tvm.runtime.tensor(qkv), cache)]
        B.end(cache)
        want = model.step(batch, [qkv[layer, 0] for layer in range(2)], 0.25)
        for layer in range(2):
            np.testing.assert_allclose(got[layer], want[layer], atol=2e-3, err_msg=f"batch {batch} layer {layer}")


# ---------------------------------------------------------------------------- partial rotary dims


def test_longrope_with_a_partial_rotary_dim_works():
    """The factors tensor was allocated at head_dim, so a LongRoPE cache with a partial
    rotary dim (factors of the rotary dim, TVM's layout) could not be created; through TVM's
    creation arguments the probe then refused the right kernels (only the rotated features
    carry the attention factor)."""
    from reference_model import longrope

    factors = tuple(float(x) for x in np.r_[np.linspace(1, 9, 4), np.linspace(1, 1.5, 4)])
    cache = tiny_cache(rope_rotary_dim=8, rope_ext_factors=factors, rope_original_max_position_embeddings=3,
                        rope_attention_factor=1.2)
    cache.add_sequence(0)
    rng = np.random.default_rng(5)
    qkv = [rng.standard_normal((6, 8, 16)).astype("float32") for _ in range(2)]
    cache.begin_forward([0], [6])
    for layer in range(2):
        cache.attention_with_fused_qkv(layer, tvm.runtime.tensor(qkv[layer]), tvm.runtime.empty((6, 4, 16)), 0.25)
    cache.end_forward()
    k, v = tvm.runtime.empty((2, 6, 2, 16)), tvm.runtime.empty((2, 6, 2, 16))
    cache.debug_get_kv(0, 0, 6, k, v)
    want = longrope(qkv[1][:, 4:6], np.arange(6), 1e4, 1.0, factors, 3, 1.2)
    np.testing.assert_allclose(k.numpy()[1], want, atol=1e-5)
    import relax_kvcache.ffi_registry.create as create_module  # creation through TVM's arguments

    kernels = cache._kernels
    args = [tvm.runtime.ShapeTuple([4, 64, 32, 4, 0]), tvm.runtime.ShapeTuple([0, 2]), 4, 2, 16, 16,
            tvm.runtime.ShapeTuple([0, 0]), False, 1, 1.0, 1e4, tvm.runtime.tensor(np.array(factors, np.float32)),
            tvm.runtime.empty((), "float32"), kernels.transpose_append, None, ["tirx", kernels.attention_prefill_ragged],
            ["tirx", kernels.attention_prefill], ["tirx", kernels.attention_decode], [], [], [], [], [],
            [kernels.merge_inplace], kernels.split_rotary, kernels.copy_single_page, kernels.debug_get_kv,
            kernels.compact_copy]
    created = create_module.paged_attention_kv_cache_create(*args)
    assert created.config.rotary_dim == 8
