"""variants/linear.py, linear attention (model.attn.kind=linear): its parallel (chunked) and
recurrent forms against the causal formula written out in float64, with and without RoPE and GQA,
gradients, the matmuls lab/counting.py counts, its constant-size state, and what the probe says of it."""
import pytest
import torch
import torch.nn.functional as F

from attention import apply_rope, rope_table
from helpers import variant_model as make
from model import GPT, GPTConfig
from variants.linear import LinearState


def phi(x):
    return F.elu(x) + 1


def linear_formula(q, k, v, rope=None):
    """y_i = Σ_{j≤i} φ(q_i)ᵀφ(k_j) v_j / Σ_{j≤i} φ(q_i)ᵀφ(k_j) in float64, one row at a time, K/V repeated
    per query-head group, for q, k, v (B, T, heads, hs) as the layer's qkv gives them; with rope
    (T, hs/2, 2), the numerator's φ(q_i), φ(k_j) are rotated to their positions (RoFormer's linear
    attention), the denominator's are not. Returns (B, h, T, hs)."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    q, k, v = phi(q.double()), phi(k.double()), v.double()
    g = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    rq, rk = q, k
    if rope is not None:
        rq = apply_rope(q, rope.double(), dim=-2)
        rk = apply_rope(k, rope.double(), dim=-2)
    out = torch.zeros_like(q[..., :v.size(-1)])
    for i in range(q.size(2)):
        num = (rq[:, :, i:i + 1] * rk[:, :, :i + 1]).sum(-1)  # (B, h, i+1)
        den = (q[:, :, i:i + 1] * k[:, :, :i + 1]).sum(-1).sum(-1, keepdim=True)
        out[:, :, i] = (num.unsqueeze(-1) * v[:, :, :i + 1]).sum(2) / den
    return out


@pytest.mark.parametrize("chunk", [64, 5, 1], ids=["one-chunk", "ragged-chunks", "chunks-of-1"])
@pytest.mark.parametrize("pos,n_kv", [("none", 4), ("rope", 4), ("rope", 2)], ids=["nope", "rope", "rope-gqa"])
def test_linear_attention_parallel_and_recurrent_forms_equal_the_causal_formula(pos, n_kv, chunk):
    """The parallel (chunked) form of a whole sequence, with one chunk, chunks that do not divide the
    length and chunks of one position, and the recurrent form fed one token at a time (a prefill,
    then steps on the state) all equal the formula written out."""
    model = make(pos=pos, n_kv_head=n_kv, attn={"kind": "linear"})
    attn = model.blocks[0].attn
    attn.chunk = chunk
    x = torch.randn(2, 12, 32)
    rope = rope_table(8, 12, 10000.0) if pos == "rope" else None
    with torch.no_grad():
        q, k, v = attn.qkv(x, None)  # unrotated: φ comes first
        want = linear_formula(q, k, v, rope)  # (B, h, T, hs), before the output projection
        B, T, C = x.shape
        project = lambda y: attn.c_proj(y.transpose(1, 2).reshape(B, -1, C).float())  # noqa: E731
        parallel = attn(x, rope=rope)
        state = attn.new_cache(2, 12, device=x.device, dtype=x.dtype)
        steps = [attn(x[:, :4], rope=None if rope is None else rope[:4], cache=state, pos=0)]
        for t in range(4, 12):
            steps.append(attn(x[:, t:t + 1], rope=None if rope is None else rope[t:t + 1], cache=state, pos=t))
    assert torch.allclose(parallel, project(want), atol=1e-5)
    assert torch.allclose(torch.cat(steps, 1), project(want), atol=1e-5)


@pytest.mark.parametrize("chunk", [64, 5])
def test_linear_attention_gradients_equal_the_causal_formulas(chunk):
    """Training's gradients: the chunked form's gradients for the input and every weight of the layer
    equal those of the formula written out (float64, RoPE, GQA, a ragged last chunk)."""
    model = make(pos="rope", n_kv_head=2, attn={"kind": "linear"}).double()
    attn = model.blocks[0].attn
    attn.chunk = chunk
    x = torch.randn(2, 12, 32, dtype=torch.float64, requires_grad=True)
    rope = rope_table(8, 12, 10000.0).double()
    w = torch.randn(2, 12, 32, dtype=torch.float64)
    grads = []
    for formula in (False, True):
        if formula:
            q, k, v = attn.qkv(x, None)
            y = attn.c_proj(linear_formula(q, k, v, rope).transpose(1, 2).reshape(2, 12, 32))
        else:
            y = attn(x, rope=rope)
        params = [x, *attn.parameters()]
        grads.append(torch.autograd.grad((y * w).sum(), params))
    for mine, want in zip(*grads):
        assert torch.allclose(mine, want, atol=1e-10, rtol=1e-8)


def test_a_gate_on_linear_attention_scales_each_head_output():
    """The output gate is the core's slot, so a linear layer's heads are gated too: sigmoid(x W_g)
    times the formula's output, before the projection."""
    model = make(attn={"kind": "linear", "gate": "head"})
    attn = model.blocks[0].attn
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        q, k, v = attn.qkv(x, None)
        y = linear_formula(q, k, v).transpose(1, 2)  # (B, T, nh, hs)
        g = torch.sigmoid(x @ attn.gate.weight.T).view(2, 9, 4, 1)
        want = (y * g).reshape(2, 9, 32).float() @ attn.c_proj.weight.T
        assert torch.allclose(attn(x), want, atol=1e-5)


