"""Every check of caller input, and the decoding of kernel refusals into messages.

``geometry`` (what the checks know of an allocation), ``inputs`` (raw arguments into host
arrays), ``bounds`` (kernel status codes, block-id ranges, view bounds), ``config``
(construction and ``allocate``), ``rows`` (the row calls' index pairs), ``carry`` (the
chunk carry), ``checks`` (the forwards: destination view, draft loop, commit pass),
``writer_inputs`` (the two view writers' checks) and ``block_counts`` (the opt-in
counts). A check raises ``ValueError``/``IndexError``/``InvalidDtypeError`` naming the
argument and the bound before anything is written; explicit raises, never ``assert``, so
they hold under ``python -O``.
"""
