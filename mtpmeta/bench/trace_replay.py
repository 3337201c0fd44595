"""Replaying a trace (``mtpmeta.bench.trace``) through each path, and counting it.

A :class:`Replay` is one path's objects plus its own ``[R, W]`` host table: ``prepare``
applies a step's table rows (untimed), ``run`` makes the step's calls in engine order
(rows, take, commit pass, carry, draft loop). The captured row's draft loop is its host
side only (``begin_decode(..., capture_setup=True)`` + ``end_forward``: the graph
replays are device work the caller launches); ``depths=True`` also runs the depths
eagerly (what a replay computes), for the agreement check.

On torch's ``meta`` device the reference's read-backs (``.item()``: the commit's token
count and longest length, the eager loop's ``max_seqlen_k``) cannot run: they are
answered from a CPU replay of the trace and counted (:class:`HostKnownReference`).
:class:`DropIn` is that sequence with mtpmeta's individual writers in place of its own.
The ``megatron`` path makes the commit pass and the draft loop through an engine
context's MTP helpers as ``mtpmeta.integrations.megatron.patch()`` installs them
(``mtpmeta.bench.engine_context``): the trace's requests hold rows ``[0, P)``, so each
step declares the split ``(0, P)`` and passes the context's whole ``[R, W]`` table. The
``upstream engine`` and ``megatron engine`` paths drive an engine context with
Megatron's client placement (``mtpmeta.bench.engine_placement``): upstream's helpers on
the reference, and the helpers ``patch()`` installs, whose read-backs of the client's
device inputs on meta its ``PlacementRuntime`` answers with the values a CPU replay of
the same trace read (``known_syncs``), in order, shape and dtype checked.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Container, Dict, Iterator, List, Optional, Tuple

import torch

from mtpmeta.reference import ReferenceMTPMetadata
from mtpmeta.buffers.device_runtime import TorchRuntime, get_runtime, use_runtime
from mtpmeta.bench.engine_context import EngineContext
from mtpmeta.bench.engine_placement import EnginePlacement, PlacementRuntime, patched_engine
from mtpmeta.bench.trace import TraceConfig, TraceStep
from mtpmeta.bench.upstream_helpers import UpstreamEngineContext
from mtpmeta.bench.variants import build, state_of

__all__ = ["HostKnownReference", "DropIn", "PATHS", "ENGINE_PATHS", "PLACEMENT_PATHS",
           "Replay", "known_syncs", "check_trace", "device_inputs"]


class HostKnownReference(ReferenceMTPMetadata):
    """The reference whose read-backs come from ``known`` (an iterator the replay sets
    per step; None: read them, and append them to ``recorded``)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.known: Optional[Iterator[int]] = None
        self.recorded: List[int] = []
        self.patched = 0
        self.read_bytes = 0  # of the answered read-backs

    def _host_int(self, value: torch.Tensor) -> int:
        if self.known is None:
            self.recorded.append(super()._host_int(value))
            return self.recorded[-1]
        self.patched += 1
        self.read_bytes += value.element_size()
        return next(self.known)


class DropIn(HostKnownReference):
    """"The drop-in": upstream's own helper sequence (the reference's fused calls and
    device ops) with mtpmeta's individual writers (``write_token_maps``,
    ``write_mha_metadata`` of a mirror-path ``MTPMetadata`` on the same device) in
    place of its own; on a device their inputs are device tensors (the device route)."""

    def __init__(self, max_tokens: int, **kwargs: Any) -> None:
        from mtpmeta.metadata import MTPMetadata

        super().__init__(**kwargs)
        self.library = MTPMetadata(**kwargs)
        self._max_tokens = max_tokens

    def allocate(self, device: torch.device, *, mirror: Any = None) -> None:
        super().allocate(device)
        self.library.allocate(device, mirror=True, max_tokens=self._max_tokens)

    def write_token_maps(self, gpu_view: Any, rows: Any, positions: Any, block_table: Any,
                         padded_token_count: int, inherited_blocks: Any = None) -> None:
        device = gpu_view.token_to_pos_ids.device
        inherited = (None if inherited_blocks is None
                     else torch.as_tensor(inherited_blocks).to(device))
        self.library.write_token_maps(gpu_view, rows, positions,
                                      torch.as_tensor(block_table).to(device),
                                      padded_token_count, inherited)

    def write_mha_metadata(self, gpu_view: Any, query_lengths: Any, kv_lengths: Any,
                           block_table: Any, padded_request_count: int) -> None:
        self.library.write_mha_metadata(gpu_view, query_lengths, kv_lengths, block_table,
                                        padded_request_count)


def _library(path: str, config: TraceConfig, device: torch.device):
    return build(path, config.step_config(), device)


