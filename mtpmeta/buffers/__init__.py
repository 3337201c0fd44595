"""Fixed-address memory and its order across streams.

``persistent`` (the buffers born in ``allocate``), ``device_runtime`` (streams, events,
pinned memory, copy fences and the stream order), ``lifecycle`` (the one rule that orders
buffers' creation and drop against every stream's use), ``layout`` (named typed fields packed in
one byte buffer) and ``bounded_cache`` (the one memo of derived objects).
"""
