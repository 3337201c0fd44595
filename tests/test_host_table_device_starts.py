"""The draft loop's begin with device start positions and a table in host memory.

Megatron's engine calls the begin with its start positions on the device and its own
pinned host table (``request_to_kv_block_ids``). The host table is read on the host,
where its rows are checked, and crosses to the device once. On a real device the two
inputs sit on different torch devices; the ``meta`` device reproduces that here (the
simulator keeps every tensor on the CPU, so it cannot).
"""

from __future__ import annotations

import pytest
import torch

from mtpmeta import MTPForwardMode, MTPMetadata
from mtpmeta.bench.meta_device import cpp_meta_kernels
from mtpmeta.kernels import native

R, W, BS, D = 8, 6, 4, 63


def _meta_object(dtype=torch.int32):
    meta = MTPMetadata(enabled=True, max_requests=R, max_kv_block_count=W,
                       block_size_tokens=BS, dummy_block_idx=D, block_table_dtype=dtype,
                       hidden_size=4, hidden_dtype=torch.float32)
    meta.allocate(torch.device("meta"), mirror=True)
    return meta


def test_device_start_positions_take_a_host_table():
    meta = _meta_object()
    starts = torch.zeros(R, dtype=torch.int64, device="meta")
    table = torch.arange(R * W, dtype=torch.int32).view(R, W)
    with cpp_meta_kernels():
        meta.begin_decode(3, 4, starts, table, True)
    assert meta.forward_mode is MTPForwardMode.DRAFT
    assert meta.active_request_count == 3


@pytest.mark.parametrize("table_dtype", [torch.int64, torch.int32])
def test_a_host_table_beside_device_starts_is_checked_on_the_host(table_dtype):
    """An id that ``block_table_dtype`` cannot hold is refused, naming the table and
    the dtype, with the object left as it was (an int32 table too: only a dtype that
    holds every int32 id skips the read)."""
    meta = _meta_object(torch.int16)
    starts = torch.zeros(R, dtype=torch.int64, device="meta")
    table = torch.zeros(R, W, dtype=table_dtype)
    table[1, 2] = 1 << 20
    with cpp_meta_kernels(), pytest.raises(ValueError, match="block_table_src"):
        meta.begin_decode(3, 4, starts, table, True)
    assert meta.forward_mode is MTPForwardMode.NONE


def test_a_host_table_beside_device_starts_must_be_a_tensor():
    meta = _meta_object()
    starts = torch.zeros(R, dtype=torch.int64, device="meta")
    with cpp_meta_kernels(), pytest.raises(ValueError, match="block_table_src"):
        meta.begin_decode(3, 4, starts, [[0] * W] * R, True)
    assert meta.forward_mode is MTPForwardMode.NONE


def test_an_advance_after_device_starts_advances_the_device_offsets_only(monkeypatch):
    """After device start positions the host holds no offsets, so an advance adds one
    on the device and runs no host kernel; after host start positions it advances the
    host's copy too (the control)."""
    meta = _meta_object()
    advanced = []
    real = native.draft_state.advance_offsets
    def counted(offsets, count):
        advanced.append(count)
        return real(offsets, count)

    monkeypatch.setattr(native.draft_state, "advance_offsets", counted)
    table = torch.arange(R * W, dtype=torch.int32).view(R, W)
    with cpp_meta_kernels():
        meta.begin_decode(3, 4, torch.zeros(R, dtype=torch.int64, device="meta"), table,
                          True)
        meta.advance_decode_step()
        assert advanced == []
        meta.end_forward()
        meta.begin_decode(3, 4, torch.zeros(R, dtype=torch.int64), table, True)
        meta.advance_decode_step()
    assert advanced == [3]
