"""sample.py's plumbing, around its decoding (generate, in sample.py): the prompt read and turned into
token ids, the CPU threads and the KV cache's dtype chosen, the checkpoint loaded and laid out for
decoding, generate() run on num_samples seeded copies of the prompt, and each sample's text cut at
<|endoftext|> or the stop string, streamed or printed. tools/visualize.py reads its prompt here too,
and tools/bench_sample.py times decoding with the same choices. generate is passed in (the lab
imports no entry point), so what sample.py calls is what runs. Here too: which settings a model's layers
cannot take (no KV cache, no softmax weights, no RoPE), warned in one line each, as the tools share them."""
import logging
import os
import sys
from pathlib import Path

import torch

from data.tokenizer import StreamDecoder, tokenizer_from_dict
from lab.checkpoint import find_checkpoint, load_checkpoint, model_from_checkpoint, with_rope_scaling, with_selection
from lab.cli import interruption
from lab.config import SampleConfig
from lab.counting import generation_bytes
from lab.device import check_memory, compile_wanted, is_oom, pick_dtype, setup_runtime
from model import GPTConfig
from rules import UserError, check_value, first_line, warn_ignored
from variants import KINDS, kinds

log = logging.getLogger("attnlab")
CHECK_EVERY = 32  # tokens between host-side checks when not streaming


def check_sampling(**values):
    """sample.generate()'s settings against sample.py's table (config.SampleConfig.RULES)."""
    for name, value in values.items():
        check_value(name, value, SampleConfig.RULES[name])


def read_prompt(cfg) -> str:
    """The prompt of sample.py / visualize.py: `prompt_file` read as is (every space and newline
    kept), else `prompt`."""
    if cfg.prompt_file is None:
        return cfg.prompt
    try:
        return Path(cfg.prompt_file).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"prompt_file={cfg.prompt_file!r} cannot be read as UTF-8 text: "
                        f"{type(e).__name__}: {getattr(e, 'strerror', None) or e}") from None


def start_ids(tok, prompt: str, state: dict) -> list:
    """The prompt's token ids. An empty prompt starts a BPE model at <|endoftext|>, where its
    documents begin, but only if it saw any: a single-document corpus gets the token once, at its
    very end, which lands in the val split, so its model has never seen text follow it (noise).
    A model trained with data.bos=true starts at its bos token, as every training window did."""
    bos = getattr(tok, "bos", None)
    if bos is not None:
        return [bos, *tok.encode(prompt).tolist()]
    ids = tok.encode(prompt) if prompt else []
    if len(ids):
        return ids
    if getattr(tok, "kind", None) == "mqar":  # its tokens are names split on whitespace: "\n" is none
        raise UserError(f"prompt={prompt!r} holds no mqar tokens: an mqar model continues key-value pairs, e.g. "
                        "prompt='k1 v9 k2 v17 k1' (it should answer v9)")
    if tok.eot is None:
        raise UserError("prompt is empty: a char-level model needs at least one character to start from")
    seen = state.get("eot_in_train")
    if seen is False:
        raise UserError("prompt is empty, but this model was trained on a single document, so it never saw "
                        "<|endoftext|> start one and would print noise: pass prompt=TEXT (e.g. how your corpus begins)")
    if seen is None:  # a checkpoint written before this was recorded
        log.warning("empty prompt: starting from <|endoftext|>, which this checkpoint cannot tell its model ever "
                    "saw; if the output is noise, pass prompt=TEXT")
    return [tok.eot]


def decode_threads(num_samples: int, kv_cache: bool, cores: int) -> int:
    """The CPU threads a decode step of this much work runs fastest on: a cached step of one sequence
    is dozens of tiny ops (one row each), where syncing threads costs more than it saves, so one thread;
    a batch, or recomputing the whole context each step, gives each op rows to split: every core.
    An explicit threads= wins."""
    rows = num_samples if kv_cache else num_samples * 64  # a recomputed step reads its whole context
    return 1 if rows < 4 else cores


def cpu_cores() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def kv_cache_dtype(name: str, rt, num_samples: int) -> torch.dtype:
    """sample.kv_dtype: as named; auto is the autocast dtype where there is one (bf16 or fp16 on a
    GPU), and fp32 on a CPU. Why: a bf16 cache halves what a decode step reads, but on a CPU whether
    that pays is the CPU's (torch's CPU attention kernel can be slow in bf16 for one query), and fp32
    is never far from the best. kv_dtype=bfloat16 asks for it; bf16 moves logits by its rounding
    (tested)."""
    if name == "int8":
        return torch.int8
    if name != "auto":
        return pick_dtype(name, rt.device, "kv_dtype")
    if rt.dtype != torch.float32:  # autocast: k and v come out of their projection in this dtype
        return rt.dtype
    return torch.float32


