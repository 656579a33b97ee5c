"""zero/layout.py: the pure partition arithmetic (property-tested)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zerodp.zero.layout import (ParamSlice, assign_buckets, assign_buckets_like_ddp, flat_offsets, group_layout,
                                owner_pieces)

numels = st.lists(st.integers(min_value=0, max_value=50), max_size=30)


@given(numels, st.integers(min_value=1, max_value=80))
def test_buckets_cover_every_entry_once_in_order(sizes: list[int], bucket_numel: int) -> None:
    buckets = assign_buckets(sizes, bucket_numel)
    assert [i for b in buckets for i in range(b.first, b.last)] == list(range(len(sizes)))
    assert all(b.stop - b.start == sum(sizes[b.first:b.last]) for b in buckets)
    assert [b.start for b in buckets] == [flat_offsets(sizes)[b.first] for b in buckets]
    for b in buckets:  # over the limit only when one entry alone is bigger than a bucket
        assert b.numel <= bucket_numel or b.last - b.first == 1 or sum(x > 0 for x in sizes[b.first:b.last]) == 1


def test_bucket_boundaries_by_hand() -> None:
    assert [(b.first, b.last) for b in assign_buckets([3, 3, 3, 10, 1], 6)] == [(0, 2), (2, 3), (3, 4), (4, 5)]
    assert flat_offsets([3, 3, 3, 10, 1]) == [0, 3, 6, 9, 19]
    with pytest.raises(ValueError, match="bucket size must be positive"):
        assign_buckets([1], 0)


@given(st.lists(st.integers(min_value=0, max_value=50), min_size=1, max_size=30), st.sampled_from([4, 2]), st.lists(st.integers(min_value=1, max_value=200), min_size=1, max_size=3))
def test_ddp_buckets_are_torch_ddps_own_assignment(sizes: list[int], element_size: int, limits: list[int]) -> None:
    """The same buckets as torch's C++ compute_bucket_assignment_by_size (what DDP's reducer calls),
    so stage 0 sums every element at the position DDP's all-reduce does."""
    import torch
    import torch.distributed as dist

    dtype = {4: torch.float32, 2: torch.bfloat16}[element_size]
    tensors = [torch.empty(n, dtype=dtype) for n in sizes]
    torch_buckets, _ = dist._compute_bucket_assignment_by_size(tensors, limits, [False] * len(sizes), list(range(len(sizes))))
    mine = assign_buckets_like_ddp(sizes, element_size, tuple(limits))
    assert [list(range(b.first, b.last)) for b in mine] == [list(b) for b in torch_buckets if b]
    assert [b.start for b in mine] == [flat_offsets(sizes)[b.first] for b in mine]


def test_ddp_buckets_by_hand() -> None:
    # 1 MiB of fp32 is 262,144 elements: the first bucket closes at the entry that reaches it
    assert [(b.first, b.last) for b in assign_buckets_like_ddp([200_000, 62_144, 10, 7_000_000, 5], 4)] == \
        [(0, 2), (2, 4), (4, 5)]
    with pytest.raises(ValueError, match="must be positive"):
        assign_buckets_like_ddp([1], 4, ())


layouts = st.tuples(st.lists(st.integers(min_value=0, max_value=40), min_size=1, max_size=12),
                    st.integers(min_value=1, max_value=8), st.integers(min_value=1, max_value=4))


@given(layouts)
def test_owned_ranges_are_disjoint_equal_and_cover_the_buffer(args) -> None:
    numels, num_ranks, alignment = args
    layout = group_layout(numels, num_ranks, alignment)
    ranges = [layout.owned_range(r) for r in range(num_ranks)]
    assert all(stop - start == layout.shard_numel for start, stop in ranges)
    assert [start for start, _ in ranges] == [r * layout.shard_numel for r in range(num_ranks)]
    assert ranges[-1][1] == layout.padded_numel and layout.padded_numel % num_ranks == 0
    assert layout.padded_numel - (layout.offsets[-1] + numels[-1]) < num_ranks  # tail padding
    assert all(o % alignment == 0 for o in layout.offsets)


@given(layouts)
def test_every_parameter_reassembles_from_its_slices_across_ranks(args) -> None:
    numels, num_ranks, alignment = args
    layout = group_layout(numels, num_ranks, alignment)
    flat = [None] * layout.padded_numel
    for i, (offset, n) in enumerate(zip(layout.offsets, numels)):
        for k in range(n):
            flat[offset + k] = (i, k)
    rebuilt: dict[int, list] = {i: [] for i in range(len(numels))}
    for rank in range(num_ranks):
        for s in layout.slices_in(*layout.owned_range(rank)):
            assert flat[s.flat_offset:s.flat_offset + s.numel] == [(s.index, s.param_offset + k) for k in range(s.numel)]
            rebuilt[s.index].extend(range(s.param_offset, s.param_offset + s.numel))
    assert all(rebuilt[i] == list(range(n)) for i, n in enumerate(numels))


@given(layouts)
def test_owned_slice_is_the_parameters_piece_in_each_rank_shard(args) -> None:
    # the tensor-fragment API's "local" piece: in rank order, the pieces are the whole parameter
    numels, num_ranks, alignment = args
    layout = group_layout(numels, num_ranks, alignment)
    for i, n in enumerate(numels):
        pieces = [layout.owned_slice(i, rank) for rank in range(num_ranks)]
        assert [p for p in pieces if p.numel] == [s for rank in range(num_ranks)
                                                  for s in layout.slices_in(*layout.owned_range(rank)) if s.index == i]
        assert sum(p.numel for p in pieces) == n
        assert all(p.index == i and layout.owned_range(r)[0] <= p.flat_offset
                   and p.flat_offset + p.numel <= layout.owned_range(r)[1] for r, p in enumerate(pieces))


@given(layouts, st.data())
def test_owner_pieces_split_a_range_at_shard_boundaries(args, data) -> None:
    numels, num_ranks, alignment = args
    layout = group_layout(numels, num_ranks, alignment)
    start = data.draw(st.integers(0, layout.padded_numel))
    stop = data.draw(st.integers(start, layout.padded_numel))
    pieces = owner_pieces(start, stop, layout.shard_numel) if layout.shard_numel else []
    assert sum(b - a for _, a, b in pieces) == stop - start
    for rank, a, b in pieces:
        lo, hi = layout.owned_range(rank)
        assert lo <= a < b <= hi


def test_fewer_elements_than_ranks_leaves_padding_only_shards() -> None:
    layout = group_layout([1, 2], num_ranks=4)
    assert (layout.padded_numel, layout.shard_numel) == (4, 1)
    assert layout.slices_in(*layout.owned_range(3)) == []
    assert layout.slices_in(*layout.owned_range(1)) == [ParamSlice(index=1, param_offset=0, flat_offset=1, numel=1)]
