"""``CallState``: what every call group of one ``MTPMetadata`` reads and writes, and the
error a call on an object without buffers raises.

The groups (``rows``, ``carry``, ``draft_loop``, ``commit_pass``, ``writers``) each
hold this one object by reference; ``MTPMetadata`` exposes its fields as the public
attributes ``enabled``, ``forward_mode``, ``last_forward`` and
``draft_annotation_offset``. Nothing here validates caller input (that is
``mtpmeta.validation``).
"""

from __future__ import annotations

from typing import Any, NoReturn, Optional, Tuple

from mtpmeta.errors import MTPDisabledError, NotAllocatedError
from mtpmeta.types import ForwardRecord, MTPForwardMode
from mtpmeta.validation.request_rows import RequestRows

__all__ = ["CallState", "raise_unavailable"]


class CallState:
    """The object-wide state the call groups share.

    Invariant: ``mode`` is ``NONE`` on an object without buffers unless the caller set
    it (``forward_mode`` is assignable); ``DRAFT`` is entered only by the draft loop's
    begins, ``COMMIT`` only by the commit pass; ``last_forward`` is the record of the
    last view-writing call on the current allocation (None before any).

    Fields:
        enabled: bool, the constructor's ``enabled`` (assignable, as upstream's field).
        mode: ``MTPForwardMode`` of the forward that owns the attention metadata.
        last_forward: ``ForwardRecord`` of the last view-writing call, or None.
        annotation_offset: int, ``draft_annotation_offset``: draft row ``i`` belongs to
            annotation row ``annotation_offset + i`` (the paused-row count when paused
            rows come first); non-zero, it refuses the whole annotation buffer as
            ``inherited_blocks``.
        split: the live row split ``set_request_rows`` declared
            (``validation.request_rows``), or None; ``split_ended``: a split was
            declared and has ended, so the fused calls refuse until the next one.
        committed: ``(record, spans)`` of the last commit pass a split served: its
            ``ForwardRecord`` and ``[2, R]`` int64 ``[start, start + count)`` per
            context row (empty elsewhere); None after a row move, swap or reset.
    """

    __slots__ = ("enabled", "mode", "last_forward", "annotation_offset", "split",
                 "split_ended", "committed")

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.mode: MTPForwardMode = MTPForwardMode.NONE
        self.last_forward: Optional[ForwardRecord] = None
        self.annotation_offset: Any = 0
        # The row split set_request_rows declared (validation.request_rows), or None.
        self.split: Optional[RequestRows] = None
        self.split_ended = False
        self.committed: Optional[Tuple[ForwardRecord, Any]] = None

    def end_split(self) -> None:
        """End the live split (a begin_decode took it, or the buffers changed)."""
        self.committed = None
        if self.split is not None:
            self.split, self.split_ended = None, True

    def install(self) -> None:
        """The state of new (or no) buffers: mode ``NONE``, no forward record, and a
        live split ended (the next step declares its own)."""
        self.mode = MTPForwardMode.NONE
        self.last_forward = None
        self.end_split()


def raise_unavailable(state: CallState, method: str) -> NoReturn:
    """The error of ``method`` on an object that holds no buffers: a disabled object
    (``MTPDisabledError``) or one not allocated yet (``NotAllocatedError``)."""
    if not state.enabled:
        raise MTPDisabledError(f"{method}: this MTPMetadata was built with "
                               "enabled=False and holds no buffers")
    raise NotAllocatedError(f"{method}: buffers are not allocated; call "
                            "allocate(device) first")