def decode_layout(model):
    """Store every Linear weight column-major (its transpose contiguous), in place: same values,
    same shapes, same results. A decode step multiplies only a few rows (one per sample) by each
    weight, and on CPU the GEMM kernel reads a column-major weight faster then (the same for one
    row). For inference only: an optimizer's state would keep the old layout."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.data = module.weight.data.t().contiguous().t()  # a tied head re-lays the embedding too
    return model


# ----------------------------------------------------------------------------- settings a model's layers cannot take
# Decided by what each layer's kind says of itself (its flags, its RoPE width), never by its name: a tool
# that takes such a setting warns it in one line each and goes on without it.

NO_CACHE = "keep a constant-size recurrent state, not a KV cache"
NO_SOFTMAX = "have no softmax weights (no N x N table to window)"
NO_ROPE = "rotate nothing by RoPE"


def all_recurrent(model) -> bool:
    """Does every layer keep a constant-size recurrent state (linear, gdn, mamba2), so the model has no KV
    cache at all: nothing to quantise, keep or evict?"""
    return all(block.attn.recurrent for block in model.blocks)


def no_softmax(model) -> bool:
    """Has no layer softmax weights (linear, gdn, mamba2): nothing for a window to narrow, no entropy to watch?"""
    return not any(block.attn.softmax for block in model.blocks)


def rope_acts(config) -> bool:
    """Does RoPE act on this model: model.pos=rope (GPT.rotary) and a layer whose kind rotates its q and k
    (rope_width; gdn and mamba2 take none)? From the config, before a model is built."""
    return config.pos == "rope" and any(KINDS[k].rope_width(config) is not None for k in kinds(config.attn))


def layer_names(model) -> str:
    """The kinds of a model's layers (a GPT, or its GPTConfig), by class: "GatedDeltaNet, Mamba2"."""
    if isinstance(model, GPTConfig):
        return ", ".join(sorted({KINDS[k].__name__ for k in kinds(model.attn)}))
    return ", ".join(sorted({type(block.attn).__name__ for block in model.blocks}))


def warn_no_effect(settings, model, why: str, what: str = "this checkpoint"):
    """Each (key, value) in settings, one warning line: `key=value has no effect on <what>: its layers
    (kinds) <why>: ignored`."""
    warn_ignored([f"{key}={value!r} has no effect on {what}: its layers ({layer_names(model)}) {why}: ignored"
                  for key, value in settings])


def warn_without_cache(model, cfg):
    """The cache's settings do nothing for a model whose every layer keeps a constant-size recurrent
    state (linear, gdn, mamba2: nothing to quantise or evict): warned, one line each."""
    if all_recurrent(model):
        warn_no_effect([(key, value) for key, value, default in (("kv_dtype", cfg.kv_dtype, "auto"),
                                                                  ("kv_sinks", cfg.kv_sinks, 0)) if value != default],
                       model, NO_CACHE)


def with_rope_scaling_if_it_acts(state: dict, scaling=None, factor=None, longer: bool = False) -> dict:
    """lab.checkpoint.with_rope_scaling (sample.py, tools/eval_lengths.py), unless model.pos=rope rotates
    nothing in this checkpoint's layers (gdn, mamba2): then each of rope_scaling and rope_scaling_factor
    given is warned in one line and the checkpoint stays as it is. Another model.pos is refused there."""
    given = [(key, value) for key, value in (("rope_scaling", scaling), ("rope_scaling_factor", factor))
             if value is not None]
    if given and state["model_config"].get("pos", "rope") == "rope":
        try:
            config = GPTConfig(**state["model_config"])
        except TypeError:  # another version's config: model_from_checkpoint says so in one line
            config = None
        if config is not None and not rope_acts(config):
            warn_no_effect(given, config, NO_ROPE)
            return state
    return with_rope_scaling(state, scaling, factor, longer=longer)


def load_for_sampling(cfg, prompt: str, device):
    """(model, tokenizer, the prompt's token ids) from cfg.ckpt, with cfg's key selection and RoPE scaling;
    on a CPU the model's weights are laid out for decoding (decode_layout)."""
    path = find_checkpoint(cfg.ckpt)
    log.info("sampling from %s", path)
    state = load_checkpoint(path)
    tok = tokenizer_from_dict(state["tokenizer"])
    ids = start_ids(tok, prompt, state)
    state = with_selection(state, cfg.select, cfg.select_topk, cfg.select_block)
    model = model_from_checkpoint(with_rope_scaling_if_it_acts(state, cfg.rope_scaling, cfg.rope_scaling_factor,
                                                               longer=True), device)
    warn_without_cache(model, cfg)
    if device.type == "cpu":  # measured on CPU only (bench_sample.py layouts=[row,column])
        decode_layout(model)
    return model, tok, ids


