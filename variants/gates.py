"""Gated attention, `model.attn.gate=head|channel`: a sigmoid of the layer input scales each head's output.

Fills the core's `gate` slot, the output transform (attention.CausalSelfAttention.project: after
hook_z, before the output projection): y_h <- y_h * sigmoid(x W_g), one gate per head or per head
channel. Qiu et al. 2025, arXiv 2505.06708 (gates remove attention sinks and massive activations at
scale). Tests: tests/variants/test_gates.py (the gate written out; a gate at one is the plain model).
"""
import torch
import torch.nn as nn


class HeadGate(nn.Linear):
    """One gate per head: W_g is a Linear from the layer input (n_embd) to n_head outputs, no bias."""

    def __init__(self, config):
        super().__init__(config.n_embd, config.n_head * self.width(config), bias=False)

    @staticmethod
    def width(config) -> int:
        return 1

    @classmethod
    def params(cls, c) -> int:
        """W_g's weights: n_embd inputs, n_head * width outputs (lab/counting.py adds them to the layer's)."""
        return c.n_embd * c.n_head * cls.width(c)

    def transform(self, x, y):
        """y (B, T, nh, hs) gated by sigmoid(x W_g) (B, T, nh, 1 or hs)."""
        return y * torch.sigmoid(self(x)).view(*y.shape[:3], -1)


class ChannelGate(HeadGate):
    """One gate per head channel: n_head * head_dim outputs."""

    @staticmethod
    def width(config) -> int:
        return config.head_dim
