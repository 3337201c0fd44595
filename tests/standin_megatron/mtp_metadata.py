"""Stand-in for upstream's ``megatron.core.inference.contexts.mtp_metadata``.

Upstream's ``MTPMetadata`` is a pure-torch class; ``mtpmeta.reference.
ReferenceMTPMetadata`` performs its op sequence field for field, so it stands in here.
Upstream's ``MTPForwardMode`` is an enum of upstream's own: the stand-in keeps every
mode it stores in it (the reference stores the library's), so a test sees whether the
patch really swapped the enum the engine compares against.
"""

from __future__ import annotations

import enum

from mtpmeta.reference import ReferenceMTPMetadata

__all__ = ["MTPForwardMode", "MTPMetadata"]


class MTPForwardMode(enum.Enum):
    """Upstream's enum: which MTP forward owns the attention metadata."""

    NONE = "none"
    DRAFT = "draft"
    COMMIT = "commit"


class MTPMetadata(ReferenceMTPMetadata):
    """Upstream's class: the reference's ops, its forward mode in upstream's enum."""

    @property
    def forward_mode(self) -> MTPForwardMode:
        return self._mode

    @forward_mode.setter
    def forward_mode(self, mode: enum.Enum) -> None:
        self._mode = MTPForwardMode(mode.value)

    @property
    def forward_active(self) -> bool:
        return self._mode is not MTPForwardMode.NONE

    @property
    def is_varlen_forward(self) -> bool:
        return self._mode is MTPForwardMode.COMMIT
