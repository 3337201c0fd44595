"""Stand-in for the engine's context: the state ``MTPContextMixin``'s helpers read.

``StandInContext`` builds its ``MTPMetadata`` by the name this module imported, as the
engine's context does, so only a patch that reaches already-imported modules gives it
the library's class. Its ``gpu_view`` has upstream's byte layout
(``tests/upstream_view.py``); its per-request arrays hold paused rows first.
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch

from mtpmeta.bench.engine_context import AttentionMetadata
from tests.standin_megatron.mtp_context_mixin import MTPContextMixin
from tests.standin_megatron.mtp_metadata import MTPMetadata
from tests.upstream_view import UpstreamLayoutView

__all__ = ["StandInContext"]


class StandInContext(MTPContextMixin):
    """Context state for the MTP helpers; ``activations`` lists the keyword arguments
    of every ``_mtp_activate_attn_metadata`` call."""

    def __init__(self, max_requests: int, max_kv_block_count: int, block_size_tokens: int,
                 dummy_block_idx: int, max_tokens: int, graph_max_seqlen: int,
                 device: str = "cpu") -> None:
        R, W = max_requests, max_kv_block_count
        self.enable_mtp_kv_cache = True
        self.mtp_metadata = MTPMetadata(
            enabled=True, max_requests=R, max_kv_block_count=W,
            block_size_tokens=block_size_tokens, dummy_block_idx=dummy_block_idx,
            block_table_dtype=torch.int32, hidden_size=8, hidden_dtype=torch.float32)
        self.mtp_metadata.allocate(torch.device(device))
        self.gpu_view = UpstreamLayoutView(R, max_tokens, W, device)
        self.paused_request_count = 0
        self.total_request_count = 0
        self.request_to_kv_block_ids = torch.full((R, W), -1, dtype=torch.int32,
                                                  device=device)  # [R, W], -1 unallocated
        self.graph_attn_metadata = {"mha_metadata": AttentionMetadata(graph_max_seqlen)}
        self.non_graph_attn_metadata = {"mha_metadata": AttentionMetadata(graph_max_seqlen)}
        self.active_attn_metadata: Any = None
        self.active_token_count = 0
        self.padded_active_token_count = 0
        self._using_cuda_graph_this_step = False
        self.activations: List[Dict[str, Any]] = []

    @property
    def request_matched_prefix_blocks(self) -> torch.Tensor:
        """[R] int32 host: inherited prefix blocks per row (the metadata's annotations)."""
        return self.mtp_metadata.request_matched_prefix_blocks

    @property
    def request_kv_block_counts(self) -> torch.Tensor:
        """[R] int32 host: the blocks each row holds (its leading allocated columns;
        ``block_counts_override`` when a test sets one)."""
        if self.block_counts_override is not None:
            return self.block_counts_override
        table = self.request_to_kv_block_ids
        return (table >= 0).cumprod(1).sum(1).to(torch.int32).cpu()

    block_counts_override: Any = None

    def _mtp_activate_attn_metadata(self, **kwargs: Any) -> Any:
        self.activations.append(dict(kwargs))
        return super()._mtp_activate_attn_metadata(**kwargs)
