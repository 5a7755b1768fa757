"""FlashAttention's algorithm in plain PyTorch: `model.attn.impl=tiled` (block: `model.attn.block`).

Fills the core's `path` slot (attention.CausalSelfAttention's `attend`), with sdpa_attention's
signature: the same mask, logit bias and sink. Dao et al. 2022, arXiv 2205.14135; the online softmax
of Milakov & Gimelshein 2018, arXiv 1805.02867. Tests: tests/variants/test_tiled.py (forward and
backward against the formula in float64, O(N) saved memory), tests/test_windows.py, and
tests/variants/test_sinks.py and test_alibi.py (with a sink, with ALiBi).
"""
import torch


def key_range(mask, q0: int, q1: int, Tk: int, block: int):
    """The key blocks [k0, k1) the queries q0..q1-1 can see any key of: a causal query sees no later
    key, a windowed one none older than its window. Blocks past that are never computed
    (FlashAttention skips them too: the causal half of the table costs nothing)."""
    if mask is None:
        return [(k0, min(k0 + block, Tk)) for k0 in range(0, Tk, block)]
    offset = mask.Tk - mask.Tq  # the queries are the last Tq positions
    lo = 0 if mask.window is None else max(0, offset + q0 - mask.window + 1) // block * block
    hi = min(Tk, offset + q1)
    return [(k0, min(k0 + block, hi)) for k0 in range(lo, hi, block)]


def tile_scores(qg, kg, scale, mask, bias, q0, q1, k0, k1):
    """One tile's logits (B, n_kv, g, bq, bk): q·kᵀ·scale, plus this tile's part of the logit bias
    (never the whole table), -inf where the mask hides a key."""
    s = qg[..., q0:q1, :] @ kg[..., k0:k1, :].transpose(-2, -1) * scale
    if bias is not None:
        s = s + bias(slice(q0, q1), slice(k0, k1)).view(1, *qg.shape[1:3], q1 - q0, k1 - k0)
    if mask is not None:
        s = s.masked_fill(~mask(qg.device, q0, q1, k0, k1), float("-inf"))
    return s


