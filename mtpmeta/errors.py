"""Exception types. Each one subclasses the builtin a drop-in caller already catches."""

from __future__ import annotations

__all__ = [
    "ChunkCarryError",
    "MTPDisabledError",
    "NotAllocatedError",
    "CarryNotAllocatedError",
    "InvalidDtypeError",
    "ForwardModeError",
]


class ChunkCarryError(AssertionError):
    """A chunk-boundary carry check failed (no live carry, wrong request, wrong seam).

    Subclasses ``AssertionError`` because upstream raised one; it is raised explicitly,
    so it still fires under ``python -O``.
    """


class MTPDisabledError(AssertionError):
    """A draft-loop or writer method was called on an object built with ``enabled=False``.

    Subclasses ``AssertionError`` because upstream's ``assert self.enabled`` raised one.
    """


class NotAllocatedError(ValueError, RuntimeError):
    """An enabled object was used before ``allocate`` (or after ``deallocate``)."""


class CarryNotAllocatedError(NotAllocatedError, ChunkCarryError):
    """``take_chunk_boundary`` on an enabled object that is not allocated.

    There is no buffer to return and no live carry, so it is both: a
    ``NotAllocatedError`` naming ``allocate`` and a ``ChunkCarryError`` (an
    ``AssertionError``), which code written against upstream, where the missing carry
    raised, already catches.
    """


class InvalidDtypeError(ValueError, TypeError):
    """An input's dtype cannot be cast safely to the buffer it feeds."""


class ForwardModeError(ValueError, RuntimeError):
    """A step entry point was called in the wrong forward mode (e.g. no ``begin_decode``)."""


class InvariantError(AssertionError):
    """A debug check (``MTPMetadata.check_invariants``) found a broken invariant.

    The message names the invariant and the offending row, token or slot. Raised
    explicitly, so it still fires under ``python -O``.
    """


class GraphCaptureError(RuntimeError):
    """A staging call ran while the buffers' device stream was capturing a CUDA graph.

    ``graphed=True`` means the MTP *forward* replays a captured graph; the metadata
    setup runs eagerly before each replay (contract §9), unless the draft loop was begun
    with ``capture_setup=True`` (contract §12), whose per-depth calls are device ops only
    and are never refused. Captured, it would bake a pinned
    staging slot, a host-side decision and the captured request count into the graph,
    and a replay would leave the host's copy of the draft state behind the device's.
    """


__all__ += ["InvariantError", "GraphCaptureError"]


class StaleOffsetsError(ForwardModeError):
    """A default-route draft call after a captured depth (contract §12), before a new
    ``begin_decode``: the device advanced the offsets without the host, so the host's
    copy of them is no longer the truth and nothing may be computed from it."""


__all__ += ["StaleOffsetsError"]