@pytest.mark.parametrize("n_kv", [4, 2])
def test_linear_attention_matmuls_are_what_counting_says(n_kv):
    """torch's FlopCounterMode on a linear-attention layer (2 chunks of 64, GQA or not) measures 2 x
    the MACs counted for it, less the additions counting also counts as MACs (z += φ(k): n_kv x hs
    per token, no matmul)."""
    from torch.utils.flop_counter import FlopCounterMode

    from lab.counting import macs_per_token
    c = GPTConfig(vocab_size=64, block_size=128, n_layer=1, n_head=4, n_kv_head=n_kv, n_embd=128,
                  attn={"kind": "linear"})
    model, (B, N) = GPT(c), (2, 128)
    with FlopCounterMode(display=False) as counter:
        model(torch.randint(0, 64, (B, N)))
    measured = sum(counter.get_flop_counts()["GPT.blocks.0.attn"].values())
    m = macs_per_token(c, N)
    assert measured == 2 * B * N * (m["proj"] + m["attn"] - n_kv * 32)


def test_linear_state_does_not_grow_with_the_tokens_generated():
    from sample import generate
    model = make(attn={"kind": "linear"})
    sizes = []
    for n in (10, 100):
        caches = []
        real = model.new_kv_cache
        model.new_kv_cache = lambda *a, **k: caches.append(real(*a, **k)) or caches[-1]
        generate(model, torch.zeros(1, 1, dtype=torch.long), n, temperature=0)
        model.new_kv_cache = real
        assert all(isinstance(c, LinearState) for c in caches[0])
        sizes.append(sum(c.nbytes() for c in caches[0]))
    assert sizes[0] == sizes[1] == 2 * 4 * (8 * 8 + 8) * 4  # layers x kv heads x (hs² + hs) fp32


def test_linear_attention_gives_the_probe_no_softmax_weights_and_says_so():
    from lab.attnstats import AttentionProbe, attention_maps, without_softmax
    model = make(attn={"kind": "linear"})
    stats = AttentionProbe(torch.randint(40, (2, 16))).run(model)
    assert not any(k.startswith("attn_") for k in stats) and "incontext/gain" in stats
    maps, heads = attention_maps(model, torch.randint(40, (1, 8)))
    assert maps.shape == (2, 4, 8, 8) and maps.isnan().all() and heads["entropy"].isnan().all()
    assert without_softmax(model) == "L0 (linear), L1 (linear): no softmax weights, so no logged attention statistics (tools/visualize.py draws their effective attention)"
    assert without_softmax(make()) == ""
