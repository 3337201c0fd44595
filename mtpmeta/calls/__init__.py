"""The objects that carry out ``MTPMetadata``'s calls, one group of calls each.

``state`` (what an object holds between calls and its allocation), ``forward_memo``
(resolved views and shapes), ``draft_loop``, ``captured_loop`` and ``writers`` (the call
groups), ``backend`` (the interface the direct and mirror backends share).
"""
