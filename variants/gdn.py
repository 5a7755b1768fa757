"""Gated DeltaNet, `model.attn.kind=gdn`: a linear-attention state that forgets (a gate per token) and
overwrites (the delta rule) instead of only adding.

A kind: GatedDeltaNet is softmax attention's sibling under mixer.Mixer, with its own projections,
forward, new_cache, init_weights and counts; its output gate (RMSNorm of each head's output times SiLU of a
gate from the layer input, as the paper's) fills the core's gate slot. Yang, Kautz & Hatamizadeh 2024,
arXiv 2412.06464 (Qwen3-Next and Olmo Hybrid mix it 3:1 with attention). Tests:
tests/variants/test_gdn.py (the chunked and recurrent forms against a float64 loop of the formula,
outputs and gradients; segmented decoding against the whole sequence; a broken chunk boundary fails);
tests/test_effective_attention.py (effective_attention against the layer's own output).

Per head, with q and k L2-normalised after a short causal convolution (kernel 4) and SiLU:

    S_t = α_t (I - β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ,    o_t = S_tᵀ q_t

β_t = σ(W_β x_t) is how much of the old association of k_t is replaced, α_t = exp(-e^A softplus(W_α
x_t + b)) how much of the whole state is kept. Training runs the chunked form (chunks of 64): with
u_t = β_t (v_t - α_t S_{t-1}ᵀ k_t) the state is S_t = α_t S_{t-1} + k_t u_tᵀ, and inside a chunk the u
solve one triangular system (the WY/UT representation): (I + diag(β) A) U = diag(β) (V - diag(γ) K
S_0), A_ti = (γ_t/γ_i) k_tᵀ k_i for i < t, γ_t the product of the α up to t. Then O = diag(γ) Q S_0 +
(Γ ∘ Q Kᵀ) U (Γ_ti = γ_t/γ_i, i ≤ t) and the next chunk starts from γ_C S_0 + (diag(γ_C/γ) K)ᵀ U:
O(N) memory (one state per chunk), no N x N table. Generation runs the recurrence on a constant-size
state (hs x hs per head) plus the convolution's last 3 inputs.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from mixer import Mixer

CONV = 4  # the short convolution's kernel


class GatedRMSNorm(nn.Module):
    """The output gate: RMSNorm(y) * SiLU(x W_g), per head (the norm's weight shared by the heads, as
    the paper's), or, with gate_first (Mamba-2's order), RMSNorm(y * SiLU(x W_g)) over all heads."""

    def __init__(self, config, gate_first: bool = False):
        super().__init__()
        self.proj = nn.Linear(config.n_embd, config.n_head * config.head_dim, bias=False)
        self.norm = nn.RMSNorm(config.n_embd if gate_first else config.head_dim, eps=1e-6)
        self.gate_first = gate_first

    def transform(self, x, y):
        """y (B, T, nh, hs) gated by x (B, T, C)."""
        g = F.silu(self.proj(x)).view(y.shape)
        if self.gate_first:
            return self.norm((y * g).flatten(2)).view(y.shape)
        return self.norm(y) * g


class ShortConv(nn.Module):
    """A causal depthwise convolution over time (kernel CONV) and SiLU; decoding keeps the last CONV - 1
    inputs of each channel."""

    def __init__(self, channels: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, CONV))

    def forward(self, x, state=None):
        """x (B, T, D) -> (B, T, D); state (B, D, CONV - 1): the inputs before x (zeros at the start),
        updated in place to the last CONV - 1 inputs."""
        xt = x.transpose(1, 2)  # (B, D, T)
        past = xt.new_zeros(*xt.shape[:2], CONV - 1) if state is None else state.to(xt.dtype)
        full = torch.cat([past, xt], dim=-1)  # (B, D, CONV - 1 + T)
        if state is not None:
            state.copy_(full[..., -(CONV - 1):])
        return F.silu(F.conv1d(full, self.weight, groups=x.size(-1))).transpose(1, 2)


class RecurrentState:
    """A recurrent layer's whole context in constant size: its state S (B, nh, d_key, hs) and its short
    convolution's last inputs (B, D, CONV - 1)."""

    def __init__(self, batch_size, n_head, key_dim, head_dim, conv_channels, device=None, dtype=torch.float32):
        self.S = torch.zeros(batch_size, n_head, key_dim, head_dim, device=device, dtype=dtype)
        self.conv = torch.zeros(batch_size, conv_channels, CONV - 1, device=device, dtype=dtype)

    def nbytes(self) -> int:
        return self.S.numel() * self.S.element_size() + self.conv.numel() * self.conv.element_size()


