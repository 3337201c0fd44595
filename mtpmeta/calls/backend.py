"""``Backend``: the interface the two backends share (``DirectBackend``,
``MirrorBackend``), as the call groups use it.

The groups validate and convert every input, then call one of these methods. Host
inputs arrive as C-contiguous int32/int64 numpy arrays; the ``*_device`` methods and
``begin_decode_device`` (mirror path only) take device tensors. Kernel-backed methods
return what the caller needs for the ``ForwardShape`` or a refusal code, and never
raise for bad values (the caller raised before, or decodes the refusal).
"""

from __future__ import annotations

from typing import Optional, Protocol, Tuple

import numpy as np
import torch

from mtpmeta.buffers.device_runtime import StreamOrder
from mtpmeta.buffers.persistent import PersistentBuffers
from mtpmeta.gpu_view import ViewTarget
from mtpmeta.buffers.lifecycle import DeviceLifecycle

__all__ = ["Backend"]


class Backend(Protocol):
    mirror: bool
    buffers: PersistentBuffers
    host_offsets: np.ndarray  # [R] int32: the host's copy of the draft offsets
    host_block_table: np.ndarray  # [R, W] (or a counted begin's [n, C]) host table
    host_offsets_known: bool  # False after begin_decode from device start positions
    stream_order: Optional[StreamOrder]  # of the persistent buffers (None: the CPU)
    lifecycle: DeviceLifecycle  # orders its buffers' creation and drop across streams

    @property
    def named_counts(self) -> Optional[np.ndarray]: ...  # [n] opt-in block counts
    def begin_decode(self, count: int, start_positions: np.ndarray, table_src: np.ndarray,
                     block_counts: Optional[np.ndarray] = None) -> bool: ...
    def begin_decode_device(self, count: int, start_positions: torch.Tensor,
                            table_src: torch.Tensor,
                            padded: Optional[int] = None) -> None: ...
    def begin_decode_for_capture(self, count: int) -> None: ...
    def advance_decode_step(self, count: int) -> None: ...
    def stage_decode_lengths(self, count: int) -> None: ...
    def decode_step(self, target: ViewTarget, count: int, padded: int,
                    graphed: bool) -> int: ...
    def stage_prefill_lengths(self, counts: np.ndarray, pad_tokens: int) -> int: ...
    def stage_prefill_lengths_device(self, counts: torch.Tensor, pad_tokens: int) -> int: ...
    def commit_pass(self, target: ViewTarget, counts: np.ndarray,
                    starts: Optional[np.ndarray], table: np.ndarray,
                    inherited: Optional[np.ndarray], padded_tokens: int, pad_tokens: int,
                    min_padded_requests: int, padded_requests: int,
                    block_counts: Optional[np.ndarray] = None,
                    device_table: Optional[torch.Tensor] = None
                    ) -> Tuple[int, int, int, int]: ...
    def write_token_maps(self, target: ViewTarget, rows: np.ndarray, positions: np.ndarray,
                         table: np.ndarray, inherited: Optional[np.ndarray],
                         padded: int) -> None: ...
    def write_token_maps_device(self, target: ViewTarget, rows: torch.Tensor,
                                positions: torch.Tensor, table: torch.Tensor,
                                inherited: Optional[torch.Tensor], padded: int) -> None: ...
    def write_mha_metadata(self, target: ViewTarget, query_lengths: np.ndarray,
                           kv_lengths: np.ndarray, count: int, table: np.ndarray,
                           padded: int) -> None: ...
    def write_mha_metadata_device(self, target: ViewTarget, query_lengths: torch.Tensor,
                                  kv_lengths: torch.Tensor, count: int,
                                  table: torch.Tensor, padded: int) -> None: ...
    def carry_hidden(self, source: torch.Tensor) -> None: ...
