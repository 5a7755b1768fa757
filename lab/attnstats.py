"""How sharp is each head's attention? Entropy, peak weight and largest logit, per layer and head.

For a query at position i the attention weights p_ij over the keys it may see (j <= i) have
entropy H_i = -sum_j p_ij ln p_ij: ln(i+1) when uniform, 0 when one-hot. Softmax saturation (the
failure √d_k scaling and QK-Norm prevent) shows up as entropy collapsing and the peak weight
going to 1 (Dehghani et al. 2023, arXiv 2302.05442; Wortsman et al. 2023, arXiv 2309.14322).

What each head looks at, from the same weights: the mean weight on the previous token (a
previous-token head), on the first token of the window (an "attention sink", Xiao et al. 2023,
arXiv 2309.17453), on the query itself, and the mean attention distance sum_j p_ij (i - j). These
are means over rows i >= 1 (row 0 sees only itself, so it says nothing about a head).

Induction heads (Olsson et al. 2022, arXiv 2209.11895): on a sequence repeated twice,
[r_1..r_n, r_1..r_n], a query at t in the second copy that attends to t - n + 1, the token right
after its earlier occurrence, can copy what came next. The probe runs a fixed batch of such
sequences (r: held-out text, see repeated_batch) and logs each head's mean weight there, and the
in-context gain: the model's mean loss on the first copy minus on the second (what seeing the text
once already saves).

The probe reads each layer's q and k at the attention's hook points (reading_qk), so no forward
carries it and training steps run without it, and asks the layer what its softmax takes of them
(CausalSelfAttention.scores: its scale, mask and window, logit bias and sink), so every statistic is
computed over exactly the weights the layer uses, whatever its kind and add-ons. One layer and one
block of queries at a time: memory is O(B * heads * block * T), never a T x T matrix per layer held
at once, and training steps that do not probe never build an attention matrix. A layer without
softmax weights (linear attention) has no statistics; the probe says which layers those are.
attention_maps returns the whole weights of one prompt (at most block_size tokens); layer_maps adds,
for a layer without softmax, its effective attention: the matrix A with y = A v that the layer's
linear recurrence amounts to (linear attention, Gated DeltaNet, Mamba-2: their effective_attention),
for the maps that tools/visualize.py and the end of a run draw (lab/plots/). Entropy needs a
distribution: A's rows are one only for linear attention without RoPE (positive features, divided by
their sum); elsewhere a head's entropy is NaN and a note says why.
"""
import contextlib
import math
import re
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from attention import Mask, attention_scores, softmax_with_sink
from variants import KINDS


ROLE_STATS = ("prev", "first", "self", "dist")  # what each head looks at (rows i >= 1)


def weight_at_offset(p, start: int, d: int):
    """Each row's weight on the key d positions back, for a block p (..., Tb, end) whose row r is
    query start + r: (values (..., m), index of the first row that has such a key, i >= d)."""
    first_row = max(0, d - start)  # rows before it have no key at i - d
    return torch.diagonal(p, offset=start - d, dim1=-2, dim2=-1), start + first_row


def role_rows(p, start: int):
    """Per-row statistics of a block of causal attention weights p (B, nh, Tb, end), row r being
    query i = start + r: dict of (B, nh, Tb) tensors `prev` (weight on key i-1, 0 for row 0), `first`
    (on key 0), `self` (on key i), `dist` (sum_j p_ij (i - j))."""
    Tb, end = p.shape[-2:]
    prev, first_row = weight_at_offset(p, start, 1)
    prev = F.pad(prev, (first_row - start, 0))  # row 0 has no previous token
    offsets = (torch.arange(start, start + Tb, device=p.device)[:, None]
               - torch.arange(end, device=p.device)[None, :]).to(p.dtype)  # (Tb, end): i - j
    return {"prev": prev, "first": p[..., 0], "self": weight_at_offset(p, start, 0)[0],
            "dist": (p * offsets.clamp(min=0)).sum(-1)}


