"""QK-Clip (`train.qk_clip=TAU`), the logit control of Kimi K2's MuonClip (Kimi Team 2025, arXiv 2507.20534):
after an optimizer step, each query head whose largest attention logit on that step's batch exceeds τ has
its W_q and W_k rows scaled so that every logit of that head shrinks by τ / S_max. The forward and the
backward are unchanged; only the weights are rescaled, between steps.

S_max of a head is the largest scale·q·k (after RoPE, before any soft-cap or bias) over the batch and every
(query, visible key) pair. It is measured here with the weights the step just wrote (one more forward of
the step's batch, without gradients), layer after layer, each layer run again once clipped so the next
one sees its new output; so after the clip every head's logits on the same batch are ≤ τ exactly, not
only approximately: q and k are linear in their rows of c_attn (RoPE rotates, it does not scale), so
scaling q's rows by a and k's by b scales each logit by a·b. (Kimi K2 clips with the logits of the step's
own forward, before the update, at no extra cost; this is the exact version, at one no-grad forward.)

Grouped-query attention: a key head is shared by the query heads of its group, so it takes the smallest
factor any of them needs, √(min γ), and each query head h its own γ_h / √(min γ): every head's logits
scale by exactly its γ_h = min(1, τ / S_max,h), and a head under τ in a group where another is clipped
keeps its logits (its q grows as its k shrinks). With QK-Norm the norm undoes any scaling of W_q and W_k
(the logit bound is the gain's), so the config check refuses the two together.
"""
import torch
import torch.distributed as dist

from attention import Mask, attention_scores, repeat_kv

CHUNK = 256  # queries scored at a time: a (B, nh, CHUNK, T) block of logits at most


def largest_logits(attn, q, k):
    """(n_head,) the largest scale·q·k each head gives a key its query sees, of q (B, T, nh, hs) and k (B, T,
    n_kv, hs) as the layer's hooks read them (after QK-Norm and RoPE), in float32, block by block."""
    q, k = q.transpose(1, 2).float(), repeat_kv(k.transpose(1, 2), q.size(2)).float()  # (B, nh, T, hs)
    T = q.size(2)
    best = torch.full((q.size(1),), float("-inf"), device=q.device)
    for q0 in range(0, T, CHUNK):
        q1 = min(q0 + CHUNK, T)
        s = attention_scores(q[:, :, q0:q1], k[:, :, :q1], scale=attn.scale,  # the queries q0..q1-1 of q1 positions
                             mask=Mask(q1 - q0, q1, attn.window))
        best = torch.maximum(best, s.amax(dim=(0, 2, 3)))
    if dist.is_available() and dist.is_initialized():  # DDP: the largest over every process's batch, so all clip alike
        dist.all_reduce(best, op=dist.ReduceOp.MAX)
    return best


def rescale_(attn, gamma):
    """Scale the logits of query head h by gamma[h] (<= 1) through c_attn's rows: a key head shared by a group
    of query heads takes the group's smallest √gamma, each query head gamma_h / that; V's rows stay."""
    nh, nkv, hs = attn.n_head, attn.n_kv_head, attn.head_dim
    group = gamma.view(nkv, nh // nkv)  # consecutive query heads share a key head (attention.repeat_kv)
    k_factor = group.min(dim=1).values.sqrt()  # (nkv,)
    q_factor = (group / k_factor[:, None]).reshape(nh)  # (nh,)
    rows = torch.cat([q_factor.repeat_interleave(hs), k_factor.repeat_interleave(hs),
                      torch.ones(nkv * hs, device=gamma.device)])  # [Q | K | V] rows of c_attn
    attn.c_attn.weight.mul_(rows.to(attn.c_attn.weight.dtype)[:, None])
    if attn.c_attn.bias is not None:
        attn.c_attn.bias.mul_(rows.to(attn.c_attn.bias.dtype))


@torch.no_grad()
def clip_(model, batches, tau: float) -> dict:
    """QK-Clip after a step: one forward of the step's batches (concatenated; in eval mode, so no dropout and
    no random draw) in which each softmax layer, once it has run, measures its heads' largest logits, rescales
    the rows of those above tau, and runs again with them, so the layers after it see what they will see from
    now on: every head's logits on this batch end <= tau, in every layer. Returns {"qk_clip/max_logit": the
    largest logit measured (before any clip), "qk_clip/heads": how many heads were clipped}, as tensors."""
    x = torch.cat(list(batches))
    seen, found = {}, {"max": [], "heads": 0}

    def measure(attn, args, kwargs, out):
        if seen.get("again"):
            return out
        s_max = largest_logits(attn, seen.pop("q"), seen.pop("k"))
        found["max"].append(s_max.max())
        over = s_max > tau
        if not bool(over.any()):
            return out
        found["heads"] += int(over.sum())
        rescale_(attn, torch.where(over, tau / s_max, torch.ones_like(s_max)))
        seen["again"] = True
        try:
            return attn(*args, **kwargs)  # this layer again, with its clipped rows
        finally:
            seen["again"] = False

    def read(name):
        return lambda module, args, out: None if seen.get("again") else seen.__setitem__(name, out)

    handles = []
    for block in model.blocks:
        attn = block.attn
        if attn.softmax and hasattr(attn, "c_attn"):
            handles += [attn.hook_q.register_forward_hook(read("q")), attn.hook_k.register_forward_hook(read("k")),
                        attn.register_forward_hook(measure, with_kwargs=True)]
    training = model.training
    model.eval()
    try:
        model(x)
    finally:
        model.train(training)
        for h in handles:
            h.remove()
    top = torch.stack(found["max"]).max() if found["max"] else torch.tensor(float("nan"))
    return {"qk_clip/max_logit": top, "qk_clip/heads": torch.tensor(float(found["heads"]))}
