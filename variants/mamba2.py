"""Mamba-2's SSD mixer, `model.attn.kind=mamba2` (state size: `model.attn.state_dim`, default head_dim):
a state-space layer whose state decays by one scalar per head and token.

A kind: Mamba2 is softmax attention's sibling under mixer.Mixer, with its own projections, forward,
new_cache, init_weights and counts; its output gate (RMSNorm of the heads' output times SiLU of a gate from
the layer input) fills the core's gate slot. Dao & Gu 2024, arXiv 2405.21060 (Jamba mixes Mamba 7:1
with attention). Tests: tests/variants/test_mamba2.py (the chunked and recurrent forms against the
materialised matrix and a float64 loop, outputs and gradients; segmented decoding);
tests/test_effective_attention.py (effective_attention against the layer's own output).

Per head, x_t (head_dim) and, shared by the heads, B_t and C_t (state_dim), all after a short causal
convolution and SiLU; Δ_t = softplus(x_t W_Δ + b) > 0 and A = -e^{A_log} < 0 per head:

    h_t = exp(Δ_t A) h_{t-1} + B_t (Δ_t x_t)ᵀ,    y_t = h_tᵀ C_t + D x_t

Unrolled, y = M (Δ ∘ X) + D X with M = L ∘ (C Bᵀ), L_tj = exp(Σ_{j<m≤t} Δ_m A) for j <= t: linear
attention (queries C, keys B, values Δx) with a decay mask, the SSD paper's duality. Training runs it
in chunks of 64 (inside a chunk the masked matrix, across chunks one state each); generation runs the
recurrence on a constant-size state (state_dim x head_dim per head) plus the convolution's last 3
inputs.
"""
import math
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

from mixer import Mixer
from variants.gdn import CONV, GatedRMSNorm, RecurrentState, ShortConv


def chunked_ssd(x, a, Bm, Cm, h0=None, chunk: int = 64):
    """y_t = Σ_{j<=t} exp(Σ_{j<m<=t} a_m) (C_t·B_j) x_j, plus exp(Σ_{m<=t} a_m) C_tᵀ h0, chunk by chunk:
    x (B, h, T, hs) (already times Δ), a (B, h, T) = Δ A (log decay), Bm, Cm (B, T, ds), h0 (B, h, ds, hs)
    or None. Returns y (B, h, T, hs) and the last state."""
    Bsz, h, T, hs = x.shape
    ds = Bm.size(-1)
    C = min(chunk, T)
    n = -(-T // C)
    pad = n * C - T  # padded steps: x = B = 0 and a = 0 change nothing
    if pad:
        x, a, Bm, Cm = F.pad(x, (0, 0, 0, pad)), F.pad(a, (0, pad)), F.pad(Bm, (0, 0, 0, pad)), F.pad(Cm, (0, 0, 0, pad))
    x, cum = x.view(Bsz, h, n, C, hs), a.view(Bsz, h, n, C).cumsum(-1)
    Bm, Cm = Bm.view(Bsz, 1, n, C, ds), Cm.view(Bsz, 1, n, C, ds)
    lower = torch.ones(C, C, dtype=torch.bool, device=x.device).tril()
    L = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~lower, float("-inf")).exp()  # (B, h, n, C, C)
    y = (L * (Cm @ Bm.transpose(-1, -2))) @ x  # inside each chunk: the masked matrix
    state = x.new_zeros(Bsz, h, ds, hs) if h0 is None else h0.to(x.dtype)
    out = []
    for c in range(n):  # across chunks: the state each starts from
        out.append(y[:, :, c] + cum[:, :, c].exp().unsqueeze(-1) * (Cm[:, :, c] @ state))
        last = cum[:, :, c, -1:]
        state = last.exp().unsqueeze(-1) * state + ((last - cum[:, :, c]).exp().unsqueeze(-1) * Bm[:, :, c]).transpose(
            -1, -2) @ x[:, :, c]
    return torch.stack(out, dim=2).view(Bsz, h, n * C, hs)[:, :, :T], state


