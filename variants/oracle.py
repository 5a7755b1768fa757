"""Oracle top-k, `model.attn.select=oracle` (`select_topk` k): each query reads the k keys that full
softmax attention weights most: the best any selector of k keys can do.

Fills the core's `select` slot (as variants/moba.py, whose SelectedMask it returns): the logits
q·kᵀ·scale over the keys the mask lets the query see, their top k (all of them when it sees fewer), and
attention over those keys only. Softmax is monotonic, so the largest logits are the largest weights. It
works on any checkpoint at evaluation (a trained model read through its k strongest keys) and trains.
Tests: tests/variants/test_moba.py (against a top-k written out; k covering every key is full attention).
"""
import torch

from attention import Mask, repeat_kv
from variants.moba import SelectedMask, Selection


class Oracle(Selection):
    """select(q, k, mask, q_pos, k_pos) -> SelectedMask, as variants.moba.MoBA."""

    def __init__(self, config):
        self.topk = config.attn.select_topk

    @staticmethod
    def reads_everything(a, length: int):
        """Why this selection reads every key of a `length`-token window, or None: select_topk keys each."""
        if a.select_topk >= length:
            return f"select_topk={a.select_topk} keys per query of at most {length}: every key; lower select_topk"
        return None

    @staticmethod
    def reads(a, i: int) -> int:
        """Keys causal query i reads: select_topk, or all i + 1 it sees."""
        return min(a.select_topk, i + 1)

    def __call__(self, q, k, mask: Mask, q_pos=None, k_pos=None) -> SelectedMask:
        visible = mask(q.device)
        logits = (q.float() @ repeat_kv(k, q.size(1)).float().transpose(-1, -2)).masked_fill(~visible, float("-inf"))
        top = logits.topk(min(self.topk, logits.size(-1)), dim=-1).indices
        chosen = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, top, True) & visible
        return SelectedMask(mask.Tq, mask.Tk, mask.window, mask.written, chosen=chosen)
