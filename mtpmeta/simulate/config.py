"""Sizes and workload knobs of one simulation run (``SimConfig``).

Small on purpose: a few requests, blocks of 8 tokens, a 16-wide hidden. Every number
is a knob a real engine has too (``max_requests`` is upstream's ``max_bs``, ``tp`` the
tensor-parallel multiple the commit pass pads its tokens to).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Dict

import torch

__all__ = ["SimConfig"]


@dataclass(frozen=True)
class SimConfig:
    """Geometry of the library object, of the paged KV cache and of the toy model.

    Geometry: ``max_requests`` rows (``R``), ``block_columns`` blocks per request
    (``W``) of ``block_size`` tokens (``BS``); the cache holds ``num_blocks`` real
    blocks plus the dummy block ``D = num_blocks`` (so ``[num_blocks + 1, BS, heads,
    head_dim]``). The pool is as large as ``R * W``: the scheduler never runs out, and
    pausing is driven by the seeded scheduler instead (see ``Scheduler.pause_resume``).

    Model: ``hidden_size``, ``heads`` x ``head_dim`` attention, ``vocab`` tokens.
    Speculation: ``depths`` (``K``) draft depths per step.
    Scheduling: ``chunk_tokens`` prompt tokens per step (longer prompts are chunked,
    one at a time, since the library has one carry slot), ``tp`` the commit pass's
    token multiple, ``arrival_rate`` mean new requests per step, ``max_new_tokens``
    the largest generation length, ``pause_rate`` chance per step of a preemption.
    """

    max_requests: int = 12
    block_columns: int = 12
    block_size: int = 8
    hidden_size: int = 16
    heads: int = 2
    head_dim: int = 8
    vocab: int = 8
    depths: int = 3
    chunk_tokens: int = 20
    tp: int = 4
    arrival_rate: float = 0.55
    max_prompt: int = 44
    max_new_tokens: int = 36
    pause_rate: float = 0.12
    system_prompts: int = 3
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.depths < 1:
            raise ValueError(f"SimConfig: depths {self.depths} < 1")
        if self.system_prompts and self.max_prompt < 3 * self.block_size + 4:
            raise ValueError(f"SimConfig: max_prompt {self.max_prompt} cannot hold a "
                             f"system prompt (up to 3 * block_size + 3 tokens) plus one "
                             f"token; raise it or set system_prompts=0")
        # A request overshoots max_new_tokens by up to K accepted tokens, and its draft
        # loop writes up to 2K - 2 positions past its length: 3K of room covers both.
        room = self.max_prompt + self.max_new_tokens + 3 * self.depths
        if room > self.max_positions:
            raise ValueError(f"SimConfig: max_prompt {self.max_prompt} + max_new_tokens "
                             f"{self.max_new_tokens} + 3 * depths {3 * self.depths} > "
                             f"block_columns * block_size {self.max_positions}")

    @property
    def max_positions(self) -> int:
        """Positions one request can hold: ``W * BS``."""
        return self.block_columns * self.block_size

    @property
    def num_blocks(self) -> int:
        """Real blocks in the pool (the dummy block is one more)."""
        return self.max_requests * self.block_columns

    @property
    def dummy_block(self) -> int:
        return self.num_blocks

    @property
    def max_tokens(self) -> int:
        """Token rows of the destination view: every active request commits at most
        ``K`` drafts, plus one prefill budget, plus the TP pad."""
        return self.max_requests * (self.depths + 1) + self.chunk_tokens + self.tp

    def metadata_kwargs(self) -> Dict[str, Any]:
        """Constructor keywords of ``MTPMetadata`` for this geometry."""
        return dict(enabled=True, max_requests=self.max_requests,
                    max_kv_block_count=self.block_columns,
                    block_size_tokens=self.block_size, dummy_block_idx=self.dummy_block,
                    block_table_dtype=torch.int32, hidden_size=self.hidden_size,
                    hidden_dtype=self.dtype)

    def as_dict(self) -> Dict[str, Any]:
        out = asdict(self)
        out["dtype"] = str(self.dtype)
        return out
