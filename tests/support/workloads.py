"""Random sequences of cache operations, each run on a fresh cache through a
:class:`.harness.Check` (every output against the float64 reference; run by
``tests/test_workloads.py``). :data:`WORKLOADS` names them (``gpu_prepare.CHECK_CONFIGS`` lists
those run per configuration)."""

from __future__ import annotations

from typing import Callable, Dict, List

import ml_dtypes
import numpy as np
import tvm

from relax_kvcache.reference import attention, merge_states
from .harness import GRID_SCALES, Check


def wl_random(c: Check, steps: int = 40, max_length: int = 60) -> None:
    """Random add / fork (any position) / popn / remove and steps mixing decode and prefill chunks
    of up to ``max_length`` tokens per sequence (``c``: a :class:`Check`, or a
    :class:`.harness.Harness`, which asserts instead of recording)."""
    rng, cfg = c.rng, c.cfg
    live: List[int] = []
    next_id = 0
    for _ in range(steps):
        op = rng.choice(["step", "step", "step", "add", "fork", "popn", "remove"])
        if op == "add" or not live:
            c.add(next_id)
            live.append(next_id)
            next_id += 1
            op = "step"
        if op == "fork":
            parent = int(rng.choice(live))
            length = c.ref.length(parent)
            pos = int(rng.choice([-1, 0, length, rng.integers(0, length + 1),
                                  (length // cfg.page_size) * cfg.page_size]))
            c.fork(parent, next_id, pos)
            live.append(next_id)
            next_id += 1
            c.check_contents()
        elif op == "popn":
            seq = int(rng.choice(live))
            c.popn(seq, int(rng.integers(0, c.ref.length(seq) + 1)))
            c.check_contents()
        elif op == "remove" and len(live) > 1:
            seq = int(rng.choice(live))
            c.remove(seq)
            live.remove(seq)
            c.check_contents()
        elif op == "step":
            members = rng.choice(live, size=min(len(live), int(rng.integers(1, 6))), replace=False)
            budget, batch = cfg.prefill_chunk_size, []
            for i, seq in enumerate(members):
                length = 1 if rng.random() < 0.5 else int(rng.integers(2, max_length))
                length = min(length, budget - (len(members) - i - 1))
                if length < 1:
                    break
                budget -= length
                batch.append((int(seq), length))
            if c.cache.get_num_available_pages() < 8 * len(batch) + 8:
                for seq in live[:-1]:
                    c.remove(seq)
                live[:-1] = []
                continue
            c.step(batch)
    c.check_contents()
    for seq in list(live):
        c.remove(seq)
    c.expect_equal("cache empty after removing everything", c.cache.empty(), True)


def wl_prefix_chain(c: Check) -> None:
    """Prefixes forked six levels deep (multi-depth attention), then decode and mixed batches."""
    c.add(0)
    c.step([(0, 30)])
    for child in range(1, 7):  # 0 <- 1 <- ... <- 6, each forked mid-page at the parent's end
        c.fork(child - 1, child, -1)
        c.step([(child, 5 + 3 * child)])
    c.check_contents()
    for _ in range(3):
        c.step([(s, 1) for s in range(7)])
    c.step([(6, 20), (3, 1), (0, 7)])
    c.fork(4, 7, 37)  # inside a shared prefix
    c.step([(7, 1), (4, 1), (2, 9)])
    c.check_contents()


#: The tree shapes of :func:`random_tree`.
TREE_SHAPES = ("chain", "star", "binary", "deep", "wide", "forest", "random")


def random_tree(r: np.random.Generator, size: int, shape: str) -> List[int]:
    """Parent pointers of a token tree of ``size`` nodes in one of :data:`TREE_SHAPES` (node 0 a
    root, parents before children; a forest has up to 4 roots)."""
    if size == 1:
        return [-1]
    if shape == "chain":
        return [i - 1 for i in range(size)]
    if shape == "star":
        return [-1] + [0] * (size - 1)
    if shape == "binary":
        return [(i - 1) // 2 for i in range(size)]
    if shape == "deep":  # a long spine with short side branches
        return [-1] + [i - 1 if r.random() < 0.8 else max(0, i - 1 - int(r.integers(1, 4)))
                       for i in range(1, size)]
    if shape == "wide":  # a few hubs under the root, each with many children
        hubs = max(1, min(3, size // 4))
        return [-1] + [0 if i <= hubs else int(r.integers(0, hubs + 1)) for i in range(1, size)]
    if shape == "forest":  # up to 4 roots, random subtrees
        roots = {0} | {int(x) for x in r.choice(np.arange(1, size), size=min(3, size - 1), replace=False)}
        return [-1 if i in roots else int(r.integers(0, i)) for i in range(size)]
    assert shape == "random", shape
    return [-1] + [int(r.integers(0, i)) for i in range(1, size)]


def wl_token_tree(c: Check) -> None:
    """Token trees: random trees per sequence, commit of a random leaf, decode after; then a tree
    grown over several steps (earlier nodes in the pages) and committed."""
    rng = c.rng
    for seq in range(4):
        c.add(seq)
    c.step([(0, 10), (1, 21), (2, 8), (3, 40)])
    c.fork(1, 4, 13)  # a shared prefix: two block depths
    c.step([(4, 3)])
    for round_ in range(3):
        sizes = {seq: int(rng.integers(1, 20)) for seq in range(5)}
        trees = {seq: random_tree(rng, sizes[seq], TREE_SHAPES[(seq + round_) % len(TREE_SHAPES)])
                 for seq in range(5)}
        c.step([(seq, sizes[seq]) for seq in range(5)], trees=trees)
        c.commit({seq: int(rng.integers(-1, sizes[seq])) for seq in range(5)})
        c.check_contents()
        c.step([(seq, 1) for seq in range(5)])
    full = [(k - 1) // 2 for k in range(15)]  # binary tree of 4 levels appended level by level
    for level in range(4):
        lo, hi = 2 ** level - 1, 2 ** (level + 1) - 1
        c.step([(seq, hi - lo) for seq in range(3)], trees={seq: full[lo:hi] for seq in range(3)})
    c.commit({0: 3, 1: 5, 2: -1})
    c.check_contents()
    c.step([(0, 1), (1, 1), (2, 1)])
    c.check_contents()


def wl_self_cross_merge(c: Check) -> None:
    """cross_attention (cached KV) + self_attention (new tokens) merged == attention over both;
    a sequence with nothing cached gets o = 0, lse = -inf from cross_attention."""
    cfg = c.cfg
    for seq in range(3):
        c.add(seq)
    c.step([(0, 21), (1, 40)])
    batch = [(0, 3), (1, 1), (2, 5)]
    n = sum(length for _, length in batch)
    hq, hkv, d = cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim
    (q, q_np), (k, k_np), (v, v_np) = c.random((n, hq, d)), c.random((n, hkv, d)), c.random((n, hkv, d))
    o_self, o_cross = c.poisoned((n, hq, d)), c.poisoned((n, hq, d))
    lse_self, lse_cross = c.poisoned((n, hq), "float32"), c.poisoned((n, hq), "float32")
    c.cache.begin_forward([s for s, _ in batch], [length for _, length in batch])
    starts = [c.ref.length(seq) for seq, _ in batch]
    positions = np.concatenate([np.arange(s, s + length) for s, (_, length) in zip(starts, batch)])
    c.expect_equal("get_query_positions", c.cache.get_query_positions().numpy(), positions)
    for layer in range(cfg.num_layers):
        c.cache.self_attention(layer, q, k, v, o_self, lse_self, c.sm_scale)
        c.cache.cross_attention(layer, q, o_cross, lse_cross, c.sm_scale)
        exp_self = np.zeros((n, hq, d))
        exp_self_lse = np.zeros((n, hq))
        exp_cross, exp_cross_lse = np.zeros((n, hq, d)), np.zeros((n, hq))
        offset = 0
        for (seq, length), start in zip(batch, starts):
            r = slice(offset, offset + length)
            q_pos = np.arange(start, start + length)
            qs = c.as_attended(q_np[r], q_pos)
            k_cached, v_cached = (x[layer] for x in c.ref.stored_kv(seq))
            k_cached = c.as_attended(k_cached, c.ref.pos[seq])
            exp_cross[r], exp_cross_lse[r] = attention(qs, k_cached, v_cached, c.sm_scale, causal=False)
            exp_self[r], exp_self_lse[r] = attention(qs, c.as_attended(k_np[r], q_pos), v_np[r], c.sm_scale,
                                                     causal=True)
            offset += length
        c.compare(f"self_attention o layer {layer}", o_self, exp_self)
        c.compare(f"self_attention lse layer {layer}", lse_self, exp_self_lse, lse=True)
        c.compare(f"cross_attention o layer {layer}", o_cross, exp_cross)
        c.compare(f"cross_attention lse layer {layer}", lse_cross, exp_cross_lse, lse=True)
        merged_o, merged_lse = c.cache.merge_attn_output_inplace(o_self, lse_self, o_cross, lse_cross)
        exp_o, exp_lse = merge_states(exp_self, exp_self_lse, exp_cross, exp_cross_lse)
        c.compare(f"merge_attn_output_inplace o layer {layer}", merged_o, exp_o)
        c.compare(f"merge_attn_output_inplace lse layer {layer}", merged_lse, exp_lse, lse=True)
        for x in (o_self, o_cross):  # poison again for the next layer
            x.copyfrom(np.full(x.shape, np.nan, c.np_dtype))
        for x in (lse_self, lse_cross):
            x.copyfrom(np.full(x.shape, np.nan, np.float32))
    c.cache.end_forward()
    c.steps += 1
    for seq, length in batch:  # the step reserved its tokens, but self/cross attention store no K/V
        c.cache.popn(seq, length)
    c.check_contents()


def wl_seq_windows(c: Check) -> None:
    """Per-sequence sliding windows with attention sinks beside a plain sequence: appends longer
    than the window, long decode, a fork inside the sink (``c``: a :class:`Check` or a
    :class:`.harness.Harness`)."""
    specs = {0: (20, 6), 1: (25, 0), 2: (33, 17)}  # seq -> (window, sink)
    for seq, (window, sink) in specs.items():
        c.add(seq)
        c.enable_window(seq, window, sink)
    c.add(3)
    c.step([(0, 4), (1, 6), (2, 30), (3, 5)])
    c.step([(0, 20), (1, 19), (2, 9), (3, 3)])
    c.step([(0, 40), (1, 3), (2, 2), (3, 1)])  # 40 > window: slides within one step
    c.check_contents()
    for _ in range(20):
        c.step([(0, 1), (1, 1), (2, 1), (3, 1)])
    c.check_contents()
    c.fork(2, 4, 12)  # within sequence 2's sink of 17
    c.step([(4, 5), (2, 2)])
    c.popn(3, 4)
    c.step([(3, 17), (4, 1), (0, 1)])
    c.check_contents()


def wl_layer_windows(c: Check) -> None:
    """MHA_SLIDING or MHA_CHUNKED_LOCAL layers: steps longer than the window (or across attention
    chunks), decode, forks (mid-page and page-aligned), popn."""
    c.add(0)
    c.add(1)
    c.step([(0, 90), (1, 7)])  # 90 > window 40: the window applies inside the chunk
    c.step([(0, 1), (1, 1)])
    c.fork(0, 2, 73)
    c.fork(2, 3, -1)
    c.check_contents()
    c.step([(2, 60), (3, 4), (1, 50)])
    for _ in range(4):
        c.step([(0, 1), (2, 1), (3, 1)])
    c.fork(1, 4, 16)
    c.step([(4, 3), (1, 45), (0, 2)])
    c.popn(0, 5)
    c.step([(0, 1), (4, 1)])
    c.check_contents()


def wl_shared_kv(c: Check) -> None:
    """attention_with_shared_kv over every layer's KV (MHA and MHA_SLIDING sources) after that
    layer's attention in the same step, in prefill, mixed and decode steps."""
    cfg = c.cfg
    hq, d = cfg.num_qo_heads, cfg.head_dim
    for seq in range(2):
        c.add(seq)
    for batch in ([(0, 50), (1, 9)], [(0, 3), (1, 1)], [(0, 1), (1, 1)], [(0, 60), (1, 1)], [(0, 1), (1, 1)]):
        n = sum(length for _, length in batch)
        starts = [c.ref.length(seq) for seq, _ in batch]
        queries = [c.random((n, hq, d)) for _ in range(cfg.num_layers)]
        outs = [c.poisoned((n, hq, d)) for _ in range(cfg.num_layers)]

        def shared_calls():
            for layer in range(cfg.num_layers):
                k_new, v_new = c.new_kv(layer, batch, starts)
                c.cache.attention_with_shared_kv(layer, queries[layer][0], c.upload(k_new), c.upload(v_new),
                                                 outs[layer], c.sm_scale)

        c.step(batch, during=shared_calls)
        for layer in range(cfg.num_layers):
            expected = np.zeros((n, hq, d))
            offset = 0
            for (seq, length), start in zip(batch, starts):
                r = slice(offset, offset + length)
                q_pos = np.arange(start, start + length)
                k_all, v_all = (x[layer, :start + length] for x in c.ref.stored_kv(seq))
                k_pos = c.ref.pos[seq][:start + length]
                mask = None
                if c.layer_windows[layer]:
                    mask = k_pos[None, :] > q_pos[:, None] - c.layer_windows[layer]
                elif c.layer_chunks[layer]:
                    mask = k_pos[None, :] // c.layer_chunks[layer] == q_pos[:, None] // c.layer_chunks[layer]
                expected[r], _ = attention(c.as_attended(queries[layer][1][r], q_pos), c.as_attended(k_all, k_pos),
                                           v_all, c.sm_scale, causal=True, mask=mask)
                offset += length
            c.compare(f"attention_with_shared_kv source layer {layer} step {c.steps}", outs[layer], expected)
    c.check_contents()


def wl_long_context(c: Check) -> None:
    """12 sequences of 300..1400 tokens (prefilled in chunks of whole sequences), then decode
    steps of every sequence and of subsets: long KV walks (many chunks per block), decode
    batches without KV splits. (The float64 reference makes this the slowest workload.)"""
    rng = c.rng
    lengths = [int(x) for x in rng.integers(300, 1400, size=12)]
    for seq in range(len(lengths)):
        c.add(seq)
    batch, used = [], 0
    for seq, length in enumerate(lengths):
        if used + length > c.cfg.prefill_chunk_size:
            c.step(batch)
            batch, used = [], 0
        batch.append((seq, length))
        used += length
    c.step(batch)
    c.step([(seq, 1) for seq in range(len(lengths))])
    c.step([(seq, 1) for seq in range(0, len(lengths), 5)])
    c.check_contents()


def wl_checkpoint(c: Check) -> None:
    """Checkpoints: sequences (one forked inside a page) saved as page groups (checked against
    the reference: positions in page-size runs, the last page's tail zero; on the device, then
    on the host) and imported into new ids while another sequence steps; then the copies decode
    alongside the originals. Over 8-bit pages the groups hold the stored elements (``value /
    scale``), compared as such."""
    cfg = c.cfg
    ps, hkv, d = cfg.page_size, cfg.num_kv_heads, cfg.head_dim
    group_dtype = cfg.kv_dtype or cfg.dtype
    np_group = getattr(ml_dtypes, cfg.kv_dtype) if cfg.kv_dtype else c.np_dtype
    scales = np.array(GRID_SCALES if cfg.kv_dtype else (1.0, 1.0)).reshape(1, 1, 2, 1, 1, 1)  # K, V
    c.add(0)
    c.step([(0, 70)])
    c.fork(0, 1, 37)
    c.step([(1, 20), (0, 3)])
    for src, dst in ((1, 5), (0, 6)):
        length = c.ref.length(src)
        pages = -(-length // ps)
        meta = c.cache.get_checkpoint_metadata(src)
        shape = (1, pages, 2, hkv, ps, d)
        nan = np.full(shape, np.nan, np.float32).astype(np_group)
        groups = [tvm.runtime.tensor(nan, c.device) if src == 1 else  # the second checkpoint in host memory
                  tvm.runtime.tensor(nan) for _ in range(cfg.num_layers)]
        assert str(groups[0].dtype) == group_dtype
        k_ref, v_ref = c.ref.stored_kv(src)
        for layer, group in enumerate(groups):
            c.cache.export_page_group(src, layer, group)
            expected = np.zeros((pages * ps, 2, hkv, d))
            expected[:length, 0], expected[:length, 1] = k_ref[layer], v_ref[layer]
            expected = expected.reshape(pages, ps, 2, hkv, d).transpose(0, 2, 3, 1, 4)[None]
            if cfg.kv_dtype:  # the stored elements: exact
                stored = group.numpy().astype(np.float64) * scales
                c.expect_equal(f"page group {layer} of sequence {src} (8-bit elements)", stored.tobytes(),
                               expected.tobytes())
            else:
                c.compare(f"page group {layer} of sequence {src}", group, expected)
        c.cache.prepare_import(dst, meta)
        c.step([(0, 1)] if src != 0 else [(1, 1)])  # other sequences step during the import
        for layer in reversed(range(cfg.num_layers)):
            c.cache.import_page_group(dst, layer, groups[layer])
        c.cache.finish_import(dst)
        c.ref.fork(src, dst, length)  # the copy holds the tokens saved
    c.check_contents()
    c.step([(5, 1), (6, 1), (0, 1)])
    c.step([(5, 9), (1, 2)])
    c.check_contents()


def _graph_buffers(c: Check, n: int):
    """Fixed per-layer qkv and output tensors of ``n`` rows (what a captured graph reads and writes)."""
    cfg = c.cfg
    hq, hkv, d = cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim
    return ([tvm.runtime.empty((n, hq + 2 * hkv, d), cfg.dtype, c.device) for _ in range(cfg.num_layers)],
            [tvm.runtime.empty((n, hq, d), cfg.dtype, c.device) for _ in range(cfg.num_layers)])


def _graph_step(c: Check, graphs, batch, buffers, label: str) -> str:
    """One decode step of ``batch`` ``[(seq, 1)]`` through ``graphs.run``: fresh random q / k / v
    copied into ``buffers`` (`_graph_buffers`), outputs poisoned with NaN, every layer's output
    against float64; how the step ran."""
    cfg, (qkvs, outs), n = c.cfg, buffers, len(batch)

    def forward() -> None:
        for layer in range(cfg.num_layers):
            c.cache.attention_with_fused_qkv(layer, qkvs[layer], outs[layer], c.sm_scale)

    host = [c.qkv_values(n).astype(c.np_dtype) for _ in range(cfg.num_layers)]
    for layer in range(cfg.num_layers):
        qkvs[layer].copyfrom(host[layer])
        outs[layer].copyfrom(np.full((n, cfg.num_qo_heads, cfg.head_dim), np.nan, c.np_dtype))
    # ShapeTuples, as vm.builtin passes them: repeated batches take the in-place decode path
    c.cache.begin_forward(tvm.runtime.ShapeTuple([s for s, _ in batch]), tvm.runtime.ShapeTuple([k for _, k in batch]))
    how = graphs.run(forward)
    c.cache.end_forward()
    graphs.synchronize()
    expected = c.ref.step(batch, [h.astype(np.float64) for h in host], c.sm_scale)
    c.steps += 1
    for layer in range(cfg.num_layers):
        c.compare(f"graph step {c.steps}{label} ({how}) layer {layer}", outs[layer], expected[layer])
    return how


def wl_graph_decode(c: Check, steps: int = 60) -> None:
    """Repeated decode steps of one batch replayed as a CUDA graph (`cuda_graph.DecodeGraphs`):
    fixed q / k / v and output buffers, fresh random values copied in before each step, every
    step's outputs checked against float64. The steps cross pages and, with local layers, window
    and chunk edges (the window pages change inside the fixed slots). CUDA only (a no-op on CPU)."""
    from relax_kvcache.cuda_graph import DecodeGraphs

    if c.device.dlpack_device_type() != tvm.cuda().dlpack_device_type():
        return
    for seq in range(3):
        c.add(seq)
    c.step([(0, 37), (1, 70), (2, 5)])
    batch, buffers = [(0, 1), (1, 1), (2, 1)], _graph_buffers(c, 3)
    graphs, runs = DecodeGraphs(c.cache), {}
    with graphs.stream_context():
        for _ in range(steps):
            how = _graph_step(c, graphs, batch, buffers, "")
            runs[how] = runs.get(how, 0) + 1
    graphs.close()
    if runs.get("replayed", 0) < steps // 2:
        c.problems.append(f"graph_decode: too few replays {runs}")
    c.check_contents()


def wl_graph_batches(c: Check, rounds: int = 6) -> None:
    """Decode steps of changing batches through ``DecodeGraphs(any_batch=True)``: batches of
    three sequences taken in turn from four (and of two, between them), so that a graph
    captured on one batch replays for the others of its size; q / k / v and outputs in one
    fixed set of tensors per batch size, every step's outputs against float64. Sequences
    also take new pages on the way. CUDA only (a no-op on CPU)."""
    from relax_kvcache.cuda_graph import DecodeGraphs

    if c.device.dlpack_device_type() != tvm.cuda().dlpack_device_type():
        return
    for seq in range(4):
        c.add(seq)
    c.step([(0, 37), (1, 70), (2, 5), (3, 16)])
    batches = [(0, 1, 2), (1, 2, 3), (0, 1), (2, 3, 0), (3, 0, 1), (2, 3)]
    buffers = {n: _graph_buffers(c, n) for n in (2, 3)}
    graphs, runs, seen = DecodeGraphs(c.cache, any_batch=True), {}, {}
    with graphs.stream_context():
        for step in range(rounds * len(batches)):
            seqs = batches[step % len(batches)]
            how = _graph_step(c, graphs, [(s, 1) for s in seqs], buffers[len(seqs)], f" {seqs}")
            runs[how] = runs.get(how, 0) + 1
            if how == "replayed":  # a replay for another batch than the one captured
                seen.setdefault(len(seqs), set()).add(seqs)
    graphs.close()
    if runs.get("captured", 0) != 2 or len(seen.get(3, ())) < 3 or len(seen.get(2, ())) < 2:
        c.problems.append(f"graph_batches: expected one graph per batch size replayed for each batch, got {runs}, "
                          f"replayed batches {seen}")
    c.check_contents()


def wl_prefix_cache(c: Check) -> None:
    """Prefix caching (a config with ``prefix_caching`` and a host tier): hits on a live and on
    a released sequence's pages, decode filling pages, a fork and a pop into a shared cached
    page (copy-on-write); then the cache filled until those pages go to the host tier, and a
    prompt that brings them back. Every output against the reference."""
    ps, rng = c.cfg.page_size, c.rng

    def ids(n: int) -> List[int]:
        return rng.integers(0, 32000, n).tolist()

    system, source = ids(5 * ps + 3), 100  # the reference keeps the system prompt's K/V as "sequence" 100
    c.add(0)
    c.step([(0, len(system))], token_ids=system)
    c.ref.fork(0, source, -1)
    c.ghosts.add(source)
    first = system[:3 * ps] + ids(7)
    c.add_cached(1, first, source, 3 * ps)  # three whole pages, live in sequence 0
    c.step([(1, 7)], token_ids=first[3 * ps:])
    for _ in range(ps):  # decode: sequence 1's fourth page fills and registers
        c.step([(0, 1), (1, 1)], token_ids=ids(2))
    c.fork(1, 2, 3 * ps + 5)
    c.popn(0, c.ref.length(0) - (3 * ps - 4))  # into the third page, shared with 1 and 2: copied first
    c.step([(0, 5), (2, 3)], token_ids=ids(8))
    c.check_contents()
    for seq in (0, 1, 2):
        c.release(seq)
    c.add_cached(3, system[:4 * ps + 1], source, 4 * ps)  # all released: their pages stay cached
    c.step([(3, 1)], token_ids=system[4 * ps:4 * ps + 1])
    c.release(3)
    c.add(4)  # fill the cache without ids: every cached page is evicted to the host tier
    while c.cache.get_num_available_pages():
        c.step([(4, min(c.cfg.prefill_chunk_size, c.cache.get_num_available_pages() * ps))])
    c.remove(4)
    stats = c.cache.prefix_cache_stats()
    if stats["spilled_pages"] < 4 or stats["evictable_pages"]:
        c.problems.append(f"prefix_cache: cached pages did not all go to the host tier: {stats}")
    c.add_cached(5, system[:4 * ps] + ids(3), source, 4 * ps)  # back from the host
    c.step([(5, 3)], token_ids=ids(3))
    c.step([(5, 1)], token_ids=ids(1))
    c.check_contents()
    stats = c.cache.prefix_cache_stats()
    if stats["loaded_pages"] < 4:
        c.problems.append(f"prefix_cache: the hit did not load from the host tier: {stats}")


WORKLOADS: Dict[str, Callable[[Check], None]] = {
    "prefix_cache": wl_prefix_cache,
    "graph_decode": wl_graph_decode,
    "graph_batches": wl_graph_batches,
    "long_context": wl_long_context,
    "checkpoint": wl_checkpoint,
    "random": wl_random,
    "prefix_chain": wl_prefix_chain,
    "token_tree": wl_token_tree,
    "self_cross_merge": wl_self_cross_merge,
    "seq_windows": wl_seq_windows,
    "layer_windows": wl_layer_windows,
    "shared_kv": wl_shared_kv,
}
