"""The methods of :class:`~relax_kvcache.PagedAttentionKVCache` that read or write stored K/V
outside the forward protocol: debug reads, checkpoints and the scales of 8-bit pages (a base
class of the cache; the components they call are the cache's)."""

from __future__ import annotations

from typing import Any, Tuple

import tvm

from ..errors import KVCacheError
from .attention import MHAAttention
from .mla import MLAAttention


class StoredKVMethods:
    """Debug reads, checkpoints and 8-bit scales of the cache (see the module docstring)."""

    def debug_get_kv(self, seq_id: int, start_pos: int, end_pos: int, k_data: tvm.runtime.Tensor,
                     v_data: tvm.runtime.Tensor) -> None:
        """Copy positions ``[start_pos, end_pos)`` of a sequence's K/V of every layer.

        ``k_data`` / ``v_data``: ``(num_layers, end_pos - start_pos, num_kv_heads, head_dim)``.
        K is stored after RoPE in NORMAL mode and before it otherwise.
        """
        self._component("debug_get_kv", MHAAttention)
        self._debug.read("debug_get_kv", seq_id, start_pos, end_pos, k_data=k_data, v_data=v_data)

    def set_kv_scales(self, layer_id: int, k_scale: Any, v_scale: Any) -> None:
        """Set layer ``layer_id``'s scales of 8-bit pages (``KVCacheConfig.kv_dtype``): a number
        or one per KV head each, positive; an element is stored as ``value / scale`` and read as
        ``stored * scale``. Only while the cache holds no tokens (stored bytes keep their scale)."""
        layer = self._local_layer(layer_id)
        self._require_no_step("set_kv_scales")
        scales = self._kv_scales.checked(layer_id, k_scale, v_scale)
        stored = self._paging.total_sequence_length()
        if stored:
            raise KVCacheError(f"set_kv_scales({layer_id}) while the cache holds {stored} tokens stored with the "
                               "current scales; set scales before the first append")
        self._kv_scales.set(layer, scales)

    def calibrate_kv_scales(self, margin: float = 1.0) -> None:
        """Let the next step set the scales of 8-bit pages from the K / V each layer appends in
        it, before storing them: ``margin * max|x| / format max`` per KV head (see
        :meth:`KVScales.arm <relax_kvcache.cache.kv_scales.KVScales.arm>`). Only while no tokens are stored."""
        self._require_no_step("calibrate_kv_scales")
        self._kv_scales.arm(margin, self._paging.total_sequence_length())

    def get_kv_scales(self, layer_id: int) -> Tuple[Any, Any]:
        """Layer ``layer_id``'s scales of 8-bit pages: ``(k_scale, v_scale)``, float32 copies,
        one per KV head each."""
        return self._kv_scales.get(self._local_layer(layer_id))

    def debug_get_kv_mla(self, seq_id: int, start_pos: int, end_pos: int, kv_data: tvm.runtime.Tensor) -> None:
        """Copy positions ``[start_pos, end_pos)`` of a sequence's latent vectors of every layer
        into ``kv_data (num_layers, end_pos - start_pos, kv_lora_rank + rope dim)`` (MLA caches)."""
        self._component("debug_get_kv_mla", MLAAttention)
        self._debug.read("debug_get_kv_mla", seq_id, start_pos, end_pos, kv_data=kv_data)

    def get_layout_hash(self) -> str:
        """The layout hash of checkpoints of this cache (TVM's 64-bit FNV-1a, 16 hex digits)."""
        return self._checkpoints.layout_hash()

    def get_checkpoint_metadata(self, seq_id: int) -> str:
        """JSON metadata of a checkpoint of sequence ``seq_id`` (TVM's format): the layout, its
        hash, the sequence length, its logical pages and one page group per layer.

        Any sequence without a sliding window or an uncommitted token tree can be saved, also
        one sharing a prefix with others (TVM: sequence 0 only). Not while a step is active.
        """
        return self._checkpoints.metadata(seq_id)

    def export_page_group(self, seq_id: int, group_id: int, out: tvm.runtime.Tensor) -> None:
        """Write layer ``group_id``'s K/V of sequence ``seq_id`` into ``out`` of shape
        ``(1, ceil(length / page_size), 2, num_kv_heads, page_size, head_dim)``: position p at
        page ``p // page_size``, slot ``p % page_size``; the last page's unused slots are zero.
        ``out`` may be on the cache's device or, for a GPU cache, on the host."""
        self._checkpoints.export_group(seq_id, group_id, out)

    def prepare_import(self, seq_id: int, metadata: str) -> None:
        """Start importing a checkpoint (``metadata`` from :meth:`get_checkpoint_metadata`, ours
        or TVM's) into sequence ``seq_id``: new, or empty without a window (TVM: sequence 0).

        The sequence gets its pages now; fill them with :meth:`import_page_group` (each layer
        once), then :meth:`finish_import`. Until then the sequence cannot join a step, fork,
        pop, be saved or report its length; other sequences work as usual. Removing the
        sequence (or ``clear``) abandons the import. One import at a time.
        """
        self._checkpoints.prepare(seq_id, metadata)
        self._sync_host()  # its pages may have evicted cached ones to the host tier

    def import_page_group(self, seq_id: int, group_id: int, group: tvm.runtime.Tensor) -> None:
        """Copy page group ``group_id`` (layer ``group_id``'s K/V, the layout of
        :meth:`export_page_group`; on the cache's device or the host) into the importing
        sequence's pages."""
        self._checkpoints.import_group(seq_id, group_id, group)

    def finish_import(self, seq_id: int) -> None:
        """End the import into ``seq_id`` once every page group is in."""
        self._checkpoints.finish(seq_id)
