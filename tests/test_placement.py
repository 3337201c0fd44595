"""``CopyPlan``: many copies as few torch ops, same bytes as one copy_ per pair."""

from __future__ import annotations

import numpy as np
import torch

from mtpmeta.bench.counters import OpCounter
from mtpmeta.mirror.copy_plan import CopyPlan, word_view


def test_copy_plan_writes_what_one_copy_per_pair_writes(rng):
    """Mixed int32/int64 pairs, 1-D and 2-D, a dtype conversion, an empty pair and a
    size-1 slice with a stride: the plan's result equals a copy_ per pair, and it
    dispatches one _foreach_copy_ for the word-viewable pairs plus a copy_ each for the
    conversion and the strided int64. A wrong word view (an int64 read as the wrong half) or a dropped pair
    would write the wrong KV metadata."""
    for _ in range(20):
        dst32 = torch.from_numpy(rng.integers(-9, 9, 40).astype(np.int32))
        dst64 = torch.from_numpy(rng.integers(-9, 9, 12).astype(np.int64))
        table = torch.from_numpy(rng.integers(-9, 9, (4, 3)).astype(np.int32))
        src32 = torch.from_numpy(rng.integers(-2**31, 2**31 - 1, 40).astype(np.int32))
        src64 = torch.from_numpy(rng.integers(-2**40, 2**40, 12).astype(np.int64))
        src_table64 = torch.from_numpy(rng.integers(0, 99, (4, 3)).astype(np.int64))
        a, b = (int(v) for v in sorted(rng.integers(0, 12, 2)))
        pairs = [(dst32[:5], src32[:5]), (dst32[10:20], src32[20:30]),
                 (dst64[a:b], src64[a:b]), (dst64[:0], src64[:0]),
                 (dst64[::2][:1], src64[3:4]), (table[:2], src_table64[1:3])]
        want = [t.clone() for t in (dst32, dst64, table)]
        expected = dict(zip(("dst32", "dst64", "table"), want))
        for dst, src in pairs:  # the same writes, one copy_ each, into the clones
            for name, base in (("dst32", dst32), ("dst64", dst64), ("table", table)):
                if dst.untyped_storage().data_ptr() == base.untyped_storage().data_ptr():
                    offset = (dst.storage_offset() - base.storage_offset())
                    view = torch.as_strided(expected[name], dst.shape, dst.stride(),
                                            expected[name].storage_offset() + offset)
                    view.copy_(src)
        plan = CopyPlan(pairs)
        with OpCounter() as counter:
            plan.run()
        assert torch.equal(dst32, expected["dst32"])
        assert torch.equal(dst64, expected["dst64"])
        assert torch.equal(table, expected["table"])
        assert counter.data_ops == plan.ops
        assert counter.ops["aten::_foreach_copy_"] == 1
        # The int64 -> int32 table rows, and the size-1 strided int64 (not word-viewable).
        assert counter.ops["aten::copy_"] == 2


def test_word_view_reads_int64_as_its_int32_halves():
    values = torch.tensor([[1, -2], [2**33 + 5, -1]])
    words = word_view(values)
    assert words.dtype == torch.int32 and words.shape == (2, 4)
    assert words.data_ptr() == values.data_ptr()
    assert word_view(values[:, :1]) is not None  # strided: left alone
    assert word_view(values[:, :1]).dtype == torch.int64
