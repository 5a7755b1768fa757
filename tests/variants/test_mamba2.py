"""variants/mamba2.py, Mamba-2's SSD mixer (model.attn.kind=mamba2): the materialised matrix
M = L ∘ (C Bᵀ) times the inputs (SSD is linear attention with a decay mask) equals the chunked and the
recurrent forms and a float64 loop of h_t = exp(Δ_t A) h_{t-1} + B_t (Δ_t x_t)ᵀ; gradients; segmented
decoding against the whole sequence; the layer written out."""
import pytest
import torch
import torch.nn.functional as F

from helpers import segments_minus_whole, variant_model as make
from variants.mamba2 import chunked_ssd, ssd_step


def ssm_loop(x, a, Bm, Cm):
    """h_t = exp(a_t) h_{t-1} + B_t x_tᵀ, y_t = h_tᵀ C_t, one step at a time in float64: x (B, h, T, hs)
    (already times Δ), a = Δ A (B, h, T), Bm, Cm (B, T, ds)."""
    x, a, Bm, Cm = (t.double() for t in (x, a, Bm, Cm))
    B, h, T, hs = x.shape
    state = torch.zeros(B, h, Bm.size(-1), hs, dtype=torch.float64)
    out = []
    for t in range(T):
        state = a[:, :, t, None, None].exp() * state + Bm[:, None, t, :, None] * x[:, :, t, None, :]
        out.append((state * Cm[:, None, t, :, None]).sum(-2))
    return torch.stack(out, dim=2), state


def materialised(x, a, Bm, Cm):
    """M = L ∘ (C Bᵀ), L_tj = exp(Σ_{j<m≤t} a_m) for j <= t, 0 above the diagonal, then M x: (B, h, T, hs)."""
    cum = a.double().cumsum(-1)  # (B, h, T)
    T = a.size(-1)
    L = torch.zeros(*a.shape, T, dtype=torch.float64)
    for t in range(T):
        for j in range(t + 1):
            L[..., t, j] = (cum[..., t] - cum[..., j]).exp()
    M = L * (Cm.double() @ Bm.double().transpose(-1, -2)).unsqueeze(1)
    return M @ x.double()


def random_inputs(B=2, h=3, T=100, hs=6, ds=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, h, T, hs, generator=g)
    a = -torch.rand(B, h, T, generator=g) * torch.tensor([0.01, 0.2, 1.5]).view(1, h, 1)  # Δ A: slow to fast
    return x, a, torch.randn(B, T, ds, generator=g), torch.randn(B, T, ds, generator=g)


@pytest.mark.parametrize("chunk", [64, 16, 7, 1], ids=["chunk-64", "chunk-16", "ragged-7", "chunk-1"])
def test_ssd_is_its_materialised_matrix_and_the_recurrence(chunk):
    x, a, Bm, Cm = random_inputs()
    loop, h_loop = ssm_loop(x, a, Bm, Cm)
    assert (materialised(x, a, Bm, Cm) - loop).abs().max() < 1e-10  # the duality, in float64
    got, h = chunked_ssd(x, a, Bm, Cm, chunk=chunk)
    assert (got.double() - loop).abs().max() < 1e-4 and (h.double() - h_loop).abs().max() < 1e-4
    got64, _ = chunked_ssd(x.double(), a.double(), Bm.double(), Cm.double(), chunk=chunk)
    assert (got64 - loop).abs().max() < 1e-10


def test_the_recurrent_step_and_segments_carry_the_state():
    x, a, Bm, Cm = (t.double() for t in random_inputs())
    loop, _ = ssm_loop(x, a, Bm, Cm)
    state = torch.zeros(2, 3, 5, 6, dtype=torch.float64)
    steps = []
    for t in range(100):
        y, state = ssd_step(x[:, :, t], a[:, :, t], Bm[:, t], Cm[:, t], state)
        steps.append(y)
    assert (torch.stack(steps, 2) - loop).abs().max() < 1e-10
    state, parts = None, []
    for s, e in ((0, 3), (3, 4), (4, 70), (70, 100)):
        y, state = chunked_ssd(x[:, :, s:e], a[:, :, s:e], Bm[:, s:e], Cm[:, s:e], state, chunk=16)
        parts.append(y)
    assert (torch.cat(parts, 2) - loop).abs().max() < 1e-10


def test_gradients_of_the_chunked_form_equal_the_loops():
    inputs = [t.double().requires_grad_(True) for t in random_inputs(T=40)]
    w = torch.randn(2, 3, 40, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    grads = [torch.autograd.grad((fn(*inputs)[0] * w).sum(), inputs)
             for fn in (lambda *t: chunked_ssd(*t, chunk=16), ssm_loop)]
    for name, a, b in zip(("x", "a", "B", "C"), *grads):
        assert torch.allclose(a, b, atol=1e-10, rtol=1e-8), name


@pytest.mark.parametrize("T", [20, 150], ids=["one-chunk", "three-chunks"])
def test_the_layer_decoded_in_segments_equals_the_whole_sequence(T):
    assert segments_minus_whole(make(block_size=T, attn={"kind": "mamba2"}), T) < 1e-9


def test_the_state_does_not_grow_with_the_context():
    model = make(block_size=64, attn={"kind": "mamba2", "state_dim": 16})
    sizes = [sum(c.nbytes() for c in model.new_kv_cache(1, n)) for n in (16, 4096)]
    assert sizes[0] == sizes[1] == 2 * (4 * 16 * 8 + (32 + 2 * 16) * 3) * 4  # layers x (h x ds x hs + conv) fp32


def test_the_layer_is_mamba2_written_out():
    """One mamba2 layer against its parts by hand: the input projection, the causal convolution and
    SiLU on x, B and C, Δ = softplus(· + b), the materialised SSD with D x, SiLU(z)-gated RMSNorm over
    the heads, the output projection."""
    model = make(n_layer=1, attn={"kind": "mamba2", "state_dim": 4})
    attn = model.blocks[0].attn
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        h = x @ attn.in_proj.weight.T  # (B, T, 32 + 4 + 4 + 4)
        xbc, dt = h[..., :40], h[..., 40:]
        pad = torch.cat([torch.zeros(2, 3, 40), xbc], dim=1)
        conv = F.silu(torch.stack([(pad[:, t:t + 4] * attn.conv.weight[:, 0].T).sum(1) for t in range(9)], dim=1))
        xs, Bm, Cm = conv[..., :32].view(2, 9, 4, 8).transpose(1, 2), conv[..., 32:36], conv[..., 36:]
        delta = F.softplus(dt + attn.dt_bias).transpose(1, 2)  # (B, h, T)
        y = materialised(xs * delta.unsqueeze(-1), delta * -attn.A_log.exp().view(1, 4, 1), Bm, Cm).float()
        y = (y + attn.D.view(1, 4, 1, 1) * xs).transpose(1, 2).reshape(2, 9, 32)
        y = y * F.silu(x @ attn.gate.proj.weight.T)
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6) * attn.gate.norm.weight
        assert (attn(x) - y @ attn.c_proj.weight.T).abs().max() < 1e-5
