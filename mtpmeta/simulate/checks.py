"""Checks run after every MTP forward, against a dense recomputation.

``Expectation`` is what the engine meant a forward to do, stated without the library:
each real token's request, position and destination block (``D`` for a token in an
inherited block), the request slots with their query/KV lengths, the padded extents,
and which outputs are meaningful. ``Checker.after_forward`` then compares the library's
view, the cache and the attention output with it, in this order:

1. ``launch shape``: the ``ForwardShape`` counts equal the engine's; its
   ``max_seqlen_q``/``max_seqlen_k`` are at least every length in the batch (they are
   launch bounds; not required to be tight);
2. ``token map`` / ``pad token``: each real token's block, slot, position and request
   as expected; every pad token row points at ``D``, slot 0;
3. ``mha metadata`` / ``paged read``: lengths per slot; padded slots empty; every block
   a slot read is one its request owns, or ``D``;
4. ``stray write`` / ``inherited block``: the only cache slots that changed are the
   real tokens' own (and ``D``); no token, draft tokens included, is meant for a block
   some live request inherited, and such a block never changes;
5. ``kv``: for every live request, active or paused, the paged KV of every position it
   has committed (plus this draft loop's speculative positions) equals a dense
   recomputation from its tokens (``DenseOracle``), within dtype tolerance;
6. ``attention output``: where meaningful, equal to dense causal attention. A commit
   pass is a fresh causal prefill (KV length = query length, contract §6): its output is
   the true attention only for a span starting at position 0, so only those are
   compared; for the others the KV check is the one that counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from mtpmeta.simulate.config import SimConfig
from mtpmeta.simulate.mismatch import Mismatch
from mtpmeta.simulate.model import TinyModel
from mtpmeta.simulate.paged import PagedKVCache
from mtpmeta.simulate.rows import Request

__all__ = ["Expectation", "Checker", "DenseOracle"]


@dataclass
class Expectation:
    """One forward as the engine planned it (see the module docstring).

    ``tokens``: per real token ``(request or None, position, slot, block)`` in token
    order; ``x``: their inputs ``[T, H]``; ``slots``: per request slot ``(request or
    None, query length, kv length)``; ``groups``: ``(request, first token, last token + 1)``
    whose outputs are the true attention. ``speculative``: the tokens are draft
    positions beyond the committed ones (their expected KV comes from ``x``).
    """

    kind: str
    tokens: List[Tuple[Optional[Request], int, int, int]]
    x: Tensor
    padded_tokens: int
    slots: List[Tuple[Optional[Request], int, int]]
    padded_slots: int
    groups: List[Tuple[Request, int, int]] = field(default_factory=list)
    speculative: bool = False


class DenseOracle:
    """Committed MTP KV of each request, recomputed from its tokens alone: main
    hiddens, roll-by-one MTP inputs, projections. No cache, no block table, no carry."""

    def __init__(self, model: TinyModel) -> None:
        self.model = model
        self._kv: Dict[int, Tuple[Tensor, Tensor]] = {}

    def committed(self, request: Request) -> Tuple[Tensor, Tensor]:
        """``k, v [mtp_committed, heads, head_dim]`` of ``request``."""
        k, v = self._kv.get(request.rid, (None, None))
        done = 0 if k is None else k.shape[0]
        upto = request.mtp_committed
        if done < upto:
            device = self.model.device
            tokens = torch.tensor(request.tokens[:upto + 1], device=device)
            positions = torch.arange(done, upto, device=device)
            hidden = self.model.main_hiddens(tokens, done, upto)
            x = self.model.mtp_input(hidden, tokens[done + 1:upto + 1], positions)
            _, k_new, v_new = self.model.qkv(x, positions)
            k = k_new if k is None else torch.cat([k, k_new])
            v = v_new if v is None else torch.cat([v, v_new])
            self._kv[request.rid] = (k, v)
        return k[:upto], v[:upto]

    def forget(self, request: Request) -> None:
        self._kv.pop(request.rid, None)


class Checker:
    """Runs the checks of the module docstring; counts each one that passed."""

    def __init__(self, config: SimConfig, model: TinyModel, cache: PagedKVCache,
                 view: Any) -> None:
        self.config = config
        self.model = model
        self.cache = cache
        self.view = view
        self.oracle = DenseOracle(model)
        self.dummy = config.dummy_block
        self.bs = config.block_size
        self.tol = dict(rtol=1e-4, atol=1e-4) if config.dtype == torch.float32 else \
            dict(rtol=2e-2, atol=2e-2)
        # this draft loop's speculative KV, rid -> (positions, k, v)
        self.speculative: Dict[int, Tuple[List[int], List[Tensor], List[Tensor]]] = {}
        self.passed: Dict[str, int] = {}

    def _ok(self, name: str, count: int = 1) -> None:
        self.passed[name] = self.passed.get(name, 0) + count

    def end_draft_loop(self) -> None:
        self.speculative.clear()

    # ------------------------------------------------------------------ entry
    def after_forward(self, expect: Expectation, shape: Any, out: Tensor,
                      reads: List[List[int]], before: Tuple[Tensor, Tensor],
                      live: List[Request]) -> None:
        self._check_shape(expect, shape)
        self._check_token_maps(expect)
        self._check_slots(expect, reads)
        self._check_stray_writes(expect, before, live)
        if expect.speculative:
            self._record_speculative(expect)
        self._check_kv(live)
        self._check_outputs(expect, out)

    # ----------------------------------------------------------------- checks
    def _check_shape(self, expect: Expectation, shape: Any) -> None:
        q_max = max((q for _, q, _ in expect.slots), default=0)
        kv_max = max((kv for _, _, kv in expect.slots), default=0)
        counts = {"token_count": len(expect.tokens),
                  "padded_token_count": expect.padded_tokens,
                  "request_count": len(expect.slots),
                  "padded_request_count": expect.padded_slots}
        for name, value in counts.items():
            if getattr(shape, name) != value:
                raise Mismatch("launch shape", f"ForwardShape.{name}", expected=value,
                               got=getattr(shape, name))
        bounds = (("max_seqlen_q", q_max), ("max_seqlen_k", kv_max))
        for name, needed in bounds:
            got = getattr(shape, name)
            if got is not None and got < needed:
                raise Mismatch("launch shape", f"ForwardShape.{name} is a launch bound "
                               f"below a length of this batch (a kernel would read too "
                               f"little)", expected=f">= {needed}", got=got)
        self._ok("launch shape")

    def _check_token_maps(self, expect: Expectation) -> None:
        view, rows = self.view, expect.padded_tokens
        blocks = view.token_to_block_idx[:rows].tolist()
        slots = view.token_to_local_position_within_kv_block[:rows].tolist()
        owners = view.token_to_request_idx[:rows].tolist()
        in_request = view.token_to_position_in_request[:rows].tolist()
        pos_ids = view.token_to_pos_ids[:rows].tolist()
        for t, (request, position, slot, block) in enumerate(expect.tokens):
            got = (blocks[t], slots[t], owners[t], in_request[t], pos_ids[t])
            want = (block, position % self.bs, slot, position, position)
            if got != want:
                what = ("an inherited block: the write must go to the dummy block"
                        if block == self.dummy and request is not None else "its block")
                raise Mismatch("token map", f"token {t} (slot {slot}) of {expect.kind} "
                               f"lands in {what}; (block, local, request, position, "
                               f"pos_id)", request=repr(request), position=position,
                               expected=want, got=got)
        for t in range(len(expect.tokens), rows):
            if blocks[t] != self.dummy or slots[t] != 0:
                raise Mismatch("pad token", f"pad token row {t} (pad rows "
                               f"{len(expect.tokens)}..{rows - 1}) of {expect.kind} "
                               f"does not write the dummy block slot 0",
                               expected=(self.dummy, 0), got=(blocks[t], slots[t]))
        self._ok("token map", len(expect.tokens))
        self._ok("pad token", rows - len(expect.tokens))

    def _check_slots(self, expect: Expectation, reads: List[List[int]]) -> None:
        view = self.view
        q_lens = view.mha_query_lengths[:expect.padded_slots].tolist()
        kv_lens = view.mha_kv_seq_lengths[:expect.padded_slots].tolist()
        for i in range(expect.padded_slots):
            request, q, kv = expect.slots[i] if i < len(expect.slots) else (None, 0, 0)
            if (q_lens[i], kv_lens[i]) != (q, kv):
                raise Mismatch("mha metadata", f"request slot {i} of {expect.kind}: "
                               f"(query, kv) lengths", request=repr(request),
                               expected=(q, kv), got=(q_lens[i], kv_lens[i]))
            owned = {self.dummy} if request is None else {self.dummy, *request.blocks}
            foreign = [b for b in reads[i] if b not in owned]
            if foreign:
                raise Mismatch("paged read", f"request slot {i} of {expect.kind} reads "
                               f"block {foreign[0]}, which its request does not own",
                               request=repr(request), expected=sorted(owned),
                               got=reads[i])
        self._ok("mha metadata", expect.padded_slots)

    def _check_stray_writes(self, expect: Expectation, before: Tuple[Tensor, Tensor],
                            live: List[Request]) -> None:
        shared = {b for r in live for b in r.blocks[:r.matched]}
        changed = self.cache.changed_slots(before)
        changed[self.dummy] = False
        for request, position, _, block in expect.tokens:
            if block in shared:  # the engine itself meant to write a shared block
                raise Mismatch("inherited block", f"{expect.kind} plans a write of "
                               f"shared block {block} (a draft has no inherited-block "
                               f"redirect: a scheduler must never draft there)",
                               request=repr(request), position=position,
                               expected=f"not one of {sorted(shared)}", got=block)
            if block != self.dummy:
                changed[block, position % self.bs] = False
        stray = changed.nonzero()
        if stray.numel():
            block, slot = (int(i) for i in stray[0])
            what = "an inherited (shared) block" if block in shared else \
                "a slot no real token of this forward writes"
            raise Mismatch("stray write", f"{expect.kind} changed block {block} slot "
                           f"{slot}: {what} (a pad row or a wrong block id?)",
                           expected="unchanged", got=f"block {block} slot {slot} changed")
        self._ok("stray write")

    def _record_speculative(self, expect: Expectation) -> None:
        positions = torch.tensor([p for _, p, _, _ in expect.tokens],
                                 device=expect.x.device)
        _, k, v = self.model.qkv(expect.x[:len(expect.tokens)], positions)
        for t, (request, position, _, _) in enumerate(expect.tokens):
            entry = self.speculative.setdefault(request.rid, ([], [], []))
            entry[0].append(position)
            entry[1].append(k[t])
            entry[2].append(v[t])

    def dense(self, request: Request) -> Tuple[Tensor, Tensor, List[int]]:
        """Expected ``k, v`` of every position ``request`` holds now, and the positions."""
        k, v = self.oracle.committed(request)
        positions = list(range(k.shape[0]))
        spec = self.speculative.get(request.rid)
        if spec is not None:
            if spec[0] != list(range(k.shape[0], k.shape[0] + len(spec[0]))):
                raise RuntimeError(f"engine bug: {request}'s speculative positions "
                                   f"{spec[0]} do not follow its {k.shape[0]} committed")
            k = torch.cat([k, torch.stack(spec[1])])
            v = torch.cat([v, torch.stack(spec[2])])
            positions += spec[0]
        return k, v, positions

    def _check_kv(self, live: List[Request]) -> None:
        owners: List[Tuple[Request, int]] = []
        blocks: List[int] = []
        expected_k, expected_v = [], []
        for request in live:
            k, v, positions = self.dense(request)
            expected_k.append(k)
            expected_v.append(v)
            for p in positions:
                blocks.append(request.blocks[p // self.bs])
                owners.append((request, p))
        if not owners:
            return
        device = self.cache.k.device
        block_index = torch.tensor(blocks, device=device)
        slot_index = torch.tensor([p % self.bs for _, p in owners], device=device)
        for name, paged, expected in (("K", self.cache.k, expected_k),
                                      ("V", self.cache.v, expected_v)):
            got = paged[block_index, slot_index]
            want = torch.cat(expected)
            close = torch.isclose(got, want, **self.tol).flatten(1).all(dim=1)
            if not bool(close.all()):
                i = int((~close).nonzero()[0, 0])
                request, position = owners[i]
                raise Mismatch("kv", f"{name} of {request} at position {position} (block "
                               f"{blocks[i]}, slot {position % self.bs}) differs from "
                               f"the dense recomputation", request=repr(request),
                               position=position, expected=want[i], got=got[i])
        self._ok("kv positions", len(owners))

    def _check_outputs(self, expect: Expectation, out: Tensor) -> None:
        """All meaningful outputs of the forward at once, against ``dense_attention``."""
        if not expect.groups:
            return
        keys, values, group_of, rows = [], [], [], []
        for g, (request, first, last) in enumerate(expect.groups):
            k, v, _ = self.dense(request)
            keys.append(k)
            values.append(v)
            group_of += [g] * (last - first)
            rows += range(first, last)
        device = out.device
        index = torch.tensor(rows, device=device)
        positions = torch.tensor([expect.tokens[t][1] for t in rows], device=device)
        q, _, _ = self.model.qkv(expect.x[index], positions)
        groups = torch.tensor(group_of, device=device)
        padded_k = torch.nn.utils.rnn.pad_sequence(keys, batch_first=True)[groups]
        padded_v = torch.nn.utils.rnn.pad_sequence(values, batch_first=True)[groups]
        want = dense_attention(q, positions, padded_k, padded_v)
        got = out[index]
        close = torch.isclose(got, want, **self.tol).flatten(1).all(dim=1)
        if not bool(close.all()):
            i = int((~close).nonzero()[0, 0])
            request = expect.groups[group_of[i]][0]
            raise Mismatch("attention output", f"output of token {rows[i]} of "
                           f"{expect.kind} differs from dense causal attention",
                           request=repr(request), position=int(positions[i]),
                           expected=want[i], got=got[i])
        self._ok("attention output", len(rows))


def dense_attention(q: Tensor, positions: Tensor, keys: Tensor, values: Tensor) -> Tensor:
    """Reference attention, one query at a time: ``q [T, heads, d]`` at ``positions [T]``
    over its own request's ``keys, values [T, L, heads, d]`` (zero-padded past the
    request's length), seeing keys ``0..positions[t]``. Written independently of the
    paged kernel's ``causal_attention``. Returns ``[T, heads, d]``."""
    scores = torch.einsum("thd,tlhd->thl", q, keys) / math.sqrt(q.shape[-1])
    future = torch.arange(keys.shape[1], device=q.device)[None, :] > positions[:, None]
    scores = scores.masked_fill(future[:, None, :], float("-inf"))
    return torch.einsum("thl,tlhd->thd", torch.softmax(scores, dim=-1), values)
