"""``patch()``: Megatron-core's inference engine on mtpmeta, in one call.

As ``apply_liger_kernel_to_llama()`` does for a Hugging Face model, ``patch()``
replaces, in the installed megatron-core, what its engine uses for the MTP draft-KV
cache:

- ``MTPMetadata`` and ``MTPForwardMode`` of upstream's module
  ``megatron.core.inference.contexts.mtp_metadata`` become this library's, there and in
  every ``megatron`` module already imported that holds upstream's object under that
  name (``from .mtp_metadata import MTPForwardMode`` binds the name at import, and
  importing upstream's module imports its package, the engine's context included);
- the three context helpers of ``megatron.core.inference.contexts.mtp_context_mixin.
  MTPContextMixin`` (``_mtp_begin_decode``, ``_mtp_setup_decode_step``,
  ``_mtp_setup_prefill_step``) become the functions below: one fused call each
  (``begin_decode``, ``setup_decode_step``, ``setup_commit_pass``; docs/contract.md
  §5, §10) instead of upstream's writer sequence.

Call it before the engine builds its context: the context constructs its
``MTPMetadata`` then, and the replaced helpers need this library's. ``patch()`` twice
is one patch; ``unpatch()`` puts every original back, object for object. Neither
imports megatron before it is called (``import mtpmeta`` never does); without the
modules, ``patch()`` raises ``ImportError`` naming the one that is missing.

The replacements keep upstream's signatures and upstream's effects on the context: the
bytes of ``context.gpu_view`` (contract §13: the writers touch nothing outside the ten
MTP fields), the arguments of every ``context._mtp_activate_attn_metadata(...)`` call,
and ``forward_mode`` afterwards (``COMMIT`` after the prefill step). What they drop is
the read-back: upstream's eager helpers take ``kv_len.max().item()`` (a draft depth)
and ``seq_lengths.max().item()`` (the commit pass) from the device, a sync each; these
take both from the ``ForwardShape`` the fused call computed on the host. The one
exception is an eager draft depth after ``start_positions`` arrived as a device tensor:
the host has no copy of them (contract §10, ``max_seqlen_k`` is None), so that depth
reads its longest KV length back from the view as upstream does. Host inputs keep the
whole step free of syncs. On the engine's own placement (device counts and start
positions, ``block_table_prefill`` a device copy of rows of the context's host table)
the commit pass reads the counts and start positions back in one packed read, ``16 *
A`` bytes and upstream's one sync, and takes the table rows from the context's host
table instead of reading the device copy, which places the view's table rows on the
device (``engine_inputs``, which says what that assumes and what is validated).

Documented differences the replacements inherit from the library (README,
"Differences from upstream"): inputs are validated before anything is written, and a
full commit batch (``P == max_requests``) with pad tokens points the absorbing request's
block columns past its span at the dummy block instead of copying the caller's row.
By default (``patch(block_counts=False)`` turns it off) a commit pass given a host
table also takes the context's ``request_kv_block_counts``, and its ``mha_block_table``
rows hold the dummy block where upstream copies ``-1`` past a row's count; on the
engine's own placement (a device copy of the rows) the device rows are placed as they
are, upstream's bytes with either setting.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from mtpmeta.buffers.device_runtime import get_runtime
from mtpmeta.errors import MTPDisabledError
from mtpmeta.integrations.engine_inputs import check_total, commit_inputs, host_view, \
    longest_length
from mtpmeta.metadata import MTPMetadata
from mtpmeta.types import MTPForwardMode
from mtpmeta.validation.inputs import is_device_tensor
from mtpmeta.validation.request_rows import leading_length

__all__ = ["patch", "unpatch", "is_patched", "helpers", "HELPERS", "METADATA_MODULE",
           "MIXIN_MODULE"]

#: Upstream's module that defines ``MTPMetadata`` and ``MTPForwardMode``.
METADATA_MODULE = "megatron.core.inference.contexts.mtp_metadata"
#: Upstream's module that defines ``MTPContextMixin``, the context's MTP helpers.
MIXIN_MODULE = "megatron.core.inference.contexts.mtp_context_mixin"

_MISSING = object()  # an attribute that was not in the namespace before the patch
# What patch() replaced: (namespace owner, name, original or _MISSING), in order.
_applied: List[Tuple[Any, str, Any]] = []


# ------------------------------------------------------------------- the helpers
def _declare_rows(context: Any, meta: MTPMetadata) -> None:
    """Declare the context's row split, ``[0, paused)`` paused and ``[paused, total)``
    active (``paused_request_count``, ``total_request_count``), to ``meta``.

    The context's per-request arrays (``request_to_kv_block_ids`` [R, W],
    ``request_matched_prefix_blocks`` [R]) hold paused rows first, so active request
    ``i`` is row ``paused + i``. With the split declared the helpers pass those arrays
    whole and the library takes their active rows (``set_request_rows``, contract §3);
    it also sets ``draft_annotation_offset``, which ``check_invariants`` reads.
    Example: paused 1, total 3, R 8 -> a commit pass of 2 requests reads rows 1 and 2.
    """
    meta.set_request_rows(int(context.paused_request_count),
                          int(context.total_request_count))


def _in_active_order(context: Any, array: Any, count: Any) -> Any:
    """A caller's start positions as upstream's helper reads them: request ``i`` at
    entry ``i``, whatever the array's length.

    The declared split makes an array of exactly ``R`` entries a whole context array,
    read from row ``paused``; a caller's static ``[R]`` start-position buffer (the draft
    loop's ``start_positions``, the commit's ``request_start_positions``) holds the
    active requests from entry 0, so behind paused rows it is cut to its first
    ``count`` entries (``count``: an int, or ``append_counts``, whose length it is).
    Example: R 8, paused 2, an [8] buffer for 3 requests -> ``array[:3]``.
    """
    if (context.paused_request_count
            and leading_length(array) == context.mtp_metadata.max_requests):
        count = count if isinstance(count, int) else leading_length(count)
        if count is not None:  # otherwise the call refuses the bad count itself
            return array[:count]
    return array


def _commit_block_counts(context: Any, host_table: bool) -> Any:
    """For the commit pass with block counts: the context's host
    ``request_kv_block_counts`` (whole, ``[R]``: the declared split takes the active
    rows) when the table is on the host; else None (the caller passes none beside a
    device copy of the rows either: the table's bytes then never reach the host).

    Safe by upstream's engine: the commit pass runs after the speculative rewind and
    writes committed positions only (a decode request's accepted drafts, below
    ``base_position - 1``; a prefill request's prompt positions ``off .. off + q - 2``),
    all inside the blocks the rewound counts still hold. The draft loop gets no counts:
    its depths write up to ``base_position - 2 + D``, past the committed tokens, into
    blocks the rewind has released (the count lowered, the entry cleared to -1; the
    newer engine keeps a pre-rewind table for them), which a count-limited depth
    refuses (contract §5) where upstream writes them.
    """
    if not host_table:
        return None
    counts = getattr(context, "request_kv_block_counts", None)
    runtime = get_runtime()
    return None if is_device_tensor(counts, runtime) else host_view(counts, runtime)


def _prefix_blocks(context: Any, meta: MTPMetadata) -> Any:
    """Each row's inherited prefix blocks ``[R]``, whole (the declared split takes the
    active rows): the metadata's ``request_matched_prefix_blocks``, which the newer
    engine keeps (its mixin reads them there).

    The older engine keeps the hits on its context (``request_matched_prefix_blocks``,
    its mixin reads them there) and never writes the metadata's. A host array of ``R``
    integers is then copied into the metadata's before the pass, so the pass, the draft
    loop's protected-start check and ``check_invariants`` (``MTPMETA_DEBUG=1``) all read
    the hits the engine redirects by; any other array (a device tensor, another length,
    counts of another dtype outside ``[0, max_kv_block_count]``) is passed as it is, for
    the commit pass to read or refuse.
    Example: context hits [0, 2, 0, 1] -> the metadata's [0, 2, 0, 1], then passed.
    """
    runtime = get_runtime()
    annotations = host_view(meta.request_matched_prefix_blocks, runtime)
    blocks = getattr(context, "request_matched_prefix_blocks", None)
    if blocks is None:
        return annotations
    hits = host_view(blocks, runtime)
    if not (isinstance(hits, np.ndarray) and isinstance(annotations, np.ndarray)
            and hits.shape == annotations.shape and hits.dtype.kind in "iu"):
        return hits
    if hits.dtype != annotations.dtype and hits.size and not (
            hits.min() >= 0 and hits.max() <= meta.max_kv_block_count):
        return hits  # a conversion could wrap a count into range: the pass refuses it
    annotations[...] = hits
    return annotations


def _library_metadata(context: Any, helper: str, *, enabled: bool = False) -> MTPMetadata:
    """``context.mtp_metadata``, which must be this library's (built after ``patch()``).

    ``enabled``: also require ``context.enable_mtp_kv_cache``, as upstream's helper
    asserts (raised explicitly here: ``MTPDisabledError`` is an ``AssertionError``).
    """
    if enabled and not context.enable_mtp_kv_cache:
        raise MTPDisabledError(f"{helper}: the context's MTP KV cache is disabled "
                               f"(enable_mtp_kv_cache is False)")
    meta = context.mtp_metadata
    if not isinstance(meta, MTPMetadata):
        raise TypeError(
            f"{helper}: context.mtp_metadata is {type(meta).__module__}."
            f"{type(meta).__qualname__}, not mtpmeta's MTPMetadata: call "
            f"mtpmeta.integrations.megatron.patch() before the engine builds its context")
    return meta


def _mtp_begin_decode(self: Any, active_request_count: int, padded_count: int,
                      start_positions: Any, graphed: bool = False) -> None:
    """Enter the draft loop over the active rows (upstream's helper, one fused call).

    ``start_positions`` [>= n]: depth 0's write position per active request. The
    block table is the context's whole ``request_to_kv_block_ids`` (or the metadata's
    ``prerewind_block_table`` when the engine took one), of which the library reads
    the active rows (the declared split).
    """
    meta = _library_metadata(self, "_mtp_begin_decode", enabled=True)
    _declare_rows(self, meta)
    # The deepest drafts write past the accepted tokens, into blocks the speculative
    # rewind releases; an engine that snapshots its table before the rewind keeps it
    # on the metadata, and the drafts read that snapshot, as upstream's helper does.
    table = getattr(meta, "prerewind_block_table", None)
    if table is None:
        table = self.request_to_kv_block_ids
    meta.begin_decode(active_request_count, padded_count,
                      _in_active_order(self, start_positions, active_request_count),
                      table, graphed)


def _mtp_setup_decode_step(self: Any) -> None:
    """One draft depth: ``setup_decode_step`` on ``context.gpu_view``, then publish the
    attention metadata. Graphed: the graph metadata's capture-time ``max_seqlen`` as
    the key bound, as upstream passes it; eager: the host's longest KV length."""
    meta = _library_metadata(self, "_mtp_setup_decode_step")
    shape = meta.setup_decode_step(self.gpu_view)
    if meta.graphed:
        max_seqlen_k = self.graph_attn_metadata["mha_metadata"].max_seqlen
    elif shape.max_seqlen_k is None:  # device start positions: no host copy (one sync)
        n = shape.request_count
        max_seqlen_k = longest_length(meta, self.gpu_view.mha_kv_seq_lengths[:n]) \
            if n else 1
    else:
        max_seqlen_k = int(shape.max_seqlen_k)  # a plain int whatever the kernels return
    self._mtp_activate_attn_metadata(
        graphed=meta.graphed,
        padded_request_count=shape.padded_request_count,
        max_seqlen_q=1,
        max_seqlen_k=max_seqlen_k,
        token_count=shape.token_count,
        padded_token_count=shape.padded_token_count,
    )


def _setup_prefill_step_with(block_counts: bool) -> Callable[..., None]:
    """The commit-pass helper, passing the context's block counts (``block_counts``)
    or not (upstream's bytes)."""

    def _mtp_setup_prefill_step(self: Any, append_counts: Any, block_table_prefill: Any,
                                padded_token_count: Optional[int] = None,
                                padded_request_count: Optional[int] = None,
                                request_start_positions: Any = None,
                                total: Optional[int] = None) -> None:
        """The varlen commit pass: ``setup_commit_pass`` on ``context.gpu_view``, then
        publish the attention metadata; leaves ``forward_mode`` at ``COMMIT``.

        ``append_counts`` [P] and ``block_table_prefill`` [P, W] are the P requests in
        active-row order (an [R, W] table is the context's whole table: its active rows
        are read, the declared split); the inherited-block redirect reads
        ``request_matched_prefix_blocks`` (``_prefix_blocks``: the context's, else the
        metadata's), passed whole, at its active rows. Device counts
        and start positions come to the host in one packed read and the table rows from
        the context's host table (``engine_inputs``: one sync, as upstream's helper);
        ``total`` (``append_counts.sum()``), when given, must be the counts' sum.
        """
        meta = _library_metadata(self, "_mtp_setup_prefill_step", enabled=True)
        _declare_rows(self, meta)
        append_counts, block_table_prefill, starts, device_rows = commit_inputs(
            self, append_counts, block_table_prefill,
            _in_active_order(self, request_start_positions, append_counts), meta)
        check_total(total, append_counts)
        host = not is_device_tensor(block_table_prefill, get_runtime())
        shape = meta.setup_commit_pass(
            self.gpu_view, append_counts, block_table_prefill,
            start_positions=starts,
            inherited_blocks=_prefix_blocks(self, meta),
            padded_token_count=padded_token_count,
            padded_request_count=padded_request_count,
            block_counts=_commit_block_counts(self, host)
            if block_counts and device_rows is None else None,
            device_block_table=device_rows)
        max_seqlen = int(shape.max_seqlen_q)
        if shape.request_count and not shape.padded_token_count:
            # upstream's read-back of all-zero lengths (ForwardShape floors at 1)
            max_seqlen = 0
        self._mtp_activate_attn_metadata(
            graphed=False,
            padded_request_count=shape.padded_request_count,
            max_seqlen_q=max_seqlen,
            max_seqlen_k=max_seqlen,
            token_count=shape.token_count,
            padded_token_count=shape.padded_token_count,
        )

    return _mtp_setup_prefill_step


#: The commit-pass helper by its ``block_counts`` setting, built once.
_SETUP_PREFILL_STEP = {flag: _setup_prefill_step_with(flag) for flag in (True, False)}


def helpers(block_counts: bool = True) -> Dict[str, Callable[..., None]]:
    """The replacement helpers by upstream's name, as ``patch(block_counts)`` sets them
    on ``MTPContextMixin`` (the trace bench binds them to its engine context the same
    way). ``block_counts`` is ``patch()``'s (its docstring)."""
    if type(block_counts) is not bool:
        raise TypeError(f"block_counts: {block_counts!r}, expected a bool")
    return {
        "_mtp_begin_decode": _mtp_begin_decode,
        "_mtp_setup_decode_step": _mtp_setup_decode_step,
        "_mtp_setup_prefill_step": _SETUP_PREFILL_STEP[block_counts],
    }


#: ``helpers()`` with ``patch()``'s default.
HELPERS = helpers()


# ------------------------------------------------------------------ patch / unpatch
def _upstream(name: str) -> Any:
    """Import upstream's module ``name``; ImportError naming it when it is missing."""
    try:
        return importlib.import_module(name)
    except ImportError as err:
        raise ImportError(
            f"mtpmeta.integrations.megatron.patch() needs upstream's module {name} "
            f"(megatron-core with the MTP draft-KV cache; released wheels up to 0.19.2 do "
            f"not have it): {err}") from err


def _require(owner: Any, name: str, where: str) -> Any:
    value = getattr(owner, name, _MISSING)
    if value is _MISSING:
        raise ImportError(f"mtpmeta.integrations.megatron.patch() needs {where}.{name}, "
                          f"which the installed megatron-core does not define")
    return value


def _check_signature(mixin: Any, name: str) -> None:
    """Upstream's helper must take the replacement's parameters, in the same order."""
    ours = list(inspect.signature(HELPERS[name]).parameters)
    theirs = list(inspect.signature(getattr(mixin, name)).parameters)
    if theirs != ours:
        raise ImportError(
            f"mtpmeta.integrations.megatron.patch(): upstream's MTPContextMixin.{name} "
            f"takes ({', '.join(theirs)}), the replacement ({', '.join(ours)}); the "
            f"installed megatron-core's helpers differ, so nothing was patched")


def _replace(owner: Any, name: str, value: Any) -> None:
    _applied.append((owner, name, vars(owner).get(name, _MISSING)))
    setattr(owner, name, value)


def patch(block_counts: bool = True) -> None:
    """Put upstream's engine on this library (module docstring); a second call patches
    nothing more (it only sets ``block_counts``). Raises ``ImportError`` naming what is
    missing, patching nothing.

    ``block_counts`` (default True): a commit pass given a host ``block_table_prefill``
    also takes the context's host ``request_kv_block_counts`` (its active rows), so the
    host reads and ships only the blocks in use (contract §5). The one difference in
    the view is then the dummy block ``D`` in place of ``-1`` in ``mha_block_table``
    past a row's count. ``block_counts=False`` keeps every byte upstream's. On the
    engine's own placement (a device copy of the rows, ``engine_inputs``) the table's
    bytes never reach the host and the device rows are placed as they are, so both
    settings write upstream's bytes. The draft loop takes no counts
    (``_commit_block_counts`` says why).
    """
    installed = helpers(block_counts)
    if _applied:  # already patched: only the commit-pass helper changes
        mixin = next(owner for owner, name, _ in _applied
                     if name == "_mtp_setup_prefill_step")
        setattr(mixin, "_mtp_setup_prefill_step", installed["_mtp_setup_prefill_step"])
        return
    metadata_module = _upstream(METADATA_MODULE)
    mixin_module = _upstream(MIXIN_MODULE)
    originals = {name: _require(metadata_module, name, METADATA_MODULE)
                 for name in ("MTPMetadata", "MTPForwardMode")}
    mixin = _require(mixin_module, "MTPContextMixin", MIXIN_MODULE)
    for name in HELPERS:
        _require(mixin, name, f"{MIXIN_MODULE}.MTPContextMixin")
        _check_signature(mixin, name)
    ours = {"MTPMetadata": MTPMetadata, "MTPForwardMode": MTPForwardMode}
    modules = [metadata_module] + [module for key, module in list(sys.modules.items())
                                   if key.startswith("megatron.") and module is not None
                                   and module is not metadata_module]
    for module in modules:
        for name, original in originals.items():
            if vars(module).get(name, _MISSING) is original:
                _replace(module, name, ours[name])
    for name, helper in installed.items():
        _replace(mixin, name, helper)


def unpatch() -> None:
    """Restore every original ``patch()`` replaced, object for object (a no-op when
    not patched). A context built while patched keeps this library's ``MTPMetadata``:
    build it again after ``unpatch()``."""
    while _applied:
        owner, name, original = _applied.pop()
        if original is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, original)


def is_patched() -> bool:
    """Whether ``patch()`` is in effect."""
    return bool(_applied)
