"""A learned lightning indexer, `model.attn.select=indexer` (`select_topk` k, `indexer_heads` H,
`indexer_dim` d, `indexer_kl` the weight of its loss): each query reads the k keys a small scorer of
its own ranks highest, as DeepSeek Sparse Attention does (DeepSeek-AI 2025, DeepSeek-V3.2, arXiv
2512.02556).

Fills the core's `select` slot (attention.CausalSelfAttention.forward and .scores; it returns
variants/moba.py's SelectedMask). The index score of key s for query t is

    I[t, s] = Σ_j w[t, j] · ReLU(q^I[t, j] · k^I[s] / √d)        j = 1..H indexer heads of width d

q^I (H heads) and w (one weight per indexer head, times 1/√H so that I's size does not grow with H)
are projected from the layer's query, all its heads side by side; k^I, one key head shared by the
indexer heads as in DSA, from its keys. Each query keeps the k keys of largest I among those it may
see (all of them when it sees fewer; a tie goes to the more recent key) and attends over those only. The choice is shared by the layer's heads, as DSA's is.

- Input: the layer's own q and k, detached (DSA stops the main model's gradient at the indexer's
  input), turned back by RoPE's angles to what they were before the rotation; q^I and k^I then get a
  rotation of their own (RoPE at width d). So I, like the layer's logits, depends on positions only
  through their offset, and a KV cache that slid past block_size chooses as recomputation does.
- Its loss: KL(p_t || softmax(I_t)) over the keys query t may see, p_t the layer's attention with no
  selection, summed over its heads and normalised to 1 (a sink's share left out: it ranks keys),
  detached; the mean over the queries. This is the paper's dense warm-up objective; its sparse stage
  takes the KL over the chosen keys only. Here the model trains from scratch with the selection on,
  and only the dense KL shows the indexer the keys it failed to choose, so it is the one used throughout.
- The main model learns from the LM loss alone (the choice is not differentiable, and the indexer's
  input is detached). The KL is the layer's auxiliary loss (aux_loss, the generic path of mixer.py):
  the loss keeps the cross-entropy's value and carries indexer_kl times each layer's KL in its
  gradient, so one backward trains both, scaled as the loss is, and DDP reduces it with the rest.
  Its mean (detached) is logged as `aux/indexer_kl`.
- indexer_kl = 1 by default. The indexer's parameters learn from this term alone, and AdamW's update
  hardly depends on a gradient's scale (it divides by the gradient's running RMS; Muon's not at all),
  so the weight hardly changes how the indexer learns (0 stops it: the choice then stays at its random
  start). What it does set is the indexer's
  share of the global gradient norm that train.grad_clip clips: as a mean per query in nats, like the
  cross-entropy, the KL at weight 1 weighs as much as the LM loss does, no more.

Scored in float32, autocast off: the choice must not hinge on bf16 rounding. Like MoBA's, the choice is
a mask, so every score is still computed; the saving in work needs a kernel that reads only the chosen
keys. Tests: tests/variants/test_indexer.py.
"""
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

from attention import Mask, apply_rope, attention_scores, repeat_kv, rope_theta
from variants.moba import SelectedMask, Selection
from variants.oracle import Oracle
from variants.rope_scaling import ROPE_SCALINGS


def turn(x, pos, theta, sign: int = 1):
    """x (..., T, d) rotated as RoPE rotates it at positions pos (T,): by pos·theta_j on channel pair j
    (sign -1: by minus that, undoing the rotation). pos·theta is the product attention.rope_table forms,
    so the angles are the model's to the bit."""
    angles = pos.to(torch.float32)[:, None] * theta  # (T, d/2)
    return apply_rope(x, torch.stack((angles.cos(), sign * angles.sin()), dim=-1))


