"""``ReferenceGPUView``: the reference's destination view, upstream's layout of ten
separate tensors (the library's ``ContextGPUView`` packs the same fields in one buffer)."""

from __future__ import annotations

import torch

__all__ = ["ReferenceGPUView"]


class ReferenceGPUView:
    """Stand-in for upstream's ``ContextGPUView``: ten separate, zeroed destination tensors."""

    def __init__(
        self, max_requests: int, max_tokens: int, max_kv_blocks: int, device: torch.device
    ) -> None:
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.max_kv_blocks = max_kv_blocks
        i32, i64 = torch.int32, torch.int64
        T, R, W = max_tokens, max_requests, max_kv_blocks

        def z(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.token_to_pos_ids = z(T, dtype=i64)  # [max_tokens] int64
        self.token_to_block_idx = z(T, dtype=i32)  # [max_tokens] int32
        self.token_to_local_position_within_kv_block = z(T, dtype=i32)  # [max_tokens] int32
        self.token_to_request_idx = z(T, dtype=i32)  # [max_tokens] int32
        self.token_to_position_in_request = z(T, dtype=i32)  # [max_tokens] int32
        self.mha_query_lengths = z(R, dtype=i32)  # [max_requests] int32
        self.mha_kv_seq_lengths = z(R, dtype=i32)  # [max_requests] int32
        self.mha_cu_query_seq_lengths = z(R + 1, dtype=i32)  # [max_requests + 1] int32
        self.mha_cu_kv_seq_lengths = z(R + 1, dtype=i32)  # [max_requests + 1] int32
        self.mha_block_table = z(R, W, dtype=i32)  # [max_requests, max_kv_blocks] int32