def _reference(config: TraceConfig, device: torch.device, drop_in: bool = False):
    step_config = config.step_config()
    kwargs = step_config.metadata_kwargs()
    meta = (DropIn(step_config.max_tokens, **kwargs) if drop_in
            else HostKnownReference(**kwargs))
    meta.allocate(device)
    return meta, build("reference", step_config, device)[1]


#: How each path's ``(metadata, view)`` is built for a trace geometry on a device: the
#: one place a new path joins the replay (``trace_bench.ROWS`` then names it in a row).
#: A path whose metadata must answer read-backs from the host on ``meta`` is a
#: ``HostKnownReference`` (a :class:`Replay` hands it the values the host knows);
#: ``captured`` is the mirror path whose draft loop is its host side only.
PATHS: Dict[str, Callable[[TraceConfig, torch.device], Tuple[Any, Any]]] = {
    "reference": _reference,
    "direct": lambda config, device: _library("direct", config, device),
    "mirror": lambda config, device: _library("mirror", config, device),
    "captured": lambda config, device: _library("mirror", config, device),
    "drop-in": lambda config, device: _reference(config, device, drop_in=True),
    "megatron": lambda config, device: _library("mirror", config, device),
    "upstream engine": _reference,
    "megatron engine": lambda config, device: _library("mirror", config, device),
}
#: Paths whose steps go through an engine context's helpers (:class:`Replay`).
ENGINE_PATHS = ("megatron",)
#: Paths driven with Megatron's client placement (``mtpmeta.bench.engine_placement``):
#: upstream's helpers on the reference, and the helpers ``patch()`` installs.
PLACEMENT_PATHS = ("upstream engine", "megatron engine")


