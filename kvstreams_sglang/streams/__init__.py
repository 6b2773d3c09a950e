"""KV streams: slots, positions and in-place eviction, independent of any engine.

``SlotAllocator`` (page-size-1 slots) -> ``KVStream`` (a sequence's kept slots and their
original positions; ``evict``) -> ``StreamTable`` (open streams) -> pools
(``FullPrecisionPool``, ``KV4Pool``) that store the bytes. The built-in engine and the
SGLang integration both use these.
"""

from .allocator import OutOfSlotsError, SlotAllocator
from .pool import FullPrecisionPool, KV4Pool
from .slot_table import SlotTable
from .stream import EvictionError, KVStream, StreamTable, validate_spans

__all__ = ["EvictionError", "FullPrecisionPool", "KV4Pool", "KVStream", "OutOfSlotsError", "SlotAllocator",
           "SlotTable", "StreamTable", "validate_spans"]
