"""How sharp is each head's attention? Entropy, peak weight and largest logit, per layer and head.

For a query at position i the attention weights p_ij over the keys it may see (j <= i) have
entropy H_i = -sum_j p_ij ln p_ij: ln(i+1) when uniform, 0 when one-hot. Softmax saturation (the
failure √d_k scaling and QK-Norm prevent) shows up as entropy collapsing and the peak weight
going to 1 (Dehghani et al. 2023, arXiv 2302.05442; Wortsman et al. 2023, arXiv 2309.14322).

The statistics come from the reference path's scores (model.attention_scores), one layer and one
block of queries at a time, so memory is O(B * heads * block * T), never a T x T matrix per
layer held at once, and training steps that do not probe never build an attention matrix.
"""
import math

import torch
import torch.nn.functional as F

from model import attention_scores


@torch.no_grad()
def attention_stats(q, k, scale: float, block: int = 256, dtype=torch.float32) -> dict:
    """Statistics of causal softmax(q·kᵀ·scale) for q, k (B, nh, T, hs), computed block-wise.

    Returns per-head tensors (nh,): `entropy` (nats, mean over rows), `entropy_norm` (each row
    divided by ln(i+1), rows i >= 1 only, since one key has no choice), `peak` (mean largest
    weight); and `logit_max` per head (largest scaled logit any query gives a visible key).
    """
    B, nh, T, _ = q.shape
    q, k = q.to(dtype), k.to(dtype)
    positions = torch.arange(T, device=q.device, dtype=dtype)
    ent_sum = torch.zeros(nh, device=q.device, dtype=dtype)
    norm_sum = torch.zeros_like(ent_sum)
    peak_sum = torch.zeros_like(ent_sum)
    logit_max = torch.full((nh,), -math.inf, device=q.device, dtype=dtype)
    for start in range(0, T, block):
        end = min(start + block, T)
        scores = attention_scores(q[:, :, start:end], k[:, :, :end], scale)  # (B, nh, Tb, end)
        logp = F.log_softmax(scores, dim=-1)
        p = logp.exp()
        ent = -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(-1)  # (B, nh, Tb)
        ent_sum += ent.sum(dim=(0, 2))
        log_keys = torch.log1p(positions[start:end])  # ln(i+1) for the block's rows
        rows = log_keys > 0
        norm_sum += (ent[..., rows] / log_keys[rows]).sum(dim=(0, 2))
        peak_sum += p.amax(-1).sum(dim=(0, 2))
        logit_max = torch.maximum(logit_max, scores.amax(dim=(0, 2, 3)))  # masked keys are -inf
    n_rows, n_norm_rows = B * T, B * max(T - 1, 1)
    return {"entropy": ent_sum / n_rows, "entropy_norm": norm_sum / n_norm_rows,
            "peak": peak_sum / n_rows, "logit_max": logit_max}


class AttentionProbe:
    """Runs a fixed batch through the model and returns the attention statistics as flat metrics."""

    def __init__(self, idx, block: int = 256):
        self.idx = idx  # (B, T) token ids, drawn once so every probe sees the same text
        self.block = block

    @torch.no_grad()
    def run(self, model) -> dict:
        was_training = model.training
        model.eval()
        per_layer = {}

        def hook(layer, q, k, scale):  # called once per layer with that layer's q, k
            per_layer[layer] = attention_stats(q, k, scale, self.block)

        model(self.idx, probe=hook)
        model.train(was_training)
        return flatten_stats(per_layer)


def flatten_stats(per_layer: dict) -> dict:
    """{layer: stats} -> metric keys attn_entropy/L{l}/H{h}, attn_entropy/L{l}, .../mean, etc."""
    out = {}
    for l, s in sorted(per_layer.items()):
        for h, v in enumerate(s["entropy"].tolist()):
            out[f"attn_entropy/L{l}/H{h}"] = v
        out[f"attn_entropy/L{l}"] = s["entropy"].mean().item()
        out[f"attn_entropy_norm/L{l}"] = s["entropy_norm"].mean().item()
        out[f"attn_peak/L{l}"] = s["peak"].mean().item()
        out[f"attn_logit_max/L{l}"] = s["logit_max"].max().item()
    n = len(per_layer)
    out["attn_entropy/mean"] = sum(out[f"attn_entropy/L{l}"] for l in per_layer) / n
    out["attn_entropy_norm/mean"] = sum(out[f"attn_entropy_norm/L{l}"] for l in per_layer) / n
    out["attn_peak/mean"] = sum(out[f"attn_peak/L{l}"] for l in per_layer) / n
    return out


def entropy_grid(stats: dict):
    """The layer x head matrix of attn_entropy/L{l}/H{h} values in a metrics line (list of lists)."""
    cells = {}
    for key, v in stats.items():
        parts = key.split("/")
        if len(parts) == 3 and parts[0] == "attn_entropy":
            cells[(int(parts[1][1:]), int(parts[2][1:]))] = v
    if not cells:
        return None
    n_l = max(l for l, _ in cells) + 1
    n_h = max(h for _, h in cells) + 1
    return [[cells.get((l, h), float("nan")) for h in range(n_h)] for l in range(n_l)]
