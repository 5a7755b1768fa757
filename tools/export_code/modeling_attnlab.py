"""attnlab's GPT as a transformers causal LM (custom code: load with trust_remote_code=True).

attnlab's tools/export.py (format=code) writes this file beside copies of attnlab's own model
files (model.py, attention.py, rules.py, lab/counting.py and variants/, their imports made relative), so the
model computed here is attnlab's, line for line, for every option it has. This file only wraps it:
it builds attnlab's GPT from the config, loads the weights under attnlab's names (prefixed
`model.`), and returns transformers' output type.

- forward(input_ids) returns logits (and the shifted next-token loss with `labels`, ignoring
  -100) for at most block_size tokens, as attnlab's model does. An attention_mask may only pad on
  the right (a causal model's real tokens never see right padding); left padding is refused.
- generate() recomputes the whole context every step (no KV cache: correct by construction),
  cropped to its last block_size tokens once longer: what attnlab's sample.py computes with
  kv_cache=false (and with its cache for absolute-position models).
"""
import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_attnlab import AttnlabConfig
from .model import GPT, GPTConfig


class AttnlabForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = AttnlabConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _tied_weights_keys = {"model.lm_head.weight": "model.wte.weight"}  # when tie_word_embeddings

    def __init__(self, config: AttnlabConfig):
        super().__init__(config)
        self.model = GPT(GPTConfig(**config.attnlab))
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # no KV cache: generate() feeds the whole sequence each step

    @torch.no_grad()
    def _init_weights(self, module):
        """Every parameter comes from model.safetensors, and a model built from a config keeps
        attnlab's own init (GPT.init_weights). What is left is what GPT computes when built and does
        not save (non-persistent buffers: RoPE's table, the sinusoidal table, ...): transformers
        builds the model on the meta device, so these are computed again, as a GPT built here."""
        if not isinstance(module, GPT):
            return
        dtype = next(p.dtype for p in module.parameters() if p.is_floating_point())
        fresh = GPT(module.config).to(dtype)  # GPT's own rules: tables in the model's dtype, RoPE's in float32
        for name, sub in module.named_modules():
            for buf in sub._non_persistent_buffers_set:
                value = fresh.get_buffer(f"{name}.{buf}" if name else buf)
                if value is not None:  # an option the model does not use registers None (no ALiBi, no sink)
                    sub._buffers[buf] = value.to(sub._buffers[buf].device)

    def get_input_embeddings(self):
        return self.model.wte

    def set_input_embeddings(self, value):
        self.model.wte = value

    def get_output_embeddings(self):
        return self.model.lm_head

    def set_output_embeddings(self, value):
        self.model.lm_head = value

    def forward(self, input_ids=None, attention_mask=None, labels=None, return_dict=None, **kwargs):
        """input_ids (B, T), T <= block_size -> CausalLMOutputWithPast(logits (B, T, vocab), loss)."""
        if input_ids is None:
            raise ValueError("attnlab's model takes input_ids (token ids), not inputs_embeds")
        if attention_mask is not None and attention_mask.dim() == 2 and \
                bool((attention_mask[:, 1:] > attention_mask[:, :-1]).any()):
            raise ValueError("attnlab's model attends to every earlier token: pad on the right "
                             "(tokenizer.padding_side='right') or run sequences one at a time")
        logits = self.model(input_ids)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten().to(logits.device),
                                   ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        """The whole sequence every step, its last block_size tokens once longer (no cache)."""
        block = self.model.config.block_size
        if attention_mask is not None:
            attention_mask = attention_mask[:, -block:]
        return {"input_ids": input_ids[:, -block:], "attention_mask": attention_mask}
