"""Pure-Python paging layer of the paged KV cache: pages, the block tree and sequences.

Reproduces the bookkeeping of TVM's C++ paged KV cache (page ids included) without touching
KV data and without importing TVM.
"""

from .block_pool import Block, BlockPool
from .decode_lane import DecodeLane
from .page_pool import PagePool
from .sequences import Sequence
from .state import PagingState
from .tree import PageCopy

__all__ = ["Block", "BlockPool", "DecodeLane", "PageCopy", "PagePool", "PagingState", "Sequence"]
