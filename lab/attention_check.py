"""A checker for the attention a learner writes (the tour's exercise): softmax(q·kᵀ/√d_k + M)·v, causal.

    from lab.attention_check import check_attention
    check_attention(my_attention)     # my_attention(q, k, v) -> (B, heads, T, d), q/k/v (B, heads, T, d)

It runs the learner's function on random inputs and compares the result with the repo's written-out path
(attention.reference_attention) and PyTorch's fused kernel (F.scaled_dot_product_attention); when they
differ it names the usual mistake by recomputing each one and seeing which the learner's output matches:
the scale missing or 1/d_k, no mask, the mask after the softmax, the mask's triangle the wrong way round,
the softmax over the wrong axis, keys scoring queries (k·qᵀ), the weights returned instead of weights·v.
"""
import math

import torch
import torch.nn.functional as F

from attention import Mask, reference_attention

TOLERANCE = 1e-4


def causal(T: int) -> torch.Tensor:
    """(T, T) True where query i sees key j (j <= i)."""
    return torch.ones(T, T, dtype=torch.bool).tril()


def mistakes(q, k, v) -> dict:
    """{what went wrong: the output it gives} for the usual mistakes, each written out."""
    T, d = q.size(-2), q.size(-1)
    s = q @ k.transpose(-2, -1)
    seen = causal(T)

    def masked_softmax(scores, dim=-1, keep=seen):
        return torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=dim)

    after = torch.softmax(s / math.sqrt(d), dim=-1)
    return {
        "the scale is missing: divide the scores q·kᵀ by √d_k before the softmax": masked_softmax(s) @ v,
        "the scores are divided by d_k; the scale is 1/√d_k (the square root)": masked_softmax(s / d) @ v,
        "no mask: query i must not see keys after it (set those scores to -inf before the softmax)":
            torch.softmax(s / math.sqrt(d), dim=-1) @ v,
        "the mask is applied after the softmax: mask the scores (-inf), then softmax, so each row of weights "
        "still sums to 1": after.masked_fill(~seen, 0.0) @ v,
        "the mask hides the past instead of the future: query i sees keys j <= i (a lower triangle, tril)":
            masked_softmax(s / math.sqrt(d), keep=seen.T) @ v,
        "the softmax runs over the queries (dim=-2); it runs over the keys, the last dim, so each query's "
        "weights sum to 1": masked_softmax(s / math.sqrt(d), dim=-2) @ v,
        "the scores are k·qᵀ: row i must hold query i's scores against every key, q @ k.transpose(-2, -1)":
            masked_softmax(k @ q.transpose(-2, -1) / math.sqrt(d)) @ v,
    }


def check_attention(fn, seed: int = 0, verbose: bool = True) -> bool:
    """Run fn(q, k, v) on random (2, 3, 7, 16) inputs; True when it matches causal softmax attention (and
    says so), else False with one line naming what is wrong."""
    g = torch.Generator().manual_seed(seed)
    B, H, T, d = 2, 3, 7, 16
    q, k, v = (torch.randn(B, H, T, d, generator=g) * 2 for _ in range(3))  # large enough that a missing scale shows
    want = reference_attention(q, k, v, scale=1 / math.sqrt(d), mask=Mask(T, T))
    fused = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.allclose(want, fused, atol=TOLERANCE), "reference and SDPA disagree: the repo's own check failed"

    def say(line):
        if verbose:
            print(line)

    try:
        got = fn(q.clone(), k.clone(), v.clone())
    except Exception as e:  # the learner's code: whatever it raises, say it in one line
        say(f"your function raised {type(e).__name__}: {e}")
        return False
    if not torch.is_tensor(got):
        say(f"your function returned {type(got).__name__}; return a tensor of shape {tuple(want.shape)}")
        return False
    if got.shape == (B, H, T, T):
        say(f"you returned the weights ({tuple(got.shape)}); multiply them by v to get {tuple(want.shape)}")
        return False
    if got.shape != want.shape:
        say(f"your output has shape {tuple(got.shape)}; it should be {tuple(want.shape)} (batch, heads, T, d)")
        return False
    got = got.float()
    if not torch.isfinite(got).all():
        say("your output has NaN or inf: masked scores go to -inf *before* the softmax (after it, -inf times v "
            "is not a number), and never a whole row")
        return False
    err = (got - want).abs().max().item()
    if err <= TOLERANCE:
        say(f"correct: equal to attnlab's reference_attention and to PyTorch's SDPA (largest difference {err:.1e})")
        return True
    for what, out in mistakes(q, k, v).items():
        if torch.allclose(got, out, atol=TOLERANCE):
            say(f"not yet: {what}")
            return False
    say(f"not yet: the largest difference from the reference is {err:.3g}; check the scale (1/√d_k), the mask "
        "(before the softmax) and the softmax's axis (the last)")
    return False
