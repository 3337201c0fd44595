"""A tiny deterministic main model and MTP ("draft") layer, fixed random weights.

Only the MTP layer has a paged KV cache here, because that is the cache ``MTPMetadata``
routes. The main model is a stand-in whose hiddens are a closed-form function of the
tokens, so the checker can recompute them from scratch:

* main hidden ``h[p] = tanh(Ea[t[p]] + Eb[t[p-1]] + Pm[p])`` (``t[-1]`` is a BOS row);
* main next token ``t[p+1] = (3 t[p] + 1 + bump(p)) % vocab``, ``bump`` a fixed
  pseudo-random 0/1 per position (so drafts are right often, not always);
* MTP input at position ``p`` (roll-by-one: the main hidden at ``p`` with the token at
  ``p + 1``): ``x[p] = tanh(h[p] @ Wh + Et[t[p+1]] + Px[p])``; deeper draft depths feed
  the previous depth's MTP hidden ``g`` instead of ``h``;
* attention: ``q = x Wq + Pq[pos]``, ``k = x Wk + Pk[pos]``, ``v = x Wv`` with ``pos``
  read from ``token_to_pos_ids`` (a RoPE stand-in), causal softmax attention;
* MTP hidden ``g = tanh(attn Wo + x)``; draft token: the "guess" ``(3 t + 1) % vocab``
  when ``g[0] > -0.25``, else ``argmax(g U)``. Drafts thus depend on the attention
  output, and roughly half of them are accepted.
"""

from __future__ import annotations

import math
from typing import Tuple

import torch
from torch import Tensor

from mtpmeta.simulate.config import SimConfig

__all__ = ["TinyModel", "causal_attention"]


def causal_attention(q: Tensor, k: Tensor, v: Tensor, q_positions: Tensor) -> Tensor:
    """Softmax attention of ``q [m, heads, d]`` over ``k, v [L, heads, d]``; the query
    at position ``q_positions[i]`` sees keys ``0..q_positions[i]``. Returns ``[m, heads,
    d]``. Example: ``q_positions [0, 2]`` with ``L = 3``: row 0 sees key 0, row 1 all."""
    scores = q.transpose(0, 1) @ k.permute(1, 2, 0) / math.sqrt(q.shape[-1])  # [h, m, L]
    keys = torch.arange(k.shape[0], device=k.device)
    future = keys[None, :] > q_positions[:, None]  # [m, L]
    weights = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    return (weights @ v.transpose(0, 1)).transpose(0, 1)  # [m, h, d]


class TinyModel:
    """Fixed random weights drawn from ``torch.Generator().manual_seed(seed)`` on the
    CPU, then moved to ``device`` (the same numbers on every device)."""

    def __init__(self, config: SimConfig, seed: int, device: torch.device) -> None:
        gen = torch.Generator().manual_seed(seed)
        H, V, P = config.hidden_size, config.vocab, config.max_positions
        width = config.heads * config.head_dim

        def draw(*shape: int, scale: float = 1.0) -> Tensor:
            return (torch.randn(*shape, generator=gen) * scale).to(device, config.dtype)

        self.config = config
        self.device = device
        self.main_token_emb = draw(V, H)  # Ea
        self.main_prev_emb = draw(V + 1, H, scale=0.5)  # Eb, row V is BOS
        self.main_pos_emb = draw(P, H, scale=0.5)  # Pm
        self.mtp_hidden_proj = draw(H, H, scale=1 / math.sqrt(H))  # Wh
        self.mtp_token_emb = draw(V, H)  # Et
        self.mtp_pos_emb = draw(P, H, scale=0.5)  # Px
        self.wq = draw(H, width, scale=1 / math.sqrt(H))
        self.wk = draw(H, width, scale=1 / math.sqrt(H))
        self.wv = draw(H, width, scale=1 / math.sqrt(H))
        self.q_pos = draw(P, width, scale=0.3)  # Pq
        self.k_pos = draw(P, width, scale=0.3)  # Pk
        self.wo = draw(width, H, scale=1 / math.sqrt(width))
        self.head = draw(H, V)  # U
        # bump(p): which positions the main model's next token skips the guess at.
        self.bump = torch.randint(0, 4, (P + 1,), generator=gen).eq(0).tolist()

    # ---------------------------------------------------------------- main model
    def main_hiddens(self, tokens: Tensor, start: int, end: int) -> Tensor:
        """``h[start:end]`` of a request whose tokens are ``tokens [>= end]`` (int64,
        on the model's device). ``[end - start, H]``."""
        positions = torch.arange(start, end, device=self.device)
        prev = torch.cat([torch.full((1,), self.config.vocab, device=self.device,
                                     dtype=torch.int64), tokens[:-1]])
        return torch.tanh(self.main_token_emb[tokens[start:end]]
                          + self.main_prev_emb[prev[start:end]]
                          + self.main_pos_emb[positions])

    def main_next(self, token: int, position: int) -> int:
        """The main model's next token after ``token`` at ``position``."""
        return (3 * token + 1 + int(self.bump[position])) % self.config.vocab

    # ----------------------------------------------------------------- MTP layer
    def mtp_input(self, hidden: Tensor, next_tokens: Tensor, positions: Tensor) -> Tensor:
        """``x [n, H]`` from the hidden at each position ``[n, H]``, the token one past
        it ``[n]`` and the position ``[n]``."""
        return torch.tanh(hidden @ self.mtp_hidden_proj + self.mtp_token_emb[next_tokens]
                          + self.mtp_pos_emb[positions])

    def qkv(self, x: Tensor, pos_ids: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """Query, key, value ``[n, heads, head_dim]`` of ``x [n, H]`` at ``pos_ids``."""
        shape = (x.shape[0], self.config.heads, self.config.head_dim)
        q = (x @ self.wq + self.q_pos[pos_ids]).view(shape)
        k = (x @ self.wk + self.k_pos[pos_ids]).view(shape)
        v = (x @ self.wv).view(shape)
        return q, k, v

    def draft(self, attn: Tensor, x: Tensor, in_tokens: Tensor) -> Tuple[Tensor, Tensor]:
        """MTP hidden ``g [n, H]`` and draft token ``[n]`` from the attention output
        ``[n, heads, head_dim]``, the input ``x`` and the input token ``[n]``."""
        g = torch.tanh(attn.reshape(attn.shape[0], -1) @ self.wo + x)
        guess = (3 * in_tokens + 1) % self.config.vocab
        tokens = torch.where(g[:, 0] > -0.25, guess, (g @ self.head).argmax(dim=-1))
        return g, tokens
