"""Other MLPs, `model.mlp=relu2|swiglu`: the activation between the MLP's two projections.

Fills the MLP's `act` slot (model.MLP: c_proj(act(c_fc(x)))); the table (ACTIVATIONS) also says how
many d_ff-wide parts c_fc makes for each. ReLU² is the Primer activation (So et al.
2021, arXiv 2109.08668), as modded-nanogpt uses it; SwiGLU is the Llama MLP (Shazeer 2020, arXiv
2002.05202), silu(gate) * up with gate and up from one matmul laid out [gate | up]. Tests:
tests/variants/test_mlps.py (each against its formula written out), tests/test_variants.py (through
the paths, caches and training).
"""
import torch.nn.functional as F


def relu2(h):
    return F.relu(h).square()


def swiglu(h):
    gate, up = h.chunk(2, dim=-1)  # (B, T, d_ff) each
    return F.silu(gate) * up
