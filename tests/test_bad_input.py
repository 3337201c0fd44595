"""contract §8: every public method validates before it writes.

Each case primes an object (annotations, a staged draft loop, staged lengths, a live
carry) and three sentinel-filled views, snapshots ALL of it, makes one bad call, and
checks the exception type, that the message names the argument (and the bound), and
that not one element of any buffer or view changed.

Geometry: R = 8, W = 6, BS = 4, D = 999, H = 8. Views: ``view`` [R 8, 16 tokens, W 6],
``small`` [R 3, 4 tokens, W 6], ``wide`` [R 8, 16 tokens, W 7].
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from typing import Any, Callable, NamedTuple, Optional

import pytest
import torch

from mtpmeta import ForwardModeError, MTPMetadata
from tests.helpers import (assert_same_state, buffer_state, config, make_metadata,
                           make_view, view_state)

T3 = [[10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 24, 25], [30, 31, 32, 33, 34, 35]]
NARROW = [row[:5] for row in T3]  # width 5 != W 6
DTYPE = (ValueError, TypeError)


class Case(NamedTuple):
    id: str
    call: Callable[[MTPMetadata, dict], Any]
    exc: Any
    match: str
    prep: Optional[Callable[[MTPMetadata], None]] = None


def _reallocated(meta: MTPMetadata) -> None:
    mirror = meta.mirror
    meta.deallocate()
    meta.allocate("cpu", mirror=mirror)


def _past_the_table(meta: MTPMetadata, graphed: bool = False) -> None:
    meta.begin_decode(2, 2, [23, 3], T3, graphed=graphed)  # 23: last slot of column 5
    meta.advance_decode_step()


def _negative_offset(meta: MTPMetadata) -> None:
    meta.begin_decode(2, 2, [0, 3], T3, graphed=False)
    meta.offsets[0] = -1  # the buffer is public; a scheduler could write it
    if meta.mirror:
        meta._backend.host_offsets[0] = -1  # its host copy, which the mirror checks


CASES = [
    # ---------------------------------------------------------------- begin_decode
    Case("begin_decode-count-beyond-R", lambda m, v: m.begin_decode(
        9, 9, [0] * 9, [[1] * 6] * 9, False), ValueError, r"active_request_count.*8"),
    Case("begin_decode-negative-count", lambda m, v: m.begin_decode(
        -1, 0, [0], T3, False), ValueError, r"active_request_count"),
    Case("begin_decode-padded-below-n", lambda m, v: m.begin_decode(
        2, 1, [0, 0], T3, False), ValueError, r"padded_count.*1.*2"),
    Case("begin_decode-padded-beyond-R", lambda m, v: m.begin_decode(
        2, 9, [0, 0], T3, False), ValueError, r"padded_count.*max_requests 8"),
    Case("begin_decode-column-beyond-W", lambda m, v: m.begin_decode(
        2, 2, [0, 24], T3, False), ValueError,
        r"start_positions.*block column 6 >= max_kv_block_count 6"),
    Case("begin_decode-negative-position", lambda m, v: m.begin_decode(
        2, 2, [0, -1], T3, False), ValueError, r"start_positions.*-1"),
    Case("begin_decode-too-few-positions", lambda m, v: m.begin_decode(
        2, 2, [0], T3, False), ValueError, r"start_positions"),
    Case("begin_decode-table-width", lambda m, v: m.begin_decode(
        2, 2, [0, 0], NARROW, False), ValueError, r"block_table_src.*max_kv_block_count"),
    Case("begin_decode-too-few-table-rows", lambda m, v: m.begin_decode(
        2, 2, [0, 0], T3[:1], False), ValueError, r"block_table_src"),
    Case("begin_decode-float-positions", lambda m, v: m.begin_decode(
        2, 2, torch.tensor([0.0, 1.0]), T3, False), DTYPE, r"start_positions"),
    Case("capture-padded-beyond-R", lambda m, v: m.begin_decode_for_capture(9),
         ValueError, r"padded_count.*max_requests 8"),
    # ----------------------------------------------------------- setup_decode_step
    Case("decode_step-advanced-past-table", lambda m, v: m.setup_decode_step(v["view"]),
         ValueError, r"active_offsets.*block column 6 >= max_kv_block_count 6",
         _past_the_table),
    Case("decode_step-graphed-advanced-past-table",
         lambda m, v: m.setup_decode_step(v["view"]), ValueError,
         r"active_offsets.*block column 6 >= max_kv_block_count 6",
         lambda m: _past_the_table(m, graphed=True)),
    Case("decode_step-negative-offset", lambda m, v: m.setup_decode_step(v["view"]),
         ValueError, r"active_offsets: negative position -1", _negative_offset),
    Case("decode_step-after-end_forward", lambda m, v: m.setup_decode_step(v["view"]),
         ForwardModeError, r"begin_decode", lambda m: m.end_forward()),
    Case("decode_step-without-begin_decode", lambda m, v: m.setup_decode_step(v["view"]),
         ForwardModeError, r"begin_decode", _reallocated),
    Case("decode_step-padded-beyond-view", lambda m, v: m.setup_decode_step(v["small"]),
         ValueError, r"padded.*5.*max_tokens 4",
         lambda m: m.begin_decode(2, 5, [0, 1], T3, False)),
    Case("decode_step-view-width", lambda m, v: m.setup_decode_step(v["wide"]),
         ValueError, r"max_kv_block_count 6.*width 7"),
    # ------------------------------------------------------- stage_prefill_lengths
    Case("prefill-count-beyond-R", lambda m, v: m.stage_prefill_lengths([1] * 9, 0),
         ValueError, r"append_counts.*9.*max_requests 8"),
    Case("prefill-negative-count", lambda m, v: m.stage_prefill_lengths([3, -1], 0),
         ValueError, r"append_counts.*-1"),
    Case("prefill-negative-pad", lambda m, v: m.stage_prefill_lengths([3], -1),
         ValueError, r"pad_tokens.*-1"),
    Case("prefill-float-counts", lambda m, v: m.stage_prefill_lengths(
        torch.tensor([1.0, 2.0]), 0), DTYPE, r"append_counts"),
    # ------------------------------------------------------------ write_token_maps
    Case("token_maps-row-outside-table", lambda m, v: m.write_token_maps(
        v["view"], [0, 3], [0, 0], T3, 2), IndexError, r"rows.*3.*3 rows"),
    Case("token_maps-row-outside-inherited", lambda m, v: m.write_token_maps(
        v["view"], [0, 2], [0, 0], T3, 2, inherited_blocks=[1, 1]), IndexError,
        r"row 2.*inherited_blocks"),
    Case("token_maps-column-beyond-W", lambda m, v: m.write_token_maps(
        v["view"], [0, 1], [0, 24], T3, 2), ValueError,
        r"positions.*block column 6 >= max_kv_block_count 6"),
    Case("token_maps-column-beyond-table-width", lambda m, v: m.write_token_maps(
        v["view"], [0], [12], [row[:3] for row in T3], 1), ValueError,
        r"positions.*block column 3 >= block_table width 3"),
    Case("token_maps-negative-position", lambda m, v: m.write_token_maps(
        v["view"], [0], [-1], T3, 1), ValueError, r"positions.*-1"),
    Case("token_maps-padded-below-T", lambda m, v: m.write_token_maps(
        v["view"], [0, 0], [0, 1], T3, 1), ValueError, r"padded_token_count.*1.*2"),
    Case("token_maps-negative-padded", lambda m, v: m.write_token_maps(
        v["view"], [0], [0], T3, -1), ValueError, r"padded_token_count.*-1"),
    Case("token_maps-T-beyond-view", lambda m, v: m.write_token_maps(
        v["small"], [0] * 5, [0, 1, 2, 3, 4], T3, 5), ValueError, r"5.*max_tokens 4"),
    Case("token_maps-padded-beyond-view", lambda m, v: m.write_token_maps(
        v["small"], [0], [0], T3, 5), ValueError, r"padded_token_count.*max_tokens 4"),
    Case("token_maps-length-mismatch", lambda m, v: m.write_token_maps(
        v["view"], [0], [0, 1], T3, 2), ValueError, r"rows.*positions"),
    Case("token_maps-float-positions", lambda m, v: m.write_token_maps(
        v["view"], [0], torch.tensor([1.0]), T3, 1), DTYPE, r"positions"),
    # ---------------------------------------------------------- write_mha_metadata
    Case("mha-table-more-rows-than-requests", lambda m, v: m.write_mha_metadata(
        v["view"], [1, 1], [1, 1], T3, 2), ValueError, r"block_table.*3.*2"),
    Case("mha-table-width", lambda m, v: m.write_mha_metadata(
        v["view"], [1, 1], [1, 1], NARROW[:2], 2), ValueError, r"block_table width 5.*6"),
    Case("mha-negative-query-length", lambda m, v: m.write_mha_metadata(
        v["view"], [1, -1], [1, 1], T3[:2], 2), ValueError, r"query_lengths.*-1"),
    Case("mha-negative-kv-length", lambda m, v: m.write_mha_metadata(
        v["view"], [1, 1], [-2, 1], T3[:2], 2), ValueError, r"kv_lengths.*-2"),
    Case("mha-length-mismatch", lambda m, v: m.write_mha_metadata(
        v["view"], [1, 1], [1], T3[:2], 2), ValueError, r"kv_lengths"),
    Case("mha-padded-below-n", lambda m, v: m.write_mha_metadata(
        v["view"], [1, 1], [1, 1], T3[:2], 1), ValueError, r"padded_request_count.*1.*2"),
    Case("mha-padded-beyond-view", lambda m, v: m.write_mha_metadata(
        v["small"], [1, 1], [1, 1], T3[:2], 4), ValueError,
        r"padded_request_count.*max_requests 3"),
    Case("mha-n-beyond-view", lambda m, v: m.write_mha_metadata(
        v["small"], [1] * 4, [1] * 4, T3[:2], 4), ValueError,
        r"query_lengths.*4.*max_requests 3"),
    Case("mha-float-lengths", lambda m, v: m.write_mha_metadata(
        v["view"], torch.tensor([1.0]), [1], T3[:1], 1), DTYPE, r"query_lengths"),
    # ----------------------------------------------------------- setup_commit_pass
    Case("commit-count-beyond-R", lambda m, v: m.setup_commit_pass(
        v["view"], [1] * 9, T3 * 3), ValueError, r"append_counts.*9.*max_requests 8"),
    Case("commit-negative-count", lambda m, v: m.setup_commit_pass(
        v["view"], [2, -1], T3), ValueError, r"append_counts.*-1"),
    Case("commit-count-beyond-int32", lambda m, v: m.setup_commit_pass(
        v["view"], [2, 2**31], T3), ValueError,
        r"append_counts: count beyond int32 2147483648 at index 1"),
    Case("commit-negative-start", lambda m, v: m.setup_commit_pass(
        v["view"], [2, 1], T3, start_positions=[0, -2]), ValueError,
        r"start_positions.*-2"),
    Case("commit-span-beyond-W", lambda m, v: m.setup_commit_pass(
        v["view"], [25], T3), ValueError,
        r"append_counts.*block column 6 >= max_kv_block_count 6"),
    Case("commit-span-from-start-beyond-W", lambda m, v: m.setup_commit_pass(
        v["view"], [2, 5], T3, start_positions=[0, 20]), ValueError,
        r"start_positions.*request 1.*block column 6"),
    Case("commit-padded-tokens-below-total", lambda m, v: m.setup_commit_pass(
        v["view"], [3, 2], T3, padded_token_count=4), ValueError,
        r"padded_token_count.*4.*5"),
    Case("commit-total-beyond-view", lambda m, v: m.setup_commit_pass(
        v["small"], [3, 2], T3), ValueError, r"append_counts.*5.*max_tokens 4"),
    Case("commit-padded-tokens-beyond-view", lambda m, v: m.setup_commit_pass(
        v["view"], [3, 2], T3, padded_token_count=17), ValueError,
        r"padded_token_count.*max_tokens 16"),
    Case("commit-padded-requests-beyond-view", lambda m, v: m.setup_commit_pass(
        v["small"], [1, 1], T3, padded_request_count=4), ValueError,
        r"padded.request.count.*4.*max_requests 3"),
    Case("commit-padded-requests-below-P", lambda m, v: m.setup_commit_pass(
        v["view"], [1, 1], T3, padded_request_count=1), ValueError,
        r"padded_request_count.*1.*2"),
    Case("commit-table-too-few-rows", lambda m, v: m.setup_commit_pass(
        v["view"], [1, 1], T3[:1]), ValueError, r"block_table.*1.*2"),
    Case("commit-table-width", lambda m, v: m.setup_commit_pass(
        v["view"], [1, 1], NARROW), ValueError, r"block_table width 5.*6"),
    Case("commit-inherited-too-short", lambda m, v: m.setup_commit_pass(
        v["view"], [1, 1], T3, inherited_blocks=[1]), ValueError, r"inherited_blocks"),
    Case("commit-float-counts", lambda m, v: m.setup_commit_pass(
        v["view"], torch.tensor([1.0]), T3), DTYPE, r"append_counts"),
    # ---------------------------------------------------------- carry and row ops
    Case("carry-wrong-hidden-size", lambda m, v: m.carry_chunk_boundary(
        torch.ones(7), 1, 2), ValueError, r"hidden.*7.*hidden_size 8"),
    Case("carry-integer-hidden", lambda m, v: m.carry_chunk_boundary(
        torch.ones(8, dtype=torch.int32), 1, 2), DTYPE, r"hidden"),
    Case("reset-row-beyond-R", lambda m, v: m.reset_request_rows([1, 8]),
         IndexError, r"request_indexes.*8"),
    Case("reset-row-below-minus-R", lambda m, v: m.reset_request_rows(
        torch.tensor([-9])), IndexError, r"request_indexes.*-9"),
    Case("reset-mask-wrong-length", lambda m, v: m.reset_request_rows(
        torch.ones(7, dtype=torch.bool)), IndexError, r"request_indexes"),
    Case("reset-float-index", lambda m, v: m.reset_request_rows(torch.tensor([1.0])),
         DTYPE, r"request_indexes"),
    Case("move-length-mismatch", lambda m, v: m.move_request_rows([0, 1], [2]),
         ValueError, r"src_idxs.*dst_idxs"),
    Case("move-dst-out-of-range", lambda m, v: m.move_request_rows([0], [8]),
         IndexError, r"dst_idxs.*8"),
    Case("swap-src-out-of-range", lambda m, v: m.swap_request_rows([8], [0]),
         IndexError, r"src_idxs.*8"),
    Case("swap-length-mismatch", lambda m, v: m.swap_request_rows([0], [1, 2]),
         ValueError, r"src_idxs.*dst_idxs"),
]


def _primed(path: str):
    meta = make_metadata(path)
    meta.request_matched_prefix_blocks[:] = torch.tensor([1, 2, 3, 4, 5, 6, 1, 2],
                                                         dtype=torch.int32)
    meta.begin_decode(2, 3, [5, 9], T3, graphed=False)
    meta.stage_decode_lengths()
    meta.carry_chunk_boundary(torch.arange(8, dtype=torch.float32), 42, 17)
    views = {"view": make_view("context"),
             "small": make_view("context", max_requests=3, max_tokens=4),
             "wide": make_view("context", max_kv_blocks=7)}
    return meta, views


def _snapshot(meta, views):
    state = buffer_state(meta)
    for name, view in views.items():
        for field_name, tensor in view_state(view).items():
            state[f"{name}.{field_name}"] = tensor
    return state


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_raises_naming_the_argument_and_changes_nothing(path, case):
    """A half-applied bad call leaves the next forward with a block table, offsets or
    lengths from two different steps: KV written to the wrong block, silently. The
    message must point at the argument so the caller can find the bug."""
    meta, views = _primed(path)
    if case.prep is not None:
        case.prep(meta)
    before = _snapshot(meta, views)
    with pytest.raises(case.exc, match=case.match):
        case.call(meta, views)
    assert_same_state(before, _snapshot(meta, views))


UNALLOCATED = {
    "reset_request_rows": lambda m, v: m.reset_request_rows([0]),
    "move_request_rows": lambda m, v: m.move_request_rows([0], [1]),
    "swap_request_rows": lambda m, v: m.swap_request_rows([0], [1]),
    "carry_chunk_boundary": lambda m, v: m.carry_chunk_boundary(torch.ones(8), 1, 2),
    "take_chunk_boundary": lambda m, v: m.take_chunk_boundary(1, 2),
    "begin_decode": lambda m, v: m.begin_decode(1, 1, [0], T3, False),
    "begin_decode_for_capture": lambda m, v: m.begin_decode_for_capture(1),
    "advance_decode_step": lambda m, v: m.advance_decode_step(),
    "stage_decode_lengths": lambda m, v: m.stage_decode_lengths(),
    "setup_decode_step": lambda m, v: m.setup_decode_step(v),
    "stage_prefill_lengths": lambda m, v: m.stage_prefill_lengths([1], 0),
    "write_token_maps": lambda m, v: m.write_token_maps(v, [0], [0], T3, 1),
    "write_mha_metadata": lambda m, v: m.write_mha_metadata(v, [1], [1], T3[:1], 1),
    "setup_commit_pass": lambda m, v: m.setup_commit_pass(v, [1], T3),
}


@pytest.mark.parametrize("method", list(UNALLOCATED))
def test_use_before_allocate_names_allocate(method):
    """Construction is cheap and allocate comes later; forgetting it must produce an
    error that says so, not an AttributeError on None deep inside a kernel."""
    meta = MTPMetadata(**config())
    view = make_view("context")
    before = {**buffer_state(meta), **view_state(view)}
    with pytest.raises((ValueError, RuntimeError), match=r"allocate"):
        UNALLOCATED[method](meta, view)
    assert_same_state(before, {**buffer_state(meta), **view_state(view)})


_OPTIMIZED_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from mtpmeta import ChunkCarryError, ContextGPUView, MTPMetadata

    if __debug__:
        sys.exit("not running under -O")
    meta = MTPMetadata(enabled=True, max_requests=8, max_kv_block_count=6,
                       block_size_tokens=4, dummy_block_idx=999,
                       block_table_dtype=torch.int32, hidden_size=8,
                       hidden_dtype=torch.float32)
    meta.allocate("cpu", mirror=sys.argv[1] == "mirror")
    problems = []

    def expect_carry_error(label, req_id, seam):
        try:
            meta.take_chunk_boundary(req_id, seam)
        except ChunkCarryError:
            return
        problems.append(label)

    expect_carry_error("no carry", 7, 10)
    meta.carry_chunk_boundary(torch.ones(8), 7, 10)
    expect_carry_error("other request", 8, 10)
    expect_carry_error("other position", 7, 11)

    view = ContextGPUView(8, 16, 6, "cpu")
    view.buffer.fill_(0x5A)
    before = view.buffer.clone()
    table = [[10, 11, 12], [20, 21, 22]]  # 3 columns: position 12 is column 3
    try:
        meta.write_token_maps(view, [0, 1], [1, 12], table, 2)
        problems.append("write_token_maps accepted an out-of-table block column")
    except ValueError:
        pass
    if not torch.equal(before, view.buffer):
        problems.append("write_token_maps changed the view before raising")
    print("PROBLEMS:", problems)
    sys.exit(1 if problems else 0)
""")


def test_kv_protecting_checks_survive_python_O(path, tmp_path):
    """``python -O`` strips asserts: a carry check or a KV bound written as ``assert``
    would vanish in an optimized deployment and write through a foreign block."""
    script = tmp_path / "optimized_checks.py"
    script.write_text(_OPTIMIZED_SCRIPT)
    result = subprocess.run([sys.executable, "-O", str(script), path],
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PROBLEMS: []" in result.stdout
