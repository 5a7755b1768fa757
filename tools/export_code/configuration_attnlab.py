"""The config of an attnlab model exported as custom code (attnlab's tools/export.py, format=code).

`attnlab` holds the model's GPTConfig fields as attnlab saved them (model.py beside this file
builds the model from them); the usual transformers names (vocab_size, hidden_size, ...) are
derived from it, for the tools that read them (lm-evaluation-harness takes its context length
from max_position_embeddings).
"""
from transformers import PretrainedConfig


class AttnlabConfig(PretrainedConfig):
    model_type = "attnlab"

    def __init__(self, attnlab=None, **kwargs):
        super().__init__(**kwargs)
        self.attnlab = dict(attnlab or {})  # GPTConfig's fields; attn is a nested dict
        c = self.attnlab
        self.vocab_size = c.get("vocab_size")
        self.hidden_size = c.get("n_embd")
        self.num_hidden_layers = c.get("n_layer")
        self.num_attention_heads = c.get("n_head")
        self.num_key_value_heads = c.get("n_kv_head") or c.get("n_head")
        self.max_position_embeddings = c.get("block_size")
        self.tie_word_embeddings = bool(c.get("tie_embeddings", True))
