"""Upstream's MTP context helpers on the reference metadata: the baseline of the trace
bench's engine-placement rows.

:class:`UpstreamEngineContext` is :class:`~mtpmeta.bench.engine_context.EngineContext`
with upstream's own ``_mtp_begin_decode``, ``_mtp_setup_decode_step`` and
``_mtp_setup_prefill_step`` in place of the ones ``patch()`` installs: the individual
writers of the reference ``MTPMetadata`` (``mtpmeta.reference``) in upstream's order,
the commit pass's token owners and positions built with device ops from the device
``append_counts`` and start positions, and each maximum read back where upstream reads
one. The read-backs go through the metadata's ``_host_int`` (``int(value.item())``), so
a replay on torch's ``meta`` device answers and counts them
(``trace_replay.HostKnownReference``). With ``total`` given, as the engine passes it,
the commit pass reads one value back (the longest length). The tests' stand-in for
upstream's ``MTPContextMixin`` takes these very helpers.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from mtpmeta.bench.engine_context import EngineContext
from mtpmeta.types import MTPForwardMode

__all__ = ["UpstreamEngineContext"]


class UpstreamEngineContext(EngineContext):
    """The engine context with upstream's helpers over a reference ``metadata``."""

    def _mtp_require_enabled(self) -> None:
        """Upstream's assertion that the context's MTP KV cache is enabled."""
        if not self.enable_mtp_kv_cache:
            raise AssertionError("MTP KV cache is disabled")

    def _mtp_begin_decode(self, active_request_count: int, padded_count: int,
                          start_positions: Any, graphed: bool = False) -> None:
        """Stage the draft loop from the active rows of the context's block table."""
        self._mtp_require_enabled()
        active = slice(self.paused_request_count, self.total_request_count)
        self.mtp_metadata.begin_decode(active_request_count, padded_count, start_positions,
                                       self.request_to_kv_block_ids[active], graphed)

    def _mtp_setup_decode_step(self) -> None:
        """One draft depth: token maps, decode lengths, MHA metadata, then the bounds
        (graphed: the capture-time ``max_seqlen``; eager: the longest length, read back)."""
        meta = self.mtp_metadata
        n, padded = meta.active_request_count, meta.padded_count
        meta.write_token_maps(self.gpu_view, meta.row_ids[:n], meta.active_offsets,
                              meta.active_block_table, padded)
        query_lengths, kv_lengths = meta.stage_decode_lengths()
        meta.write_mha_metadata(self.gpu_view, query_lengths, kv_lengths,
                                meta.active_block_table, padded)
        if meta.graphed:
            bound = self.graph_attn_metadata["mha_metadata"].max_seqlen
        else:
            bound = meta._host_int(kv_lengths.max()) if n > 0 else 1
        self._mtp_activate_attn_metadata(graphed=meta.graphed, padded_request_count=padded,
                                         max_seqlen_q=1, max_seqlen_k=bound,
                                         token_count=n, padded_token_count=padded)

    def _mtp_setup_prefill_step(self, append_counts: torch.Tensor,
                                block_table_prefill: torch.Tensor,
                                padded_token_count: Optional[int] = None,
                                padded_request_count: Optional[int] = None,
                                request_start_positions: Optional[torch.Tensor] = None,
                                total: Optional[int] = None) -> None:
        """The varlen commit pass: request ``r`` writes ``append_counts[r]`` positions
        from its start through row ``r`` of ``block_table_prefill``, inherited blocks
        redirected; the lengths absorb the pad; ``COMMIT`` afterwards."""
        self._mtp_require_enabled()
        meta, view = self.mtp_metadata, self.gpu_view
        device = view.token_to_block_idx.device
        requests = append_counts.numel()
        if total is None:
            total = meta._host_int(append_counts.sum())
        tokens = total if padded_token_count is None else padded_token_count
        slots = requests if padded_request_count is None else padded_request_count
        owner = torch.repeat_interleave(torch.arange(requests, device=device),
                                        append_counts, output_size=total)
        first_token = torch.cumsum(append_counts, 0) - append_counts
        positions = torch.arange(total, device=device) - first_token[owner]
        if request_start_positions is not None:
            positions = positions + request_start_positions.to(device)[owner]
        active = slice(self.paused_request_count, self.total_request_count)
        inherited = self.request_matched_prefix_blocks[active][
            :block_table_prefill.shape[0]].to(torch.long)
        meta.write_token_maps(view, owner, positions, block_table_prefill, tokens,
                              inherited)
        lengths = meta.stage_prefill_lengths(append_counts, tokens - total)
        staged = lengths.numel()
        slots = max(slots, staged)
        meta.write_mha_metadata(view, lengths, lengths, block_table_prefill, slots)
        longest = meta._host_int(lengths.max()) if staged > 0 else 1
        self._mtp_activate_attn_metadata(graphed=False, padded_request_count=slots,
                                         max_seqlen_q=longest, max_seqlen_k=longest,
                                         token_count=total, padded_token_count=tokens)
        meta.forward_mode = MTPForwardMode.COMMIT
