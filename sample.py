"""Sample text from a trained checkpoint. Samples go to stdout, everything else to stderr.

    python sample.py                                   # newest checkpoint under outputs/
    python sample.py ckpt=outputs/runs/X prompt="ROMEO:" max_new_tokens=500 temperature=0.8 top_k=200
    python sample.py prompt="'def '"                   # Hydra strips unquoted trailing spaces
    python sample.py prompt_file=prompt.txt            # whitespace and newlines kept exactly

Generation uses a KV cache: the prompt is run once (prefill) and each later step feeds only the
newest token, whose query attends to the cached keys and values. `kv_cache=false` recomputes the
whole context every step instead; both give the same logits (tests hold them equal).
"""
import logging
import sys
from pathlib import Path

import hydra
import torch

import config  # noqa: F401  (registers the config schema with Hydra)
from checkpoint import find_checkpoint, load_checkpoint, model_from_checkpoint
from common import UserError, cli, pick_device
from tokenizer import tokenizer_from_dict

log = logging.getLogger("attnlab")


def check_sampling(max_new_tokens, temperature, top_k, top_p, num_samples=1):
    if max_new_tokens < 0:
        raise UserError(f"max_new_tokens={max_new_tokens} must be >= 0")
    if temperature < 0:
        raise UserError(f"temperature={temperature} must be >= 0 (0 = greedy)")
    if not 0 < top_p <= 1:
        raise UserError(f"top_p={top_p} must be in (0, 1]")
    if top_k is not None and top_k <= 0:
        raise UserError(f"top_k={top_k} must be a positive integer or null")
    if num_samples <= 0:
        raise UserError(f"num_samples={num_samples} must be a positive integer")


