"""zero/layout.py: the pure partition arithmetic (property-tested)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zerodp.zero.layout import assign_buckets, flat_offsets

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
