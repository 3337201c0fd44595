"""numba kernels of mtpmeta: numpy in, numpy out, never torch.

Installed as ``mtpmeta.native``. Every kernel is a plain ``@njit(cache=True)`` function
that writes into pre-allocated outputs and never raises; it reports through its return value.
Helpers named ``_*`` are inlined into the kernels of their own file.

What the kernels check, and what they trust:

* **Scans** write nothing and return the first offending index (-1 when none):
  ``checks.first_outside`` / ``first_outside_closed``, the block-id scans
  ``checks.first_bad_token_block`` / ``first_bad_commit_block`` (a ``checks`` code
  beside the culprit) and ``first_bad_draft_block``,
  ``rows.first_row_outside`` / ``first_pair_outside``,
  ``draft_state.offsets_in_table`` (a bool), ``draft_state.matching_rows`` (a row count),
  ``checks.check_token_inputs`` and
  ``checks.check_commit_inputs`` (a ``staging`` code such as ``NEGATIVE_POSITION``
  beside the culprit's index), and for the opt-in block counts
  ``checks.first_bad_commit_count`` (a code beside the culprit) /
  ``first_counted_outside``. ``checks.min_max`` only reduces. The wrappers in
  ``mtpmeta`` turn a result into the ValueError/IndexError; the row scans are run by
  the row kernels themselves.
* **Refusing writers** check their indices before the first write and, on a bad one,
  write nothing: ``rows.reset_rows`` / ``move_rows`` / ``swap_rows`` return the first
  row index outside ``[-R, R)`` (``K + i`` for ``dst[i]``) or -1 when done;
  ``draft_state.copy_decode_inputs`` (and ``copy_counted_inputs`` /
  ``stage_counted_inputs``) returns False and ``staging.decode_step`` -1 when an
  offset is negative or its block column is ``>= W``.
* **Everything else trusts its caller**: ``carry.*`` (``check_take`` returns a
  ``CARRY_*`` code for the state it is given), ``fill_capture_state``,
  ``advance_offsets``, ``stage_decode_lengths``, ``write_token_maps``,
  ``write_commit_token_maps``, ``stage_prefill_lengths``, ``write_mha_metadata`` and
  ``commit_pass`` index where their inputs say; the wrappers must have run the
  matching scan. No kernel checks shapes, dtypes, that ``src`` and ``dst`` have one
  length, that scratch or outputs are long enough, or a ``count``/``padded`` against
  them; under ``NUMBA_BOUNDSCHECK=1`` such an index raises IndexError instead.

Every docstring example runs as a doctest (``tests/test_native.py``, with ``np`` bound
to numpy), and each kernel is checked there against a plain numpy twin
(``tests/naive.py``).

Modules:
    rows     -- request-row annotation lifecycle (reset, move, swap)
    carry    -- chunk-boundary carry state and its take check
    checks   -- bound scans used by the validating wrappers
    draft_state -- the draft loop's host state: begin copy, capture fill, advances, and
                   the rows of it a commit may reuse
    staging  -- draft-depth and commit-pass staging, token maps, MHA metadata
    counts   -- a commit pass's table rows with the opt-in block counts
"""

from . import carry, checks, counts, draft_state, rows, staging

__all__ = ["carry", "checks", "counts", "draft_state", "rows", "staging"]
