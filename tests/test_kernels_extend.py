"""The extend kernel equals the torch reference: quantised prefix + causal new tokens."""

import pytest
import torch
from kv4_cases import filled_cache, rel_l2
from triton_keys import record_launch_keys

from kvstreams_sglang.kernels import kv4_extend
from kvstreams_sglang.kernels.extend import ExtendTile
from kvstreams_sglang.kv4.reference import extend_reference


@pytest.mark.parametrize(
    "prefix,new,hq,hkv",
    [
        ([0], [5], 4, 2),  # prefill from empty: only the causal full-precision part
        ([200, 30], [9, 20], 8, 2),  # two requests with quantised prefixes, GQA 4
        ([150], [1], 6, 3),  # one new token behaves like decode
    ],
)
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("words", [True, False], ids=["words", "bytes"])  # the two INT4 unpacks (ExtendTile.words)
def test_extend_kernel_matches_reference(prefix, new, hq, hkv, splits, words, device):
    cache, meta, _ = filled_cache(prefix, hkv=hkv, seed=sum(new), device=device)
    n = sum(new)
    qo_indptr = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32, device=device)
    q, k_new, v_new = (torch.randn(n, h, 128, device=device) for h in (hq, hkv, hkv))
    tile = ExtendTile(block_r=16, block_n=32, words=words)
    out = kv4_extend(q, k_new, v_new, qo_indptr, cache, **meta, tile=tile, splits=splits)
    ref = extend_reference(q, k_new, v_new, qo_indptr, cache, **meta)
    assert rel_l2(out, ref) <= 1e-3


def test_the_swept_tiles_match_the_reference(device):
    """Every launch shape ``bench.decode_attention --extend-sweep`` times (``EXTEND_TILES``, 256-row tiles included)
    computes the reference's attention, so a sweep's fastest tile can become the default."""
    from bench.decode_attention import EXTEND_TILES

    prefix, new, hq, hkv = [200, 30], [70, 9], 8, 2  # request 0 spans two 32-token blocks of a 128-row tile
    cache, meta, _ = filled_cache(prefix, hkv=hkv, seed=11, device=device)
    qo_indptr = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32, device=device)
    # bf16 on the GPU, as the server runs (fp32 operands of the big tiles need more shared memory than an H100 has)
    dtype, tol = (torch.bfloat16, 1e-2) if torch.device(device).type == "cuda" else (torch.float32, 1e-3)
    q, k_new, v_new = (torch.randn(sum(new), h, 128, device=device).to(dtype) for h in (hq, hkv, hkv))
    ref = extend_reference(q.double(), k_new.double(), v_new.double(), qo_indptr, cache, **meta)
    for tile in sorted({t for t in EXTEND_TILES if t.block_r >= 128}):
        out = kv4_extend(q, k_new, v_new, qo_indptr, cache, **meta, tile=tile)
        assert rel_l2(out.float(), ref.float()) <= tol, tile


def test_extend_splits_fill_the_gpu_within_the_scratch_cap():
    from kvstreams_sglang.kernels.extend import extend_splits

    cpu = torch.device("cpu")  # 4 "SMs" on CPU: 8 programs wanted
    assert extend_splits(1, 10, 4, 128, cpu) == 8
    assert extend_splits(100, 10, 4, 128, cpu) == 1  # a full grid is not split
    assert extend_splits(3, 10, 4, 128, cpu) == 3  # short of a program per SM: two per SM
    assert extend_splits(4, 10, 4, 128, cpu) == 1  # a program per SM already
    assert extend_splits(1, 1 << 16, 32, 128, cpu) == 1  # a long prefill would need > 64 MiB of partials


def test_extend_rejects_mismatched_new_kv():
    cache, meta, _ = filled_cache([4], hkv=2)
    with pytest.raises(ValueError, match="do not fit"):
        kv4_extend(torch.randn(3, 4, 128), torch.randn(2, 2, 128), torch.randn(2, 2, 128),
                   torch.tensor([0, 3]), cache, **meta)


def test_dequantised_prefix_holds_the_keys_the_two_regions_read(device):
    """The extend bench's dequantise-then-BF16-prefill design (``bench.decode_attention.dequantized_prefix``):
    full-precision attention over each request's dequantised prefix (INT8 positions from the side cache, the rest
    from INT4) and its new tokens equals the two-region reference up to the reference's INT8 query rounding."""
    from bench.decode_attention import dequantized_prefix
    from kvstreams_sglang.kv4.hadamard import hadamard
    from kvstreams_sglang.kv4.reference import full_precision_attention

    prefix, new, hq, hkv, d = [200, 30], [9, 20], 8, 2, 128
    cache, meta, _ = filled_cache(prefix, hkv=hkv, seed=5, device=device)
    qo = [0, *torch.tensor(new).cumsum(0).tolist()]
    q, k_new, v_new = (torch.randn(sum(new), h, d, device=device) for h in (hq, hkv, hkv))
    ref = extend_reference(q, k_new, v_new, torch.tensor(qo, dtype=torch.int32, device=device), cache, **meta)
    outs = []
    for i, (length, m) in enumerate(zip(prefix, new, strict=True)):
        k, v = dequantized_prefix(cache, meta, i, torch.float32)
        assert k.shape == v.shape == (length, hkv, d)
        rows = slice(qo[i], qo[i + 1])
        j, t = torch.arange(length + m, device=device), torch.arange(m, device=device)
        visible = (j[None] < length) | (j[None] - length <= t[:, None])  # the prefix, then causal
        outs.append(full_precision_attention(hadamard(q[rows]), torch.cat((k, hadamard(k_new[rows]))),
                                             torch.cat((v, v_new[rows])), d ** -0.5, visible)[0])
    out = torch.cat(outs)
    assert rel_l2(out, ref) <= 3e-2  # (0.9% here: the reference's INT8 queries)
    no_side = {**meta, "side_indptr": torch.zeros_like(meta["side_indptr"])}
    without_side = rel_l2(out, extend_reference(q, k_new, v_new, torch.tensor(qo, dtype=torch.int32, device=device),
                                                cache, **no_side))
    assert without_side > 0.5  # the comparison can tell a missing region (1.2 here)


