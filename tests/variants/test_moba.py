"""variants/moba.py and variants/oracle.py, keys chosen by content (model.attn.select=moba|oracle): the
choice against loops written out, full attention when the choice covers every key (outputs and
gradients), the layer against softmax over the chosen keys by hand, cached generation against
recomputation, and the probe's weights over the chosen keys only."""
import math

import pytest
import torch

from attention import Mask
from helpers import hooked_outputs, plain_attention, variant_model as make
from model import GPTConfig
from rules import UserError
from sample import generate
from variants.moba import MoBA
from variants.oracle import Oracle


def config(**attn):
    return GPTConfig(vocab_size=40, block_size=64, n_layer=1, n_head=4, n_embd=32, attn=attn)


def moba_written_out(q, k, block, topk):
    """(B, nh, T, T) bool: query i reads the keys of its own block up to itself and of the topk earlier
    blocks with the largest q_i · mean(K_block), one query at a time."""
    B, nh, T, _ = q.shape
    k = k.repeat_interleave(nh // k.size(1), dim=1)
    out = torch.zeros(B, nh, T, T, dtype=torch.bool)
    for b in range(B):
        for h in range(nh):
            for i in range(T):
                own = i // block
                score = [q[b, h, i].double() @ k[b, h, j * block:(j + 1) * block].double().mean(0) for j in range(own)]
                best = sorted(range(own), key=lambda j: -score[j])[:topk]
                for j in best:
                    out[b, h, i, j * block:(j + 1) * block] = True
                out[b, h, i, own * block:i + 1] = True
    return out


@pytest.mark.parametrize("n_kv", [4, 2])
@pytest.mark.parametrize("block,topk", [(4, 2), (5, 1), (8, 3)])
def test_moba_chooses_the_blocks_written_out(block, topk, n_kv):
    g = torch.Generator().manual_seed(block * 10 + topk)
    q, k = torch.randn(2, 4, 30, 8, generator=g), torch.randn(2, n_kv, 30, 8, generator=g)
    pos = torch.arange(30)
    chosen = MoBA(config(select="moba", select_block=block, select_topk=topk))(q, k, Mask(30, 30), pos, pos)
    assert torch.equal(chosen(), moba_written_out(q, k, block, topk))


def test_the_oracle_chooses_the_top_keys_written_out():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 20, 8, generator=g), torch.randn(2, 2, 20, 8, generator=g)
    pos = torch.arange(20)
    got = Oracle(config(select="oracle", select_topk=3))(q, k, Mask(20, 20), pos, pos)()
    k4 = k.repeat_interleave(2, dim=1)
    for b, h, i in [(0, 0, 0), (0, 1, 2), (1, 3, 7), (1, 2, 19)]:
        logits = [q[b, h, i] @ k4[b, h, j] for j in range(i + 1)]
        want = set(sorted(range(i + 1), key=lambda j: -logits[j])[:3])
        assert set(torch.nonzero(got[b, h, i]).flatten().tolist()) == want


@pytest.mark.parametrize("attn", [{"select": "moba", "select_block": 4, "select_topk": 16},
                                  {"select": "oracle", "select_topk": 64},
                                  {"select": "moba", "select_block": 8, "select_topk": 8, "qk_norm": True}],
                         ids=["moba", "oracle", "moba-qk-norm"])
@pytest.mark.parametrize("n_kv", [4, 1])
def test_a_choice_that_covers_every_key_is_full_attention(attn, n_kv):
    """Outputs and every gradient equal the model without selection (the same weights)."""
    idx = torch.randint(40, (2, 64), generator=torch.Generator().manual_seed(1))
    base = {k: v for k, v in attn.items() if not k.startswith("select")}
    models = [make(block_size=64, n_kv_head=n_kv, attn=a).train() for a in (attn, base)]
    losses = []
    for m in models:
        logits = m(idx)
        loss = logits.logsumexp(-1).mean()
        loss.backward()
        losses.append(logits)
    assert torch.allclose(losses[0], losses[1], atol=1e-5)
    for (name, a), (_, b) in zip(*(m.named_parameters() for m in models)):
        assert torch.allclose(a.grad, b.grad, atol=1e-5), name


@pytest.mark.parametrize("impl", ["sdpa", "reference"])
@pytest.mark.parametrize("select", ["moba", "oracle"])
def test_the_layer_is_softmax_over_the_chosen_keys_by_hand(select, impl):
    """A layer whose choice leaves keys out: its output is the softmax over the chosen keys written out
    (from its hook points), and the probe's logits are -inf exactly where the choice says no."""
    model = make(block_size=32, n_kv_head=2, impl=impl, attn={"select": select, "select_block": 4, "select_topk": 2})
    attn = model.blocks[0].attn
    seen = hooked_outputs(model, attn, torch.randint(40, (2, 32), generator=torch.Generator().manual_seed(2)))
    q, k, v = (seen[n].transpose(1, 2).double() for n in ("hook_q", "hook_k", "hook_v"))  # (B, heads, T, hs)
    pos = torch.arange(32)
    chosen = attn.select(seen["hook_q"].transpose(1, 2), seen["hook_k"].transpose(1, 2), Mask(32, 32), pos, pos)()
    assert chosen.sum(-1).lt(torch.arange(1, 33)).any()  # some query leaves keys out
    want = plain_attention(q, k, v, 1 / math.sqrt(q.size(-1)), causal=False, keep=chosen)
    assert torch.allclose(seen["hook_z"].transpose(1, 2).double(), want, atol=1e-5)
    probe, _ = attn.scores(seen["hook_q"], seen["hook_k"])
    assert torch.equal(probe.isfinite(), chosen)


