"""Linear attention, `model.attn.kind=linear`: the kernel φ(q)·φ(k) instead of softmax, so the
product re-associates, training is linear in N and a constant-size state replaces the KV cache.

A kind: LinearAttention subclasses attention.CausalSelfAttention and overrides forward and new_cache
(its projections, QK-Norm, hook points and output gate are the core's). Katharopoulos et al. 2020,
arXiv 2006.16236 ("Transformers are RNNs"); the chunked training form of Hua et al. 2022, arXiv
2202.10447 and Yang et al. 2023, arXiv 2312.06635. Tests: tests/variants/test_linear.py (parallel,
chunked and recurrent forms against the causal formula, with and without RoPE and GQA; the state's
size; counts and gradients); tests/test_effective_attention.py (effective_attention, the weights
written out, against the layer's own output).
"""
import torch
import torch.nn.functional as F

from attention import CausalSelfAttention, apply_rope, repeat_kv

LINEAR_CHUNK = 64  # positions per chunk of the training form (lab/counting.py counts with it)


def elu_feature(x):
    """φ(x) = elu(x) + 1 > 0: the feature map of Katharopoulos et al. (2020), whose inner products
    φ(q)·φ(k) stand in for exp(q·k) (positive, so each row is still a weighted mean of values)."""
    return F.elu(x) + 1


class LinearState:
    """A linear-attention layer's whole context, in constant size whatever its length: S = Σ_j
    rope(φ(k_j)) v_jᵀ (B, n_kv, hs, hs) and z = Σ_j φ(k_j) (B, n_kv, hs). What a KV cache is to
    softmax attention, this is to linear attention: an RNN's hidden state."""

    def __init__(self, batch_size, n_kv_head, head_dim, device=None, dtype=torch.float32):
        self.S = torch.zeros(batch_size, n_kv_head, head_dim, head_dim, device=device, dtype=dtype)
        self.z = torch.zeros(batch_size, n_kv_head, head_dim, device=device, dtype=dtype)
        for t in (self.S, self.z):  # updated in place by a compiled decode step
            torch._dynamo.mark_static_address(t)

    def nbytes(self) -> int:
        return self.S.numel() * self.S.element_size() + self.z.numel() * self.z.element_size()


