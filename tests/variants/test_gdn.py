"""variants/gdn.py, Gated DeltaNet (model.attn.kind=gdn): its chunked training form and its recurrence
against a float64 loop of the paper's formula written out (outputs and gradients), segmented decoding
against the whole sequence, the state's constant size, and a broken chunk boundary that the tests
catch."""
import pytest
import torch
import torch.nn.functional as F

from helpers import segments_minus_whole, variant_model as make
from variants.gdn import chunked_gated_delta, gated_delta_step


def delta_rule_loop(q, k, v, beta, g):
    """S_t = α_t (I - β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ, o_t = S_tᵀ q_t, one step at a time in float64,
    the matrices written out: q, k (B, h, T, dk), v (B, h, T, dv), beta, g = ln α (B, h, T)."""
    q, k, v, beta, g = (t.double() for t in (q, k, v, beta, g))
    B, h, T, dk = k.shape
    S = torch.zeros(B, h, dk, v.size(-1), dtype=torch.float64)
    eye = torch.eye(dk, dtype=torch.float64)
    out = []
    for t in range(T):
        kt, b, a = k[:, :, t], beta[:, :, t, None, None], g[:, :, t, None, None].exp()
        S = a * (eye - b * kt.unsqueeze(-1) * kt.unsqueeze(-2)) @ S + b * kt.unsqueeze(-1) * v[:, :, t].unsqueeze(-2)
        out.append((S.transpose(-1, -2) @ q[:, :, t].unsqueeze(-1)).squeeze(-1))
    return torch.stack(out, dim=2), S


def random_inputs(B=2, h=3, T=150, dk=8, dv=6, seed=0):
    """Inputs as the layer makes them: q, k unit vectors, β in (0, 1), α in (0, 1), some near 1."""
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, h, T, dk, generator=g), dim=-1)
    k = F.normalize(torch.randn(B, h, T, dk, generator=g), dim=-1)
    v = torch.randn(B, h, T, dv, generator=g)
    beta = torch.rand(B, h, T, generator=g)
    log_alpha = -torch.rand(B, h, T, generator=g) * torch.tensor([0.02, 0.3, 2.0]).view(1, h, 1)  # slow to fast
    return q, k, v, beta, log_alpha


@pytest.mark.parametrize("chunk", [64, 16, 7, 1], ids=["chunk-64", "chunk-16", "ragged-7", "chunk-1"])
def test_chunked_form_equals_the_formula_written_out(chunk):
    """150 positions: several chunks and a ragged last one; chunk 1 is the recurrence itself."""
    q, k, v, beta, g = random_inputs()
    want, S_want = delta_rule_loop(q, k, v, beta, g)
    got, S = chunked_gated_delta(q, k, v, beta, g, chunk=chunk)
    assert (got.double() - want).abs().max() < 1e-5, (got.double() - want).abs().max()
    assert (S.double() - S_want).abs().max() < 1e-5


def test_the_recurrent_step_equals_the_formula_and_a_state_carries_between_segments():
    q, k, v, beta, g = random_inputs()
    want, _ = delta_rule_loop(q, k, v, beta, g)
    S = torch.zeros(2, 3, 8, 6)
    steps = []
    for t in range(q.size(2)):
        o, S = gated_delta_step(q[:, :, t], k[:, :, t], v[:, :, t], beta[:, :, t], g[:, :, t], S)
        steps.append(o)
    assert (torch.stack(steps, 2).double() - want).abs().max() < 1e-5
    S, parts = None, []  # segments of any length, each chunked, continuing from the last state
    for a, b in ((0, 5), (5, 6), (6, 90), (90, 150)):
        o, S = chunked_gated_delta(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], beta[:, :, a:b], g[:, :, a:b], S, chunk=16)
        parts.append(o)
    assert (torch.cat(parts, 2).double() - want).abs().max() < 1e-5