@pytest.mark.parametrize("attn", [{"select": "moba", "select_block": 4, "select_topk": 1},
                                  {"select": "oracle", "select_topk": 3}], ids=["moba", "oracle"])
def test_cached_generation_equals_recomputation(attn):
    """A decode step chooses among the cached keys as the whole sequence's query would."""
    model = make(block_size=48, n_kv_head=2, attn=attn)
    prompt = torch.randint(40, (2, 9), generator=torch.Generator().manual_seed(3))
    a = generate(model, prompt, 30, temperature=0, kv_cache=True)
    b = generate(model, prompt, 30, temperature=0, kv_cache=False)
    assert torch.equal(a, b)


@pytest.mark.parametrize("attn,needle", [
    ({"select": "moba", "window": 8}, "with a window it is not implemented"),
    ({"select": "oracle", "impl": "tiled"}, "with the tiled path it is not implemented"),
])
def test_a_choice_with_what_it_cannot_take_is_one_line(attn, needle):
    with pytest.raises(UserError, match=needle) as e:
        config(**attn)
    assert "\n" not in str(e.value)


def test_a_choice_on_layers_without_softmax_is_ignored_and_said():
    c = GPTConfig(vocab_size=40, n_layer=1, n_head=4, n_embd=32, attn={"kind": "gdn", "select": "moba"})
    assert c.ignored[0].startswith("model.attn.select='moba' has no effect unless a layer is softmax")


def test_sample_py_reads_any_checkpoint_through_a_choice(tmp_path):
    """sample.py select=oracle select_topk=2 on a checkpoint trained without: greedy text equal to the
    checkpoint's model built with that choice, recomputing the context at every step (within
    block_size: past it a two-layer sliding cache is another function); and not the checkpoint's own text."""
    from lab.checkpoint import load_checkpoint, model_from_checkpoint, with_selection
    from data.tokenizer import tokenizer_from_dict
    from helpers import compose_cfg, save_tiny_checkpoint
    from sample import sample
    ckpt = save_tiny_checkpoint(tmp_path, block_size=32)
    base = [f"ckpt={ckpt}", "prompt=the quick brown", "max_new_tokens=17", "temperature=0", "device=cpu"]
    chosen = sample(compose_cfg("sample", [*base, "select=oracle", "select_topk=2"]), out=open(tmp_path / "a", "w"))[0]
    plain = sample(compose_cfg("sample", base), out=open(tmp_path / "b", "w"))[0]
    state = load_checkpoint(ckpt)
    tok = tokenizer_from_dict(state["tokenizer"])
    model = model_from_checkpoint(with_selection(state, "oracle", 2)).eval()
    want = generate(model, torch.as_tensor(tok.encode("the quick brown")).long()[None], 17, temperature=0,
                    kv_cache=False)
    assert chosen == tok.decode(want[0].tolist()) != plain


@pytest.mark.parametrize("attn", [{"select": "moba", "select_block": 4, "select_topk": 2},
                                  {"select": "moba", "select_block": 7, "select_topk": 1},
                                  {"select": "oracle", "select_topk": 5}, {}], ids=["moba-4-2", "moba-7-1", "oracle-5", "full"])
def test_the_keys_each_query_reads_are_what_counting_says(attn):
    """counting.selected_keys, the mean over the causal queries, against the keys the built layer's
    choice lets through, counted on its mask (30 positions: ragged last blocks)."""
    from fractions import Fraction
    from lab.counting import selected_keys
    c = GPTConfig(vocab_size=40, block_size=30, n_layer=1, n_head=4, n_embd=32, attn=attn)
    model = make(block_size=30, attn=attn)
    q, k = torch.randn(2, 4, 30, 8), torch.randn(2, 4, 30, 8)
    pos = torch.arange(30)
    select = model.blocks[0].attn.select
    seen = select(q, k, Mask(30, 30), pos, pos)() if select else Mask(30, 30)().expand(2, 4, 30, 30)
    per_query = seen.sum(-1)  # (B, heads, T): the same count for every head and batch row
    assert (per_query == per_query[0, 0]).all()
    assert Fraction(int(per_query[0, 0].sum()), 30) == selected_keys(c, 30)