class LinearAttention(CausalSelfAttention):
    """Causal linear attention: the weights of query i on key j are φ(q_i)·φ(k_j) / Σ_{j'≤i}
    φ(q_i)·φ(k_j'), φ(x) = elu(x) + 1, so

        y_i = φ(q_i)ᵀ S_i / φ(q_i)ᵀ z_i,   S_i = Σ_{j≤i} φ(k_j) v_jᵀ,   z_i = Σ_{j≤i} φ(k_j)

    and the N x N product re-associates. Training uses the chunked form: within a chunk of `chunk`
    positions the masked quadratic form (φ(q)·φ(k) table, lower triangle, times v), and across chunks
    one state S per chunk boundary, so the work is O(N·(chunk + hs)·hs) and it keeps N/chunk states
    instead of N (the plain prefix sums of S_i keep an hs x hs matrix per position, and at nanoGPT's
    CPU size took several times as long). z_i is a prefix sum (hs numbers per position). Generation
    carries S and z as a constant-size state (the recurrent form). With RoPE, φ(q) and φ(k) are rotated
    in the numerator only, as the RoPE paper does for linear attention (Su et al. 2021, §3.4.4): the
    denominator keeps every weight's sum. QK-Norm applies before φ. No softmax: no scale, no logits,
    no windows, no N x N table."""

    softmax = False  # the attention probe reads softmax attention only
    recurrent = True  # a constant-size state, no KV cache
    selects = False  # no logits to choose keys by
    chunk = LINEAR_CHUNK  # positions per chunk in the chunked (training) form

    @classmethod
    def mixing_macs(cls, c, seq_len, keys) -> tuple:
        """In its chunked training form: each token adds φ(k)vᵀ and φ(k) to its kv head's chunk state
        (n_kv·hs·(hs + 1)), each query head reads the state its chunk starts from (nh·hs·(hs + 1)), and
        inside its chunk of L = min(N, chunk) positions q·k and the weighted sum as softmax does (nh·hs·L
        each): independent of N beyond one chunk."""
        hs, local = c.head_dim, c.n_head * c.head_dim * min(seq_len, cls.chunk)
        return c.n_kv_head * hs * (hs + 1) + local, c.n_head * hs * (hs + 1) + local

    @classmethod
    def cache_rows(cls, c, n_kv_head=None) -> list:
        return []  # a recurrent state, nothing per token

    @classmethod
    def state_numbers(cls, c) -> int:
        return c.n_kv_head * (c.head_dim ** 2 + c.head_dim)  # S (hs x hs) and z (hs) per kv head

    def features(self, x, rope, ve):
        """q, k, v as linear attention uses them, (B, heads, T, hs): (φ rotated, φ) for q and k, v."""
        q, k, v = self.qkv(x, None, ve)  # normed (QK-Norm), not rotated: φ comes first
        q, k, v = (h(t).transpose(1, 2) for h, t in ((self.hook_q, q), (self.hook_k, k), (self.hook_v, v)))
        fq, fk = elu_feature(q), elu_feature(k)  # (B, heads, T, hs)
        if rope is None:
            return (fq, fq), (fk, fk), v
        rot = lambda t: apply_rope(t, rope, dim=-2)  # noqa: E731
        return (rot(fq), fq), (rot(fk), fk), v

    def effective_attention(self, x, q, k, *, rope=None):
        """The weights this layer mixes its values with, written out as a matrix A (B, nh, T, T), so that
        each head's output at hook_z is A @ v for the v read at hook_v (query head h reads kv head
        h // (nh / n_kv)), in a forward from position 0 without a cache:

            A_ij = rope(φ(q_i))·rope(φ(k_j)) / φ(q_i)·Σ_{j'≤i} φ(k_j')   for j ≤ i, 0 above the diagonal

        q (B, T, nh, hs) and k (B, T, n_kv, hs) as read at hook_q and hook_k (after QK-Norm, before φ);
        rope: the table the layer was given (None without RoPE); x (the layer input) is not needed here.
        Without RoPE every row is a distribution (φ > 0 and the denominator is the numerators' sum), a
        softmax-like weighting; RoPE rotates the numerator only, so then weights can be negative and a
        row's sum is not 1."""
        acc = torch.promote_types(q.dtype, torch.float32)
        q, k = q.transpose(1, 2).to(acc), repeat_kv(k.transpose(1, 2), self.n_head).to(acc)  # (B, nh, T, hs)
        fq, fk = elu_feature(q), elu_feature(k)
        den = (fq * fk.cumsum(dim=2)).sum(-1, keepdim=True)  # φ(q_i)·z_i (B, nh, T, 1)
        if rope is not None:  # the numerator's features, rotated as forward rotates them
            fq, fk = (apply_rope(t, rope, dim=-2) for t in (fq, fk))
        return (fq @ fk.transpose(-1, -2)).tril() / den  # (B, nh, T, T)

    def new_cache(self, batch_size: int, length: int, *, device=None, dtype=torch.float32, make=None):
        """The layer's recurrent state: its size does not depend on `length`, so there is nothing to
        evict or quantise (`make`, the softmax layers' cache, does not apply; an int8 cache's layers
        keep a float state)."""
        return LinearState(batch_size, self.n_kv_head, self.head_dim, device, torch.promote_types(dtype, torch.float32))

    def forward(self, x, *, rope=None, cache=None, pos=0, window=None, ve=None):
        """x (B, T, C) -> (B, T, C); cache: this layer's LinearState (prefill or one decode step)."""
        B, T, C = x.shape
        (qn, qd), (kn, kd), v = self.features(x, rope, ve)  # numerator (rotated) and denominator features
        g = self.n_head // self.n_kv_head
        acc = torch.promote_types(x.dtype, torch.float32)
        qn, qd = (t.view(B, self.n_kv_head, g, T, -1).to(acc) for t in (qn, qd))  # query heads by kv head
        kn, kd, v = kn.to(acc), kd.to(acc), v.to(acc)
        z = torch.cumsum(kd, dim=2)  # (B, n_kv, T, hs): z_i, a prefix sum
        S0 = None
        if cache is not None:  # start from the state before this input (prefill or decode)
            S0, z = cache.S, z + cache.z.unsqueeze(2)
        num, S = self.chunked_numerator(qn, kn, v, S0)  # φ(q_i)ᵀ S_i (B, n_kv, g, T, hs) and S_T
        den = torch.einsum("bkgtd,bktd->bkgt", qd, z)  # φ(q_i)ᵀ z_i > 0
        if cache is not None:  # the recurrent form's state, for the next step
            cache.S.copy_(S)
            cache.z.copy_(z[:, :, -1])
        y = (num / den.unsqueeze(-1)).to(x.dtype).reshape(B, self.n_head, T, -1)
        return self.project(x, y.transpose(1, 2))

    def chunked_numerator(self, q, k, v, S0=None):
        """φ(q_i)ᵀ S_i for every i, S_i = S0 + Σ_{j≤i} φ(k_j) v_jᵀ, chunk by chunk: q (B, n_kv, g, T, hs),
        k and v (B, n_kv, T, hs). Returns it (B, n_kv, g, T, hs) and S_T (B, n_kv, hs, hs)."""
        B, K, g, T, hs = q.shape
        L = min(T, self.chunk)
        n = -(-T // L)  # chunks; the last is padded with zero keys and values, which add nothing
        pad = n * L - T
        if pad:
            q, k, v = F.pad(q, (0, 0, 0, pad)), F.pad(k, (0, 0, 0, pad)), F.pad(v, (0, 0, 0, pad))
        q, k, v = q.view(B, K, g, n, L, hs), k.view(B, K, n, L, hs), v.view(B, K, n, L, -1)
        S_chunk = k.transpose(-1, -2) @ v  # (B, K, n, hs, hs): each chunk's Σ φ(k_j) v_jᵀ
        S_end = torch.cumsum(S_chunk, dim=2)  # the state after each chunk
        if S0 is not None:
            S_end = S_end + S0.unsqueeze(2)
        first = S0.unsqueeze(2) if S0 is not None else torch.zeros_like(S_chunk[:, :, :1])
        S_before = torch.cat([first, S_end[:, :, :-1]], dim=2)  # the state each chunk starts from
        scores = (q @ k.unsqueeze(2).transpose(-1, -2)).tril()  # (B, K, g, n, L, L): φ(q_i)·φ(k_j), j ≤ i
        num = q @ S_before.unsqueeze(2) + scores @ v.unsqueeze(2)
        return num.view(B, K, g, n * L, -1)[:, :, :, :T], S_end[:, :, -1]
