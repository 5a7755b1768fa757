"""Interventions on a trained model, read and written at its hook points: ablating heads (zero or
mean), the logit lens, direct logit attribution of a logit to the parts of the residual stream, and
activation patching of a clean run into a corrupted one. tools/ablate.py, lens.py and patch.py are
their commands; lab/attnstats.py holds the probe's statistics."""
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from lab.attnstats import copy_losses, layer_kinds, repeated_batch
from rules import UserError

# ----------------------------------------------------------------------------- ablation


class Ablation:
    """Forward hooks on the layers' hook_z that replace the chosen heads' outputs: by zero, or by
    `means[layer]` (nh, hs), the head's mean output. Used as a context manager."""

    def __init__(self, model, heads, means=None):
        self.model, self.heads, self.means, self.handles = model, heads, means, []

    def __enter__(self):
        by_layer = {}
        for layer, head in self.heads:
            by_layer.setdefault(layer, []).append(head)
        for layer, heads in by_layer.items():
            def hook(module, args, z, layer=layer, heads=heads):
                z = z.clone()
                z[:, :, heads] = 0 if self.means is None else self.means[layer][heads].to(z.dtype)
                return z
            self.handles.append(self.model.blocks[layer].attn.hook_z.register_forward_hook(hook))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


@torch.no_grad()
def head_means(model, x, batch_size: int) -> list:
    """Each layer's mean hook_z over the windows x and their positions: (nh, hs) per layer."""
    sums, count = [0.0] * len(model.blocks), 0
    handles = [b.attn.hook_z.register_forward_hook(lambda m, a, z, l=l: sums.__setitem__(l, sums[l] + z.double().sum((0, 1))))
               for l, b in enumerate(model.blocks)]
    try:
        for xb in x.split(batch_size):
            model(xb)
            count += xb.numel()
    finally:
        for h in handles:
            h.remove()
    return [(s / count).float() for s in sums]


