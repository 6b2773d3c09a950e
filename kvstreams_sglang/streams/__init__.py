"""KV streams: slots, positions and in-place eviction, independent of any engine.

``SlotAllocator`` (page-size-1 slots) -> ``KVStream`` (a ``StreamLedger`` plus the kept
tokens' slots; ``evict``) -> ``StreamTable`` (open streams) -> pools
(``FullPrecisionPool``, ``KV4Pool``) that store the bytes. The built-in engine and the
SGLang integration both use these.
"""

from trainer_masks import EvictionError

from .allocator import OutOfSlotsError, SlotAllocator
from .pool import FullPrecisionPool, KV4Pool
from .slot_table import ContextLengthError, SlotTable
from .stream import KVStream, StreamTable

__all__ = ["ContextLengthError", "EvictionError", "FullPrecisionPool", "KV4Pool", "KVStream", "OutOfSlotsError",
           "SlotAllocator", "SlotTable", "StreamTable"]
