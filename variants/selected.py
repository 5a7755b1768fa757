"""Attention over the key blocks a selection chose, and no others: `model.attn.impl=gathered` with
`model.attn.select=moba`.

Fills the core's `path` slot (attention.CausalSelfAttention's `attend`), with sdpa_attention's
signature. MoBA (variants/moba.py; Lu et al. 2025, arXiv 2502.13189) hands the path its choice as a
BlockChoice: per query, its own block and up to K earlier blocks of B keys. The masked paths turn the
choice into a mask over the full N x N table and still compute every score; this path computes only
the chosen blocks, (K + 1)·B keys per query whatever N. Tests: tests/variants/test_selected.py (outputs
and gradients equal the masked path and softmax over the chosen keys written out, in float64, with GQA,
a sink and lengths no multiple of B; choosing every block is full causal attention; the work counted).

How, for the queries of every batch row and head at once:
1. pairs: each (query, chosen block) pair, sorted by the block it reads, so each block of keys meets
   all the queries that chose it in one matrix product, q_pairs (m, hs) @ K_blockᵀ (hs, B). The keys
   are read in place; only the queries are copied, K + 1 times each.
2. softmax by query: each query's largest logit and sum of exponentials gathered over its pairs
   (scatter_reduce, index_add), the causal mask inside its own block, the sink's logit if the layer
   has one; then weights (m, B) @ V_block (B, hs) per block, added into each query's output.
3. backward: as FlashAttention's (Dao et al. 2022, arXiv 2205.14135; variants/tiled.py), from q, k,
   v, the output and one log-sum-exp per query; each pair's weights are recomputed, never kept.

Other ways were measured and dropped (one run: one layer's attention, 4 heads of 32, B = 64, K = 4,
one thread): copying the K + 1 blocks of keys and values for every query holds (K+1)·B·hs numbers per
query, more than the N scores it saves while N < (K+1)·B·hs, and took 32x sdpa's step at N = 1024; for each
block of B queries, taking the union of the blocks its queries chose keeps the products large, but at random
weights the queries disagree and the union was every earlier block (5.6x sdpa at N = 1024, 11x at
2048): its work grows as N again. Letting autograd differentiate this path as written kept each pair's
weights for the backward: 130 MiB at N = 8192 against 6.6 MiB here, and its step was slower.

Anything else (a KV cache's decode step, a mask that is no block choice, a logit bias) goes to
sdpa_attention, the masked path. It drops no attention weights (model.dropout must be 0, as for tiled).
"""
import torch
import torch.nn.functional as F

from variants.sinks import sdpa_with_sink
from variants.moba import BlockChoice