def test_gradients_of_the_chunked_form_equal_the_formulas():
    """Training's gradients for q, k, v, β and ln α through the chunked form (a ragged chunk included)
    equal the float64 loop's."""
    inputs = [t.double().requires_grad_(True) for t in random_inputs(T=40)]
    w = torch.randn(2, 3, 40, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    grads = []
    for fn in (lambda *a: chunked_gated_delta(*a, chunk=16)[0], lambda *a: delta_rule_loop(*a)[0]):
        grads.append(torch.autograd.grad((fn(*inputs) * w).sum(), inputs))
    for name, a, b in zip(("q", "k", "v", "beta", "g"), *grads):
        assert torch.allclose(a, b, atol=1e-10, rtol=1e-8), name


def test_a_broken_chunk_boundary_fails():
    """What the equality tests catch: the state handed to the next chunk without its decay (γ_C S_0
    taken as S_0) changes every output after the first chunk, by far more than the tolerance."""
    q, k, v, beta, g = random_inputs()
    want, _ = delta_rule_loop(q, k, v, beta, g)
    out, S = [], None
    for a in range(0, q.size(2), 64):  # chunk by chunk, the state passed on without the chunk's decay
        part, S = chunked_gated_delta(q[:, :, a:a + 64], k[:, :, a:a + 64], v[:, :, a:a + 64], beta[:, :, a:a + 64],
                                      g[:, :, a:a + 64], S, 64)
        out.append(part)
        S = S / g[:, :, a:a + 64].sum(-1).exp()[..., None, None]  # the broken boundary: γ_C S_0 -> S_0
    got = torch.cat(out, 2)
    assert (got[:, :, :64].double() - want[:, :, :64]).abs().max() < 1e-5  # the first chunk is right
    assert (got[:, :, 64:].double() - want[:, :, 64:]).abs().max() > 1e-2


@pytest.mark.parametrize("T", [20, 150], ids=["one-chunk", "three-chunks"])
def test_the_layer_decoded_in_segments_equals_the_whole_sequence(T):
    """A model of gdn layers: a prefill, then single steps and chunks of several tokens through its
    state (and the short convolution's last inputs), equal to one forward of the whole sequence
    (in float64: float32's chunk boundaries round apart by ~1e-5 over hundreds of positions)."""
    assert segments_minus_whole(make(block_size=T, attn={"kind": "gdn"}), T) < 1e-9


def test_the_state_does_not_grow_with_the_context():
    model = make(block_size=64, attn={"kind": "gdn"})
    sizes = [sum(c.nbytes() for c in model.new_kv_cache(1, n)) for n in (16, 4096)]
    assert sizes[0] == sizes[1] == 2 * (4 * 8 * 8 + 3 * 32 * 3) * 4  # layers x (heads x hs x hs + conv) fp32


def test_the_layer_is_the_papers_layer_written_out():
    """One gdn layer against its parts by hand: the projections, the causal convolution and SiLU, L2
    norms, β and α from their projections, the recurrence, RMSNorm and the SiLU gate, the output
    projection."""
    model = make(n_layer=1, attn={"kind": "gdn"})
    attn = model.blocks[0].attn
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        h = x @ attn.c_attn.weight.T  # (B, T, 3 * 32)
        pad = torch.cat([torch.zeros(2, 3, 96), h], dim=1)
        conv = torch.stack([(pad[:, t:t + 4] * attn.conv.weight[:, 0].T).sum(1) for t in range(9)], dim=1)
        q, k, v = F.silu(conv).view(2, 9, 3, 4, 8).unbind(2)
        q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
        beta = torch.sigmoid(x @ attn.beta_proj.weight.T)
        log_alpha = -attn.A_log.exp() * F.softplus(x @ attn.alpha_proj.weight.T + attn.dt_bias)
        o, _ = delta_rule_loop(*(t.transpose(1, 2) for t in (q, k, v, beta, log_alpha)))
        o = o.transpose(1, 2).float()  # (B, T, nh, hs)
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-6) * attn.gate.norm.weight
        o = o * F.silu(x @ attn.gate.proj.weight.T).view(2, 9, 4, 8)
        want = o.reshape(2, 9, 32) @ attn.c_proj.weight.T
        assert (attn(x) - want).abs().max() < 1e-5


@pytest.mark.parametrize("attn,why", [
    ({"kind": "gdn"}, "its q, k and v have n_head heads each"),
    ({"kind": "mamba2"}, "B and C are shared by every head"),
    ({"layer_kinds": ["gdn", "mamba2"]}, "its q, k and v have n_head heads each"),
])
def test_grouped_heads_on_recurrent_layers_only_are_ignored_and_said(attn, why):
    """n_kv_head groups softmax and linear layers' keys and values; gdn and mamba2 layers have none."""
    from model import GPTConfig
    cfg = GPTConfig(vocab_size=40, n_layer=2, n_head=4, n_embd=32, n_kv_head=2, attn=attn)
    kind = attn.get("kind") or attn["layer_kinds"][0]
    assert cfg.ignored[0] == f"model.n_kv_head=2 has no effect on a {kind} layer ({why}): ignored"
    assert make(n_kv_head=2, attn=attn).blocks[0].attn.n_kv_head == 4


def test_grouped_heads_in_a_hybrid_group_its_softmax_layers_and_nothing_is_said():
    from model import GPTConfig
    cfg = GPTConfig(vocab_size=40, n_layer=2, n_head=4, n_embd=32, n_kv_head=2, attn={"layer_kinds": ["gdn", "softmax"]})
    assert cfg.ignored == []
    model = make(n_kv_head=2, attn={"layer_kinds": ["gdn", "softmax"]})
    assert [b.attn.n_kv_head for b in model.blocks] == [4, 2]
