"""The engine's captured draft mode (contract §12): the per-depth setup inside a graph.

``CapturedSetups`` holds, per padded bucket ``p``, the captured route's two per-depth
calls. ``warm(p)`` runs ``begin_decode_for_capture(p, capture_setup=True)`` once per
bucket; a draft loop then calls ``begin_decode(..., capture_setup=True)`` with its own
``n <= p`` and, per depth, ``setup(p)`` / ``advance(p)``:

* on the CPU these run the capturable route eagerly (the same device ops a graph would
  replay; there is no CPU graph to replay);
* on CUDA ``warm`` captures each of them once into a ``torch.cuda.CUDAGraph`` and the
  loop replays the graphs: the host then does no setup work per depth at all, and the
  forward reads what the replayed setup wrote. The shape a captured depth reports is
  the graphed one (``ForwardShape`` of §10) for the loop's host-known ``n``.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

import torch

from mtpmeta.metadata import MTPMetadata
from mtpmeta.types import ForwardShape

__all__ = ["CapturedSetups"]


class CapturedSetups:
    """Per-bucket captured setup and advance (CUDA graphs on CUDA, eager on the CPU)."""

    def __init__(self, mtp: MTPMetadata, view: Any, device: torch.device) -> None:
        self.mtp = mtp
        self.view = view
        self.cuda = device.type == "cuda"
        self.graphs: Dict[int, Tuple[Any, Any]] = {}

    def warm(self, padded: int) -> ForwardShape:
        """Enter the captured loop at ``padded`` (all rows real, every block ``D``) and
        run one depth eagerly; on CUDA, capture the depth's setup and advance."""
        mtp, view = self.mtp, self.view
        mtp.begin_decode_for_capture(padded, capture_setup=True)
        shape = mtp.setup_decode_step(view)  # eager: builds the plans, checkable
        if self.cuda:
            setup, advance = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            with torch.cuda.graph(setup):
                mtp.setup_decode_step(view)
            with torch.cuda.graph(advance):
                mtp.advance_decode_step()
            self.graphs[padded] = (setup, advance)
        return shape

    def setup(self, padded: int) -> ForwardShape:
        mtp = self.mtp
        if not self.cuda:
            return mtp.setup_decode_step(self.view)
        self.graphs[padded][0].replay()
        count = mtp.active_request_count
        bound = mtp.max_kv_block_count * mtp.block_size_tokens
        return ForwardShape(count, padded, count, padded, 1, bound)

    def advance(self, padded: int) -> None:
        if self.cuda:
            self.graphs[padded][1].replay()
        else:
            self.mtp.advance_decode_step()
