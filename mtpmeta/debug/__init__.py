"""``check_invariants``: the KV-protecting invariants of an object and of the last view it
wrote (``invariants``, ``view_checks``), run after every public call under
``MTPMETA_DEBUG=1``."""