class Indexer(nn.Module, Selection):
    """select(q, k, mask, q_pos, k_pos) -> SelectedMask, as variants.moba.MoBA; q (B, nh, Tq, hs), k
    (B, n_kv, Tk, hs), or one per query head as CausalSelfAttention.scores hands them."""

    reads_everything = staticmethod(Oracle.reads_everything)  # select_topk keys per query, as the oracle
    reads = staticmethod(Oracle.reads)

    @staticmethod
    def params(c) -> int:
        """q^I and w from the layer's queries, k^I from its keys (no biases)."""
        a = c.attn
        return c.n_head * c.head_dim * (a.indexer_heads * a.indexer_dim + a.indexer_heads) + c.n_kv_head * c.head_dim * a.indexer_dim

    def __init__(self, config):
        super().__init__()
        a = config.attn
        self.topk, self.heads, self.dim, self.weight = a.select_topk, a.indexer_heads, a.indexer_dim, a.indexer_kl
        self.n_kv, self.scale = config.n_kv_head, config.attn_scale
        self.wq = nn.Linear(config.n_head * config.head_dim, self.heads * self.dim, bias=False)  # q^I
        self.ww = nn.Linear(config.n_head * config.head_dim, self.heads, bias=False)  # w
        self.wk = nn.Linear(config.n_kv_head * config.head_dim, self.dim, bias=False)  # k^I
        self.theta = self.own_theta = None  # without RoPE there is no rotation to undo, and none of its own
        if config.pos == "rope":
            # the frequencies GPT.rope_theta gives the layers
            scaling = ROPE_SCALINGS[config.rope_scaling if config.rope_scaling_factor != 1 else "none"]
            self.theta = partial(scaling, config.rope_dim, config.rope_base, config.rope_scaling_factor,
                                 config.rope_original_length)
            self.own_theta = partial(rope_theta, self.dim, config.rope_base)
        self.pending = None  # this forward's KL with its graph, until GPT.forward adds its gradient to the loss
        self.kl_sum, self.kl_count = torch.zeros(()), torch.zeros(())  # detached, since train.py last read them

    def forward(self, q, k, mask: Mask, q_pos, k_pos) -> SelectedMask:
        visible = mask(q.device)  # (Tq, Tk), or (1, Tk) from a cache's written slots
        with torch.autocast(q.device.type, enabled=False):
            score = self.score(q.detach(), k.detach(), q_pos, k_pos)  # (B, Tq, Tk)
            self.pending = self.kl(q.detach(), k.detach(), score, visible) \
                if self.training and torch.is_grad_enabled() else None
        if self.pending is not None:
            kl = self.pending.detach()  # the sums move to its device
            self.kl_sum, self.kl_count = self.kl_sum + kl, self.kl_count + torch.ones_like(kl)
        chosen = self.choose(score.detach(), visible, k_pos)
        return SelectedMask(mask.Tq, mask.Tk, mask.window, mask.written, chosen=chosen[:, None])

    def aux_loss(self):
        """("indexer_kl", indexer_kl times this forward's KL) in training with autograd on, else None;
        taken once (mixer.with_aux_losses adds its gradient to the LM loss's)."""
        pending, self.pending = self.pending, None
        return None if pending is None else ("indexer_kl", self.weight * pending)

    def aux_metrics(self) -> dict:
        """{"indexer_kl": the mean KL over the forwards it trained in since the last call}, forgotten."""
        mean = self.kl_sum / self.kl_count  # no sync with the device: nan if it did not train
        self.kl_sum, self.kl_count = torch.zeros_like(self.kl_sum), torch.zeros_like(self.kl_count)
        return {"indexer_kl": mean}

    def score(self, q, k, q_pos, k_pos):
        """The index score I (B, Tq, Tk), float32."""
        B, Tq, H, d = q.size(0), q.size(2), self.heads, self.dim
        k = k[:, ::k.size(1) // self.n_kv]  # scores() repeats each kv head per query head: its first copy
        q, k = q.float(), k.float()
        if self.theta is not None:  # the layer's q and k as before RoPE
            theta = self.theta(device=q.device)[0]
            q, k = turn(q, q_pos, theta, -1), turn(k, k_pos, theta, -1)
        q, k = q.transpose(1, 2).flatten(2), k.transpose(1, 2).flatten(2)  # (B, Tq, nh hs), (B, Tk, n_kv hs)
        qi = F.linear(q, self.wq.weight.float()).view(B, Tq, H, d).transpose(1, 2)  # (B, H, Tq, d)
        ki = F.linear(k, self.wk.weight.float())  # (B, Tk, d)
        w = F.linear(q, self.ww.weight.float()) * H ** -0.5  # (B, Tq, H)
        if self.own_theta is not None:  # the indexer's own RoPE
            theta = self.own_theta(device=q.device)
            qi, ki = turn(qi, q_pos, theta), turn(ki, k_pos, theta)
        logits = torch.einsum("bhtd,bsd->bhts", qi, ki) * d ** -0.5  # (B, H, Tq, Tk)
        return torch.einsum("bth,bhts->bts", w, F.relu(logits))

    def choose(self, score, visible, k_pos):
        """(B, Tq, Tk) bool: each query's topk visible keys by score, a tie going to the more recent key."""
        score = score.masked_fill(~visible, float("-inf"))
        recent = torch.sort(k_pos, descending=True, stable=True).indices  # (Tk,) the slots, newest key first
        ranked = torch.sort(score[..., recent], dim=-1, descending=True, stable=True).indices[..., :self.topk]
        chosen = torch.zeros(score.shape, dtype=torch.bool, device=score.device).scatter_(-1, recent[ranked], True)
        return chosen & visible

    def kl(self, q, k, score, visible):
        """KL(p || softmax(I)) per query over the keys it sees, the mean over queries: p the layer's
        attention without selection, summed over heads, normalised (module docstring)."""
        with torch.no_grad():
            logits = attention_scores(q.float(), repeat_kv(k, q.size(1)).float(), scale=self.scale)  # (B, nh, Tq, Tk)
            p = logits.masked_fill(~visible, float("-inf")).softmax(-1).mean(1)  # (B, Tq, Tk), rows sum to 1
        log_q = score.masked_fill(~visible, float("-inf")).log_softmax(-1).masked_fill(~visible, 0.0)
        return (torch.xlogy(p, p) - p * log_q).sum(-1).mean()