def next_tokens(logits, temperature, top_k, top_p, generators):
    """One token per row of logits (B, vocab): greedy at temperature 0, else sampled from the
    temperature-scaled, top-k and top-p filtered distribution, row b with generators[b]."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)  # (B, 1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:  # keep the smallest set of most likely tokens whose mass reaches top_p
        sorted_p, order = probs.sort(dim=-1, descending=True)
        outside = sorted_p.cumsum(-1) - sorted_p >= top_p  # mass before this token already enough
        probs = probs.scatter(-1, order, sorted_p.masked_fill(outside, 0.0))
    # each row has its own generator, so sample b of a batch equals a lone sample with that seed
    return torch.stack([torch.multinomial(probs[b], 1, generator=g) for b, g in enumerate(generators)])


@torch.inference_mode()
def generate(model, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=1.0, kv_cache=True,
             generators=None, on_token=None, every=1):
    """Continue idx (B, T) by max_new_tokens tokens; returns (B, T + n) with n <= max_new_tokens.

    on_token(tokens (B, k)) is called with the k newest tokens every `every` steps (and at the
    end), e.g. to stream text; if it returns True, generation stops. Without it the loop never
    waits for the device: tokens stay on it until the end.
    """
    check_sampling(max_new_tokens, temperature, top_k, top_p)
    model.eval()
    B, T0 = idx.shape
    block_size = model.config.block_size
    if generators is None:
        generators = [torch.Generator(device=idx.device).manual_seed(1337 + b) for b in range(B)]
    out = torch.empty(B, T0 + max_new_tokens, dtype=idx.dtype, device=idx.device)  # preallocated
    out[:, :T0] = idx
    decode = CachedDecoder(model, idx, max_new_tokens) if kv_cache and max_new_tokens > 0 else None
    reported = n = T0
    for step in range(max_new_tokens):
        # the cache needs only the newest token; recomputing runs the whole (cropped) context
        logits = decode.next_logits(out, n) if decode else model(out[:, max(0, n - block_size):n])[:, -1]
        out[:, n:n + 1] = next_tokens(logits, temperature, top_k, top_p, generators)  # (B, 1)
        n += 1
        if on_token is not None and (n - reported >= every or step == max_new_tokens - 1):
            stop = on_token(out[:, reported:n])
            reported = n
            if stop:
                break
    return out[:, :n]


class CachedDecoder:
    """KV-cache decoding: the prompt is run once (prefill), then each step feeds only the newest
    token. Past block_size a relative-position model (RoPE, NoPE) slides its cache; a model with
    an absolute position table re-prefills the last block_size tokens at positions 0.. each step,
    which is what the recomputing path computes."""

    def __init__(self, model, idx, max_new_tokens):
        self.model, block_size = model, model.config.block_size
        prompt = idx[:, -block_size:]  # a longer prompt is cropped, as the recomputing path does
        # the cache holds one block: past that it slides, keys keeping their absolute RoPE positions
        self.cache = model.new_kv_cache(idx.size(0), min(block_size, prompt.size(1) + max_new_tokens))
        self.logits = model(prompt, kv_cache=self.cache, pos=0)[:, -1]  # prefill: (B, vocab)
        self.pos = prompt.size(1)  # position of the next token fed
        self.fed = idx.size(1)  # tokens of `out` the cache has seen

    def next_logits(self, out, n):
        """Logits (B, vocab) for the token after out[:, :n]."""
        if n > self.fed:  # feed the newest token
            block_size = self.model.config.block_size
            if self.model.slides or self.pos < block_size:
                self.logits = self.model(out[:, n - 1:n], kv_cache=self.cache, pos=self.pos)[:, -1]
                self.pos += 1
            else:  # an absolute table has no position block_size: run the last block afresh
                self.logits = self.model(out[:, n - block_size:n], kv_cache=self.cache, pos=0)[:, -1]
            self.fed = n
        return self.logits


def read_prompt(cfg) -> str:
    """The prompt: `prompt_file` read as is (every space and newline kept), else `prompt`."""
    if cfg.prompt_file is None:
        return cfg.prompt
    try:
        return Path(cfg.prompt_file).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"prompt_file={cfg.prompt_file!r} cannot be read as UTF-8 text: "
                        f"{type(e).__name__}: {getattr(e, 'strerror', None) or e}") from None


def sample(cfg, out=None) -> list:
    """Generate cfg.num_samples continuations of cfg.prompt from a checkpoint; returns the texts.
    With cfg.stream, text is written to `out` (default stdout) as it is produced."""
    check_sampling(cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p, cfg.num_samples)
    if cfg.stream and cfg.num_samples != 1:
        raise UserError("stream=true prints one sample as it is produced: set num_samples=1")
    device = pick_device(cfg.device)
    prompt = read_prompt(cfg)
    path = find_checkpoint(cfg.ckpt)
    log.info("sampling from %s", path)
    state = load_checkpoint(path)
    model = model_from_checkpoint(state, device)
    tok = tokenizer_from_dict(state["tokenizer"])
    if prompt == "" and tok.eot is None:
        raise UserError("prompt is empty: a char-level model needs at least one character to start from")
    # a BPE model may start from nothing: <|endoftext|> is where every document begins
    ids = tok.encode(prompt) if prompt else [tok.eot]
    prompt_ids = torch.as_tensor(ids, dtype=torch.long, device=device)
    idx = prompt_ids.unsqueeze(0).repeat(cfg.num_samples, 1)  # (num_samples, T)
    gens = [torch.Generator(device=device).manual_seed(cfg.seed + b) for b in range(cfg.num_samples)]
    out = out or sys.stdout
    new_ids = [[] for _ in range(cfg.num_samples)]
    texts = [""] * cfg.num_samples
    done = [False] * cfg.num_samples
    printed = 0

    def on_token(token):
        nonlocal printed
        for b in range(cfg.num_samples):
            if done[b]:
                continue
            if token[b].item() == tok.eot:  # a BPE model ended its document
                done[b] = True
            else:
                new_ids[b].append(token[b].item())
            # decode the whole continuation: a BPE token can end in the middle of a UTF-8 character
            texts[b] = tok.decode(new_ids[b])
            if cfg.stop and cfg.stop in texts[b]:
                texts[b] = texts[b][:texts[b].index(cfg.stop)]
                done[b] = True
            if cfg.stream:
                ready = texts[b]
                if not done[b]:  # hold back a partial character, and what may yet become the stop string
                    ready = ready.rstrip("\ufffd")
                    ready = ready[:len(ready) - len(cfg.stop) + 1] if cfg.stop else ready
                out.write(ready[printed:])
                out.flush()
                printed = max(printed, len(ready))
        return all(done)

    if cfg.stream:
        out.write(prompt)
    generate(model, idx, cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p, cfg.kv_cache, gens, on_token)
    if cfg.stream:
        out.write(texts[0][printed:])  # what was held back
    return [prompt + t for t in texts]


@hydra.main(version_base="1.3", config_path="configs", config_name="sample")
@cli
def main(cfg):
    texts = sample(cfg)
    if cfg.stream:
        print()
    else:
        for text in texts:
            print(text)
            print("---------------")


if __name__ == "__main__":
    main()
