"""RoPE scaling, `model.rope_scaling=linear|ntk|yarn` with `model.rope_scaling_factor`: RoPE for
contexts longer than the model was trained at.

Fills the model's RoPE frequencies (GPT.rope_table builds its table from the theta and the
temperature these return; attention.rope_table). Each turns RoPE's theta_j = base^(-2j/d) into the
frequencies for positions `factor` times longer than the `original` length trained on:
- linear, position interpolation (Chen et al. 2023, arXiv 2306.15595): theta_j / factor;
- ntk, "NTK-aware" (bloc97, 2023): the base raised to base * factor^(d / (d - 2)), so the lowest
  frequency is interpolated and the highest kept;
- yarn (Peng et al. 2023, arXiv 2309.00071): per dimension by its number of turns within the
  original length, r_j = original * theta_j / 2π: interpolated where r_j < alpha, kept where
  r_j > beta, a linear ramp between; and an attention temperature 0.1 ln(factor) + 1 on cos and
  sin, so every q·k logit is multiplied by its square ("length scaling").
Tests: tests/variants/test_rope_scaling.py (each against its formula; a scaled checkpoint through
eval_lengths and sample.py).
"""
import math

from attention import rope_theta

YARN_ALPHA, YARN_BETA = 1.0, 32.0  # YaRN's ramp: dims with fewer turns than alpha interpolate, more than beta don't


def unscaled(head_dim, base, factor, original, device=None):
    """(theta, temperature) of plain RoPE."""
    return rope_theta(head_dim, base, device), 1.0


def linear(head_dim, base, factor, original, device=None):
    return rope_theta(head_dim, base, device) / factor, 1.0


def ntk(head_dim, base, factor, original, device=None):
    return rope_theta(head_dim, base * factor ** (head_dim / (head_dim - 2)), device), 1.0


def yarn(head_dim, base, factor, original, device=None):
    theta = rope_theta(head_dim, base, device)
    turns = original * theta / (2 * math.pi)
    keep = ((turns - YARN_ALPHA) / (YARN_BETA - YARN_ALPHA)).clamp(0, 1)  # 1: keep, 0: interpolate
    return keep * theta + (1 - keep) * theta / factor, 0.1 * math.log(factor) + 1


ROPE_SCALINGS = {"none": unscaled, "linear": linear, "ntk": ntk, "yarn": yarn}  # model.rope_scaling (variants/__init__.py's table)
