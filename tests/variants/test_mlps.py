"""variants/mlps.py, the other MLPs (model.mlp=swiglu|relu2): each against its formula written out, and
SwiGLU's default width."""
import math

import pytest
import torch
import torch.nn.functional as F

from helpers import variant_model as make


def max_diff(a, b):
    return f"max diff {(a - b).abs().max().item():.2e}, mean {(a - b).abs().mean().item():.2e}"


def test_swiglu_and_relu2_are_the_formulas_written_out():
    mlp = make(mlp="swiglu", n_layer=1).blocks[0].mlp
    d_ff = 64 * math.ceil(8 * 32 / 3 / 64)  # 8/3 * 32 = 85.3 -> 128
    assert mlp.c_fc.out_features == 2 * d_ff and mlp.c_proj.in_features == d_ff
    gate_w, up_w = mlp.c_fc.weight[:d_ff], mlp.c_fc.weight[d_ff:]
    x = torch.randn(3, 32)
    want = (F.silu(x @ gate_w.T) * (x @ up_w.T)) @ mlp.c_proj.weight.T  # down(silu(gate(x)) * up(x))
    assert torch.allclose(mlp(x), want, atol=1e-4), max_diff(mlp(x), want)
    relu2 = make(mlp="relu2", d_ff=96, n_layer=1).blocks[0].mlp
    want = (torch.clamp(x @ relu2.c_fc.weight.T, min=0) ** 2) @ relu2.c_proj.weight.T
    assert relu2.c_fc.out_features == 96 and torch.allclose(relu2(x), want, atol=1e-4)


def test_d_ff_defaults_keep_parameter_counts_close():
    """SwiGLU has three matrices, so its default width is 2/3 of 4*n_embd (rounded up to 64):
    the same MLP parameters where 8/3*n_embd is a multiple of 64 (768 -> 2048), a little more at
    small widths (128 -> 384, +12.5% of the MLP)."""
    mlp_params = lambda m: sum(p.numel() for n, p in m.named_parameters() if ".mlp." in n)
    for n_embd, ratio in ((768, 1.0), (128, 3 * 384 / (2 * 512))):
        n = {mlp: mlp_params(make(mlp=mlp, n_embd=n_embd, n_head=4, n_layer=1)) for mlp in ("gelu", "swiglu", "relu2")}
        assert n["swiglu"] / n["gelu"] == pytest.approx(ratio) and n["relu2"] == n["gelu"]