class TiledAttention(torch.autograd.Function):
    """Queries and keys in blocks, an online softmax and a backward pass that recomputes each block's
    scores. All N² dot products are still computed (less the blocks a causal mask hides); the N x N
    table never exists: a training step keeps only q, k, v, the output and one log-sum-exp per query
    row, O(N) memory.

    Forward, per block of queries: a running maximum m, a running sum l of exp(s - m) and a running
    output o. For each block of keys, s = q·kᵀ·scale; m' = max(m, max_j s); the old l and o are
    rescaled by exp(m - m'), then l += Σ_j exp(s - m'), o += exp(s - m')·v. At the end o / l is the
    softmax-weighted sum, and m + ln l (the log-sum-exp) is all the backward needs to rebuild the
    weights p = exp(s - lse) of any block. Backward, with D_i = Σ_d dO_id O_id:
    dV += pᵀ dO, dP = dO Vᵀ, dS = p ∘ (dP - D), dQ += dS K · scale, dK += dSᵀ Q · scale.
    A sink is where every row starts: its logit, weight exp(0) = 1, value 0. Grouped-query heads read
    their shared k, v without copying them (the g query heads of a kv head are one batch dimension);
    everything accumulates in at least fp32."""

    @staticmethod
    def forward(ctx, q, k, v, scale, mask, bias, sink, block):
        B, nh, Tq, hs = q.shape
        n_kv, Tk = k.size(1), k.size(2)
        acc = torch.promote_types(q.dtype, torch.float32)
        qg = q.view(B, n_kv, nh // n_kv, Tq, hs).to(acc)  # (B, n_kv, g, Tq, hs): query heads by kv head
        kg, vg = k.unsqueeze(2).to(acc), v.unsqueeze(2).to(acc)  # (B, n_kv, 1, Tk, hs)
        out = torch.zeros(*qg.shape[:-1], v.size(-1), dtype=acc, device=q.device)  # (B, n_kv, g, Tq, hs_v)
        lse = torch.full(qg.shape[:-1], float("-inf"), dtype=acc, device=q.device)  # (B, n_kv, g, Tq)
        for q0 in range(0, Tq, block):
            q1 = min(q0 + block, Tq)
            m = torch.full((*qg.shape[:3], q1 - q0), float("-inf"), dtype=acc, device=q.device)
            l, o = torch.zeros_like(m), torch.zeros_like(out[..., q0:q1, :])
            if sink is not None:
                m = sink.to(acc).view(1, n_kv, nh // n_kv, 1).expand_as(m).clone()
                l = torch.ones_like(m)
            for k0, k1 in key_range(mask, q0, q1, Tk, block):
                s = tile_scores(qg, kg, scale, mask, bias, q0, q1, k0, k1)  # (B, n_kv, g, bq, bk)
                m_new = torch.maximum(m, s.amax(-1))
                m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)  # a row that sees no key yet
                p = torch.exp(s - m_safe.unsqueeze(-1))
                rescale = torch.exp(m - m_safe)  # the earlier blocks' partial sums, moved to the new max
                l = l * rescale + p.sum(-1)
                o = o * rescale.unsqueeze(-1) + p @ vg[..., k0:k1, :]
                m = m_new
            out[..., q0:q1, :] = o / l.unsqueeze(-1)
            lse[..., q0:q1] = m + torch.log(l)
        ctx.save_for_backward(q, k, v, out, lse, sink)
        ctx.args = (scale, mask, bias, block)
        return out.view(B, nh, Tq, -1).to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sink = ctx.saved_tensors
        scale, mask, bias, block = ctx.args
        B, nh, Tq, hs = q.shape
        n_kv, Tk = k.size(1), k.size(2)
        acc = out.dtype
        qg, kg, vg = q.view(B, n_kv, nh // n_kv, Tq, hs).to(acc), k.unsqueeze(2).to(acc), v.unsqueeze(2).to(acc)
        do = dout.reshape(out.shape).to(acc)
        D = (do * out).sum(-1)  # (B, n_kv, g, Tq)
        dq, dk, dv = torch.zeros_like(qg), torch.zeros_like(kg), torch.zeros_like(vg)
        for q0 in range(0, Tq, block):
            q1 = min(q0 + block, Tq)
            for k0, k1 in key_range(mask, q0, q1, Tk, block):
                s = tile_scores(qg, kg, scale, mask, bias, q0, q1, k0, k1)
                p = torch.exp(s - lse[..., q0:q1].unsqueeze(-1))  # this block's softmax weights, rebuilt
                dv[..., k0:k1, :] += (p.transpose(-2, -1) @ do[..., q0:q1, :]).sum(2, keepdim=True)
                dp = do[..., q0:q1, :] @ vg[..., k0:k1, :].transpose(-2, -1)
                ds = p * (dp - D[..., q0:q1].unsqueeze(-1))
                dq[..., q0:q1, :] += ds @ kg[..., k0:k1, :] * scale
                dk[..., k0:k1, :] += (ds.transpose(-2, -1) @ qg[..., q0:q1, :]).sum(2, keepdim=True) * scale
        dsink = None
        if sink is not None:  # the sink's weight p = exp(sink - lse) times (dP = 0 for its zero value) - D
            p_sink = torch.exp(sink.to(acc).view(1, n_kv, nh // n_kv, 1) - lse)
            dsink = -(p_sink * D).sum(dim=(0, 3)).reshape(nh).to(sink.dtype)
        return (dq.view(q.shape).to(q.dtype), dk.squeeze(2).to(k.dtype), dv.squeeze(2).to(v.dtype),
                None, None, None, dsink, None)


def tiled_attention(q, k, v, *, scale: float, mask=None, bias=None, sink=None, dropout_p: float = 0.0,
                    block: int = 128):
    """The tiled path, sdpa_attention's signature plus the tile size; no attention dropout."""
    if dropout_p > 0:
        raise ValueError("the tiled path does not drop attention weights")
    return TiledAttention.apply(q, k, v, scale, mask, bias, sink, block)