def ssd_step(x, a, Bm, Cm, state):
    """One token of the recurrence: h <- exp(a) h + B xᵀ, y = hᵀ C. x (B, h, hs) (times Δ), a (B, h),
    Bm, Cm (B, ds), state (B, h, ds, hs). Returns (y, state)."""
    state = a.exp()[..., None, None] * state + Bm[:, None, :, None] * x.unsqueeze(-2)
    return (Cm[:, None, None, :] @ state).squeeze(-2), state


class Mamba2(Mixer):
    """A sibling of softmax attention under mixer.Mixer: hook_z, its own output gate in the gate slot,
    a recurrent state."""
    recurrent = True  # a constant-size state, no KV cache (no softmax weights: the probe has no statistics)
    ungrouped = "B and C are shared by every head"  # why model.n_kv_head does nothing here
    options = ("state_dim",)
    chunk = 64  # positions per chunk of the training form

    def __init__(self, config, layer: int, **slots):  # the softmax slots (path, bias, sink, select) do not apply
        super().__init__(config, layer, gate=partial(GatedRMSNorm, gate_first=True))

    @staticmethod
    def state_width(c) -> int:
        return c.attn.state_dim or c.head_dim  # B's and C's width

    @classmethod
    def projections(cls, c) -> dict:
        """in_proj's parts: x as v, B as q, C and Δ as k; o; `gate` the output gate's."""
        d, ds = c.n_embd, cls.state_width(c)
        return {"q": d * ds, "k": d * ds + d * c.n_head, "v": d * d, "o": d * d, "gate": d * d}

    @classmethod
    def params(cls, c) -> dict:
        """in_proj's and c_proj's biases; the convolution, A_log, dt_bias, D, the norm's weight."""
        d, nh, ds = c.n_embd, c.n_head, cls.state_width(c)
        return {"matrices": sum(cls.projections(c).values()),
                "other": int(c.bias) * (d + 2 * ds + nh + d) + (d + 2 * ds) * CONV + 3 * nh + d}

    @classmethod
    def mixing_macs(cls, c, seq_len, keys) -> tuple:
        """In its chunks of L: C·B with L positions, shared by the heads (L ds), and C against the state
        (hs ds per head) as scores; the masked weighted sum of L inputs and the state update (L hs + hs ds
        per head)."""
        nh, hs, ds, L = c.n_head, c.head_dim, cls.state_width(c), min(seq_len, cls.chunk)
        return L * ds + nh * hs * ds, nh * (L * hs + hs * ds)

    @classmethod
    def state_numbers(cls, c) -> int:
        d, ds = c.n_embd, cls.state_width(c)
        return c.n_head * ds * c.head_dim + (d + 2 * ds) * (CONV - 1)  # h per head; the convolution's last inputs

    def make_projections(self, config):
        d, nh, hs = config.n_embd, config.n_head, config.head_dim
        self.n_kv_head, self.state_dim = nh, self.state_width(config)
        self.in_proj = nn.Linear(d, nh * hs + 2 * self.state_dim + nh, bias=config.bias)  # [x | B | C | Δ]
        self.conv = ShortConv(nh * hs + 2 * self.state_dim)  # on x, B and C
        self.A_log = nn.Parameter(torch.empty(nh))
        self.dt_bias = nn.Parameter(torch.empty(nh))
        self.D = nn.Parameter(torch.ones(nh))  # the skip: D x_t
        self.c_proj = nn.Linear(nh * hs, d, bias=config.bias)

    @torch.no_grad()
    def init_weights(self):
        """After GPT's generic init: the convolution as PyTorch's Conv1d, e^A uniform in [1, 16], b such
        that softplus(b) is log-uniform in [0.001, 0.1], D = 1 (Mamba-2's)."""
        bound = 1 / math.sqrt(self.conv.weight.size(-1))
        self.conv.weight.uniform_(-bound, bound)
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1, 16).log())
        dt = torch.exp(torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)))
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        self.D.fill_(1.0)

    def mixer_inputs(self, x, conv_state=None):
        """What the recurrence takes of x (B, T, C): per head its input x (B, nh, T, hs), step Δ (B, nh, T)
        and log decay Δ A (B, nh, T); shared B and C (B, T, ds)."""
        Bsz, T, _ = x.shape
        xbc, dt = self.in_proj(x).split((self.n_head * self.head_dim + 2 * self.state_dim, self.n_head), dim=-1)
        xs, Bm, Cm = self.conv(xbc, conv_state).split((self.n_head * self.head_dim, self.state_dim, self.state_dim), -1)
        acc = torch.promote_types(x.dtype, torch.float32)  # the recurrence in at least fp32
        xs = self.hook_v(xs.view(Bsz, T, self.n_head, self.head_dim)).transpose(1, 2).to(acc)
        Bm, Cm = self.hook_k(Bm.unsqueeze(2)).squeeze(2).to(acc), self.hook_q(Cm.unsqueeze(2)).squeeze(2).to(acc)
        dt = self.step_sizes(dt)  # (B, nh, T)
        return xs, dt, dt * -self.A_log.exp().unsqueeze(-1), Bm, Cm

    def step_sizes(self, dt):
        """Δ = softplus(dt + b) (B, nh, T), in at least fp32, of in_proj's Δ part dt (B, T, nh)."""
        return F.softplus(dt.to(torch.promote_types(dt.dtype, torch.float32)) + self.dt_bias).transpose(1, 2)

    def effective_attention(self, x, q, k, *, rope=None):
        """The weights this layer mixes its values with, written out as a matrix A (B, nh, T, T), so that
        each head's output at hook_z (before the output gate) is A @ v for v its input read at hook_v
        (the x_t above), in a forward from position 0 without a cache: the SSD paper's matrix M = L ∘ (C Bᵀ)
        with the step Δ_j folded into each column and the skip D on the diagonal,

            A_tj = exp(Σ_{j<m≤t} Δ_m a) (C_t·B_j) Δ_j + D δ_tj   for j ≤ t   (a = -e^{A_log} per head)

        q (B, T, 1, ds) and k (B, T, 1, ds) are C and B as read at hook_q and hook_k (after the
        convolution and SiLU, shared by the heads); x (B, T, C), the layer input, gives Δ; rope is not
        used. Entries are signed and rows do not sum to 1."""
        dt = self.step_sizes(self.in_proj(x)[..., -self.n_head:])  # (B, nh, T)
        Cm, Bm = q.squeeze(2).to(dt.dtype), k.squeeze(2).to(dt.dtype)  # (B, T, ds)
        cum = (dt * -self.A_log.exp().unsqueeze(-1)).cumsum(-1)  # Σ_{m≤t} Δ_m a (B, nh, T)
        T = dt.size(-1)
        lower = torch.ones(T, T, dtype=torch.bool, device=dt.device).tril()
        L = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~lower, float("-inf")).exp()  # (B, nh, T, T)
        A = L * (Cm @ Bm.transpose(-1, -2)).unsqueeze(1) * dt.unsqueeze(-2)  # column j times Δ_j
        return A + torch.diag_embed(self.D.to(dt.dtype).view(1, -1, 1).expand_as(dt))

    def new_cache(self, batch_size: int, length: int, *, device=None, dtype=torch.float32, **_):
        """The layer's recurrent state: constant size whatever `length` (nothing to evict or quantise)."""
        return RecurrentState(batch_size, self.n_head, self.state_dim, self.head_dim,
                              self.n_head * self.head_dim + 2 * self.state_dim, device,
                              torch.promote_types(dtype, torch.float32))

    def forward(self, x, *, rope=None, cache=None, pos=0, window=None, ve=None):
        """x (B, T, C) -> (B, T, C); cache: this layer's RecurrentState, continued from where it was."""
        xs, dt, a, Bm, Cm = self.mixer_inputs(x, None if cache is None else cache.conv)
        if cache is not None and x.size(1) == 1:  # a decode step: the recurrence
            y, h = ssd_step(xs[:, :, 0] * dt[..., :1], a[..., 0], Bm[:, 0], Cm[:, 0], cache.S)
            y = y.unsqueeze(2)
        else:  # training, a prefill or a segment: the chunked form
            y, h = chunked_ssd(xs * dt.unsqueeze(-1), a, Bm, Cm, None if cache is None else cache.S, self.chunk)
        if cache is not None:
            cache.S.copy_(h)
        y = y + self.D.view(1, -1, 1, 1) * xs  # (B, nh, T, hs)
        return self.project(x, y.transpose(1, 2).to(x.dtype))