def chunked_gated_delta(q, k, v, beta, g, S0=None, chunk: int = 64):
    """o_t = S_tᵀ q_t for S_t = α_t (I - β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ, α_t = exp(g_t), chunk by
    chunk (the module docstring): q, k (B, h, T, dk), v (B, h, T, dv), beta, g (B, h, T), S0 (B, h, dk,
    dv) or None. Returns o (B, h, T, dv) and the last state."""
    B, h, T, dk = k.shape
    dv = v.size(-1)
    C = min(chunk, T)
    n = -(-T // C)
    pad = n * C - T  # padded steps: k = v = β = 0 and α = 1 change nothing
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        beta, g = F.pad(beta, (0, pad)), F.pad(g, (0, pad))
    q, k, v = q.view(B, h, n, C, dk), k.view(B, h, n, C, dk), v.view(B, h, n, C, dv)
    beta, G = beta.view(B, h, n, C), g.view(B, h, n, C).cumsum(-1)  # G_t = ln γ_t within the chunk
    lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    decay = (G.unsqueeze(-1) - G.unsqueeze(-2)).masked_fill(~lower, float("-inf")).exp()  # Γ_ti = γ_t / γ_i, i <= t
    A = (k @ k.transpose(-1, -2)) * decay.masked_fill(torch.eye(C, dtype=torch.bool, device=q.device), 0.0)
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    inv = torch.linalg.solve_triangular(eye + beta.unsqueeze(-1) * A, eye.expand_as(A), upper=False,
                                        unitriangular=True)  # (I + diag(β) A)^-1
    w_v = inv @ (beta.unsqueeze(-1) * v)  # U = w_v - w_k S_0
    w_k = inv @ ((beta * G.exp()).unsqueeze(-1) * k)
    qk = (q @ k.transpose(-1, -2)) * decay  # (Γ ∘ Q Kᵀ), i <= t
    S = q.new_zeros(B, h, dk, dv) if S0 is None else S0.to(q.dtype)
    out = []
    for c in range(n):  # sequential over chunks only
        u = w_v[:, :, c] - w_k[:, :, c] @ S  # (B, h, C, dv)
        out.append((G[:, :, c].exp().unsqueeze(-1) * q[:, :, c]) @ S + qk[:, :, c] @ u)
        last = G[:, :, c, -1:]  # ln γ_C
        S = last.exp().unsqueeze(-1) * S + ((last - G[:, :, c]).exp().unsqueeze(-1) * k[:, :, c]).transpose(-1, -2) @ u
    return torch.stack(out, dim=2).view(B, h, n * C, dv)[:, :, :T], S


def gated_delta_step(q, k, v, beta, g, S):
    """One token of the recurrence, as generation runs it: S <- α S + k uᵀ with u = β (v - α Sᵀ k),
    o = Sᵀ q. q, k (B, h, dk), v (B, h, dv), beta, g (B, h), S (B, h, dk, dv). Returns (o, S)."""
    S = g.exp()[..., None, None] * S
    u = beta.unsqueeze(-1) * (v - (k.unsqueeze(-2) @ S).squeeze(-2))
    S = S + k.unsqueeze(-1) * u.unsqueeze(-2)
    return (q.unsqueeze(-2) @ S).squeeze(-2), S


class GatedDeltaNet(Mixer):
    """A sibling of softmax attention under mixer.Mixer: its hooks (hook_q, hook_k, hook_v after the
    convolution and the L2 norm; hook_z), its own output gate in the gate slot, a recurrent state."""
    recurrent = True  # a constant-size state, no KV cache (no softmax weights: the probe has no statistics)
    ungrouped = "its q, k and v have n_head heads each"  # why model.n_kv_head does nothing here
    chunk = 64  # positions per chunk of the training form

    def __init__(self, config, layer: int, **slots):  # the softmax slots (path, bias, sink, select) do not apply
        super().__init__(config, layer, gate=GatedRMSNorm)  # its own output gate

    @classmethod
    def projections(cls, c) -> dict:
        """q, k, v and o; q and k also β's and α's projections, `gate` the output gate's."""
        d, nh = c.n_embd, c.n_head
        return {"q": d * d + d * nh, "k": d * d + d * nh, "v": d * d, "o": d * d, "gate": d * d}

    @classmethod
    def params(cls, c) -> dict:
        """c_attn's (3d) and β's biases, c_proj's; the convolution, A_log, dt_bias, the norm's weight."""
        d, nh = c.n_embd, c.n_head
        return {"matrices": sum(cls.projections(c).values()),
                "other": int(c.bias) * (3 * d + nh + d) + 3 * d * CONV + 2 * nh + c.head_dim}

    @classmethod
    def mixing_macs(cls, c, seq_len, keys) -> tuple:
        """In its chunks of L, per head: k·k, q·k and the solve's right-hand side with L positions (3 L hs)
        and q against the chunk's starting state (hs²) as scores; the solve's values and (q·k) u (2 L hs),
        the state read for u and its update (2 hs²) as the weighted sum (the solve itself, ~L²/2 per
        token, is left out, as the FLOP counter does)."""
        nh, hs, L = c.n_head, c.head_dim, min(seq_len, cls.chunk)
        return nh * (3 * L * hs + hs * hs), nh * (2 * L * hs + 2 * hs * hs)

    @classmethod
    def state_numbers(cls, c) -> int:
        return c.n_head * c.head_dim ** 2 + 3 * c.n_embd * (CONV - 1)  # S per head; the convolution's last inputs

    def make_projections(self, config):
        d, nh, hs = config.n_embd, config.n_head, config.head_dim
        self.n_kv_head = nh
        self.c_attn = nn.Linear(d, 3 * nh * hs, bias=config.bias)  # [Q | K | V]
        self.conv = ShortConv(3 * nh * hs)
        self.beta_proj = nn.Linear(d, nh, bias=config.bias)  # β = σ(x W_β)
        self.alpha_proj = nn.Linear(d, nh, bias=False)  # α = exp(-e^A softplus(x W_α + b))
        self.A_log = nn.Parameter(torch.empty(nh))
        self.dt_bias = nn.Parameter(torch.empty(nh))
        self.c_proj = nn.Linear(nh * hs, d, bias=config.bias)

    @torch.no_grad()
    def init_weights(self):
        """After GPT's generic init: the convolution as PyTorch's Conv1d (uniform ±1/√kernel), A with e^A
        uniform in [1, 16] and b such that softplus(b) is log-uniform in [0.001, 0.1] (Mamba's ranges,
        which the paper keeps)."""
        bound = 1 / math.sqrt(CONV)
        self.conv.weight.uniform_(-bound, bound)
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1, 16).log())
        dt = torch.exp(torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)))
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus⁻¹(dt)

    def gates(self, x):
        """(β, ln α) per head and token, (B, nh, T) each, in at least fp32."""
        acc = torch.promote_types(x.dtype, torch.float32)
        beta = torch.sigmoid(self.beta_proj(x))
        log_alpha = -self.A_log.exp() * F.softplus(self.alpha_proj(x).to(acc) + self.dt_bias)
        return beta.transpose(1, 2).to(acc), log_alpha.transpose(1, 2).to(acc)

    def effective_attention(self, x, q, k, *, rope=None):
        """The weights this layer mixes its values with, written out as a matrix A (B, nh, T, T), so that
        each head's output at hook_z is A @ v for the v read at hook_v, in a forward from position 0
        without a cache. Unrolling S_t = α_t (I - β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ from S_0 = 0 gives
        S_t = Σ_{s≤t} w_ts v_sᵀ, o_t = S_tᵀ q_t = Σ_s (q_t·w_ts) v_s, so

            A_ts = q_tᵀ α_t (I - β_t k_t k_tᵀ) ⋯ α_{s+1} (I - β_{s+1} k_{s+1} k_{s+1}ᵀ) β_s k_s   for s ≤ t

        (for s = t the product is empty: β_t q_t·k_t). w_ts is what key s has become in the state by
        step t: written with strength β_s, decayed by every later α and partly erased by every later
        key it overlaps. It is computed by the recurrence itself, one step per token, on W_t = [w_t1 ...
        w_tT] (hs, T) per head: W_t = α_t (I - β_t k_t k_tᵀ) W_{t-1} + β_t k_t e_tᵀ (e_t: position t's
        one-hot), A_t = q_tᵀ W_t: O(T² hs) per head, no hs x hs matrix product. Entries are signed and
        rows do not sum to 1. q, k (B, T, nh, hs) as read at hook_q and hook_k (after the convolution
        and the L2 norm); x (B, T, C), the layer input, gives β and α; rope is not used."""
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, nh, T, hs)
        beta, log_alpha = self.gates(x)  # (B, nh, T) each, at least fp32
        q, k = q.to(beta.dtype), k.to(beta.dtype)
        alpha = log_alpha.exp()
        B, nh, T, hs = q.shape
        W = q.new_zeros(B, nh, hs, T)
        eye = torch.eye(T, dtype=q.dtype, device=q.device)
        rows = []
        for t in range(T):
            k_t, b_t, a_t = k[:, :, t, :, None], beta[:, :, t, None, None], alpha[:, :, t, None, None]  # (B, nh, hs, 1)
            W = a_t * (W - b_t * k_t @ (k_t.transpose(-1, -2) @ W)) + b_t * k_t * eye[t]  # (B, nh, hs, T)
            rows.append((q[:, :, t, None] @ W).squeeze(-2))  # A_t (B, nh, T): zero beyond t
        return torch.stack(rows, dim=2)  # (B, nh, T, T)

    def new_cache(self, batch_size: int, length: int, *, device=None, dtype=torch.float32, **_):
        """The layer's recurrent state: constant size whatever `length` (nothing to evict or quantise)."""
        return RecurrentState(batch_size, self.n_head, self.head_dim, self.head_dim, 3 * self.n_head * self.head_dim,
                              device, torch.promote_types(dtype, torch.float32))

    def forward(self, x, *, rope=None, cache=None, pos=0, window=None, ve=None):
        """x (B, T, C) -> (B, T, C); cache: this layer's RecurrentState, continued from where it was."""
        B, T, _ = x.shape
        qkv = self.conv(self.c_attn(x), None if cache is None else cache.conv)
        q, k, v = qkv.view(B, T, 3, self.n_head, self.head_dim).unbind(2)
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        acc = torch.promote_types(x.dtype, torch.float32)  # the recurrence in at least fp32
        q, k, v = (h(t).transpose(1, 2).to(acc) for h, t in ((self.hook_q, q), (self.hook_k, k), (self.hook_v, v)))
        beta, log_alpha = self.gates(x)
        if cache is not None and T == 1:  # a decode step: the recurrence
            o, S = gated_delta_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], beta[..., 0], log_alpha[..., 0], cache.S)
            o = o.unsqueeze(2)
        else:  # training, a prefill or a segment: the chunked form
            o, S = chunked_gated_delta(q, k, v, beta, log_alpha, None if cache is None else cache.S, self.chunk)
        if cache is not None:
            cache.S.copy_(S)
        return self.project(x, o.transpose(1, 2).to(x.dtype))
