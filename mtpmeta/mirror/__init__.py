"""The device side (``MirrorBackend``): numba stages into pinned host slots, async copies
land in persistent device buffers, and small torch ops write the view.

``backend`` (the backend and its routes' dispatch), ``pinned_ring`` (fenced pinned
slots), ``forward_staging`` and ``stages`` (the fixed shadows of draft depths and commit
passes), ``copy_plan`` and ``prefixes`` (many copies as few torch ops), ``counted`` (the
block-count route), ``device_route``, ``device_draft_plan`` and ``token_scratch`` (inputs
that are already device tensors), ``captured_route`` (the CUDA-graph-capturable loop).
"""
