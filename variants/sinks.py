"""Attention sinks, `model.attn.sink=zero|learned`: softmax may put weight on nothing.

Fills the core's `sink` slot (attention.CausalSelfAttention.sink_logit): one logit per head for one
more key that every query sees and whose value is zero, so a head with nothing to read can park its
weight there instead of on a real token. `zero` is softmax with an extra zero logit ("off by one",
Miller 2023); `learned` a trained logit per head (gpt-oss; Xiao et al. 2023, arXiv 2309.17453, name
the tokens heads park on "attention sinks"). Every path takes it: an extra logit column (reference),
an extra key (sdpa, attention.with_sink), the online softmax's starting point (tiled). Tests:
tests/variants/test_sinks.py (one more logit with a zero value, on every path; the probe's sink mass).
"""
import torch
import torch.nn as nn


def zero_sink(config):
    """A fixed zero logit per head (a buffer: nothing to learn, nothing saved)."""
    return torch.zeros(config.n_head)


def learned_sink(config):
    """A trained logit per head, starting at zero (GPT.init_weights)."""
    return nn.Parameter(torch.zeros(config.n_head))