class Replay:
    """One path (a name in ``PATHS``) on ``device``, replaying trace steps with the
    table on ``table_device`` (default: the host).

    ``counts``: the calls pass the step's ``block_counts`` (the opt-in of contract §5);
    ``masked``: the table holds the dummy block instead of -1 past each row's blocks,
    what a call with counts must equal (``check_trace``'s oracle for those rows);
    ``"commit"``: only the commit pass's table does, the draft loop's keeps -1 (the
    oracle of the Megatron helpers, which pass counts to the commit pass only)."""

    def __init__(self, path: str, config: TraceConfig, device: torch.device,
                 table_device: str = "cpu", known: Optional[List[List[int]]] = None,
                 depths: bool = False, counts: bool = False, masked: Any = False
                 ) -> None:
        self.path, self.config = path, config
        self.runtime = (PlacementRuntime(get_runtime(), holds=device.type == "cpu")
                        if path == "megatron engine" else None)  # answers its read-backs
        with use_runtime(self.runtime) if self.runtime else contextlib.nullcontext():
            self.meta, self.view = PATHS[path](config, device)
        self.counts = counts
        # the Megatron helpers pass the context's block counts to the commit pass only
        # (``patch()``'s default), not with the client's device table rows
        self.commit_counts = path in ENGINE_PATHS
        self.empty = self.meta.dummy_block_idx if masked else -1  # past the blocks
        self.table = torch.full((config.max_requests, config.block_columns), self.empty,
                                dtype=torch.int32)
        self.draft_empty = -1 if masked == "commit" else self.empty
        self.draft_table = (self.table if table_device == "cpu" and masked != "commit"
                            else torch.full_like(self.table, self.draft_empty,
                                                 device=table_device))  # begin_decode's
        # per step, for a path that answers its read-backs from the host (on meta)
        self.known = known if isinstance(self.meta, HostKnownReference) or (
            self.runtime is not None and device.type == "meta") else None
        self.captured = path == "captured"
        self.depths = depths or not self.captured
        seqlen = config.block_columns * config.block_size
        self.engine = (EngineContext(self.meta, self.view, self.table, seqlen)
                       if path in ENGINE_PATHS else None)
        self.placement = None
        if path in PLACEMENT_PATHS:
            engine = (UpstreamEngineContext(self.meta, self.view, self.table, seqlen)
                      if self.runtime is None else
                      patched_engine(self.meta, self.view, self.table, seqlen, counts))
            self.placement = EnginePlacement(engine, device, self.runtime)

    def read_backs(self) -> Tuple[int, int]:
        """``(reads, bytes)`` read back so far and answered from the host: the
        reference's on meta, the patched helpers' of the client's device inputs."""
        if self.runtime is not None:
            return self.runtime.syncs, self.runtime.read_bytes
        if isinstance(self.meta, HostKnownReference):
            return self.meta.patched, self.meta.read_bytes
        return 0, 0

    def reset(self) -> None:
        if self.runtime is not None:  # the last step's known read-backs all answered
            self.runtime.expect(None)
        self.table.fill_(self.empty)
        if self.draft_table is not self.table:
            self.draft_table.fill_(self.draft_empty)

    def prepare(self, index: int, step: TraceStep) -> None:
        """Untimed: this step's table rows and the reference's known read-backs."""
        if step.table_rows.numel():
            values = step.table_values
            if self.empty != -1:
                values = values.masked_fill(values < 0, self.empty)
            self.table[step.table_rows] = values
            if self.draft_table is not self.table:
                device = self.draft_table.device
                self.draft_table[step.table_rows.to(device)] = step.table_values.to(device)
        if self.runtime is not None:
            self.runtime.expect(None if self.known is None else self.known[index])
        elif self.known is not None:
            self.meta.known = iter(self.known[index])
        if self.engine is not None:  # the engine's counts and its requests' prefix hits
            requests = step.inherited.numel()
            self.engine.total_request_count = requests
            self.engine.request_matched_prefix_blocks[:requests] = step.inherited
            self.engine.request_kv_block_counts.copy_(step.block_counts)
        if self.placement is not None:  # the client's inputs, placed as it places them
            self.placement.prepare(step)

    def run(self, step: TraceStep) -> None:
        meta, view, table = self.meta, self.view, self.table
        if step.move_src is not None:
            meta.move_request_rows(step.move_src, step.move_dst)
        if step.swap_src is not None:
            meta.swap_request_rows(step.swap_src, step.swap_dst)
        if step.reset_rows is not None:
            meta.reset_request_rows(step.reset_rows)
        if step.take is not None:
            meta.take_chunk_boundary(*step.take)
        if self.engine is not None:
            self._run_engine(step)
            return
        if self.placement is not None:
            self.placement.run(step, meta, self.config.depths)
            return
        extra = {"block_counts": step.block_counts} if self.counts else {}
        meta.setup_commit_pass(view, step.append_counts, table,
                               start_positions=step.commit_starts,
                               inherited_blocks=step.inherited,
                               padded_token_count=step.padded_tokens,
                               padded_request_count=step.padded_requests, **extra)
        meta.end_forward()
        if step.carry is not None:
            meta.carry_chunk_boundary(*step.carry)
        table = self.draft_table
        if self.captured:
            meta.begin_decode(step.active, step.padded, step.start_positions, table, True,
                              capture_setup=True, **extra)
        else:
            meta.begin_decode(step.active, step.padded, step.start_positions, table, True,
                              **extra)
        if self.depths:
            for _ in range(self.config.depths):
                meta.setup_decode_step(view)
                meta.advance_decode_step()
        meta.end_forward()

    def _run_engine(self, step: TraceStep) -> None:
        """The step's commit pass and draft loop through the engine's helpers."""
        engine, meta = self.engine, self.meta
        engine._mtp_setup_prefill_step(step.append_counts, self.table, step.padded_tokens,
                                       step.padded_requests, step.commit_starts)
        meta.end_forward()
        if step.carry is not None:
            meta.carry_chunk_boundary(*step.carry)
        engine._mtp_begin_decode(step.active, step.padded, step.start_positions, True)
        for _ in range(self.config.depths):
            engine._mtp_setup_decode_step()
            meta.advance_decode_step()
        meta.end_forward()

    def replay(self, trace: List[TraceStep]) -> None:
        """Every step, untimed (a warm-up or a counting pass)."""
        self.reset()
        for index, step in enumerate(trace):
            self.prepare(index, step)
            self.run(step)


def known_syncs(config: TraceConfig, trace: List[TraceStep], path: str = "reference",
                counts: bool = False) -> List[List[Any]]:
    """The read-back values per step of ``path`` (``counts`` as ``Replay``'s) from a
    CPU replay: the ints of one whose metadata is a ``HostKnownReference``, the host
    tensors of the ``megatron engine`` path's ``to_host`` (``PlacementRuntime``)."""
    replay = Replay(path, config, torch.device("cpu"), counts=counts)
    recorded = replay.runtime.recorded if replay.runtime else replay.meta.recorded
    out = []
    replay.reset()
    for index, step in enumerate(trace):
        replay.prepare(index, step)
        start = len(recorded)
        replay.run(step)
        out.append(recorded[start:])
    return out


def device_inputs(trace: List[TraceStep], device: str) -> List[TraceStep]:
    """The trace with the draft loop's start positions as ``device`` tensors (the
    device-input route; a replay with ``table_device`` gives ``begin_decode`` a device
    table too). The commit pass keeps host inputs: ``setup_commit_pass`` reads device
    inputs back (contract §8, one sync each), which the meta device cannot do."""
    from dataclasses import replace

    return [replace(s, start_positions=s.start_positions.to(device)) for s in trace]