@contextmanager
def reading_qk(model, fn):
    """Within the block, every forward of `model` calls fn(layer, attn, q, k) for each layer with
    softmax attention: its index, the attention module itself (whose `scores` turns q and k into the
    logits its softmax takes) and the q (B, T, nh, hs) and k (B, T, n_kv, hs) that enter its
    attention, read at its hook points."""
    handles = []
    for layer, block in enumerate(model.blocks):
        attn, seen = block.attn, {}
        if not attn.softmax:  # linear attention has no softmax weights to read
            continue

        def read_q(module, args, q, seen=seen):
            seen["q"] = q

        def read_k(module, args, k, seen=seen, layer=layer, attn=attn):
            fn(layer, attn, seen.pop("q"), k)

        handles += [attn.hook_q.register_forward_hook(read_q), attn.hook_k.register_forward_hook(read_k)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextmanager
def reading_mixers(model, fn):
    """Within the block, every forward of `model` calls fn(layer, attn, x, q, k, rope) for each layer
    without softmax weights that can write its weights out (effective_attention), once the layer has
    run: its index, the module, its input x (B, T, C), the q and k read at its hook points and the RoPE
    table it was given (None without RoPE). fn runs inside the layer's forward hook, so parameters a
    sharded model gathers for the layer are still there."""
    handles = []
    for layer, block in enumerate(model.blocks):
        attn, seen = block.attn, {}
        if attn.softmax or not hasattr(attn, "effective_attention"):
            continue

        def read_input(module, args, kwargs, seen=seen):
            seen.update(x=args[0], rope=kwargs.get("rope"))

        def read(name, seen=seen):
            return lambda module, args, out: seen.__setitem__(name, out)

        def ran(module, args, out, seen=seen, layer=layer):
            fn(layer, module, seen.pop("x"), seen.pop("q"), seen.pop("k"), seen.pop("rope"))

        handles += [attn.register_forward_pre_hook(read_input, with_kwargs=True), attn.register_forward_hook(ran),
                    attn.hook_q.register_forward_hook(read("q")), attn.hook_k.register_forward_hook(read("k"))]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def layer_kinds(model) -> list:
    """Each layer's attention kind, by its name in model.attn.kind (variants.KINDS)."""
    names = {cls: name for name, cls in KINDS.items()}
    return [names.get(type(b.attn), type(b.attn).__name__) for b in model.blocks]


def without_softmax(model) -> str:
    """A line naming the layers whose attention has no softmax weights (no logged statistics), or ""."""
    kinds = layer_kinds(model)
    none = [f"L{l} ({kind})" for l, (kind, b) in enumerate(zip(kinds, model.blocks)) if not b.attn.softmax]
    return f"{', '.join(none)}: no softmax weights, so no logged attention statistics (tools/visualize.py draws their effective attention)" if none else ""


def logit_bound(attn):
    """The largest |logit| any input can give layer `attn` (a CausalSelfAttention): with QK-Norm
    scale·|q̂|·|k̂| (|x̂| = √hs after rms or layer norm, 1 after l2) times the largest gains of q and k;
    with a soft-cap c (model.attn.softcap), c at most; None with neither (logits then grow with the inputs)."""
    if attn.norm_kind is None:
        return attn.softcap
    norm_sq = 1.0 if attn.norm_kind == "l2" else float(attn.head_dim)
    gains = 1.0 if attn.q_gain is None else attn.q_gain.abs().max().item() * attn.k_gain.abs().max().item()
    return min(attn.scale * norm_sq * gains, attn.softcap or math.inf)


def causal_scores(q, k, scale: float):
    """The scores of plain causal attention for attention_stats: q, k (B, nh, T, hs) -> a function
    (start, end) -> (logits (B, nh, end - start, end) of the queries start..end-1, no sink)."""
    return lambda start, end: (attention_scores(q[:, :, start:end], k[:, :, :end], scale=scale,
                                                mask=Mask(end - start, end)), None)


def layer_scores(attn, q, k, dtype=torch.float32):
    """The scores of one layer for attention_stats: what its softmax takes of the q (B, T, nh, hs) and
    k (B, T, n_kv, hs) read at its hook points (CausalSelfAttention.scores), in `dtype`."""
    q, k = q.to(dtype), k.to(dtype)
    return lambda start, end: attn.scores(q, k, start, end)


@torch.no_grad()
def attention_stats(scores, T: int, block: int = 256, period=None, offset=0) -> dict:
    """Statistics of causal attention weights over T positions, computed block-wise: scores(start,
    end) gives the logits (B, nh, end - start, end) of the queries start..end-1 (-inf for keys they do
    not see) and a sink's logits (nh,) or None (causal_scores, layer_scores).

    Returns per-head tensors (nh,): `entropy` (nats, mean over rows), `entropy_norm` (each row
    divided by ln(i+1), rows i >= 1 only, since one key has no choice), `peak` (mean largest
    weight); `logit_max` per head (largest logit any query gives a visible key); and the head's
    roles, means over rows i >= 1: `prev`, `first`, `self` (weight on key i-1, 0, i) and `dist`
    (sum_j p_ij (i - j)). With `period` n (the rows are [r, r] repeated, T = 2n, or after `offset`
    tokens, T = offset + 2n): also `induction`, the mean weight of the second copy's queries
    t >= offset + n on key t - n + 1. With a sink, the softmax includes it: `sink` is its mean
    weight, the entropy counts it as one more choice, and the key statistics are the weights keys
    get beside it.
    """
    for start in range(0, T, block):
        end = min(start + block, T)
        logits, sink = scores(start, end)  # (B, nh, Tb, end)
        if start == 0:  # the sums, per head, in the logits' dtype
            B, nh, dtype = logits.size(0), logits.size(1), logits.dtype
            positions = torch.arange(T, device=logits.device, dtype=dtype)
            ent_sum, norm_sum, peak_sum, induction_sum, sink_sum = torch.zeros(5, nh, device=logits.device, dtype=dtype)
            role_sum = {name: torch.zeros_like(ent_sum) for name in ROLE_STATS}
            logit_max = torch.full_like(ent_sum, -math.inf)
        if sink is None:
            logp = F.log_softmax(logits, dim=-1)
        else:  # the sink as column 0 of the softmax, then set apart
            column = sink.to(dtype).view(1, nh, 1, 1).expand(*logits.shape[:-1], 1)
            logp_all = F.log_softmax(torch.cat([column, logits], dim=-1), dim=-1)
            sink_sum += logp_all[..., 0].exp().sum(dim=(0, 2))
            ent_sink = -(logp_all[..., 0].exp() * logp_all[..., 0])
            logp = logp_all[..., 1:]
        p = logp.exp()
        ent = -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(-1)  # (B, nh, Tb)
        if sink is not None:
            ent = ent + ent_sink
        ent_sum += ent.sum(dim=(0, 2))
        log_keys = torch.log1p(positions[start:end])  # ln(i+1) for the block's rows
        rows = log_keys > 0
        norm_sum += (ent[..., rows] / log_keys[rows]).sum(dim=(0, 2))
        peak_sum += p.amax(-1).sum(dim=(0, 2))
        logit_max = torch.maximum(logit_max, logits.amax(dim=(0, 2, 3)))  # masked keys are -inf
        for name, per_row in role_rows(p, start).items():
            role_sum[name] += per_row[..., rows].sum(dim=(0, 2))
        if period is not None:  # second-copy queries t >= offset + n, each on key t - n + 1
            w, first_row = weight_at_offset(p, start, period - 1)
            induction_sum += w[..., max(0, offset + period - first_row):].sum(dim=(0, 2))
    n_rows, n_norm_rows = B * T, B * max(T - 1, 1)
    out = {"entropy": ent_sum / n_rows, "entropy_norm": norm_sum / n_norm_rows,
           "peak": peak_sum / n_rows, "logit_max": logit_max}
    if sink is not None:  # the layer's sink (the same in every block)
        out["sink"] = sink_sum / n_rows
    out.update({name: total / n_norm_rows for name, total in role_sum.items()})
    if period is not None:
        out["induction"] = induction_sum / (B * max(T - offset - period, 1))
    return out


DISTRIBUTION_TOL = 1e-4  # a row is a distribution when no weight is below -tol and its sum is 1 within tol


def effective_stats(A, tol: float = DISTRIBUTION_TOL):
    """Statistics of one layer's effective attention A (B, nh, T, T) (zero above the diagonal), as
    attention_stats gives for softmax weights: per head (nh,) `prev`, `first`, `self` (the weight on key
    i-1, 0, i: means over rows i >= 1, signed where A is); `entropy` (mean over rows) and `dist` (mean
    over rows i >= 1 of sum_j A_ij (i - j)) only for a head whose every row is a distribution, else NaN.
    Returns (stats, notes): notes[h] says why head h has no entropy (None where it has one)."""
    T = A.size(-1)
    rows = role_rows(A, 0)  # (B, nh, T) each
    n = A.size(0) * max(T - 1, 1)
    stats = {name: rows[name][..., 1:].sum(dim=(0, 2)) / n for name in ROLE_STATS}
    low = A.amin(dim=(0, 2, 3))  # (nh,): zeros above the diagonal count, harmlessly
    sums = A.sum(-1)  # (B, nh, T)
    lo, hi = sums.amin(dim=(0, 2)), sums.amax(dim=(0, 2))
    ent = -torch.where(A > 0, A * A.clamp(min=1e-30).log(), torch.zeros_like(A)).sum(-1).mean(dim=(0, 2))
    notes = []
    for h in range(A.size(1)):
        if low[h] < -tol:
            notes.append(f"signed (min {low[h].item():.2g})")
        elif lo[h] < 1 - tol or hi[h] > 1 + tol:
            notes.append(f"rows sum {lo[h].item():.2g}..{hi[h].item():.2g}")
        else:
            notes.append(None)
    distribution = torch.tensor([note is None for note in notes], device=A.device)
    stats["entropy"] = torch.where(distribution, ent, float("nan"))
    stats["dist"] = torch.where(distribution, stats["dist"], float("nan"))
    return stats, notes


@torch.no_grad()
def layer_maps(model, idx, block: int = 256, effective: bool = True):
    """Every layer's and head's weights for one sequence idx (1, T): for a softmax layer the softmax it
    takes of the q and k it computes itself (read at its hook points; CausalSelfAttention.scores: its
    mask and window, logit bias and sink; with GQA k comes one per query head); for a layer without
    softmax, with `effective`, its effective attention (its effective_attention of the input, q and k it
    had: reading_mixers), the A whose A @ v is each head's output. One forward. Returns the weights
    (L, nh, T, T) as a float32 CPU tensor (zero where a query does not see a key; a softmax row sums to
    1 minus a sink's share), each head's statistics {name: (L, nh)} (attention_stats', effective_stats'
    for effective attention) and notes (L lists of nh): why a head's entropy is NaN, or None; a layer
    with no map (without `effective`, or a kind that cannot write its weights out) is NaN throughout."""
    was_training = model.training
    model.eval()
    maps, stats, notes = {}, {}, {}

    def hook(layer, attn, q, k):
        logits, sink = attn.scores(q.float(), k.float())  # (1, nh, T, T), -inf where hidden
        maps[layer] = softmax_with_sink(logits, sink)[0].cpu()
        stats[layer] = attention_stats(layer_scores(attn, q, k), q.size(1), block)

    def mixer(layer, attn, x, q, k, rope):
        A = attn.effective_attention(x, q, k, rope=rope).float()  # (1, nh, T, T)
        maps[layer] = A[0].cpu()
        stats[layer], notes[layer] = effective_stats(A)

    with reading_qk(model, hook), (reading_mixers(model, mixer) if effective else contextlib.nullcontext()):
        model(idx)
    model.train(was_training)
    T, nh = idx.size(1), model.config.n_head
    names = ("entropy",) + ROLE_STATS
    empty = torch.full((nh, T, T), float("nan"))
    L = len(model.blocks)
    return (torch.stack([maps.get(l, empty) for l in range(L)]),
            {name: torch.stack([stats[l][name].cpu() if l in stats else empty[:, 0, 0] for l in range(L)])
             for name in names},
            [notes.get(l, [None] * nh) for l in range(L)])


def attention_maps(model, idx, block: int = 256):
    """layer_maps' weights and statistics of the softmax layers only: a layer without softmax weights
    (linear attention: without_softmax) is NaN in both."""
    maps, stats, _ = layer_maps(model, idx, block, effective=False)
    return maps, stats


def repeated_batch(idx):
    """Sequences [r_1..r_n, r_1..r_n] (B, 2n), n = T // 2, for the induction score: r is the first
    half of each probe row, i.e. a span of held-out text.

    Why text and not random tokens as in Olsson et al.: a small char model has never seen a random
    string of characters (on one it does worse than uniform), so what its heads do there says little
    about what they do on text; a val span is text it could meet, and the same span at every probe.
    The cost: a character can occur twice in r, and a head that attends to the successor of every
    earlier occurrence then splits its weight, so a perfect score of 1 is reached only by a head that
    matches more than one token back (as the induction heads of trained models do)."""
    r = idx[:, : idx.size(1) // 2]
    return torch.cat([r, r], dim=1)


def copy_losses(logits, x, n: int):
    """Mean next-token loss on the first copy (targets x_1..x_{n-1}) and on the second (targets
    x_{n+1}..x_{2n-1}) of x = [r, r] (B, 2n); the prediction of the second copy's first token is in
    neither: nothing in the first copy tells that the sequence is about to repeat."""
    logp = F.log_softmax(logits.float(), dim=-1)  # (B, 2n, vocab)
    nll = -logp[:, :-1].gather(-1, x[:, 1:, None]).squeeze(-1)  # (B, 2n-1): position t predicts x_{t+1}
    return nll[:, :n - 1].mean().item(), nll[:, n:].mean().item()


class AttentionProbe:
    """Runs a fixed batch through the model and returns the attention statistics as flat metrics;
    with `induction`, also a fixed batch of repeated random tokens (repeated_batch) for the
    induction score per head and the in-context gain. With `bos` (data.bos=true: every row of idx
    starts with it) the repeated batch keeps it first: [bos, r, r]."""

    def __init__(self, idx, block: int = 256, induction: bool = True, bos: bool = False):
        self.idx = idx  # (B, T) token ids, drawn once so every probe sees the same text
        self.block = block
        self.offset = int(bos)  # tokens before the repeated span
        rows = idx[:, self.offset:]
        self.repeated = None  # (B, offset + 2n)
        if induction and rows.size(1) >= 4:
            self.repeated = torch.cat([idx[:, :self.offset], repeated_batch(rows)], dim=1)

    @torch.no_grad()
    def run(self, model) -> dict:
        was_training = model.training
        model.eval()
        per_layer = {}

        def hook(layer, attn, q, k):  # called once per softmax layer with the q, k it computed
            per_layer[layer] = attention_stats(layer_scores(attn, q, k), q.size(1), self.block)

        largest = {}  # the largest |activation| of the residual stream after each block ("massive
        handles = [b.register_forward_hook(  # activations", Sun et al. 2024, arXiv 2402.17762; sinks' partners)
            lambda m, args, out, l=l: largest.__setitem__(l, out.abs().max().item())) for l, b in enumerate(model.blocks)]
        try:
            with reading_qk(model, hook):
                model(self.idx)
        finally:
            for h in handles:
                h.remove()
        extra = {f"act_max/L{l}": v for l, v in sorted(largest.items())}
        extra["act_max/max"] = max(largest.values())
        if self.repeated is not None:
            o = self.offset
            n = (self.repeated.size(1) - o) // 2

            def induction_hook(layer, attn, q, k):
                per_layer[layer]["induction"] = attention_stats(layer_scores(attn, q, k), q.size(1), self.block,
                                                                period=n, offset=o)["induction"]

            with reading_qk(model, induction_hook):
                logits = model(self.repeated)
            first, second = copy_losses(logits[:, o:], self.repeated[:, o:], n)
            extra.update({"incontext/loss_first": first, "incontext/loss_second": second, "incontext/gain": first - second})
        model.train(was_training)
        return {**flatten_stats(per_layer), **extra}


def metric_key(name: str, layer=None, head=None) -> str:
    """The metric key of a statistic: attn_{name}/L{layer}/H{head}, attn_{name}/L{layer} (mean over
    heads) or attn_{name}/{layer} for a summary ("mean", "max"). parse_key reads them back."""
    if head is not None:
        return f"attn_{name}/L{layer}/H{head}"
    return f"attn_{name}/L{layer}" if isinstance(layer, int) else f"attn_{name}/{layer}"


KEY = re.compile(r"attn_(\w+)/L(\d+)(?:/H(\d+))?")


def parse_key(key: str):
    """(name, layer, head) of a per-layer (head None) or per-head metric key; None for any other."""
    m = KEY.fullmatch(key)
    return None if m is None else (m.group(1), int(m.group(2)), None if m.group(3) is None else int(m.group(3)))


def head_keys(lines, name: str) -> list:
    """[(layer, head, key)] of the per-head statistic `name` in metric lines, sorted."""
    found = {(p[1], p[2], key) for line in lines for key in line
             for p in [parse_key(key)] if p and p[0] == name and p[2] is not None}
    return sorted(found)


def layer_keys(lines, name: str) -> list:
    """[(layer, key)] of the per-layer mean of statistic `name` in metric lines, sorted."""
    return sorted({(p[1], key) for line in lines for key in line
                   for p in [parse_key(key)] if p and p[0] == name and p[2] is None})


def flatten_stats(per_layer: dict) -> dict:
    """{layer: stats} -> metric keys attn_entropy/L{l}/H{h}, attn_entropy/L{l}, .../mean, etc.;
    the role statistics (and induction, when measured) per head and as per-layer means."""
    out = {}
    if not per_layer:  # no softmax layer (linear attention): no attention statistics
        return out
    for l, s in sorted(per_layer.items()):
        for h, v in enumerate(s["entropy"].tolist()):
            out[metric_key("entropy", l, h)] = v
        out[metric_key("entropy", l)] = s["entropy"].mean().item()
        out[metric_key("entropy_norm", l)] = s["entropy_norm"].mean().item()
        out[metric_key("peak", l)] = s["peak"].mean().item()
        out[metric_key("logit_max", l)] = s["logit_max"].max().item()
    n = len(per_layer)
    for name in ("entropy", "entropy_norm", "peak"):
        out[metric_key(name, "mean")] = sum(out[metric_key(name, l)] for l in per_layer) / n
    for name in ROLE_STATS + ("induction", "sink"):
        for l, s in sorted(per_layer.items()):
            if name not in s:
                continue
            for h, v in enumerate(s[name].tolist()):
                out[metric_key(name, l, h)] = v
            out[metric_key(name, l)] = s[name].mean().item()
    heads = [out[key] for _, _, key in head_keys([out], "induction")]
    if heads:
        out[metric_key("induction", "max")] = max(heads)  # the strongest induction head
    return out


def head_grid(stats: dict, name: str = "entropy"):
    """The layer x head matrix of statistic `name` in a metrics line (list of lists), or None."""
    cells = {(l, h): stats[key] for l, h, key in head_keys([stats], name)}
    if not cells:
        return None
    n_l = max(l for l, _ in cells) + 1
    n_h = max(h for _, h in cells) + 1
    return [[cells.get((l, h), float("nan")) for h in range(n_h)] for l in range(n_l)]


def entropy_grid(stats: dict):
    """The layer x head matrix of attn_entropy/L{l}/H{h} values in a metrics line (list of lists)."""
    return head_grid(stats, "entropy")


def induction_line(history: list):
    """One line on the probes' in-context gain (`history`: their metric lines by step), or None where there is
    none: the gain at the first and last probe, its largest rise between two probes in a row (where an induction
    head formed, Olsson et al. 2022's phase change) and the two heads with the highest induction scores at the
    last probe."""
    gains = [(line["step"], line["incontext/gain"]) for line in history if "incontext/gain" in line]
    if not gains:
        return None
    def f(x):
        return f"{x:.3f}".replace("-0.000", "0.000")

    (s0, g0), (s1, g1) = gains[0], gains[-1]
    text = f"in-context gain on the probe batch {f(g1)} at step {s1} ({f(g0)} at step {s0})"
    if len(gains) > 1:
        (a, ga), (b, gb) = max(zip(gains, gains[1:]), key=lambda p: p[1][1] - p[0][1])
        text += f"; its largest rise, {f(ga)} to {f(gb)}, between steps {a} and {b}"
    last = history[-1]
    top = sorted(((last[key], l, h) for l, h, key in head_keys([last], "induction")), reverse=True)[:2]
    if top:
        text += "; top induction scores " + ", ".join(f"L{l}H{h} {f(v)}" for v, l, h in top)
    return text
