"""What an eager cached decode step dispatches, and that its head-major path (CausalSelfAttention.token_qkv)
computes what recomputation computes. A decode step of one sequence is dozens of tiny ops, so its time is
mostly dispatch: each aten op the step calls, views included, is counted here with a TorchDispatchMode,
per block (between the block's forward pre- and post-hook) and for the whole model call."""
import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from model import GPT, GPTConfig
from sample import generate

BABY = dict(n_layer=6, n_head=6, n_embd=384, block_size=256, dropout=0.2, vocab_size=65)  # the "baby" preset
PER_BLOCK, OUTSIDE = 25, 8  # at most: ops inside each block's forward, and around the blocks


class CountOps(TorchDispatchMode):
    """Counts every aten op dispatched, by name, and per block of the model (None: outside every block)."""

    def __init__(self, model):
        super().__init__()
        self.ops, self.where, self.per_block = collections.Counter(), None, collections.Counter()
        self.handles = [h for i, block in enumerate(model.blocks) for h in (
            block.register_forward_pre_hook(lambda m, a, i=i: setattr(self, "where", i)),
            block.register_forward_hook(lambda m, a, out: setattr(self, "where", None)))]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        self.per_block[self.where] += 1
        return func(*args, **(kwargs or {}))

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        return super().__exit__(*exc)


def baby(**kw):
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**BABY, **kw})).eval()


def decode_step_ops(model, prompt_len=10):
    """The ops of one eager decode step (batch 1, one new token, fp32, inference_mode as generate runs it)."""
    with torch.inference_mode():
        cache = model.new_kv_cache(1, 64)
        model(torch.randint(model.config.vocab_size, (1, prompt_len)), cache=cache, pos=0)
        with CountOps(model) as count:
            model(torch.tensor([[3]]), cache=cache, pos=prompt_len)
    return count


def test_a_decode_step_dispatches_at_most_25_ops_per_block():
    model = baby()
    count = decode_step_ops(model)
    blocks = [count.per_block[i] for i in range(len(model.blocks))]
    total = sum(count.ops.values())
    assert max(blocks) <= PER_BLOCK, f"ops per block {blocks}: {count.ops.most_common()}"
    assert total <= PER_BLOCK * len(model.blocks) + OUTSIDE, f"{total} ops: {count.ops.most_common()}"
    assert not {"aten.dropout", "aten.to", "aten.type_as"} & set(count.ops)  # eval at fp32: nothing to do
    assert count.ops["aten.transpose"] <= len(model.blocks)  # one token: views, but for the heads' output


def test_a_full_forward_dispatches_no_dropout_or_cast_in_eval():
    """The T > 1 path (training's, recomputation's) also calls nothing that does nothing: at most as many ops
    per block as a decode step, and no dropout or dtype cast at fp32 in eval."""
    model = baby()
    with torch.inference_mode(), CountOps(model) as count:
        model(torch.randint(65, (1, 64)))
    assert max(count.per_block[i] for i in range(6)) <= PER_BLOCK + 1, count.ops.most_common()
    assert not {"aten.dropout", "aten.to", "aten.type_as"} & set(count.ops), count.ops.most_common()


def assert_close(got, want, what, tol=1e-4):
    d = (got - want).abs()
    assert d.max() < tol, f"{what}: max diff {d.max():.2e}, mean {d.mean():.2e}"


VARIANTS = {"baby": {}, "gqa+qk_norm": dict(n_kv_head=2, attn={"qk_norm": True, "qk_norm_gain": "channel"}),
            "mqa+value_embed": dict(n_kv_head=1, value_embed=True)}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_decode_step_logits_equal_recomputation(variant):
    """Each decode step's logits equal the full forward of the whole sequence without a cache (B = 2)."""
    model = baby(**VARIANTS[variant])
    with torch.no_grad():
        for name, p in model.named_parameters():  # trained-looking: gains away from 1
            if "gain" in name:
                p.uniform_(0.5, 2.0)
    seq = torch.randint(65, (2, 14), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        cache = model.new_kv_cache(2, 16)
        model(seq[:, :8], cache=cache, pos=0)
        for t in range(8, seq.size(1)):
            got = model(seq[:, t:t + 1], cache=cache, pos=t)[:, -1]
            assert_close(got, model(seq[:, :t + 1])[:, -1], f"{variant}, position {t}")


def test_a_hook_on_q_takes_the_general_path_with_the_same_logits():
    """A hook reading q sees (B, T, nh, hs) from forward's general path; the logits do not change."""
    model = baby(n_layer=2, n_kv_head=2)
    seq = torch.randint(65, (1, 12))
    seen = []
    with torch.inference_mode():
        logits = []
        for hooked in (False, True):
            handle = model.blocks[1].attn.hook_q.register_forward_hook(lambda m, a, q: seen.append(q.shape)) \
                if hooked else None
            cache = model.new_kv_cache(1, 16)
            model(seq[:, :6], cache=cache, pos=0)
            logits.append(torch.stack([model(seq[:, t:t + 1], cache=cache, pos=t) for t in range(6, 12)]))
            if handle:
                handle.remove()
    assert seen[1:] == [torch.Size([1, 1, 6, 64])] * 6  # after the prefill's, one per step
    assert_close(logits[1], logits[0], "hooked vs not", tol=1e-6)


def test_greedy_decoding_past_block_size_equals_recomputation():
    """One layer with RoPE: past block_size the sliding cache and the recomputed last block see the same
    offsets, so greedy tokens agree (deeper models see further with the cache: tests/test_sample.py)."""
    torch.manual_seed(2)
    model = GPT(GPTConfig(vocab_size=40, block_size=16, n_layer=1, n_head=4, n_embd=64, n_kv_head=2)).eval()
    prompt = torch.randint(40, (2, 5))
    assert torch.equal(generate(model, prompt, 40, temperature=0), generate(model, prompt, 40, temperature=0,
                                                                            kv_cache=False))