class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM during generation; `texts` holds each sample as far as it got, `how` and
    `status` what stopped it and the exit status that says so (cli.interruption)."""

    def __init__(self, texts, how, status):
        super().__init__()
        self.texts, self.how, self.status = texts, how, status


def sample_with_threads(cfg, generate, out=None) -> list:
    """sample.sample()'s work, with the CPU threads set (cfg.threads, else decode_threads' choice):
    `generate` (sample.generate) continues the prompt. Ctrl-C raises Interrupted with the texts so far."""
    rt = setup_runtime(cfg.device, cfg.dtype)
    if cfg.threads or rt.device.type == "cpu":
        torch.set_num_threads(cfg.threads or decode_threads(cfg.num_samples, cfg.kv_cache, cpu_cores()))
    kv_dtype = kv_cache_dtype(cfg.kv_dtype, rt, cfg.num_samples)
    prompt = read_prompt(cfg)
    model, tok, ids = load_for_sampling(cfg, prompt, rt.device)
    n = cfg.num_samples
    length = len(ids) + cfg.max_new_tokens
    check_memory(generation_bytes(model.config, n, length, kv_dtype.itemsize, int8=kv_dtype == torch.int8),
                 rt.device, "the samples", f"num_samples={n} x max_new_tokens, prompt included: {length} tokens")
    texts = SampleTexts(tok, n, cfg.stop, cfg.stream, out or sys.stdout)
    if cfg.stream:
        texts.out.write(prompt)
    try:
        generate_samples(cfg, rt, model, ids, texts, kv_dtype, generate)
    except KeyboardInterrupt as e:
        raise Interrupted([prompt + t for t in texts.interrupted()], *interruption(e)) from None
    except RuntimeError as e:
        if is_oom(e):
            raise UserError(f"out of memory generating num_samples={n} x max_new_tokens={cfg.max_new_tokens} "
                            f"({first_line(e, 120)}): lower them") from None
        raise
    return [prompt + t for t in texts.finish()]


def generate_samples(cfg, rt, model, ids: list, on_token, kv_dtype, generate):
    """generate() (sample.generate) on cfg.num_samples copies of the prompt ids, sample b seeded with
    cfg.seed + b. Streaming looks at every token; otherwise the host checks for stop strings and
    <|endoftext|> every CHECK_EVERY tokens, and the device runs ahead in between."""
    device, n = rt.device, cfg.num_samples
    idx = torch.as_tensor(ids, dtype=torch.long, device=device).unsqueeze(0).repeat(n, 1)  # (n, T)
    gens = [torch.Generator(device=device).manual_seed(cfg.seed + b) for b in range(n)]
    with rt.autocast():
        generate(model, idx, cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p, cfg.kv_cache, gens,
                 on_token, every=1 if cfg.stream else CHECK_EVERY,
                 compile=cfg.kv_cache and compile_wanted(cfg.compile, device), kv_dtype=kv_dtype,
                 kv_sinks=cfg.kv_sinks)


class SampleTexts:
    """Each sample's text as its tokens arrive: generate()'s on_token. Tokens are decoded and a sample
    ends at <|endoftext|>, a bos token (a BPE model ended its document; a new one began) or the stop
    string; with stream, the text goes to `out` as it is produced, less what may yet become the stop
    string. Called with the k newest tokens of every sample (B, k); returns True once all are done."""

    def __init__(self, tok, n: int, stop, stream: bool, out):
        self.tok, self.stop, self.stream, self.out = tok, stop, stream, out
        self.decoders = [StreamDecoder(tok) for _ in range(n)]
        self.texts, self.done, self.printed = [""] * n, [False] * n, 0

    def __call__(self, tokens) -> bool:
        for b, row in enumerate(tokens.tolist()):
            if self.done[b]:
                continue
            self.add(b, row)
            if self.stream:
                self.write_ready(b)
        return all(self.done)

    def add(self, b: int, row: list):
        """Sample b's new token ids, decoded, cut where the sample ends."""
        for end in (self.tok.eot, getattr(self.tok, "bos", None)):
            if end is not None and end in row:
                row, self.done[b] = row[:row.index(end)], True
        before = len(self.texts[b])
        self.texts[b] += self.decoders[b].feed(row) + (self.decoders[b].flush() if self.done[b] else "")
        if self.stop:  # only the new text (and the stop string's length before it) can hold a new match
            at = self.texts[b].find(self.stop, max(0, before - len(self.stop) + 1))
            if at >= 0:
                self.texts[b], self.done[b] = self.texts[b][:at], True

    def write_ready(self, b: int):
        ready = self.texts[b]
        if self.stop and not self.done[b]:  # hold back what may yet become the stop string
            ready = ready[:max(0, len(ready) - len(self.stop) + 1)]
        self.out.write(ready[self.printed:])
        self.out.flush()
        self.printed = max(self.printed, len(ready))

    def interrupted(self) -> list:
        """The texts as far as they got; streamed, what was held back is written first."""
        if self.stream:
            self.out.write(self.texts[0][self.printed:])
        return self.texts

    def finish(self) -> list:
        """The whole texts, every decoder flushed; streamed, what was held back is written."""
        for b, decoder in enumerate(self.decoders):
            if not self.done[b]:
                self.texts[b] += decoder.flush()
        if self.stream:
            self.out.write(self.texts[0][self.printed:])
        return self.texts


def print_samples(texts):
    for text in texts:
        print(text)
        print("---------------", flush=True)  # each sample out as soon as it is whole
