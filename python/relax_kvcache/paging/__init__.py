"""Pure-Python paging layer (pages, the block tree, sequences): TVM's bookkeeping, no TVM."""

from .block_pool import Block, BlockPool
from .decode_lane import DecodeLane
from .page_pool import PagePool
from .sequences import Sequence
from .state import PagingState
from .tree import PageCopy

__all__ = ["Block", "BlockPool", "DecodeLane", "PageCopy", "PagePool", "PagingState", "Sequence"]
