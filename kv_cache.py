"""The KV cache of generation: K and V (after RoPE) of every position a layer has seen, so a decode
step feeds only the newest token. KVCache is the eager ring buffer; StaticKVCache the same with fixed
shapes for a compiled decode step. variants/ has more (int8_cache.py, sink_cache.py), subclassing
these. A layer asks for one through its new_cache (CausalSelfAttention, MLA); recurrent kinds keep a
constant-size state instead. Tests: tests/test_decode.py (cached decoding against recomputation).
"""
import torch


class KVCache:
    """Per-layer K and V (after RoPE) for generation, preallocated as a ring buffer: with RoPE a
    cached key keeps its absolute position forever, and attention only sees offsets, so once
    `length` tokens are cached the oldest slot is overwritten and the context slides. Its dtype may
    be narrower than the model's: a bf16 cache halves what a decode step reads. v_dim: the values'
    width when it differs from the keys' (MLA caches its RoPE key as k and its latent as v)."""

    def __init__(self, batch_size, n_kv_head, length, head_dim, device=None, dtype=torch.float32, v_dim=None):
        self.k = torch.zeros(batch_size, n_kv_head, length, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros(batch_size, n_kv_head, length, head_dim if v_dim is None else v_dim, device=device,
                             dtype=dtype)
        self.length = length
        # a view of each slot, made once: a decode step's write of its one key (and value) is then one copy
        self.k_slots, self.v_slots = ([t.narrow(2, s, 1) for s in range(length)] for t in (self.k, self.v))

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    @staticmethod
    def token_bytes(rows: list, dtype_bytes: int = 4) -> int:
        """Bytes one token adds, its rows (the widths of the vectors a layer caches: a kind's cache_rows)
        at dtype_bytes each (lab/counting.py asks; a cache that stores them otherwise says so itself)."""
        return sum(rows) * dtype_bytes

    def update(self, pos: int, k, v):
        """Store k, v (B, n_kv, T, hs) for positions pos..pos+T-1; return all cached (B, n_kv, n, hs)
        and which slots hold a key (None: all returned). A prefill longer than the cache (a windowed
        layer's holds one window) keeps its latest `length` positions and returns all T for its own,
        windowed, attention."""
        T = k.size(2)
        if T > 1 and pos != 0:
            raise ValueError("a KV cache takes a multi-token chunk only as the first (prefill) step")
        if T > self.length:  # ring slot of position p is p % length, as for every later step
            keep = torch.arange(T - self.length, T, device=k.device)
            self.k.index_copy_(2, keep % self.length, k[:, :, keep].to(self.k.dtype))
            self.v.index_copy_(2, keep % self.length, v[:, :, keep].to(self.v.dtype))
            return k, v, None
        slot = pos % self.length  # a prefill starts at 0 and fits, a decode step writes one slot: no wrap
        # cast to the cache's dtype on the way in; a decode step's one slot through its view, unless autograd
        # records (it refuses writes into views made before the cache held a graph: those take the slices)
        if T == 1 and not torch.is_grad_enabled():
            self.k_slots[slot].copy_(k)
            self.v_slots[slot].copy_(v)
        else:
            self.k[:, :, slot:slot + T] = k
            self.v[:, :, slot:slot + T] = v
        n = min(pos + T, self.length)  # slots in use; order is irrelevant once no mask is needed
        if n == self.k.size(2):  # every slot (a padded cache has more than `length`): no slicing
            return self.k, self.v, None
        return self.k[:, :, :n], self.v[:, :, :n], None

    def positions(self, q_pos, n: int):
        """(query positions, positions of the n keys update returned), for a position-dependent bias
        (ALiBi): slot s of the ring holds the latest position p <= the newest with p = s mod length."""
        newest = q_pos[-1]
        if n > self.length:  # a prefill longer than the cache attends to all of its own tokens
            return q_pos, torch.arange(n, device=q_pos.device) + newest - n + 1
        return q_pos, newest - (newest - torch.arange(n, device=q_pos.device)) % self.length


class StaticKVCache(KVCache):
    """The same ring buffer with fixed shapes, for a compiled decode step (as gpt-fast does): the
    position is a tensor, each step attends over every slot and a mask hides those not written yet,
    so one graph serves every step and nothing waits for the host. The storage is padded to a
    multiple of ALIGN slots (masked, never written: GPU kernels want aligned key lengths) and marked
    as static addresses, so a CUDA graph can capture the step (torch.compile skips CUDA graphs for
    inputs mutated in place that are not static)."""
    ALIGN = 64

    def __init__(self, batch_size, n_kv_head, length, head_dim, device=None, dtype=torch.float32, v_dim=None):
        padded = -(-length // self.ALIGN) * self.ALIGN
        super().__init__(batch_size, n_kv_head, padded, head_dim, device, dtype, v_dim)
        self.length = length  # the ring's size: position p lives in slot p % length
        self.slots = torch.arange(padded, device=device)
        for t in (self.k, self.v, self.slots):
            torch._dynamo.mark_static_address(t)

    def update(self, pos, k, v):
        if not torch.is_tensor(pos):  # the prefill runs eagerly, as for KVCache
            return super().update(pos, k, v)
        slot = pos % self.length  # (1,)
        self.k.index_copy_(2, slot, k.to(self.k.dtype))
        self.v.index_copy_(2, slot, v.to(self.v.dtype))
        return self.k, self.v, (self.slots <= pos) & (self.slots < self.length)  # 0..pos, all once full; no pad

    def positions(self, q_pos, n: int):
        if n != self.slots.numel():  # the eager prefill
            return super().positions(q_pos, n)
        return q_pos, q_pos[-1] - (q_pos[-1] - self.slots) % self.length  # unwritten and pad: masked anyway
