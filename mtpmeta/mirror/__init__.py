"""The device side (``MirrorBackend``): numba stages into pinned host slots, async copies
land in persistent device buffers, and small torch ops write the view.

``backend`` (the host truth of the draft state and the dispatch to the objects below),
``begin_staging`` (a begin's pinned slots, device landing and the commit's row reuse),
``forward_staging`` (the forward ring, its fixed stages and the per-shape shadow route),
``stages``, ``depth_stage`` and ``commit_stage`` (the fixed shadows of draft depths and
commit passes), ``counted`` (the block-count route), ``host_inputs`` (the prefill
lengths' and the carry's rings), ``pinned_ring`` (fenced pinned slots), ``copy_plan``
and ``prefixes`` (many copies as few torch ops), ``device_route``,
``device_draft_plan`` and ``token_scratch`` (inputs that are already device tensors),
``captured_route`` (the CUDA-graph-capturable loop).
"""
