"""Stand-in for upstream's ``megatron.core.inference.contexts.mtp_context_mixin``.

``MTPContextMixin``'s helpers as upstream's engine runs them: the individual writers
of its ``MTPMetadata`` in upstream's order, each maximum read back from the device
with ``.item()`` where upstream reads it, and ``forward_mode`` set to upstream's
``COMMIT`` by the prefill step. The context's active rows are
``[paused_request_count, total_request_count)`` of its per-request arrays. The helpers
are the trace bench's baseline (``mtpmeta.bench.upstream_helpers``), one rendering of
upstream's sequence for both.
"""

from __future__ import annotations

from mtpmeta.bench.engine_context import EngineContext
from mtpmeta.bench.upstream_helpers import UpstreamEngineContext
# Bound at import, as upstream's module binds it: what patch() has to reach.
from tests.standin_megatron.mtp_metadata import MTPForwardMode  # noqa: F401

__all__ = ["MTPContextMixin"]


class MTPContextMixin:
    """The context's MTP helpers (upstream's behaviour, on the stand-in metadata)."""

    # Upstream's activation at its smallest (the state set, nothing launched), shared
    # with the trace bench's engine context: the patch leaves this method alone.
    _mtp_activate_attn_metadata = EngineContext._mtp_activate_attn_metadata
    _mtp_require_enabled = UpstreamEngineContext._mtp_require_enabled
    _mtp_begin_decode = UpstreamEngineContext._mtp_begin_decode
    _mtp_setup_decode_step = UpstreamEngineContext._mtp_setup_decode_step
    _mtp_setup_prefill_step = UpstreamEngineContext._mtp_setup_prefill_step
