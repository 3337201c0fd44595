"""Fixed-address memory and its order across streams.

``persistent`` (the buffers born in ``allocate``), ``device_runtime`` (streams, events,
pinned memory, copy fences and the stream order), ``layout`` (named typed fields packed in
one byte buffer) and ``bounded_cache`` (the one memo of derived objects).
"""
