"""Sample text from a trained checkpoint. Samples go to stdout, everything else to stderr.

    python sample.py                                   # newest checkpoint under outputs/
    python sample.py ckpt=outputs/runs/X prompt="ROMEO:" max_new_tokens=500 temperature=0.8 top_k=200
    python sample.py prompt="'def '"                   # Hydra strips unquoted trailing spaces
    python sample.py prompt_file=prompt.txt            # whitespace and newlines kept exactly

Generation uses a KV cache: the prompt is run once (prefill) and each later step feeds only the
newest token, whose query attends to the cached keys and values. `kv_cache=false` recomputes the
whole context every step instead; both give the same logits (tests hold them equal).

The command's plumbing (the prompt, threads, loading, stop strings, printing): lab/sampling.py.
Measured speeds: docs/sampling.md.
"""
import sys

import hydra
import torch

import lab.config  # noqa: F401  registers the config schema ("sample") with Hydra
from lab.cli import cli, run_app
from lab.sampling import Interrupted, check_sampling, print_samples, sample_with_threads
from rules import UserError, check_values


def next_tokens(logits, temperature, top_k, top_p, generators):
    """One token per row of logits (B, vocab): greedy at temperature 0, else sampled from the
    temperature-scaled, top-k and top-p filtered distribution, row b with generators[b]."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)  # (B, 1)
    logits = logits.float()
    # the best logit moved to 0 first (softmax is the same): near temperature 0 the others then go to
    # -inf, where dividing them as they are overflows to +-inf and the softmax to NaN
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:  # keep the smallest set of most likely tokens whose mass reaches top_p
        sorted_p, order = probs.sort(dim=-1, descending=True)
        outside = sorted_p.cumsum(-1) - sorted_p >= top_p  # mass before this token already enough
        outside[:, 0] = False  # the likeliest always stays (a top_p below float32's range would drop it too)
        probs = probs.scatter(-1, order, sorted_p.masked_fill(outside, 0.0))
    # each row has its own generator, so sample b of a batch equals a lone sample with that seed
    return torch.stack([torch.multinomial(probs[b], 1, generator=g) for b, g in enumerate(generators)])


@torch.inference_mode()
def generate(model, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=1.0, kv_cache=True,
             generators=None, on_token=None, every=1, compile=False, kv_dtype=None, kv_sinks=0):
    """Continue idx (B, T) by max_new_tokens tokens; returns (B, T + n) with n <= max_new_tokens.

    on_token(tokens (B, k)) is called with the k newest tokens every `every` steps (and at the
    end), e.g. to stream text; if it returns True, generation stops. Without it the loop never
    waits for the device: tokens stay on it until the end. compile: torch.compile the cached
    single-token decode step (fixed shapes; CUDA graphs on CUDA). kv_dtype: the cache's dtype
    (default the model's); bfloat16 halves the keys and values a decode step reads, int8 stores them
    quantised. kv_sinks: past block_size, keep the first kv_sinks tokens in the cache (StreamingLLM).
    """
    check_sampling(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p)
    model.eval()
    B, T0 = idx.shape
    block_size = model.config.block_size
    if generators is None:
        generators = [torch.Generator(device=idx.device).manual_seed(1337 + b) for b in range(B)]
    out = torch.empty(B, T0 + max_new_tokens, dtype=idx.dtype, device=idx.device)  # preallocated
    out[:, :T0] = idx
    decode = CachedDecoder(model, idx, max_new_tokens, compile, kv_dtype, kv_sinks) \
        if kv_cache and max_new_tokens > 0 else None
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

    def __init__(self, model, idx, max_new_tokens, compile=False, kv_dtype=None, kv_sinks=0):
        self.model, block_size = model, model.config.block_size
        prompt = idx[:, -block_size:]  # a longer prompt is cropped, as the recomputing path does
        # the cache holds one block: past that it slides, keys keeping their absolute RoPE positions
        length = min(block_size, prompt.size(1) + max_new_tokens)
        self.cache = model.new_kv_cache(idx.size(0), length, dtype=kv_dtype, static=compile,
                                        sinks=kv_sinks if kv_sinks < length else 0)  # a cache that never fills evicts nothing
        self.logits = model(prompt, cache=self.cache, pos=0)[:, -1]  # prefill: (B, vocab)
        self.pos = prompt.size(1)  # position of the next token fed
        self.fed = idx.size(1)  # tokens of `out` the cache has seen
        self.step = self.eager_step
        if compile:  # one graph for every step: the position is a tensor, the cache has a fixed shape
            model.rope_at(0, prompt.size(1) + max_new_tokens)  # grow the RoPE table now, not inside the graph
            self.pos_t = torch.tensor([self.pos], device=idx.device)
            torch._dynamo.mark_static_address(self.pos_t)  # updated in place each step: CUDA graphs need it static
            mode = "reduce-overhead" if idx.device.type == "cuda" else None  # CUDA graphs: no launch overhead
            decode = torch.compile(self.static_step, mode=mode, fullgraph=True, dynamic=False)
            self.step = lambda token: decode(token, self.pos_t)

    def eager_step(self, token):
        return self.model(token, cache=self.cache, pos=self.pos)[:, -1]

    def static_step(self, token, pos_t):
        logits = self.model(token, cache=self.cache, pos=pos_t)[:, -1]
        pos_t += 1  # in place, on the device: no host sync per token
        return logits

    def next_logits(self, out, n):
        """Logits (B, vocab) for the token after out[:, :n]."""
        if n > self.fed:  # feed the newest token
            block_size = self.model.config.block_size
            if self.model.slides or self.pos < block_size:
                self.logits = self.step(out[:, n - 1:n])
                self.pos += 1
            else:  # an absolute table has no position block_size: run the last block afresh
                self.logits = self.model(out[:, n - block_size:n], cache=self.cache, pos=0)[:, -1]
            self.fed = n
        return self.logits


def sample(cfg, out=None) -> list:
    """Generate cfg.num_samples continuations of cfg.prompt from a checkpoint; returns the texts.
    With cfg.stream, text is written to `out` (default stdout) as it is produced. Ctrl-C raises
    Interrupted, which carries the texts as far as they got; so does SIGTERM under the command (cli)."""
    check_values(cfg)
    if cfg.stream and cfg.num_samples != 1:
        raise UserError("stream=true prints one sample as it is produced: set num_samples=1")
    threads = torch.get_num_threads()
    try:
        return sample_with_threads(cfg, generate, out)
    finally:
        torch.set_num_threads(threads)  # as found: sample() is also called in-process (tools, tests)


@hydra.main(version_base="1.3", config_path="configs", config_name="sample")
@cli
def main(cfg):
    try:
        texts = sample(cfg)
    except Interrupted as e:  # keep what was generated: print it, then say it is partial
        if cfg.stream:
            print(flush=True)
        else:
            print_samples(e.texts)
        print(f"interrupted ({e.how}): the text above is what was generated until then", file=sys.stderr)
        sys.exit(e.status)
    if cfg.stream:
        print()
    else:
        print_samples(texts)


if __name__ == "__main__":
    run_app(main)
