"""The needle probe of a data=mqar model: sequences in the task's layout whose one needle key is asked
a set distance after its pair, the model's accuracy at each distance with its Wilson interval, and the
reach of a stack of windows (how far back anything can still change an answer). tools/needle.py is the
command (its docstring explains the layout and the reach)."""
from typing import Optional

import numpy as np
import torch

from data.mqar import MQARTokenizer
from lab.intervals import wilson

# ----------------------------------------------------------------------------- the sequences


def needle_sequences(n: int, length: int, pairs: int, vocab_size: int, distance: int, seed: int):
    """n sequences of `length` tokens in mqar's layout whose needle key is asked `distance` positions
    after its pair's key: (x (n, length), q (n,) the query positions, answer (n,) the needle's values).
    The pairs fill positions 0..2*pairs-1 (keys even, values odd); the needle is pair i at p = 2i, asked
    at q = p + distance; the other keys are asked once each at other even positions from 2*pairs on,
    their values after them; fillers (0) elsewhere."""
    tok = MQARTokenizer(vocab_size)
    rng = np.random.default_rng([seed, distance])
    first, last = max(0, 2 * pairs - distance), min(2 * pairs - 2, length - 1 - distance)  # where p may be
    rows = np.arange(n)
    x = np.zeros((n, length + 1), dtype=np.int64)  # one past the end: a last query's value, cut off below
    keys = np.argsort(rng.random((n, tok.keys)), axis=1)[:, :pairs] + 1  # distinct keys per sequence
    values = rng.integers(tok.keys + 1, vocab_size, (n, pairs))
    x[:, 0:2 * pairs:2], x[:, 1:2 * pairs:2] = keys, values
    needle = rng.integers(-(-first // 2), last // 2 + 1, n)  # the needle's pair index: p = 2 * needle
    q = 2 * needle + distance
    x[rows, q], x[rows, q + 1] = keys[rows, needle], values[rows, needle]
    # the other keys, each asked once at a random free slot (2 * pairs + 2j), never the needle's
    slots = (length + 1 - 2 * pairs) // 2
    draw = rng.random((n, slots))
    draw[rows, (q - 2 * pairs) // 2] = np.inf  # the needle's own slot: drawn last, never taken
    where = 2 * pairs + 2 * np.argsort(draw, axis=1)[:, :pairs - 1]
    others = np.array([[i for i in range(pairs) if i != j] for j in needle], dtype=np.int64).reshape(n, pairs - 1)
    x[rows[:, None], where], x[rows[:, None], where + 1] = keys[rows[:, None], others], values[rows[:, None], others]
    return torch.from_numpy(x[:, :length]), torch.from_numpy(q), torch.from_numpy(values[rows, needle])


# ----------------------------------------------------------------------------- scoring

@torch.no_grad()
def predictions(model, x, q, batch_size: int = 64):
    """The argmax of the model's logits at each sequence's query position: (n,)."""
    device = next(model.parameters()).device
    out = []
    for xb, qb in zip(x.split(batch_size), q.split(batch_size)):
        logits = model(xb.to(device))  # (b, T, vocab)
        out.append(logits[torch.arange(len(qb)), qb.to(device)].argmax(-1).cpu())
    return torch.cat(out)


def reach(model) -> Optional[int]:
    """The farthest a token can be behind a query and still change its output: W - 1 per layer with
    a window of W, summed over the layers (each carries information at most that far). None when
    some layer has no such bound (no window, a global layer of a pattern, a recurrent kind)."""
    total = 0
    for i, block in enumerate(model.blocks):
        window = getattr(block.attn, "window", None)
        if not block.attn.softmax or window is None:  # a recurrent or linear layer carries any distance
            return None
        total += window - 1
    return total


def probe(model, distances, *, length: int, vocab_size: int, needles: int, pairs: int, seed: int,
          batch_size: int = 64, far: Optional[int] = None) -> list:
    """Per distance: {distance, right, n, accuracy, low, high (Wilson 95%), beyond}: the accuracy of
    `model` (ids -> logits) on `needles` sequences of `length` tokens; beyond: the value the needle
    asks for sits farther back than `far`, the model's reach (None: no bound)."""
    rows = []
    for d in distances:
        x, q, answer = needle_sequences(needles, length, pairs, vocab_size, d, seed)
        right = int((predictions(model, x, q, batch_size) == answer).sum())
        low, high = wilson(right, needles)
        rows.append({"distance": d, "right": right, "n": needles, "accuracy": right / needles, "low": low,
                     "high": high, "beyond": far is not None and d - 1 > far})
    return rows


def with_window(state: dict, window=None) -> dict:
    """The checkpoint read through a sliding window of `window` keys (None: its own)."""
    if window is None:
        return state
    mc = dict(state["model_config"])
    mc["attn"] = {**(mc.get("attn") or {}), "window": window}
    return {**state, "model_config": mc}
