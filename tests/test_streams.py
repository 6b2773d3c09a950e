"""KV streams: slot allocation, positions and in-place eviction (no engine involved)."""

import random

import pytest

from kvstreams_sglang.streams import EvictionError, OutOfSlotsError, SlotAllocator, StreamTable
from trainer_masks import EvictionEvent


def test_allocator_hands_out_each_slot_once_and_takes_it_back():
    a = SlotAllocator(8)
    got = a.alloc(5)
    assert len(set(got)) == 5 and a.num_used == 5 and a.num_free == 3
    with pytest.raises(OutOfSlotsError):
        a.alloc(4)
    a.free(got[:2])
    with pytest.raises(ValueError, match="not allocated"):
        a.free(got[:1])  # double free
    assert a.num_used + a.num_free == 8


def computed_stream(table, n_prompt):
    st = table.open(list(range(n_prompt)))
    st.commit(table.allocator.alloc(st.ledger.num_pending))
    return st


def test_eviction_keeps_original_positions_and_new_tokens_continue():
    table = StreamTable(64, 4)
    st = computed_stream(table, 10)
    assert table.evict(st.sid, [(2, 5), (7, 8)]) == 4
    assert st.positions == [0, 1, 5, 6, 8, 9]
    st.ledger.append([100, 101], "env")
    st.commit(table.allocator.alloc(2))
    assert st.positions == [0, 1, 5, 6, 8, 9, 10, 11]  # counting continues from the stream end
    assert st.ledger.evictions == [EvictionEvent(at_index=10, spans=((2, 5), (7, 8)))]
    assert sum(run[2] for run in st.position_runs()) == st.ledger.num_live


@pytest.mark.parametrize(
    "spans,match",
    [
        ([(3, 12)], "outside the stream"),
        ([(4, 4)], "empty or reversed"),
        ([(1, 4), (3, 6)], "overlap"),
        ([(2, 3)], "already evicted"),
        ([(9, 11)], "pending"),
        (["ab"], "pairs"),
        ([(1.7, 2.2)], "pairs"),
        ([(True, 2)], "pairs"),
    ],
)
def test_invalid_evict_raises_and_changes_nothing(spans, match):
    table = StreamTable(64, 4)
    st = computed_stream(table, 10)
    table.evict(st.sid, [(2, 3)])
    st.ledger.add_sampled(7, 0.0, 0)  # a sampled token whose KV is not computed yet
    before = (list(st.slots), list(st.positions), list(st.ledger.evictions), table.allocator.num_free)
    with pytest.raises(EvictionError, match=match):
        table.evict(st.sid, spans)
    assert (st.slots, st.positions, st.ledger.evictions, table.allocator.num_free) == before


def test_random_open_append_generate_evict_close_never_leaks_or_double_frees():
    rng = random.Random(0)
    capacity = 512
    table = StreamTable(capacity, 16)
    ops = 0
    for _ in range(4000):
        op = rng.random()
        sids = list(table.streams)
        try:
            if op < 0.15 or not sids:
                if len(table.streams) < 16:
                    st = table.open([1] * rng.randint(1, 20))
                    st.commit(table.allocator.alloc(st.ledger.num_pending))
            elif op < 0.45:  # append observation, then prefill it
                st = table.streams[rng.choice(sids)]
                st.ledger.append([2] * rng.randint(1, 12), "env")
                st.commit(table.allocator.alloc(st.ledger.num_pending))
            elif op < 0.7:  # generate: sample, then compute the sampled token
                st = table.streams[rng.choice(sids)]
                for _ in range(rng.randint(1, 8)):
                    st.ledger.add_sampled(3, -1.0, 0)
                    st.commit(table.allocator.alloc(1))
            elif op < 0.92:  # evict a random live range (maybe invalid)
                st = table.streams[rng.choice(sids)]
                if st.positions:
                    a = rng.choice(st.positions)
                    b = a + rng.randint(1, 10)
                    before = table.allocator.num_free
                    try:
                        table.evict(st.sid, [(a, b)])
                    except EvictionError:
                        assert table.allocator.num_free == before
            else:
                table.close(rng.choice(sids))
        except OutOfSlotsError:
            table.close(rng.choice(sids))
        table.check()
        assert table.allocator.num_free + table.allocator.num_used == capacity
        ops += 1
    for sid in list(table.streams):
        table.close(sid)
    assert table.allocator.num_free == capacity and ops == 4000


def test_every_kv4_layer_cache_starts_16_byte_aligned():
    """The layers' INT8 side caches are views of one tensor per field; with 4 KV heads and an odd side-slot count
    (9 rows of SGLang's req-to-token pool x 21 slots at sink 4 + recent 16) layer 1's scales sat 8 bytes off, and the
    CUDA decode (16-byte aligned caches only) left every odd layer to the Triton kernel (H200, 2026-12-04)."""
    from kvstreams_sglang.kernels.decode import _cache_pointers, _contiguous
    from kvstreams_sglang.kv4 import side_width
    from kvstreams_sglang.streams.pool import kv4_layers

    slots = 9 * side_width(4, 16)
    assert slots % 8
    layers, side = kv4_layers(3, 64, slots, 4, 128)
    for cache in layers:
        assert all(p % 16 == 0 for p in _cache_pointers(cache)) and _contiguous(cache)
        assert cache.k_side.shape == (slots, 4, 128) and cache.v_side_scale.shape == (slots, 4)
    side["k_side_scale"][1, 5, 2] = 7.0  # the views are the shared tensors
    assert layers[1].k_side_scale[5, 2] == 7.0
