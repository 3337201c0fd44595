"""Fenced staging reuse: a pinned slot is never rewritten while a copy from it may be
in flight. On the CPU the real fence is a no-op, so the ordering is checked with a
recording fake fence injected into the ring and into the mirror backend."""

from __future__ import annotations

import torch

from mtpmeta import ContextGPUView
from mtpmeta.buffers.device_runtime import CopyFence, TorchRuntime
from mtpmeta.mirror.pinned_ring import StagingRing


class RecordingFence:
    """A fence that logs ``wait``/``record`` calls into a shared journal."""

    journal: list = []

    def __init__(self, device):
        self.index = len([f for f in RecordingFence.instances])
        RecordingFence.instances.append(self)
        self.recorded = False

    def record(self):
        self.recorded = True
        RecordingFence.journal.append(("record", self.index))

    def wait(self):
        RecordingFence.journal.append(("wait", self.index, self.recorded))


RecordingFence.instances = []


class RecordingRuntime(TorchRuntime):
    """The real runtime with its fence factory swapped for ``RecordingFence``."""

    def fence(self, device):
        return RecordingFence(device)


def _fresh_fences():
    RecordingFence.instances = []
    RecordingFence.journal = []


def test_ring_waits_on_the_slot_it_hands_out_before_reuse():
    """acquire() waits on exactly the fence of the slot it returns, round robin, so
    slot k is rewritten only after the fence recorded by its previous release."""
    _fresh_fences()
    ring = StagingRing(64, 3, torch.device("cpu"), RecordingRuntime())
    order = []
    for _ in range(7):
        slot = ring.acquire()
        order.append(slot)
        ring.release(slot)
    assert order == [0, 1, 2, 0, 1, 2, 0]
    waits = [entry for entry in RecordingFence.journal if entry[0] == "wait"]
    assert [w[1] for w in waits] == order
    # The first lap waits on unrecorded fences; every reuse waits on a recorded one.
    assert [w[2] for w in waits] == [False, False, False, True, True, True, True]
    # Each wait on slot k comes after the record of slot k's previous use.
    for position, entry in enumerate(RecordingFence.journal):
        if entry[0] == "wait" and entry[2]:
            assert ("record", entry[1]) in RecordingFence.journal[:position]


def test_mirror_backend_records_after_issuing_and_waits_before_restaging():
    """Through the public API: every forward's slot is released (fence recorded) after
    its copy is issued, and restaging into a slot waits on that slot's fence first."""
    from tests.helpers import config
    from mtpmeta.buffers.persistent import PersistentBuffers
    from mtpmeta.mirror.backend import MirrorBackend

    _fresh_fences()
    kwargs = config()
    buffers = PersistentBuffers.allocate(
        max_requests=kwargs["max_requests"], max_kv_block_count=kwargs["max_kv_block_count"],
        dummy_block_idx=kwargs["dummy_block_idx"], block_table_dtype=torch.int32,
        hidden_size=kwargs["hidden_size"], hidden_dtype=torch.float32,
        device=torch.device("cpu"))
    backend = MirrorBackend(buffers, max_requests=kwargs["max_requests"],
                            block_size=kwargs["block_size_tokens"],
                            dummy=kwargs["dummy_block_idx"], max_tokens=64, num_slots=2,
                            runtime=RecordingRuntime())
    from mtpmeta.gpu_view import ViewTarget
    import numpy as np

    view = ContextGPUView(kwargs["max_requests"], 64, kwargs["max_kv_block_count"])
    target = ViewTarget(view)
    starts = np.array([1, 2, 3], dtype=np.int64)
    table = np.arange(3 * kwargs["max_kv_block_count"]).reshape(3, -1)
    backend.begin_decode(3, starts, table)
    RecordingFence.journal = []
    for _ in range(4):
        backend.decode_step(target, 3, 4, False)
    # Forward ring fences are instances 2, 3 (begin ring 0-1, lengths ring 2-3 come
    # first in construction order); find them from the journal itself.
    waits = [e for e in RecordingFence.journal if e[0] == "wait"]
    records = [e for e in RecordingFence.journal if e[0] == "record"]
    assert len(waits) == 4 and len(records) == 4
    assert waits[0][1] != waits[1][1] and waits[0][1] == waits[2][1]
    assert [w[2] for w in waits] == [False, False, True, True]
    journal = RecordingFence.journal
    for i in range(0, len(journal), 2):
        assert journal[i][0] == "wait" and journal[i + 1] == ("record", journal[i][1])


def test_cpu_fence_is_a_no_op():
    fence = CopyFence(torch.device("cpu"))
    fence.wait()
    fence.record()
    fence.wait()
