"""Attention sinks, `model.attn.sink=zero|learned`: softmax may put weight on nothing.

Fills the core's `sink` slot (attention.CausalSelfAttention.sink_logit): one logit per head for one
more key that every query sees and whose value is zero, so a head with nothing to read can park its
weight there instead of on a real token. `zero` is softmax with an extra zero logit ("off by one",
Miller 2023); `learned` a trained logit per head (gpt-oss; Xiao et al. 2023, arXiv 2309.17453, name
the tokens heads park on "attention sinks"). Every path takes it: an extra logit column (reference),
an extra key (sdpa: sdpa_with_sink below), the online softmax's starting point (tiled). Tests:
tests/variants/test_sinks.py (one more logit with a zero value, on every path; the probe's sink mass).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from attention import float_mask, sdpa_attention


class ZeroSink:
    """A fixed zero logit per head (a buffer: nothing to learn, nothing saved)."""

    @staticmethod
    def make(config):
        return torch.zeros(config.n_head)

    @staticmethod
    def params(c) -> int:
        return 0

    @staticmethod
    def wrap(path):
        """The path of a layer with a sink: the fused kernel over one more key (sdpa_with_sink); the
        written-out and tiled paths take the sink as it is."""
        return sdpa_with_sink if path is sdpa_attention else path


class LearnedSink(ZeroSink):
    """A trained logit per head, starting at zero (GPT.init_weights)."""

    @staticmethod
    def make(config):
        return nn.Parameter(torch.zeros(config.n_head))

    @staticmethod
    def params(c) -> int:
        return c.n_head


def with_sink(q, k, v, sink, scale: float, mask):
    """q, k, v and an additive mask extended by a sink for a fused kernel: one more key, first, that
    every query sees, with value zero and logit `sink` (one per query head, whatever the query). The
    logit rides on one more channel: q gets sink/scale, the sink key 1, every other key 0."""
    B, nh, Tq, hs = q.shape
    n_kv, Tk = k.size(1), k.size(2)
    q = torch.cat([q, (sink / scale).to(q.dtype).view(1, nh, 1, 1).expand(B, nh, Tq, 1)], dim=-1)
    k = torch.cat([k.new_zeros(B, n_kv, 1, hs + 1), torch.cat([k, k.new_zeros(B, n_kv, Tk, 1)], dim=-1)], dim=2)
    k[:, :, 0, -1] = 1.0
    v = torch.cat([v.new_zeros(B, n_kv, 1, v.size(-1)), v], dim=2)
    return q, k, v, torch.cat([mask.new_zeros(*mask.shape[:-1], 1), mask], dim=-1)


def sdpa_with_sink(q, k, v, *, scale: float, mask=None, bias=None, sink=None, dropout_p: float = 0.0):
    """attention.sdpa_attention's path for a layer with a sink: the fused kernel over one more key
    (with_sink), the bias and mask as an additive float mask; without a sink (the gathered path's
    fallback), sdpa_attention itself."""
    if sink is None:
        return sdpa_attention(q, k, v, scale=scale, mask=mask, bias=bias, dropout_p=dropout_p)
    q, k, v, logits = with_sink(q, k, v, sink, scale, float_mask(q, k, mask, bias))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=logits, scale=scale, dropout_p=dropout_p,
                                          enable_gqa=k.size(1) != q.size(1))