def test_extend_tile_parses_and_rejects_bad_text():
    assert ExtendTile.parse("128,64,8,words") == ExtendTile(128, 64, 8, True)
    assert ExtendTile.parse(ExtendTile(64, 32, 4, False).name()) == ExtendTile(64, 32, 4, False)
    with pytest.raises(ValueError, match="block_r,block_n,num_warps"):
        ExtendTile.parse("128,64,words")


def test_extend_writes_into_a_given_output_buffer(device):
    """``out=``: the result lands in the caller's buffer (a view of SGLang's preallocated attention output), the
    same values as a fresh one; a buffer of the wrong shape or dtype is refused."""
    cache, meta, _ = filled_cache([120, 40], hkv=2, seed=5, device=device)
    qo_indptr = torch.tensor([0, 7, 19], dtype=torch.int32, device=device)
    q, k_new, v_new = (torch.randn(19, h, 128, device=device) for h in (8, 2, 2))
    fresh = kv4_extend(q, k_new, v_new, qo_indptr, cache, **meta, splits=2)
    flat = torch.full((19, 8 * 128), float("nan"), device=device)
    got = kv4_extend(q, k_new, v_new, qo_indptr, cache, **meta, splits=2, out=flat.view(19, 8, 128))
    assert got.data_ptr() == flat.data_ptr() and torch.equal(got, fresh)
    with pytest.raises(ValueError, match="kv4_extend: out"):
        kv4_extend(q, k_new, v_new, qo_indptr, cache, **meta, out=torch.empty(19, 8, 64, device=device))


def test_extend_bench_shapes_parse_or_say_what_is_wrong():
    """``python -m bench.decode_attention --extend --extend-shapes B,L,N;...``: the weak cases (e.g. full-context
    turns, '16,10240,40') timed without a code change; a malformed shape is refused with the reason."""
    from bench.decode_attention import parse_extend_shapes

    assert parse_extend_shapes("16,10240,40;8,16384,40;") == ((16, 10240, 40), (8, 16384, 40))
    for bad in ("16,10240", "a,1,2", "4,0,8", ""):
        with pytest.raises(ValueError, match="extend-shapes"):
            parse_extend_shapes(bad)


def test_extend_compiles_one_variant_per_tile_whatever_the_batch(device, monkeypatch):
    """The keys of the extend's launches (``triton_keys``) do not follow the batch: token counts of both parities,
    every split count, an index list at an odd offset give one key per tile, one merge and one query quantisation.
    With the split count a constexpr and the batch-sized values specialised, a fresh H100 compiled ~65 variants
    through a learning run's first evaluation."""
    from kvstreams_sglang.kernels import extend, quantize

    keys = record_launch_keys(monkeypatch, extend, {"_extend_kernel": "extend", "_merge_splits_kernel": "merge"})
    record_launch_keys(monkeypatch, quantize, {"_query_kernel": "query"}, keys)  # the INT8 queries
    hq, hkv = 8, 2
    for prefix, new in [([200, 30], [9, 20]), ([150], [1]), ([64, 64, 64], [3, 4, 5])]:
        cache, meta, _ = filled_cache(prefix, hkv=hkv, seed=1, device=device)
        qo_indptr = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32, device=device)
        q, k_new, v_new = (torch.randn(sum(new), h, 128, device=device) for h in (hq, hkv, hkv))
        side = meta["side_indptr"].to(torch.int32)
        for offset in (0, 1):  # the side list as a view 4 bytes into a buffer
            buffer = torch.zeros(side.numel() + offset, dtype=torch.int32, device=device)
            buffer[offset:] = side
            for splits in (1, 2, 3, 7, 16):
                tile = extend.SPLIT_TILE if splits > 1 else extend.GRID_TILE
                kv4_extend(q, k_new, v_new, qo_indptr, cache, **{**meta, "side_indptr": buffer[offset:]},
                           splits=splits, tile=tile)
    assert {name: len(k) for name, k in keys.items()} == {"extend": 2, "merge": 1, "query": 1}
    with pytest.raises(ValueError, match="splits=17"):
        kv4_extend(q, k_new, v_new, qo_indptr, cache, **meta, splits=extend.MAX_SPLITS + 1)
