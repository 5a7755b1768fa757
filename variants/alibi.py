"""ALiBi, `model.pos=alibi`: no positions in q or k; a linear bias per head on the logits instead.

Fills the core's `bias` slot (attention.CausalSelfAttention: a logit bias the softmax adds, on every
path: sdpa, reference and tiled, tile by tile). Press et al. 2021, arXiv 2108.12409. Tests:
tests/variants/test_alibi.py (the bias against the paper's formula and slopes, caches, the tiled path).
"""
import math

import torch
import torch.nn as nn


def alibi_slopes(n_head: int) -> torch.Tensor:
    """The per-head slopes: for n heads, n a power of two, the geometric sequence m_h = 2^(-8h/n),
    h = 1..n; otherwise those of the largest power of two p < n, then every other slope of the
    sequence for 2p, until there are n."""
    def geometric(n):
        return [2 ** (-8 * h / n) for h in range(1, n + 1)]
    p = 2 ** int(math.floor(math.log2(n_head)))
    slopes = geometric(p) if p == n_head else geometric(p) + geometric(2 * p)[0::2][:n_head - p]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi_bias(slopes, q_pos, k_pos):
    """The bias -m_h (i - j) of queries at positions q_pos (Tq,) on keys at k_pos (Tk,), as the
    slot takes it: a function of (rows, cols) slices returning (nh, rows, cols) in fp32, so a tiled
    path asks for one tile at a time and never builds the whole table."""
    def tile(rows, cols):
        distance = (q_pos[rows, None] - k_pos[None, cols]).to(torch.float32)  # i - j
        return -slopes.view(-1, 1, 1).to(torch.float32) * distance
    return tile


class ALiBi(nn.Module):
    """The slot's piece: the slopes (a buffer, not a weight: checkpoints hold nothing of it), and
    forward(query positions, key positions) -> the bias function for one attention call (a KV cache
    says where its keys sit: KVCache.positions)."""

    def __init__(self, config):
        super().__init__()
        self.register_buffer("slopes", alibi_slopes(config.n_head), persistent=False)

    def forward(self, q_pos, k_pos):
        return alibi_bias(self.slopes, q_pos, k_pos)
