"""Mixture of block attention, `model.attn.select=moba` (`select_block` B, `select_topk` K): each query
chooses by content which earlier blocks of keys it reads.

Fills the core's `select` slot (attention.CausalSelfAttention.forward and .scores: after the mask is
made, before attention): the keys, in blocks of B positions, are each summarised by their mean; a query
scores every block that ends before its own by q·mean(K_block), keeps the K best and its own block
(causally masked), and attends over those keys only. With K at least the number of earlier blocks it is
full causal attention. The choice is not differentiable (the keys chosen are; so are the block means
through them, as in MoBA). Lu et al. 2025, arXiv 2502.13189. Tests: tests/variants/test_moba.py (K
covering every block is full attention, outputs and gradients; the chosen keys against a loop written
out; cached decoding against recomputation; GQA; the probe sees only the chosen keys).

The choice is applied as a mask over the keys (SelectedMask), so every path the mask reaches (sdpa,
reference) computes exactly the selected attention, and the attention probe and the viewer read the
same weights the layer uses. On those paths it still computes every score; the choice comes as a
BlockChoice, whole blocks per query, which the gathered path (variants/selected.py,
`model.attn.impl=gathered`) reads to compute only the chosen blocks, never the N x N table.
"""
from dataclasses import dataclass
from typing import Optional

import torch

from attention import Mask, repeat_kv


@dataclass
class SelectedMask(Mask):
    """A Mask narrowed by a choice of keys: `chosen` (B, nh, Tq, Tk) bool, True where the query reads
    the key. Its tables are (B, nh, rows, cols)."""
    chosen: Optional[torch.Tensor] = None

    @property
    def causal(self) -> bool:
        return False

    @property
    def sees_all(self) -> bool:
        return False

    def __call__(self, device=None, q0: int = 0, q1=None, k0: int = 0, k1=None):
        q1, k1 = self.Tq if q1 is None else q1, self.Tk if k1 is None else k1
        return super().__call__(device, q0, q1, k0, k1) & self.chosen[:, :, q0:q1, k0:k1]


@dataclass
class BlockChoice(SelectedMask):
    """A choice of whole blocks: `blocks` (B, nh, Tq, n) bool, True where the query reads block b; `ids`
    (Tk,) the block of each key; `size` keys per block. Its (B, nh, rows, cols) table is made only when
    asked for (the masked paths, the probe), so the gathered path never builds the N x N table."""
    blocks: Optional[torch.Tensor] = None
    ids: Optional[torch.Tensor] = None
    size: int = 0

    def __call__(self, device=None, q0: int = 0, q1=None, k0: int = 0, k1=None):
        q1, k1 = self.Tq if q1 is None else q1, self.Tk if k1 is None else k1
        return Mask.__call__(self, device, q0, q1, k0, k1) & self.blocks[:, :, q0:q1][..., self.ids[k0:k1]]


class Selection:
    """What every key selection (the core's select slot) answers besides its choice: the keys query i
    reads, its parameters and an auxiliary loss (none by default), as lab/counting.py and GPT.forward ask."""

    @staticmethod
    def params(c) -> int:
        return 0

    def aux_loss(self):
        return None

    def aux_metrics(self) -> dict:
        return {}


class MoBA(Selection):
    """select(q, k, mask, q_pos, k_pos) -> BlockChoice: q (B, nh, Tq, hs), k (B, n_kv, Tk, hs) the keys
    the layer attends over, q_pos (Tq,) and k_pos (Tk,) their positions (a cache's slots may hold
    positions in any order)."""

    def __init__(self, config):
        self.block, self.topk = config.attn.select_block, config.attn.select_topk

    @staticmethod
    def reads_everything(a, length: int):
        """Why this selection reads every key of a `length`-token window (dense attention), or None:
        each query reads its own block and up to select_topk earlier ones, of ceil(length / B)."""
        n = -(-length // a.select_block)
        if a.select_topk >= n - 1:
            fix = f"lower select_block (e.g. {max(1, length // 8)})" + (f" or select_topk (below {n - 1})" if n > 2 else "")
            return (f"select_block={a.select_block} cuts {length} tokens into {n} block(s) and select_topk="
                    f"{a.select_topk} reads up to {a.select_topk} earlier ones besides a query's own: every key; {fix}")
        return None

    @staticmethod
    def reads(a, i: int) -> int:
        """Keys causal query i reads: its own block's up to itself and min(K, b) earlier blocks of B."""
        return i % a.select_block + 1 + min(a.select_topk, i // a.select_block) * a.select_block

    def __call__(self, q, k, mask: Mask, q_pos, k_pos) -> BlockChoice:
        nh = q.size(1)
        # the keys some query sees (a cache's unwritten slots out): without a window, all the last query sees
        visible = mask(q.device, q0=mask.Tq - 1) if mask.window is None else mask(q.device)  # (1 or Tq, Tk)
        written = visible.any(-2).reshape(-1)
        # blocks count from the oldest key held, so a cache that slid past block_size splits its keys as
        # a recomputation over the same last block_size tokens does
        first = torch.where(written, k_pos, k_pos.max()).min()
        ids = ((k_pos - first) // self.block).clamp(min=0)  # (Tk,) the block of each key
        n = int(ids.max()) + 1
        # the mean key of each block (over the keys a query could see at all: a cache's unwritten slots out)
        kf = repeat_kv(k, nh).float() * written.view(1, 1, -1, 1)
        sums = kf.new_zeros(*kf.shape[:2], n, kf.size(-1)).index_add_(2, ids, kf)
        counts = kf.new_zeros(n).index_add_(0, ids, written.float()).clamp(min=1)
        scores = q.float() @ (sums / counts.view(-1, 1)).transpose(-1, -2)  # (B, nh, Tq, n)
        own = ((q_pos - first) // self.block).view(-1, 1)  # (Tq, 1) the query's own block
        earlier = torch.arange(n, device=q.device).view(1, -1) < own  # only blocks that end before it
        scores = scores.masked_fill(~earlier, float("-inf"))
        top = scores.topk(min(self.topk, n), dim=-1).indices
        chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, top, True) & earlier
        chosen |= torch.arange(n, device=q.device).view(1, -1) == own
        return BlockChoice(mask.Tq, mask.Tk, mask.window, mask.written, blocks=chosen, ids=ids, size=self.block)