@torch.no_grad()
def measure(model, x, y, batch_size: int) -> dict:
    """The mean val loss over the windows, and the in-context gain on their first halves repeated."""
    loss = sum(F.cross_entropy(model(xb).flatten(0, 1).float(), yb.flatten(), reduction="sum").item()
               for xb, yb in zip(x.split(batch_size), y.split(batch_size))) / y.numel()
    first = second = 0.0
    for xb in x.split(batch_size):
        seq = repeated_batch(xb)
        a, b = copy_losses(model(seq), seq, seq.size(1) // 2)
        first, second = first + a * xb.size(0), second + b * xb.size(0)
    return {"loss": loss, "gain": (first - second) / x.size(0)}


# ----------------------------------------------------------------------------- the logit lens

POST_LN = ("model.norm_position=post normalises the residual stream inside every block (ln(x + f(x))), so the "
           "final logit is not a sum of what the layers wrote: the logit lens and direct logit attribution need "
           "a Pre-LN model")


def unembed(model, resid):
    """The model's ending applied to a residual stream (..., C): ln_f, lm_head, the soft-cap if any."""
    logits = model.lm_head(model.ln_f(resid))
    c = model.config.logit_softcap
    return c * torch.tanh(logits / c) if c else logits


def layer_names(model) -> list:
    """The stream's names in the lens: before the first block, then after each."""
    return ["embed"] + [f"L{l}" for l in range(len(model.blocks))]


@torch.no_grad()
def accumulated_resid(model, idx):
    """The residual stream (B, T, C) before the first block and after each block, read at the blocks'
    hook points in one forward of idx (B, T); and that forward's logits."""
    streams = [None] * (len(model.blocks) + 1)
    handles = [model.blocks[0].hook_resid_pre.register_forward_hook(lambda m, a, x: streams.__setitem__(0, x))]
    handles += [b.hook_resid_post.register_forward_hook(lambda m, a, x, l=l: streams.__setitem__(l + 1, x))
                for l, b in enumerate(model.blocks)]
    try:
        logits = model(idx)
    finally:
        for h in handles:
            h.remove()
    return streams, logits


@torch.no_grad()
def logit_lens(model, idx) -> torch.Tensor:
    """Every layer's prediction for idx (B, T): (n_layer + 1, B, T, vocab), the last the model's logits."""
    return torch.stack([unembed(model, r) for r in accumulated_resid(model, idx)[0]])


@torch.no_grad()
def lens_losses(model, x, y, batch_size: int) -> dict:
    """The mean next-token loss of every layer's lens over the windows x, y (n, T): one value per
    name of layer_names; and the model's own loss from its logits, for comparison."""
    sums, own = [0.0] * (len(model.blocks) + 1), 0.0
    for xb, yb in zip(x.split(batch_size), y.split(batch_size)):
        streams, logits = accumulated_resid(model, xb)
        own += F.cross_entropy(logits.flatten(0, 1).float(), yb.flatten(), reduction="sum").item()
        for l, r in enumerate(streams):  # one layer's logits at a time: (B, T, vocab) each
            sums[l] += F.cross_entropy(unembed(model, r).flatten(0, 1).float(), yb.flatten(), reduction="sum").item()
    return {"losses": [s / y.numel() for s in sums], "model_loss": own / y.numel()}


# ----------------------------------------------------------------------------- direct logit attribution

@torch.no_grad()
def residual_parts(model, idx, position: int):
    """What each piece wrote into the residual stream at `position` of idx (1, T): {name: (C,)} in the
    order written (embed, pos_embed, L{l}H{h}, L{l} attn bias, L{l} mlp), the final residual (C,)
    and the pre-cap logits (vocab,) of one forward. A head's part is its columns of c_proj times its
    slice of c_proj's input (what hook_z holds, after the layer's gate)."""
    if model.config.norm_position == "post":
        raise UserError(POST_LN)
    seen = {}
    hooks = [(model.blocks[-1].hook_resid_post, lambda m, a, x: seen.__setitem__("final", x)),
             (model.lm_head, lambda m, a, x: seen.__setitem__("logits", x))]
    for l, b in enumerate(model.blocks):
        if hasattr(b, "mlp"):
            hooks.append((b.hook_mlp_out, lambda m, a, x, l=l: seen.__setitem__(("mlp", l), x)))
    handles = [module.register_forward_hook(fn) for module, fn in hooks]
    handles += [b.attn.c_proj.register_forward_pre_hook(lambda m, a, l=l: seen.__setitem__(("z", l), a[0]))
                for l, b in enumerate(model.blocks)]
    try:
        model(idx)
    finally:
        for h in handles:
            h.remove()
    p, T = position, idx.size(1)
    parts = {"embed": model.wte(idx)[0, p]}
    if model.positions is not None:
        parts["pos_embed"] = model.positions(0, T)[p]
    for l, b in enumerate(model.blocks):
        proj, nh, hs = b.attn.c_proj, b.attn.n_head, b.attn.head_dim
        if proj.in_features != nh * hs:
            raise UserError(f"layer {l}'s output projection takes {proj.in_features} inputs, not n_head x head_dim = "
                            f"{nh} x {hs}: its heads cannot be told apart")
        z = seen[("z", l)][0, p].view(nh, hs)  # each head's output, as c_proj reads it
        per_head = torch.einsum("chd,hd->hc", proj.weight.view(-1, nh, hs), z)  # (nh, C): W_O[:, h] @ z_h
        parts.update({f"L{l}H{h}": per_head[h] for h in range(nh)})
        if proj.bias is not None:
            parts[f"L{l} attn bias"] = proj.bias
        if ("mlp", l) in seen:
            parts[f"L{l} mlp"] = seen[("mlp", l)][0, p]
    return parts, seen["final"][0, p], seen["logits"][0, p]


def frozen_norm(norm, parts: torch.Tensor, full: torch.Tensor):
    """ln_f made linear: parts (n, C) each centred (LayerNorm) and divided by the scale of the full
    residual (C,) they sum to, times the weight; returns them, the norm's bias (None without) and the
    scale. Summed, the parts give ln_f(full) minus the bias."""
    if isinstance(norm, nn.LayerNorm):
        parts = parts - parts.mean(-1, keepdim=True)
        scale = torch.sqrt(full.var(unbiased=False) + norm.eps)
    elif isinstance(norm, nn.RMSNorm):
        eps = torch.finfo(full.dtype).eps if norm.eps is None else norm.eps
        scale = torch.sqrt(full.pow(2).mean() + eps)
    else:
        raise UserError(f"the final norm is {type(norm).__name__}: the attribution knows LayerNorm and RMSNorm")
    weight = 1.0 if norm.weight is None else norm.weight.double()
    bias = getattr(norm, "bias", None)
    return parts / scale * weight, None if bias is None else bias.double(), scale.item()


@torch.no_grad()
def attribute(model, idx, position: int, token: int) -> dict:
    """The direct logit attribution of `token` at `position` of idx (1, T): every part's share of its
    pre-soft-cap logit (float64), largest first by size; their sum; the logit from the model's own
    lm_head; and how far the parts' sum is from the final residual (0 when nothing was missed)."""
    parts, final, logits = residual_parts(model, idx, position)
    names = list(parts)
    stack = torch.stack([parts[n].double() for n in names])  # (n_parts, C)
    normed, bias, scale = frozen_norm(model.ln_f, stack, final.double())
    w_u = model.lm_head.weight[token].double()  # (C,): the token's unembedding row
    values = dict(zip(names, (normed @ w_u).tolist()))
    if bias is not None:
        values["ln_f bias"] = (bias @ w_u).item()
    total = math.fsum(values.values())
    return {"parts": sorted(values.items(), key=lambda kv: -abs(kv[1])), "sum": total,
            "logit": logits[token].item(), "scale": scale,
            "resid_error": (stack.sum(0) - final.double()).abs().max().item()}


# ----------------------------------------------------------------------------- activation patching

@dataclass
class Prompts:
    """What is patched and how it is scored: clean and corrupted token ids (B, T) of equal length;
    metric=loss scores the clean tokens' predictions from position `scored` on (scored..T-2 predict
    scored+1..T-1); logit_diff scores the last position, `answer` (B,) being the clean next token (None:
    the clean run's top token). `copy`: where a drawn prompt's second copy starts (None for typed ones)."""
    clean: torch.Tensor
    corrupted: torch.Tensor
    metric: str = "loss"
    scored: int = 0
    answer: Optional[torch.Tensor] = None
    copy: Optional[int] = None


class Patching:
    """Forward hooks that write the clean run's activations into another run: at each site (hook point
    name, index), the entries `index` of that hook point's output are replaced by the same entries of
    clean[name]. Used as a context manager, as Ablation is."""

    def __init__(self, model, clean: dict, sites):
        self.model, self.clean, self.sites, self.handles = model, clean, sites, []

    def __enter__(self):
        by_name = {}
        for name, index in self.sites:
            by_name.setdefault(name, []).append(index)
        for name, indices in by_name.items():
            def hook(module, args, out, name=name, indices=indices):
                out = out.clone()
                for index in indices:
                    out[index] = self.clean[name][index].to(out.dtype)
                return out
            self.handles.append(self.model.get_submodule(name).register_forward_hook(hook))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


def components(n_layer: int, n_head: int, T: int, patterned) -> list:
    """Every component patched: (kind, row, column, name, sites). kind `head`: row = layer, column = head,
    its hook_z; `resid`: row = layer (n_layer: after the last), column = position; `pattern`: the head's
    weights, for the layers in `patterned` only."""
    every = slice(None)  # hook_z (B, T, nh, hs), hook_resid_* (B, T, C), hook_pattern (B, nh, T, T)
    heads = [("head", l, h, f"L{l}H{h}", [(f"blocks.{l}.attn.hook_z", (every, every, h))])
             for l in range(n_layer) for h in range(n_head)]
    resid = [("resid", l, p, f"L{l} p{p}", [(f"blocks.{l}.hook_resid_pre" if l < n_layer else
                                             f"blocks.{n_layer - 1}.hook_resid_post", (every, p))])
             for l in range(n_layer + 1) for p in range(T)]
    pattern = [("pattern", l, h, f"L{l}H{h}", [(f"blocks.{l}.attn.hook_pattern", (every, h))])
               for l in patterned for h in range(n_head)]
    return heads + resid + pattern


def record(model, idx, names):
    """({name: output} read at the named hook points in one forward of idx, the logits); a name whose
    hook point did not run (a layer that never passes weights through hook_pattern) is absent."""
    seen = {}
    handles = [model.get_submodule(n).register_forward_hook(lambda m, a, out, n=n: seen.__setitem__(n, out.detach()))
               for n in names]
    try:
        logits = model(idx)
    finally:
        for h in handles:
            h.remove()
    return seen, logits


def score(logits, p: Prompts, answers) -> float:
    """The metric of one run, a mean over the prompts: the loss of the clean tokens from p.scored on, or
    the logit of answers[:, 0] minus that of answers[:, 1] at the last position."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if p.metric == "loss":
        return F.cross_entropy(logits[:, p.scored:-1].flatten(0, 1), p.clean[:, p.scored + 1:].flatten()).item()
    chosen = logits[:, -1].gather(-1, answers)  # (B, 2)
    return (chosen[:, 0] - chosen[:, 1]).mean().item()


def recovery(m: float, clean: float, corrupted: float) -> float:
    """How much of the way from the corrupted run's metric to the clean run's a patch goes."""
    return (m - corrupted) / (clean - corrupted)


@torch.no_grad()
def patch_all(model, p: Prompts) -> dict:
    """Patch every component (components) of the clean run into the corrupted one: the clean and
    corrupted metric, each component's recovery and metric, the grids and the layers without weights."""
    c, T = model.config, p.clean.size(1)
    names = [f"blocks.{l}.{h}" for l in range(c.n_layer) for h in ("attn.hook_z", "hook_resid_pre")]
    cache, clean_logits = record(model, p.clean, names + [f"blocks.{c.n_layer - 1}.hook_resid_post"])
    patterns, _ = record(model, p.clean, [f"blocks.{l}.attn.hook_pattern" for l in range(c.n_layer)])
    cache.update(patterns)  # separately: a hook on hook_pattern makes the layer attend by the written-out path
    patterned = [l for l in range(c.n_layer) if f"blocks.{l}.attn.hook_pattern" in patterns]
    corrupted_logits = model(p.corrupted)
    answers = None
    if p.metric == "logit_diff":  # the clean answer, and the corrupted run's top token other than it
        clean_answer = clean_logits[:, -1].argmax(-1) if p.answer is None else p.answer
        other = corrupted_logits[:, -1].scatter(-1, clean_answer[:, None], float("-inf")).argmax(-1)
        answers = torch.stack([clean_answer, other], dim=1)  # (B, 2)
    m_clean, m_corrupted = score(clean_logits, p, answers), score(corrupted_logits, p, answers)
    if abs(m_clean - m_corrupted) < 1e-6:
        raise UserError(f"the clean and corrupted prompts score the same ({p.metric} {m_clean:.6f}): there is nothing "
                        "to recover; corrupt what the model needs (or use the drawn prompts: unset clean, corrupted)")
    grids = {"head": [[None] * c.n_head for _ in range(c.n_layer)], "resid": [[None] * T for _ in range(c.n_layer + 1)],
             "pattern": [[None] * c.n_head for _ in range(c.n_layer)]}
    rows = []
    for kind, row, col, name, sites in components(c.n_layer, c.n_head, T, patterned):
        with Patching(model, cache, sites):
            m = score(model(p.corrupted), p, answers)
        grids[kind][row][col] = recovery(m, m_clean, m_corrupted)
        rows.append({"kind": kind, "component": name, "recovery": grids[kind][row][col], "metric": m})
    rows.sort(key=lambda r: -r["recovery"])
    kinds = layer_kinds(model)
    return {"metric": p.metric, "clean": m_clean, "corrupted": m_corrupted, "prompts": p.clean.size(0), "tokens": T,
            "copy": p.copy, "answers": None if answers is None else answers.tolist(), "grids": grids, "rows": rows,
            "no_pattern": [[l, kinds[l]] for l in range(c.n_layer) if l not in patterned]}


def drawn_prompts(ids, cfg, block: int, bos=None) -> Prompts:
    """n clean prompts [r, r] and corrupted [o, r] from spans r, o of ids drawn with cfg.seed (o never r);
    for logit_diff both lose their last token, which is the clean answer."""
    n, span = cfg.n, cfg.span
    offset = int(bos is not None)
    if offset + 2 * span > block:
        raise UserError(f"span={span}: the prompts are two copies, {offset + 2 * span} tokens, more than the model's "
                        f"block_size={block}: use span <= {(block - offset) // 2}")
    if ids.numel() < 2 * span:
        raise UserError(f"the text has {ids.numel()} tokens: too few for two spans of span={span} (give a longer "
                        "text= or a shorter span=)")
    g = torch.Generator().manual_seed(cfg.seed)
    starts = torch.randint(ids.numel() - span + 1, (n,), generator=g)
    r = torch.stack([ids[s:s + span] for s in starts.tolist()])
    o = torch.empty_like(r)
    for i in range(n):  # other text: a span of its own, never the same tokens
        for _ in range(100):
            s = int(torch.randint(ids.numel() - span + 1, (1,), generator=g))
            o[i] = ids[s:s + span]
            if not torch.equal(o[i], r[i]):
                break
        else:
            raise UserError(f"the text has no two different spans of {span} tokens: give a longer, varied text=")
    first = torch.full((n, offset), bos if bos is not None else 0, dtype=torch.long)
    clean, corrupted = torch.cat([first, r, r], 1), torch.cat([first, o, r], 1)
    if cfg.metric == "logit_diff":
        return Prompts(clean[:, :-1], corrupted[:, :-1], cfg.metric, answer=r[:, -1], copy=offset + span)
    return Prompts(clean, corrupted, cfg.metric, scored=offset + span, copy=offset + span)
