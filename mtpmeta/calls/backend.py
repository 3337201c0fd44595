"""The interface the two backends share (``DirectBackend``, ``MirrorBackend``).

``MTPMetadata`` validates and converts every input, then calls one of these methods.
Host inputs arrive as C-contiguous int32/int64 numpy arrays; the ``*_device`` methods
(mirror path only) take device tensors. Kernel-backed methods return what the caller
needs for the ``ForwardShape`` or a refusal code, never raise for bad values (the
caller raised before).
"""

from __future__ import annotations

from typing import Optional, Protocol, Tuple

import numpy as np
import torch

from mtpmeta.buffers.persistent import PersistentBuffers
from mtpmeta.gpu_view import ViewTarget
from mtpmeta.buffers.device_runtime import StreamOrder
from mtpmeta.buffers.lifecycle import DeviceLifecycle

__all__ = ["Backend"]


class Backend(Protocol):
    mirror: bool
    buffers: PersistentBuffers
    host_offsets: np.ndarray  # [R] int32: the host's copy of the draft offsets
    host_offsets_known: bool  # False after begin_decode from device start positions
    stream_order: Optional[StreamOrder]  # of the persistent buffers (None: the CPU)
    lifecycle: DeviceLifecycle  # orders its buffers' creation and drop across streams

    def begin_decode(self, count: int, start_positions: np.ndarray,
                     table_src: np.ndarray) -> bool: ...
    def begin_decode_for_capture(self, count: int) -> None: ...
    def advance_decode_step(self, count: int) -> None: ...
    def stage_decode_lengths(self, count: int) -> None: ...
    def decode_step(self, target: ViewTarget, count: int, padded: int,
                    graphed: bool) -> int: ...
    def stage_prefill_lengths(self, counts: np.ndarray, pad_tokens: int) -> int: ...
    def commit_pass(self, target: ViewTarget, counts: np.ndarray,
                    starts: Optional[np.ndarray], table: np.ndarray,
                    inherited: Optional[np.ndarray], padded_tokens: int, pad_tokens: int,
                    min_padded_requests: int,
                    padded_requests: int) -> Tuple[int, int, int]: ...
    def write_token_maps(self, target: ViewTarget, rows: np.ndarray, positions: np.ndarray,
                         table: np.ndarray, inherited: Optional[np.ndarray],
                         padded: int) -> None: ...
    def write_mha_metadata(self, target: ViewTarget, query_lengths: np.ndarray,
                           kv_lengths: np.ndarray, count: int, table: np.ndarray,
                           padded: int) -> None: ...
    def carry_hidden(self, source: torch.Tensor) -> None: ...
