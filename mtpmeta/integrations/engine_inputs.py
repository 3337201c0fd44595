"""The commit pass's inputs as Megatron's engine places them, brought to the host in
one read.

Upstream's ``MTPControllerMixin`` calls ``_mtp_setup_prefill_step`` with
``append_counts`` [A] and ``request_start_positions`` [A] as device int64 tensors,
``block_table_prefill`` [A, W] as a device copy (``.to(device)``) of the context's
``request_to_kv_block_ids[paused:total][:A]``, and ``total`` (the counts' sum, which
the caller has already read back). The context's ``request_to_kv_block_ids`` is a
host (pinned) int32 ``[R, W]`` tensor.

The library's commit pass validates every input on the host before it writes, so the
patched helper brings them there at the cost of one sync, the one upstream's helper
spends on ``seq_lengths.max().item()``:

- the device counts and start positions: one packed device-to-host read of ``16 * A``
  bytes (``torch.cat`` of both into a fixed ``[2R]`` int64 device buffer, then the
  runtime's ``to_host`` into its pinned host twin: ``ReadBack``, one pair per metadata,
  made at its first commit pass, so the passes after it allocate nothing);
- the block table: never read back. Its rows are taken from the context's host table,
  from which the engine copied ``block_table_prefill``. That holds only under
  upstream's contract, which the helper cannot check without reading the device copy:
  it assumes it when the context's table is a host integer tensor of the same width
  with at least ``A`` active rows (the engine casts its copy to the view's
  ``mha_block_table`` dtype; the library checks the host ids against that dtype). The
  host rows place and check every block a token writes, and the view's
  ``mha_block_table`` rows are copied from ``block_table_prefill`` itself on the device
  (``setup_commit_pass``'s ``device_block_table``): the table's ``4 * A * W`` bytes
  never cross the bus or pass through the host, and the rows are upstream's, ``-1``
  past each row's blocks. When the context's table is itself on the device (no host
  copy to read), its rows travel in the same packed read (one sync, ``8 * A * W`` more
  bytes, into buffers made for that read: outside upstream's placement).

What is validated: the counts, the start positions and the host table rows, in full
(each written block checked against the view before anything is written), and
``total`` against the counts' sum. What is not: that the device ``block_table_prefill``
holds the host rows it was copied from; the tokens' blocks are the host rows', the
attention's table rows the device copy's.

Why not a device route for the commit pass (torch ops sized by ``total`` and the
padded counts): it would still read the longest length back (one sync, as upstream),
so it saves no sync; it would check no value (a bad block or count would reach the
KV cache), and it would run upstream's dozens of device ops per pass where the host
route ships its staging in a few copies.
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from mtpmeta.buffers.device_runtime import get_runtime
from mtpmeta.buffers.grad_mode import kept_tensors
from mtpmeta.kernels import native
from mtpmeta.validation.inputs import is_device_tensor

__all__ = ["commit_inputs", "check_total", "longest_length", "ReadBack", "host_view"]

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
_VIEWED_DTYPES = (torch.int32, torch.int64)  # the kernels' dtypes, read as they are


def host_view(value: Any, runtime: Any) -> Any:
    """A host int32/int64 tensor (``runtime.is_host``) as its numpy view, anything else
    as it is. The commit pass reads its host inputs as numpy arrays, and a context
    array's active rows cost a tenth as much cut from the array (about 0.25 µs) as from
    the tensor (about 2.5 µs, then 1.5 µs for its view)."""
    if type(value) is torch.Tensor and value.dtype in _VIEWED_DTYPES \
            and runtime.is_host(value):
        return value.numpy()
    return value


def check_total(total: Any, counts: Any) -> None:
    """``total`` (the caller's ``append_counts.sum()``) must be the host counts' sum;
    ``ValueError`` naming both otherwise. ``counts``: host ints (anything else is left
    to the commit pass's own checks)."""
    if total is None:
        return
    try:
        host = np.asarray(counts)
    except (TypeError, ValueError, RuntimeError):
        return
    if host.ndim != 1 or host.dtype.kind not in "iu":
        return
    # Signed counts (the packed read's) in a kernel: numpy's sum dispatch costs more.
    expected = int(native.checks.total_of(host) if host.dtype.kind == "i" else host.sum())
    if isinstance(total, bool) or not isinstance(total, (int, np.integer)) \
            or int(total) != expected:
        raise ValueError(f"total: {total!r}, expected the sum of append_counts "
                         f"{expected}")


class ReadBack:
    """The read-backs' fixed buffers for one metadata: ``device`` ``[2R]`` int64, a new
    tensor like the input ``like`` (on its device: the counts, then the start
    positions), and ``host``, its pinned host twin (``runtime.host_empty``); the same
    pair at ``[]`` int32 for an eager depth's longest KV length (``longest``,
    ``longest_host``)."""

    def __init__(self, rows: int, like: torch.Tensor, runtime: Any) -> None:
        self.device = like.new_empty((2 * rows,), dtype=torch.int64)
        self.host = runtime.host_empty((2 * rows,), torch.int64)
        self.longest = like.new_empty((), dtype=torch.int32)
        self.longest_host = runtime.host_empty((), torch.int32)
        self._host_values = self.host.numpy()
        self._prefixes: Dict[int, Tuple[torch.Tensor, torch.Tensor, np.ndarray]] = {}

    def prefix(self, size: int) -> Tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        """``(device[:size], host[:size], host[:size] as numpy)``, built once per
        size (at most ``2R``): a packed read slices nothing."""
        views = self._prefixes.get(size)
        if views is None:
            views = self._prefixes[size] = (self.device[:size], self.host[:size],
                                            self._host_values[:size])
        return views


#: ``ReadBack`` per metadata (weakly: it goes with the metadata), remade when the
#: inputs arrive on another device.
_READ_BACKS: "weakref.WeakKeyDictionary[Any, ReadBack]" = weakref.WeakKeyDictionary()


def _read_back(meta: Any, like: torch.Tensor, runtime: Any) -> ReadBack:
    buffers = _READ_BACKS.get(meta)
    if buffers is None or buffers.device.device != like.device:
        with kept_tensors():  # kept for every later pass, in either grad mode
            buffers = _READ_BACKS[meta] = ReadBack(meta.max_requests, like, runtime)
    return buffers


def longest_length(meta: Any, lengths: torch.Tensor) -> int:
    """The largest of the device ``lengths`` (int32, at least one), read back into the
    fixed buffers: one sync, 4 bytes, no allocation (an eager draft depth's key bound
    after device start positions, which only the device knows)."""
    runtime = get_runtime()
    buffers = _read_back(meta, lengths, runtime)
    torch.amax(lengths, 0, out=buffers.longest)
    return int(runtime.to_host(buffers.longest, out=buffers.longest_host))


def _on_device(value: Any, runtime: Any) -> bool:
    """An integer tensor of the device (read back in the packed read)."""
    return is_device_tensor(value, runtime) and value.dtype in _INT_DTYPES


def _host_rows(context: Any, table: Any, rows: int, paused: int,
               runtime: Any) -> Optional[torch.Tensor]:
    """Rows ``paused .. paused + rows`` of the context's host table, when the device
    ``table`` is its copy by upstream's contract (module docstring); else None."""
    host = getattr(context, "request_to_kv_block_ids", None)
    if not (isinstance(host, torch.Tensor) and runtime.is_host(host) and host.dim() == 2
            and table.dim() == 2 and table.shape[1] == host.shape[1]
            and host.dtype in _INT_DTYPES and table.shape[0] >= rows
            and int(context.total_request_count) - paused >= rows):
        return None
    return host_view(host, runtime)[paused:paused + rows]


def commit_inputs(context: Any, append_counts: Any, block_table: Any,
                  start_positions: Any, meta: Any) -> Tuple[Any, Any, Any, Any]:
    """``(append_counts, block_table, start_positions, device_rows)`` with every device
    tensor replaced by host values (module docstring); host inputs come back as they
    are. The host counts and start positions are views of ``meta``'s ``ReadBack``,
    valid until its next commit pass. ``device_rows``: the caller's device
    ``block_table`` when its host rows were taken from the context's table (for
    ``setup_commit_pass``'s ``device_block_table``), else None.

    ``start_positions``: in active order (entry ``i`` for request ``i``). A device
    table of exactly ``max_requests`` rows behind paused rows is the context's whole
    table, whose active rows are read. Tensors of a non-integer dtype are left on the
    device for the commit pass to refuse.
    """
    runtime = get_runtime()
    counts_dev = _on_device(append_counts, runtime)
    table_dev = _on_device(block_table, runtime)
    starts_dev = _on_device(start_positions, runtime)
    if not (counts_dev or table_dev or starts_dev):
        return append_counts, block_table, start_positions, None
    paused = int(context.paused_request_count)
    if counts_dev and append_counts.dim() != 1:
        return append_counts, block_table, start_positions, None  # refused by the pass
    requests = append_counts.shape[0] if counts_dev else len(append_counts)
    parts: List[torch.Tensor] = []
    max_requests = meta.max_requests
    size = 0  # the packed read's entries
    if counts_dev:
        parts.append(append_counts)
        size = requests
    if starts_dev and start_positions.dim() == 1 and start_positions.shape[0] >= requests:
        parts.append(start_positions if start_positions.shape[0] == requests
                     else start_positions[:requests])
        size += requests
    else:
        starts_dev = False
    table_rows = None
    if table_dev:
        table_rows = _host_rows(context, block_table, requests, paused, runtime)
        if table_rows is None and block_table.dim() == 2:
            whole = paused and block_table.shape[0] == max_requests
            first = paused if whole else 0
            if block_table.shape[0] - first >= requests:
                parts.append(block_table[first:first + requests]
                             .reshape(-1).to(torch.int64))
                size += parts[-1].numel()
            else:
                table_dev = False
        elif table_rows is None:
            table_dev = False
    if not parts:
        return (append_counts, block_table, start_positions, None) if table_rows is None \
            else (append_counts, table_rows, start_positions, block_table)
    values = None
    if size <= 2 * max_requests:  # upstream's placement: into the fixed buffers
        packed, out, values = _read_back(meta, parts[0], runtime).prefix(size)
        torch.cat(parts, out=packed)  # int64, whatever the parts' integer dtypes
    else:  # the rows of a device context table besides: made for this read
        packed, out = torch.cat([part.to(torch.int64) for part in parts]), None
    try:
        host = runtime.to_host(packed, out=out)  # the one sync
    except NotImplementedError as err:  # meta tensors (a runtime may answer for them)
        raise ValueError(f"append_counts, request_start_positions, block_table_prefill: "
                         f"a {packed.device.type} tensor has no values to read back "
                         f"({err})") from err
    if host is not out:  # numpy views: what the commit pass reads as they are
        values = host.numpy()
    at = 0
    if counts_dev:
        append_counts, at = values[:requests], requests
    if starts_dev:
        start_positions, at = values[at:at + requests], at + requests
    device_rows = None
    if table_rows is not None:
        block_table, device_rows = table_rows, block_table
    elif table_dev:
        block_table = host[at:].view(requests, block_table.shape[1]).to(block_table.dtype)
    return append_counts, block_table, start_positions, device_rows
