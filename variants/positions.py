"""Absolute positions, `model.pos=learned|sinusoidal`: a table of position vectors added to the token
embeddings, instead of RoPE's rotation inside attention (and `model.pos=none`, NoPE, has neither).

Fills the model's `positions` slot (GPT.positions, added to wte's output; GPT.slides is False with
one: a table ends at block_size, so generation past it re-prefills). GPT-2's learned table (Radford
et al. 2019) and Vaswani et al. 2017's fixed sinusoids; NoPE: Kazemnejad et al. 2023, arXiv
2305.19466. Tests: tests/variants/test_positions.py (the sinusoidal formula, what NoPE cannot tell
apart, tables that end), tests/test_variants.py (each scheme through the paths and caches),
tests/tools/test_eval_lengths.py (evaluation past the trained length).
"""
import torch
import torch.nn as nn


def sinusoidal_table(length: int, dim: int):
    """Vaswani et al.'s fixed positions: PE[p, 2i] = sin(p / 10000^(2i/d)), PE[p, 2i+1] = cos(same)."""
    angles = torch.outer(torch.arange(length, dtype=torch.float32),
                         1.0 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))  # (L, d/2)
    return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(1)  # (L, d): sin, cos interleaved


class LearnedPositions(nn.Module):
    """A trained table of block_size position vectors added to the token embeddings (GPT-2)."""

    def __init__(self, config):
        super().__init__()
        self.wpe = nn.Embedding(config.block_size, config.n_embd)

    def forward(self, start, T: int):
        return self.wpe.weight.index_select(0, torch.arange(T, device=self.wpe.weight.device) + start)  # (T, C)


class SinusoidalPositions(nn.Module):
    """The fixed sinusoidal table added to the token embeddings (Vaswani et al. 2017)."""

    def __init__(self, config):
        super().__init__()
        self.register_buffer("table", sinusoidal_table(config.block_size, config.n_embd), persistent=False)

    def forward(self, start, T: int):
        return self.table.index_select(0, torch.arange(T, device=self.table.device) + start)  # (T, C)
