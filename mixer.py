"""What every token mixer of a block shares, and what each answers for itself.

A block's mixer is softmax attention (attention.CausalSelfAttention, and MLA beside it in variants/)
or a mixer that is not q·k attention (linear attention, Gated DeltaNet, Mamba-2: variants/). They are
siblings under Mixer, which holds the protocol the rest of attnlab relies on:

- hook points with TransformerLens' names (hook_q, hook_k, hook_v, hook_pattern, hook_z), so the
  probe, the maps and the tools attach without asking which kind a layer is;
- `project`: each head's output through hook_z and the gate slot, then the output projection;
- `new_cache`: what the kind keeps for generation (a KV cache, a latent, a recurrent state);
- flags: `softmax` (its weights are a softmax the probe can read), `recurrent` (a constant-size
  state, no cache that grows with the context), `rotates_heads`, `selects` (takes the select slot),
  `takes_qk_norm`, `takes_gate`, `groups_kv` (n_kv_head acts on it), `options` (model.attn keys of its
  own): what a config may ask of it, so no code outside the kind tests its name;
- `aux_loss`: a loss of its own that rides in the gradient (None by default), logged as aux/<name>;
- its counts, from the config alone, as class methods: parameters, MACs per token, the rows its cache
  adds per token (the cache class says their bytes), state numbers, the channels RoPE rotates, the
  key/value heads it really has. lab/counting.py totals them and tests hold them equal to a built layer.
"""
import torch
import torch.nn as nn


class HookPoint(nn.Module):
    """An identity a forward hook reads a tensor at (TransformerLens' HookPoint and its names): the
    attention probe, the maps and the tools attach here, so no forward carries them."""

    def forward(self, x):
        return x


class Dropout(nn.Dropout):
    """nn.Dropout, skipped where it would change nothing (in eval, or with p = 0): a decode step would
    otherwise dispatch one no-op per dropout (tests/test_decode_ops.py counts a step's dispatches)."""

    def forward(self, x):
        return super().forward(x) if self.training and self.p > 0 else x


class Mixer(nn.Module):
    """The base of every mixer: hooks, the gate slot and the output projection's path, the flags and
    the counts' defaults (a kind overrides what differs)."""
    softmax = False  # its weights are a softmax of logits: the attention probe reads them
    recurrent = False  # a constant-size state instead of a per-token cache (a window has nothing to narrow)
    rotates_heads = False  # with model.pos=rope, RoPE rotates its whole q and k heads (pairs of channels)
    selects = False  # takes a choice of keys by content (model.attn.select: the select slot)
    takes_qk_norm = False  # model.attn.qk_norm normalises its q and k heads
    takes_gate = False  # model.attn.gate: its heads' outputs pass the gate slot
    groups_kv = False  # model.n_kv_head groups its keys and values (GQA, MQA)
    ungrouped = "it has no key/value heads"  # why model.n_kv_head does nothing to it (groups_kv False)
    options = ()  # the model.attn keys only this kind reads (MLA's ranks, Mamba-2's state_dim)

    def __init__(self, config, layer: int, *, gate=None, **slots):  # softmax attention's other slots: not taken
        super().__init__()
        self.layer = layer  # this block's index, for the attention probe
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        self.dropout = config.dropout
        self.make_projections(config)  # the kind's own weights (then the gate's: the parameters' order is the layout)
        self.resid_dropout = Dropout(config.dropout)
        self.gate = gate(config) if gate else None  # on each head's output (variants/gates.py, gdn.GatedRMSNorm)
        self.hook_q, self.hook_k, self.hook_v, self.hook_z = HookPoint(), HookPoint(), HookPoint(), HookPoint()
        self.hook_pattern = HookPoint()

    def project(self, x, y):
        """Each head's output y (B, T, nh, hs), through hook_z and the gate if the layer has one, side by
        side, projected."""
        y = self.hook_z(y)
        if self.gate is not None:
            y = self.gate.transform(x, y)
        return self.resid_dropout(self.c_proj(y.reshape(*y.shape[:2], -1)))

    def make_projections(self, config):
        """The kind's projections and other weights, c_proj (the output projection) among them."""
        raise NotImplementedError(f"{type(self).__name__} makes no projections")

    def aux_loss(self):
        """(name, this forward's auxiliary loss, weighted, with its graph) or None: GPT.forward adds its
        gradient to the LM loss's, not its value."""
        return None

    def aux_metrics(self) -> dict:
        """{name: the mean of its auxiliary loss over the forwards since the last call} (detached), forgotten."""
        return {}

    # --------------------------------------------------------------- its counts, from the config alone

    @classmethod
    def kv_heads(cls, c) -> int:
        """The key/value heads the config's n_kv_head (None: n_head) gives this kind (MLA: every head reads one latent)."""
        return c.n_kv_head or c.n_head

    @classmethod
    def rope_width(cls, c):
        """The channels RoPE rotates in each of its q and k heads; None: it takes no RoPE."""
        return None

    @classmethod
    def projections(cls, c) -> dict:
        """Its projections' weights by what they compute (one MAC each per token): q, k, v, o (+ gate)."""
        raise NotImplementedError(f"{cls.__name__} does not count its projections")

    @classmethod
    def params(cls, c) -> dict:
        """{"matrices": its weight matrices, "other": biases, norms, gains, sinks, convolutions, decays}."""
        raise NotImplementedError(f"{cls.__name__} does not count its parameters")

    @classmethod
    def mixing_macs(cls, c, seq_len, keys) -> tuple:
        """(scores, weighted_sum) MACs per token at length seq_len; keys: those a query sees (its window)."""
        raise NotImplementedError(f"{cls.__name__} does not count its MACs")

    @classmethod
    def cache_rows(cls, c, n_kv_head=None) -> list:
        """The widths of the vectors its cache adds per token (none: nothing grows with the context);
        the cache class says their bytes (kv_cache.KVCache.token_bytes, an int8 cache's own)."""
        return []

    @classmethod
    def state_numbers(cls, c) -> int:
        """Numbers of its constant-size recurrent state per sequence (fp32), 0 for none."""
        return 0


# ----------------------------------------------------------------------------- auxiliary losses

class WithGradient(torch.autograd.Function):
    """loss's value; in the backward, loss's gradient also goes to each of `terms` (scalars)."""

    @staticmethod
    def forward(ctx, loss, *terms):
        ctx.n = len(terms)
        return loss.clone()

    @staticmethod
    def backward(ctx, grad):
        return (grad, *[grad] * ctx.n)


def with_aux_losses(loss, mixers):
    """The LM loss carrying in its gradient every mixer's auxiliary loss from this forward (aux_loss):
    one backward trains both, scaled as the loss is (accumulation, fp16's scale), and DDP reduces it with
    the rest; its value stays the LM loss's, so the logged loss and the comparisons mean one thing."""
    terms = [term for mixer in mixers if (term := mixer.aux_loss()) is not None]
    return WithGradient.apply(loss, *(value for _, value in terms)) if terms else loss


def aux_metrics(mixers) -> dict:
    """{name: the mean over the mixers of their auxiliary loss since the last call} (detached tensors)."""
    seen = {}
    for mixer in mixers:
        for name, value in mixer.aux_metrics().items():
            seen.setdefault(name, []).append(value)
    return {name: torch.stack(values).mean() for name, values in seen.items()}
