"""``MTPMETA_DEBUG=1``: the switch that turns ``check_invariants`` on after every public
call, read once, when ``mtpmeta.metadata`` is imported."""

from __future__ import annotations

import os

__all__ = ["install_debug_checks_from_env"]


def install_debug_checks_from_env(cls: type) -> None:
    """Only when MTPMETA_DEBUG=1 at import are the public methods of ``cls`` wrapped so
    each call is followed by check_invariants. With the variable unset this costs
    nothing: no wrapper, and mtpmeta.debug.invariants is imported on first use only."""
    if os.environ.get("MTPMETA_DEBUG") == "1":
        from mtpmeta.debug.invariants import install_debug_checks

        install_debug_checks(cls)