def gathers(mask) -> bool:
    """Whether the path can read the choice block by block: whole blocks (a BlockChoice) over keys in
    position order, the queries at the same positions (training, a prefill); a decode step over a
    cache, whose slots may hold positions in any order, takes the masked path."""
    if not isinstance(mask, BlockChoice) or mask.Tq != mask.Tk or mask.written is not None or mask.window:
        return False
    return torch.equal(mask.ids, torch.arange(mask.Tk, device=mask.ids.device) // mask.size)


def pairs(mask, n_kv: int):
    """The (query, block) pairs of the choice, grouped by block: rows (P,) each pair's query as a row of
    q.view(B·nh·T, hs); offset (P,) its query's position less the block's first (from 0 up: a later
    key of its own block is hidden); runs [(a, b, j)]: pairs a..b-1 read block j of the keys' blocks
    (B·n_kv·n, B, hs). A later block, all of it hidden by the causal mask, is never read."""
    Bt, nh, T, n = mask.blocks.shape
    own = mask.ids.view(-1, 1)  # (T, 1) each query's block: the queries are at the keys' positions
    b, h, i, j = (mask.blocks & (torch.arange(n, device=own.device) <= own)).nonzero(as_tuple=True)
    block = (b * nh + h) * n + j  # (P,) which (batch, query head, block) each pair reads
    order = block.argsort(stable=True)  # grouped by block; each group's queries in order
    rows, offset = ((b * nh + h) * T + i)[order], (i - j * mask.size)[order]
    ends, runs, a = torch.bincount(block, minlength=Bt * nh * n).cumsum(0).tolist(), [], 0
    for s, e in enumerate(ends):  # s = (b·nh + h)·n + j: query head h reads kv head h // (nh / n_kv)
        if e > a:
            runs.append((a, e, (s // (nh * n) * n_kv + s // n % nh // (nh // n_kv)) * n + s % n))
        a = e
    return rows, offset, runs


def block_products(x, blocks, runs, transpose: bool = False):
    """Each run of rows of x times its block: x[a:b] @ blocks[j] (or blocks[j]ᵀ), as one (P, ·) tensor."""
    width = blocks.size(-2) if transpose else blocks.size(-1)
    out = x.new_empty(x.size(0), width)
    for a, b, j in runs:
        torch.mm(x[a:b], blocks[j].T if transpose else blocks[j], out=out[a:b])
    return out


def in_blocks(x, n: int, size: int, dtype):
    """k or v (B, n_kv, T, hs) as (B·n_kv·n, size, hs) blocks, the last one padded with zeros."""
    B, n_kv, T, hs = x.shape
    return F.pad(x, (0, 0, 0, n * size - T)).reshape(B * n_kv * n, size, hs).to(dtype)


class GatheredAttention(torch.autograd.Function):
    """softmax(q·kᵀ·scale + M)·v over the chosen blocks only (the module docstring says how). Saves q,
    k, v, the output and one log-sum-exp per query: O(N) memory, as FlashAttention. Backward, with the
    weights p = exp(s - lse) of each pair recomputed and D_i = Σ_d dO_id O_id: dV += pᵀ dO,
    dP = dO Vᵀ, dS = p ∘ (dP - D), dQ += dS K · scale, dK += dSᵀ Q · scale; in at least fp32."""

    @staticmethod
    def forward(ctx, q, k, v, scale, mask, sink):
        B, nh, T, hs = q.shape
        n, size = mask.blocks.size(-1), mask.size
        acc = torch.promote_types(q.dtype, torch.float32)
        rows, offset, runs = pairs(mask, k.size(1))
        kb, vb = in_blocks(k, n, size, acc), in_blocks(v, n, size, acc)
        qs = q.reshape(B * nh * T, hs).to(acc).index_select(0, rows)  # (P, hs) each pair's query
        s = pair_scores(qs, kb, runs, scale, offset)  # (P, size)
        m = s.new_full((B * nh * T,), float("-inf")).scatter_reduce_(0, rows, s.amax(-1), "amax")  # per query
        sink_logit = None if sink is None else sink.to(acc).view(1, nh, 1).expand(B, nh, T).reshape(-1)
        if sink is not None:
            m = torch.maximum(m, sink_logit)
        p = s.sub_(m[rows].unsqueeze(-1)).exp_()  # (P, size), each query's weights before normalising (in place)
        total = s.new_zeros(B * nh * T).index_add_(0, rows, p.sum(-1))
        if sink is not None:  # the sink: weight exp(sink - m), value zero
            total += torch.exp(sink_logit - m)
        out = s.new_zeros(B * nh * T, v.size(-1)).index_add_(0, rows, block_products(p, vb, runs))
        out /= total.unsqueeze(-1)
        ctx.save_for_backward(q, k, v, out, m + torch.log(total), sink, rows, offset)
        ctx.args = (scale, runs, n, size)
        return out.view(B, nh, T, -1).to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        with torch.autocast(dout.device.type, enabled=False):
            return GatheredAttention.gradients(ctx, dout)

    @staticmethod
    def gradients(ctx, dout):
        q, k, v, out, lse, sink, rows, offset = ctx.saved_tensors
        scale, runs, n, size = ctx.args
        B, nh, T, hs = q.shape
        acc = out.dtype
        kb, vb = in_blocks(k, n, size, acc), in_blocks(v, n, size, acc)
        qs = q.reshape(B * nh * T, hs).to(acc).index_select(0, rows)
        do = dout.reshape(out.shape).to(acc)
        D = (do * out).sum(-1)  # (B·nh·T,)
        dos = do.index_select(0, rows)  # (P, hs_v) each pair's output gradient
        p = pair_scores(qs, kb, runs, scale, offset).sub_(lse[rows].unsqueeze(-1)).exp_()  # the weights, rebuilt
        ds = block_products(dos, vb, runs, transpose=True).sub_(D[rows].unsqueeze(-1)).mul_(p)  # in place: (P, size)
        dkb, dvb = torch.zeros_like(kb), torch.zeros_like(vb)
        for a, b, j in runs:
            dkb[j] += ds[a:b].T @ qs[a:b]
            dvb[j] += p[a:b].T @ dos[a:b]
        dq = qs.new_zeros(B * nh * T, hs).index_add_(0, rows, block_products(ds, kb, runs)) * scale
        dk = (dkb * scale).view(B, k.size(1), n * size, hs)[:, :, :T]
        dv = dvb.view(B, v.size(1), n * size, -1)[:, :, :T]
        dsink = None
        if sink is not None:  # the sink's weight exp(sink - lse) times (dP = 0 for its zero value) - D
            p_sink = torch.exp(sink.to(acc).view(1, nh, 1) - lse.view(B, nh, T))
            dsink = -(p_sink * D.view(B, nh, T)).sum(dim=(0, 2)).to(sink.dtype)
        return dq.view(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, dsink


def pair_scores(qs, kb, runs, scale: float, offset):
    """(P, size) logits of each pair's query against its block's keys, -inf for the keys after the query."""
    s = block_products(qs, kb, runs, transpose=True).mul_(scale)
    own = (offset < s.size(-1) - 1).nonzero().squeeze(-1)  # the pairs of a query and its own block: some keys later
    s[own] = s[own].masked_fill_(torch.arange(s.size(-1), device=s.device) > offset[own].unsqueeze(-1), float("-inf"))
    return s


def gathered_attention(q, k, v, *, scale: float, mask=None, bias=None, sink=None, dropout_p: float = 0.0):
    """The gathered path, sdpa_attention's signature: q (B, nh, T, hs), k and v (B, n_kv, T, hs) ->
    (B, nh, T, hs) over the blocks a BlockChoice chose; anything else by sdpa_attention, masked."""
    if bias is not None or not gathers(mask):
        return sdpa_with_sink(q, k, v, scale=scale, mask=mask, bias=bias, sink=sink, dropout_p=dropout_p)
    if dropout_p > 0:
        raise ValueError("the gathered path does not drop attention weights")
    with torch.autocast(q.device.type, enabled=False):  # its products run in at least fp32, into fp32 buffers
        return GatheredAttention.apply(q, k, v, scale, mask, sink)
