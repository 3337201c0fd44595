"""A destination view with upstream's byte layout (SPEC §13), built by the tests.

Upstream's ``ContextGPUView`` (megatron-core 0.19.2) cuts every field out of ONE
zero-initialised ``uint8`` buffer ``_buf``, in the order below. The MTP writers touch
ten of those fields; the rest (input ids, the context's request fields, the real token
count) sit between and around them and must keep every byte. Written here by hand from
the SPEC table, independently of ``mtpmeta.buffers.layout``, so a layout bug in the library
cannot hide in the test view too.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch

__all__ = ["UpstreamLayoutView", "MTP_FIELDS"]

#: The ten fields MTP writes (SPEC §13).
MTP_FIELDS = ("token_to_pos_ids", "token_to_block_idx",
              "token_to_local_position_within_kv_block", "token_to_request_idx",
              "token_to_position_in_request", "mha_query_lengths",
              "mha_cu_query_seq_lengths", "mha_kv_seq_lengths", "mha_cu_kv_seq_lengths",
              "mha_block_table")


def _fields(T: int, R: int, W: int) -> List[Tuple[str, torch.dtype, Tuple[int, ...]]]:
    return [
        ("token_to_input_ids", torch.int64, (T,)),
        ("token_to_pos_ids", torch.int64, (T,)),
        ("token_to_block_idx", torch.int64, (T,)),
        ("token_to_local_position_within_kv_block", torch.int32, (T,)),
        ("token_to_request_idx", torch.int32, (T,)),
        ("token_to_position_in_request", torch.int32, (T,)),
        ("request_in_prefill_status", torch.int32, (R,)),
        ("request_query_lengths", torch.int32, (R,)),
        ("request_kv_length_offsets", torch.int32, (R,)),
        ("temperature", torch.float32, (R,)),
        ("top_k", torch.int32, (R,)),
        ("top_p", torch.float32, (R,)),
        ("active_request_last_token_idxs", torch.int32, (R,)),
        ("real_token_count", torch.int32, (1,)),
        ("mha_query_lengths", torch.int32, (R,)),
        ("mha_cu_query_seq_lengths", torch.int32, (R + 1,)),
        ("mha_kv_seq_lengths", torch.int32, (R,)),
        ("mha_cu_kv_seq_lengths", torch.int32, (R + 1,)),
        ("mha_block_table", torch.int32, (R, W)),
    ]


class UpstreamLayoutView:
    """Upstream's constructor signature and byte layout: ``_buf`` [nbytes] uint8, every
    field a typed view of it, in SPEC §13's order (no padding is needed: the int64
    fields come first and every later field is 4 bytes wide)."""

    def __init__(self, max_requests: int, max_tokens: int, max_kv_blocks: int,
                 device: torch.device | str = "cpu", max_mamba_chunks: int = 0) -> None:
        specs = _fields(max_tokens, max_requests, max_kv_blocks)
        sizes = [dtype.itemsize * int(torch.Size(shape).numel()) for _, dtype, shape in specs]
        self._buf = torch.zeros(sum(sizes), dtype=torch.uint8, device=device)
        self.spans: Dict[str, Tuple[int, int]] = {}
        offset = 0
        for (name, dtype, shape), size in zip(specs, sizes):
            if offset % dtype.itemsize:
                raise RuntimeError(f"{name}: offset {offset} not {dtype.itemsize}-aligned")
            setattr(self, name, self._buf[offset:offset + size].view(dtype).view(shape))
            self.spans[name] = (offset, offset + size)
            offset += size

    def outside_mtp_fields(self) -> torch.Tensor:
        """A boolean mask over ``_buf``: True on every byte no MTP field covers."""
        mask = torch.ones(self._buf.numel(), dtype=torch.bool)
        for name in MTP_FIELDS:
            start, stop = self.spans[name]
            mask[start:stop] = False
        return mask
