"""The objects that carry out ``MTPMetadata``'s calls, one group of calls each.

``rows`` (``RowLifecycle``), ``carry`` (``ChunkCarry``), ``draft_loop`` (``DraftLoop``),
``captured_loop`` (``CapturedLoop``, the captured route's guards), ``commit_pass``
(``CommitPass``) and ``writers`` (``ViewWriters``) are the groups; ``state``
(``CallState``, what they share) and ``allocation`` (``Allocation``, what one
``allocate`` holds: buffers, backend, geometry, ``forward_memo``, captured route and
``inherited`` copies) are what they hold; ``attributes`` connects the public attributes
to them; ``backend`` is the interface the direct and mirror backends share.
"""
