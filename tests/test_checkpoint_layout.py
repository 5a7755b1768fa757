"""Checkpoints keep loading as the code moves: for every variant the tests train, the parameter and
buffer names, shapes and order a checkpoint holds (the order is what an optimizer's state is keyed
by), the weights a seed initialises, and the greedy tokens a model decodes through its KV cache equal
a reference file recorded from the code before the attention variants moved into variants/.

The reference was made with that code by
    python tests/test_checkpoint_layout.py tests/data/checkpoint_layouts.json
(it uses only what both versions have: GPT, GPTConfig, optim.build_optimizer, sample.generate). The two
variants with QK-Norm gains were recorded again when the gains' init was fixed (1, not N(0, 0.02)): their
names, shapes and order did not change, their init and so their tokens did."""
import json
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
REFERENCE = HERE / "data" / "checkpoint_layouts.json"
VARIANTS = {  # every variant tests/test_variants.py trains, and the kinds with their options
    "default": {}, "gqa": {"n_kv_head": 2}, "mqa": {"n_kv_head": 1}, "post_ln": {"norm_position": "post"},
    "rmsnorm": {"norm": "rmsnorm"}, "swiglu": {"mlp": "swiglu"}, "relu2": {"mlp": "relu2", "d_ff": 96},
    "learned": {"pos": "learned"}, "sinusoidal": {"pos": "sinusoidal"}, "nope": {"pos": "none"},
    "untied": {"tie_embeddings": False}, "softcap": {"logit_softcap": 5.0}, "zero_init": {"zero_init_proj": True},
    "value_embed": {"value_embed": True},
    "llama_qk_norm": {"norm": "rmsnorm", "mlp": "swiglu", "n_kv_head": 2, "tie_embeddings": False,
                      "attn": {"qk_norm": True, "qk_norm_gain": "channel"}},
    "mqa_l2_head_gain": {"n_kv_head": 1, "attn": {"qk_norm": True, "qk_norm_type": "l2", "qk_norm_gain": "head",
                                                  "scale": "4.0"}},
    "tiled": {"attn": {"impl": "tiled", "block": 5}}, "window_gqa": {"n_kv_head": 2, "attn": {"window": 6}},
    "local_global_tiled": {"attn": {"window": 6, "window_pattern": "LG", "impl": "tiled", "block": 4}},
    "linear": {"attn": {"kind": "linear"}}, "linear_gqa_qk_norm": {"n_kv_head": 2, "attn": {"kind": "linear", "qk_norm": True}},
    "mla": {"attn": {"kind": "mla"}},
    "mla_latent_q_gate": {"attn": {"kind": "mla", "q_lora_rank": 16, "kv_lora_rank": 12, "rope_head_dim": 4,
                                   "gate": "head"}},
    "gate_sink": {"attn": {"gate": "channel", "sink": "learned"}},
    "zero_sink_tiled_gqa": {"n_kv_head": 2, "attn": {"sink": "zero", "impl": "tiled", "block": 4}},
    "alibi": {"pos": "alibi"},
    "alibi_tiled_sink_gqa": {"pos": "alibi", "n_kv_head": 2, "attn": {"impl": "tiled", "block": 4, "sink": "learned"}},
    "yarn": {"rope_scaling": "yarn", "rope_scaling_factor": 2.0},
}


def layout(fields: dict) -> dict:
    """What a checkpoint of this variant holds and what its model computes, from code of either version."""
    from model import GPT, GPTConfig
    from omegaconf import OmegaConf
    from lab.optim import build_optimizer
    from sample import generate

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=40, block_size=16, n_layer=2, n_head=4, n_embd=32, **fields))
    state = model.state_dict()
    tcfg = OmegaConf.create({"optimizer": "adamw", "lr": 1e-3, "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.99})
    opt = build_optimizer(model, tcfg, torch.device("cpu"))
    names = {id(p): n for n, p in model.named_parameters()}
    prompt = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        for p in model.parameters():  # away from the init's symmetries: gains and biases not 1 and 0
            p.add_(0.05 * torch.sin(torch.arange(p.numel(), dtype=torch.float32)).view_as(p))
        tokens = generate(model, prompt, 24, temperature=0, kv_cache=True)[0, 5:].tolist()
        logits = model(torch.arange(16).remainder(40)[None])
    return {"state": {k: list(v.shape) for k, v in state.items()},
            "optimizer_order": [[names[id(p)] for p in g["params"]] for g in opt.param_groups],
            "init_sums": {k: round(float(v.double().sum()), 6) for k, v in state.items() if v.is_floating_point()},
            "greedy": tokens, "logits_sum": round(float(logits.double().sum()), 4)}


@pytest.fixture(scope="module")
def reference():
    return json.loads(REFERENCE.read_text())


@pytest.mark.parametrize("name", list(VARIANTS))
def test_checkpoints_of_every_variant_load_resume_and_decode_as_before(name, reference):
    from model import GPT, GPTConfig
    from lab.parallel import load_weights

    want, got = reference[name], layout(VARIANTS[name])
    assert got["state"] == want["state"]  # the same names and shapes: a checkpoint of then loads now
    assert got["optimizer_order"] == want["optimizer_order"]  # its optimizer state resumes onto the same parameters
    assert got["init_sums"] == pytest.approx(want["init_sums"], abs=1e-5)  # the same seed, the same weights
    assert got["greedy"] == want["greedy"] and got["logits_sum"] == pytest.approx(want["logits_sum"], abs=1e-3)
    model = GPT(GPTConfig(vocab_size=40, block_size=16, n_layer=2, n_head=4, n_embd=32, **VARIANTS[name]))
    load_weights(model, {k: torch.zeros(s) for k, s in want["state"].items()})  # strict: names and shapes as then


if __name__ == "__main__":  # write the reference file with the code this runs in
    sys.path[:0] = [str(HERE), str(HERE.parent)]
    out = {name: layout(fields) for name, fields in VARIANTS.items()}
    Path(sys.argv[1]).write_text(json.dumps(out, indent=0, sort_keys=True) + "\n")
    print(f"wrote {len(out)} variants to {sys.argv[1]}")
