"""An int8 KV cache, `sample.py kv_dtype=int8`: keys and values stored quantised, per token and head.

A cache for the core's `new_cache(make=...)` (attention.KVCache's interface: update, positions,
nbytes): each token's key (and value) in each head is stored as round(x / s) with its own scale
s = max|x| / 127 (fp32), read back as the int8 values times s. Per token and head it holds hs + 4
bytes for each of k and v against 2·hs in bf16; the rounding error of every element is at most s / 2.
MLA's latent cache is the same class over its RoPE key and latent (each its own scale per token).
The per-token scheme of KIVI-like caches (Liu et al. 2024, arXiv 2402.02750) without their grouping.
Tests: tests/variants/test_int8_cache.py (within half a scale; decoding follows the fp32 cache; bytes).
"""
import torch

from kv_cache import KVCache

SCALE_BYTES = 4  # each row's fp32 scale


class Int8KVCache(KVCache):
    @staticmethod
    def token_bytes(rows: list, dtype_bytes: int = 1) -> int:
        """Bytes one token adds: each row (a kind's cache_rows) a byte per element and its scale."""
        return sum(rows) + SCALE_BYTES * len(rows)

    def __init__(self, batch_size, n_kv_head, length, head_dim, device=None, dtype=torch.float32, v_dim=None):
        super().__init__(batch_size, n_kv_head, length, head_dim, device, torch.int8, v_dim)
        self.k_scale = torch.zeros(batch_size, n_kv_head, length, 1, device=device, dtype=torch.float32)
        self.v_scale = torch.zeros_like(self.k_scale)
        self.out_dtype = dtype  # what update returns: the model's dtype

    @staticmethod
    def quantize(x):
        """(int8 values, fp32 scales) of x (..., hs): x ≈ values * scales, per row (an empty row: scale 0)."""
        if x.size(-1) == 0:  # MLA without RoPE caches no RoPE key
            return x.to(torch.int8), x.new_zeros(*x.shape[:-1], 1, dtype=torch.float32)
        scale = x.float().abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127
        return (x.float() / scale).round().clamp(-127, 127).to(torch.int8), scale

    def update(self, pos: int, k, v):
        T = k.size(2)
        if T > 1 and pos != 0:
            raise ValueError("a KV cache takes a multi-token chunk only as the first (prefill) step")
        keep = torch.arange(max(0, T - self.length), T, device=k.device)  # a longer prefill keeps its latest
        slots = (pos + keep) % self.length
        for store, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            values, scale = self.quantize(x[:, :, keep])
            store.index_copy_(2, slots, values)
            scales.index_copy_(2, slots, scale)
        if T > self.length:
            return k, v, None
        n = min(pos + T, self.length)
        deq = lambda s, sc: (s[:, :, :n].float() * sc[:, :, :n]).to(self.out_dtype)  # noqa: E731
        return deq(self.k, self.k_scale), deq(self.v, self.v_scale), None

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.k_scale, self.v_scale))
