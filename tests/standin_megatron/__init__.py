"""A stand-in for the two upstream modules ``mtpmeta.integrations.megatron`` patches.

Released megatron-core wheels (0.19.2) do not ship the MTP draft-KV cache, so the
tests build its two modules from upstream's documented behaviour, under upstream's
names, plus the engine's context that uses them:

- ``mtp_metadata``: upstream's ``MTPForwardMode`` (an enum of its own, not the
  library's) and ``MTPMetadata``: the library's pure-torch reference, which runs
  upstream's op sequence, with its modes kept in upstream's enum;
- ``mtp_context_mixin``: ``MTPContextMixin`` with upstream's helpers in upstream's op
  order (the individual writers, ``.item()`` read-backs for the maxima);
- ``dynamic_context``: ``StandInContext``, the context state those helpers read, which
  builds its ``MTPMetadata`` by the name it imported (as the engine's context does) and
  records every ``_mtp_activate_attn_metadata`` call.

``installed()`` puts them in ``sys.modules`` as ``megatron.core.inference.contexts.*``
(with empty parent packages) and removes them, and whatever it shadowed comes back.
"""

from __future__ import annotations

import contextlib
import sys
import types
from typing import Dict, Iterator

from tests.standin_megatron import dynamic_context, mtp_context_mixin, mtp_metadata

__all__ = ["installed", "PACKAGE", "MODULES"]

PACKAGE = "megatron.core.inference.contexts"
MODULES = {f"{PACKAGE}.mtp_metadata": mtp_metadata,
           f"{PACKAGE}.mtp_context_mixin": mtp_context_mixin,
           f"{PACKAGE}.dynamic_context": dynamic_context}


@contextlib.contextmanager
def installed() -> Iterator[Dict[str, types.ModuleType]]:
    """The stand-in modules under upstream's names for the duration of the block."""
    names = ["megatron", "megatron.core", "megatron.core.inference", PACKAGE, *MODULES]
    saved = {name: sys.modules[name] for name in names if name in sys.modules}
    try:
        for name in names[:4]:
            sys.modules[name] = types.ModuleType(name)
        sys.modules.update(MODULES)
        yield dict(MODULES)
    finally:
        for name in names:
            sys.modules.pop(name, None)
        sys.modules.update(saved)
