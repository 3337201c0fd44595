"""Integrations: one call that puts mtpmeta under an engine that uses upstream's class.

``mtpmeta.integrations.megatron``: ``patch()`` / ``unpatch()`` for Megatron-core's
inference engine. Nothing here is imported by ``import mtpmeta``, and no module here
imports an engine until its ``patch()`` is called.
"""

__all__ = ["megatron"]
