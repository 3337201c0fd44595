"""Public value types shared by the fast path and the reference: the forward mode and
the host-computed shape of one forward."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

__all__ = ["MTPForwardMode", "ForwardShape", "ForwardRecord"]


class MTPForwardMode(enum.Enum):
    """Which MTP forward, if any, currently owns the attention metadata.

    A draft depth contributes exactly one token per active request (uniform, decode
    kernel); the commit pass is ragged over each request's committed span (varlen).
    """

    NONE = "none"
    DRAFT = "draft"
    COMMIT = "commit"


@dataclass(frozen=True)
class ForwardShape:
    """Launch shape of one MTP forward, computed on the host (no device sync).

    Attributes:
        token_count: real tokens written this forward (``T``).
        padded_token_count: token rows the forward runs, padding included.
        request_count: request slots with a real or pad-absorbing length (``n``; for a
            commit pass ``P`` or ``P + 1`` when a trailing pad request was staged).
        padded_request_count: request slots the attention kernel launches over.
        max_seqlen_q: largest per-request query length among the ``request_count``
            slots (1 for a draft depth).
        max_seqlen_k: largest per-request KV length; for a graphed draft depth
            (``graphed=True``, ``begin_decode_for_capture`` included) the capture-time
            bound ``max_kv_block_count * block_size_tokens`` instead, the same at every
            depth, so a captured kernel is never replayed with a bound too small for the
            lengths of a later step. ``None`` only for an eager draft depth whose
            ``begin_decode`` received ``start_positions`` as a device tensor: the host has
            no copy of the offsets and reading one back would be a sync.

    Both maxima are at least 1, as upstream's: a forward with no requests or no tokens
    reports 1, never 0.
    """

    token_count: int
    padded_token_count: int
    request_count: int
    padded_request_count: int
    max_seqlen_q: int
    max_seqlen_k: Optional[int]


@dataclass(slots=True)
class ForwardRecord:
    """What the last view-writing call did, kept for ``check_invariants``.

    ``kind`` is ``"decode"`` (setup_decode_step), ``"commit"`` (setup_commit_pass),
    ``"tokens"`` (write_token_maps) or ``"mha"`` (write_mha_metadata). Token/request
    counts not written by that call are 0. ``inherited`` is the inherited-block count per
    request row the call redirected with, copied at the call (the caller may change its
    array afterwards), or None. ``block_table`` is the caller's table of a device-route
    writer (a reference; its block ids were not checked on the host), else None.
    ``first_row``: the context row of request 0 when a declared row split served the
    call (its paused count), else None.
    """

    kind: str
    gpu_view: object
    token_count: int
    padded_token_count: int
    request_count: int
    padded_request_count: int
    inherited: Optional[object] = None
    block_table: Optional[object] = None
    first_row: Optional[int] = None
