"""Eviction that keeps attention sinks, `sample.py kv_sinks=S`: StreamingLLM's cache.

A cache for the core's `new_cache(make=...)` (attention.KVCache's interface). Once the cache is
full, the first S tokens stay for good and the rest of it is a ring of the most recent tokens. As in
the paper, attention sees the kept keys at their places in the cache (sinks at 0..S-1, then the
recent window in order, the query last), so no offset ever exceeds the cache's length: evicted
tokens leave no gap in the positions. Xiao et al. 2023, arXiv 2309.17453. Tests:
tests/variants/test_sink_cache.py (each step equals the model run on exactly the kept tokens, with
RoPE, ALiBi or no positions; tools/eval_stream.py), tests/variants/test_mla.py (MLA's latents).

Keys arrive rotated at their own position p, as every cache receives them. RoPE rotations compose,
so at each decode step a kept key is turned on by the angle that moves it from p to its place seen
from the query at position P: P - (n - 1 - c) for the key at cache index c of n. The query is left at
P; every offset the logits see is then n - 1 - c, as the paper's in-cache positions give.
"""
import torch

from attention import apply_rope
from kv_cache import KVCache


class SinkKVCache(KVCache):
    def __init__(self, batch_size, n_kv_head, length, head_dim, device=None, dtype=torch.float32, v_dim=None, *,
                 sinks: int = 4, theta=None):
        if not 0 < sinks < length:
            raise ValueError(f"{sinks} sink tokens need a cache longer than that (it holds {length})")
        super().__init__(batch_size, n_kv_head, length, head_dim, device, dtype, v_dim)
        self.sinks, self.theta, self.n = sinks, theta, 0  # theta: RoPE's frequencies (None: no RoPE)
        self.key_pos = torch.zeros(length, dtype=torch.long, device=device)  # each slot's key's own position

    def update(self, pos: int, k, v):
        T = k.size(2)
        if T > 1 and pos != 0:
            raise ValueError("a KV cache takes a multi-token chunk only as the first (prefill) step")
        window = self.length - self.sinks
        kept = range(T) if T <= self.length else [*range(self.sinks), *range(T - window, T)]  # a long prefill
        for t in kept:
            p = pos + t
            slot = p if p < self.length else self.sinks + (p - self.sinks) % window
            self.k[:, :, slot], self.v[:, :, slot], self.key_pos[slot] = k[:, :, t], v[:, :, t], p
        self.n = max(self.n, pos + T)
        if T > 1:  # a prefill attends to its own tokens, at their own positions
            return k, v, None
        # cache order: the sinks, then the recent window oldest first (the ring's next slot is its oldest)
        order = torch.arange(min(self.n, self.length), device=k.device)
        if self.n > self.length:
            oldest = self.sinks + (self.n - self.sinks) % window
            order[self.sinks:] = self.sinks + (oldest - self.sinks + torch.arange(window, device=k.device)) % window
        keys = self.k[:, :, order]
        if self.theta is not None:  # turn each key from its own position to its place seen from the query
            place = pos - (order.numel() - 1) + torch.arange(order.numel(), device=k.device)
            angles = torch.outer((place - self.key_pos[order]).float(), self.theta)  # (n, hs/2)
            keys = apply_rope(keys, torch.stack((angles.cos(), angles.sin()), -1), dim=-2)
        return keys, self.v[:, :, order], None

    def positions(self, q_pos, n: int):
        """Positions within the cache (ALiBi): the keys 0..n-1 in cache order, the query the newest."""
        if q_pos.numel() > 1:  # a prefill, at its own positions
            return q_pos, q_pos
        return torch.arange(n - 1, n, device=q_pos.device), torch.arange(n, device=q_pos.device)