class _MarkedInputs(TorchRuntime):
    """``TorchRuntime`` that reports the CPU tensors in ``marked`` (by ``id``) as
    device tensors, so a CPU replay takes the device-input route for them."""

    def __init__(self, marked: set) -> None:
        super().__init__()
        self.marked = marked

    def is_device(self, tensor: torch.Tensor) -> bool:
        return id(tensor) in self.marked or not tensor.is_cpu

    def is_host(self, tensor: torch.Tensor) -> bool:
        return not self.is_device(tensor)


def _device_input_replay(config: TraceConfig, trace: List[TraceStep]) -> Replay:
    """The mirror path on the CPU with the draft loop's start positions and table
    taken as device tensors (the device-input route, its depths planned at the begin:
    ``mtpmeta.mirror.device_draft_plan``); the commit pass keeps host inputs."""
    marked: set = set()
    with use_runtime(_MarkedInputs(marked)):
        replay = Replay("mirror", config, torch.device("cpu"), depths=True)
    replay.draft_table = replay.table.clone()  # begin_decode's own table
    marked.add(id(replay.draft_table))
    marked.update(id(step.start_positions) for step in trace)
    return replay


def check_trace(config: TraceConfig, trace: List[TraceStep],
                paths: Tuple[str, ...] = ("direct", "mirror", "captured", "drop-in",
                                          "megatron", "upstream engine", "megatron engine"),
                counts: Tuple[str, ...] = ("direct", "mirror", "captured"),
                device_inputs: bool = True,
                inference_steps: Container[int] = ()) -> Optional[str]:
    """Replay ``trace`` on the CPU through the reference and ``paths`` (the captured
    path's depths run eagerly), the mirror path with device inputs (``mirror, device
    inputs``, with ``device_inputs``), the ``counts`` paths with block counts against
    the reference on the table with the dummy block past the counts. Describe the first
    step where one's view or persistent buffers differ from its reference's (an engine
    path's ``request_matched_prefix_blocks`` aside: ``patch()`` copies there the hits
    the engine keeps on its context, which the reference takes as ``inherited_blocks``),
    or None. Steps in ``inference_steps`` run in ``torch.inference_mode()``, built outside
    it."""
    cpu = torch.device("cpu")
    replays = {path: Replay(path, config, cpu, depths=True)
               for path in ("reference",) + paths}
    if counts:
        replays["reference, masked"] = Replay("reference", config, cpu, masked=True)
        for path in counts:
            replays[f"{path}, block counts"] = Replay(path, config, cpu, depths=True,
                                                      counts=True)
    if device_inputs:
        replays["mirror, device inputs"] = _device_input_replay(config, trace)
    if any(replay.commit_counts for replay in replays.values()):
        replays["reference, commit masked"] = Replay("reference", config, cpu,
                                                     masked="commit")
    for replay in replays.values():
        replay.reset()
    for index, step in enumerate(trace):
        states = {}
        with torch.inference_mode(index in inference_steps):
            for path, replay in replays.items():
                replay.prepare(index, step)
                replay.run(step)
                states[path] = state_of(replay.meta, replay.view)
        for path, state in states.items():
            if path.startswith("reference"):
                continue
            expected = states[_oracle(replays[path])]
            lengths = _captured_lengths(step) if replays[path].captured else {}
            if replays[path].engine or replays[path].placement:  # see the docstring
                lengths["request_matched_prefix_blocks"] = 0
            for key, value in expected.items():
                end = lengths.get(key, value.shape[0])
                if not torch.equal(state[key][:end], value[:end].to(state[key].dtype)):
                    return f"trace step {index}: {path} differs from the reference in {key}"
    return None


def _oracle(replay: Replay) -> str:
    """The reference replay ``check_trace`` holds ``replay`` to."""
    if replay.commit_counts:
        return "reference, commit masked"
    masked = replay.counts and replay.placement is None  # placement: device rows as such
    return "reference, masked" if masked else "reference"


def _captured_lengths(step: TraceStep) -> Dict[str, int]:
    """The prefixes a captured draft loop writes as the default route does (contract
    §12): the padded rows of the pad-masked fields, the ``n`` real rows of the rest."""
    n, padded = step.active, step.padded
    lengths = dict.fromkeys(("token_to_block_idx", "token_to_local_position_within_kv_block",
                             "mha_query_lengths", "mha_kv_seq_lengths", "mha_block_table"),
                            padded)
    lengths.update(dict.fromkeys(("mha_cu_query_seq_lengths", "mha_cu_kv_seq_lengths"),
                                 padded + 1))
    lengths.update(dict.fromkeys(("token_to_request_idx", "token_to_position_in_request",
                                  "token_to_pos_ids", "offsets", "query_lengths",
                                  "kv_lengths", "block_table"), n))
    return lengths
