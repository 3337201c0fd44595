"""``MTPMetadata``'s entry points into the captured draft loop (contract §12).

A mixin of ``MTPMetadata``: the public methods (``begin_decode``,
``begin_decode_for_capture``, ``setup_decode_step``, ``advance_decode_step``,
``stage_decode_lengths``) validate as always and hand a loop begun with
``capture_setup=True`` to these methods, which drive ``CapturedRoute``
(``mtpmeta.captured``). Two flags of the object: ``_capture_setup`` (this draft loop
takes the captured route; set by a ``capture_setup=True`` begin, cleared by any other
begin and by ``end_forward``) and ``_offsets_stale`` (a captured depth or advance ran
since the last begin: the host copy of the offsets is not the truth).
"""

from __future__ import annotations

from typing import Any

from .checks import raise_position_error
from .errors import StaleOffsetsError
from .gpu_view import ViewTarget
from .types import ForwardRecord, ForwardShape

__all__ = ["CapturedLoop"]


class CapturedLoop:
    """The captured-loop half of ``MTPMetadata`` (see the module docstring)."""

    def _begin_captured(self, backend: Any, count: int, padded: int, starts: Any,
                        table: Any, on_device: bool) -> None:
        """``begin_decode(..., capture_setup=True)`` for validated counts: stage
        ``offsets[:n]``, ``block_table[:n]`` and the device count, then enter DRAFT."""
        if on_device:  # mirror path only: copied on the device, count by a device fill
            backend.begin_decode_device(count, starts, table)
        elif not backend.begin_decode(count, starts, table):  # the default staging,
            # which also stages the device count (captured.stage_count)
            raise_position_error(self._geometry, "start_positions", starts, count)
        self._enter_checked(count, padded, True)
        self._capture_setup = True

    def _begin_captured_for_capture(self, padded: int) -> None:
        """``begin_decode_for_capture(p, capture_setup=True)`` after the default
        scratch fill: every one of the ``p`` rows is real for the device too."""
        self._enter_checked(padded, padded, True)  # the backend set the device count
        self._capture_setup = True

    def _captured_step(self, target: ViewTarget, gpu_view: Any) -> ForwardShape:
        """One captured depth: device ops only; the graphed ``ForwardShape`` of §10."""
        count, padded = self.active_request_count, self.padded_count
        self._captured.decode_step(target, padded)
        self._offsets_stale = True
        record = self._decode_record
        if record is None or record.gpu_view is not gpu_view:
            record = ForwardRecord("decode", gpu_view, count, padded, count, padded)
            self._decode_record = record
        self.last_forward = record
        return self._memo.shape(count, padded, count, padded, 1,
                                self.max_kv_block_count * self.block_size_tokens)

    def _captured_advance(self) -> None:
        self._captured.advance_decode_step(self.padded_count)
        self._offsets_stale = True

    def _captured_lengths(self) -> None:
        self._captured.stage_decode_lengths(self.padded_count)

    def _refuse_stale(self, method: str) -> None:
        """Raise ``StaleOffsetsError``: a default-route call after a captured depth."""
        raise StaleOffsetsError(
            f"{method}: a captured draft depth (capture_setup=True) ran since the last "
            "begin_decode, so the device advanced the offsets without the host and the "
            "host's copy of them is stale; call begin_decode (or "
            "begin_decode_for_capture) first")
