"""The standard-step ring stress, shared by its GPU test
(``tests/gpu/test_cuda_ring_stress.py``) and its simulator twin
(``tests/test_sim_ring_stress.py``).

A window of standard steps (a draft loop of ``depths`` depths, each staging its MHA
lengths, then a commit pass) runs with host inputs while the device is held back (a
sleeping stream on CUDA, a device that runs nothing on its own in the simulator), on
``staging_slots`` of 2 to 4. Every call of the window uses a pinned ring (the begin
ring, the lengths ring, the forward ring and the draft loop's shared stages behind
them), so the host fills every slot and the next use of a slot must wait on its fence
while the copy reading it is still queued. After each call a "forward" copies the
destination view and the persistent buffers on the device (what the model would read
then); each copy must equal what the reference (``mtpmeta.reference``, on the CPU)
holds after the same call.

Failure story: a slot reused before the copy reading it ran (a missing or misplaced
fence) hands an earlier forward a later step's offsets, lengths or block rows; the
forward reads them silently. The negative control removes the fence wait
(``no_fence_waits``: ``CopyFence.wait``, the seam every ring waits through) and must
see wrong forwards.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Tuple

import pytest
import torch

from mtpmeta import VIEW_FIELDS
from mtpmeta.bench.workload import StepConfig, StepInputs
from mtpmeta.buffers.device_runtime import CopyFence
from mtpmeta.reference import ReferenceGPUView, ReferenceMTPMetadata

FIELDS = tuple(f.name for f in VIEW_FIELDS)
BUFFERS = ("offsets", "block_table", "query_lengths", "kv_lengths")
#: The calls of the window that stage a forward through the forward ring.
FORWARDS = frozenset({"setup_decode_step", "setup_commit_pass"})

Snapshot = Dict[str, torch.Tensor]


def calls_per_step(cfg: StepConfig) -> int:
    """Calls after which the window takes a forward: a begin, two per depth, a commit."""
    return 2 + 2 * cfg.depths


def run_window(meta: Any, view: Any, steps: List[StepInputs], cfg: StepConfig,
               after: Callable[[str], None]) -> None:
    """The window's calls on ``meta`` and ``view``; ``after(name)`` after each one."""
    for step in steps:
        meta.begin_decode(cfg.active, cfg.padded_active, step.start_positions,
                          step.block_table, False)
        after("begin_decode")
        for _ in range(cfg.depths):
            meta.setup_decode_step(view)
            after("setup_decode_step")
            meta.stage_decode_lengths()
            after("stage_decode_lengths")
            meta.advance_decode_step()
        meta.end_forward()
        meta.setup_commit_pass(view, step.append_counts, step.block_table,
                               start_positions=step.commit_starts,
                               inherited_blocks=step.inherited,
                               padded_token_count=step.padded_tokens,
                               padded_request_count=step.padded_requests)
        after("setup_commit_pass")
        meta.end_forward()


def reference_forwards(cfg: StepConfig, warm: List[StepInputs],
                       steps: List[StepInputs]) -> List[Tuple[str, Snapshot]]:
    """The reference on the CPU through ``warm`` and then ``steps``: ``(call, fields and
    buffers)`` after each call of ``steps``."""
    ref = ReferenceMTPMetadata(**cfg.metadata_kwargs())
    ref.allocate("cpu")
    view = ReferenceGPUView(cfg.max_requests, cfg.max_tokens, cfg.block_columns, "cpu")
    run_window(ref, view, warm, cfg, lambda name: None)
    out: List[Tuple[str, Snapshot]] = []

    def keep(name: str) -> None:
        snap = {field: getattr(view, field).clone() for field in FIELDS}
        snap.update({buffer: getattr(ref, buffer).clone() for buffer in BUFFERS})
        out.append((name, snap))

    run_window(ref, view, steps, cfg, keep)
    return out


def wrong_forwards(ours: List[Snapshot], theirs: List[Tuple[str, Snapshot]]
                   ) -> List[str]:
    """``"forward i (after call): name"`` for every field or buffer that differs."""
    assert len(ours) == len(theirs), (len(ours), len(theirs))
    wrong = []
    for index, (mine, (call, ref)) in enumerate(zip(ours, theirs)):
        for name, value in mine.items():
            want = ref[name].to(value.dtype).reshape(value.shape)
            if not torch.equal(value, want):
                wrong.append(f"forward {index} (after {call}): {name}")
    return wrong


def first_stall(stalls: List[int], calls: List[str]) -> Tuple[int, int]:
    """``(index of the first call that waited on a fence, forwards staged before it)``;
    ``(-1, all forwards)`` when none waited."""
    index = next((i for i, count in enumerate(stalls) if count), -1)
    staged = calls if index < 0 else calls[:index]
    return index, sum(name in FORWARDS for name in staged)


def assert_ran_ahead_then_waited(stalls: List[int], calls: List[str], awake: List[bool],
                                 slots: int) -> None:
    """The host staged at least ``slots`` forwards without waiting, the device did not
    run before the first call that waited on a fence (``awake[i]``: whether the device
    had run by call ``i``), and that call waited for it."""
    index, staged = first_stall(stalls, calls)
    assert index > 0, f"no call waited on a fence: {list(zip(calls, stalls))}"
    assert staged >= slots, (staged, calls[:index + 1])
    assert not any(awake[:index]), "the device ran before the host waited on a fence"
    assert awake[index], "the call that stalled on a fence did not wait for the device"


@contextlib.contextmanager
def no_fence_waits(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The negative control: every ring reuses its slots without waiting for the copies
    still reading them (``CopyFence.wait`` a no-op)."""
    with monkeypatch.context() as patch:
        patch.setattr(CopyFence, "wait", lambda self: None)
        yield
