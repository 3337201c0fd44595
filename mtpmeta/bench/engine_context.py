"""An engine context whose MTP helpers are the ones ``megatron.patch()`` installs.

The trace bench's ``megatron`` row replays every step through upstream's context
helpers as ``mtpmeta.integrations.megatron.patch()`` replaces them
(``HELPERS``: ``_mtp_begin_decode``, ``_mtp_setup_decode_step``,
``_mtp_setup_prefill_step``), so its host share is what an engine pays per step after
the one-call patch, call sites unchanged. :class:`EngineContext` is the context state
those helpers read, no more:

- ``mtp_metadata`` (this library's, mirror path) and ``gpu_view`` [view of ``R`` rows];
- ``paused_request_count`` / ``total_request_count``: active rows ``[paused, total)``;
- ``request_to_kv_block_ids`` [R, W] int32, ``request_matched_prefix_blocks`` [R]
  int32 and ``request_kv_block_counts`` [R] int32, the context's per-request arrays (the
  replay's own host table, each row's prefix hit and its blocks in use, written by the
  engine before the step);
- ``graph_attn_metadata`` / ``non_graph_attn_metadata``: ``{"mha_metadata": ...}``
  with a capture-time ``max_seqlen``, and ``_mtp_activate_attn_metadata``, which makes
  one of them the context's active metadata with the forward's bounds.

``_mtp_activate_attn_metadata`` is upstream's shape of that call at its smallest (the
state set, nothing launched): its cost is the engine's under either class, so the row
measures the helpers, not the engine's attention setup.
"""

from __future__ import annotations

from typing import Any, Dict

import torch

from mtpmeta.integrations.megatron import HELPERS
from mtpmeta.metadata import MTPMetadata

__all__ = ["AttentionMetadata", "EngineContext"]

class AttentionMetadata:
    """The MHA metadata object: a capture-time ``max_seqlen`` and the last state set."""

    __slots__ = ("max_seqlen", "state")

    def __init__(self, max_seqlen: int) -> None:
        self.max_seqlen = max_seqlen
        self.state: Dict[str, int] = {}

    def set_state_data(self, **state: int) -> None:
        self.state = state


class EngineContext:
    """The context state ``HELPERS`` read (module docstring), over ``metadata``
    (allocated) and ``gpu_view``; ``block_table`` [R, W] int32 is the context's
    ``request_to_kv_block_ids``. ``graph_max_seqlen``: the graphed attention's
    capture-time bound (the longest KV span a row of ``block_table`` holds)."""

    # the helpers patch() installs on upstream's MTPContextMixin, bound the same way
    _mtp_begin_decode = HELPERS["_mtp_begin_decode"]
    _mtp_setup_decode_step = HELPERS["_mtp_setup_decode_step"]
    _mtp_setup_prefill_step = HELPERS["_mtp_setup_prefill_step"]

    def __init__(self, metadata: MTPMetadata, gpu_view: Any, block_table: torch.Tensor,
                 graph_max_seqlen: int) -> None:
        self.enable_mtp_kv_cache = True
        self.mtp_metadata = metadata
        self.gpu_view = gpu_view
        self.paused_request_count = 0
        self.total_request_count = 0
        self.request_to_kv_block_ids = block_table
        self.request_matched_prefix_blocks = torch.zeros(metadata.max_requests,
                                                         dtype=torch.int32)
        self.request_kv_block_counts = torch.zeros(metadata.max_requests, dtype=torch.int32)
        self.graph_attn_metadata = {"mha_metadata": AttentionMetadata(graph_max_seqlen)}
        self.non_graph_attn_metadata = {"mha_metadata": AttentionMetadata(graph_max_seqlen)}
        self.active_attn_metadata: Any = None
        self.active_token_count = self.padded_active_token_count = 0
        self._using_cuda_graph_this_step = False

    def _mtp_activate_attn_metadata(self, graphed: bool, padded_request_count: int,
                                    max_seqlen_q: int, max_seqlen_k: int,
                                    token_count: int, padded_token_count: int) -> Any:
        """Make the graphed or eager attention metadata the active one, with this
        forward's bounds; returns its MHA object."""
        chosen = self.graph_attn_metadata if graphed else self.non_graph_attn_metadata
        mha = chosen["mha_metadata"]
        mha.set_state_data(padded_active_request_count=padded_request_count,
                           max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
        self.active_attn_metadata = chosen
        self.active_token_count = token_count
        self.padded_active_token_count = padded_token_count
        self._using_cuda_graph_this_step = graphed
        return mha
