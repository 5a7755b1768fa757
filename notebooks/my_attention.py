"""The tour's exercise: write causal self-attention yourself, then check it.

    python notebooks/my_attention.py

Fill in my_attention below: q, k, v are (batch, heads, T, d); return softmax(q·kᵀ/√d + M)·v, where M is
-inf at the keys after each query (key j > query i) and 0 elsewhere. The check runs it on random inputs and
compares it with attnlab's reference_attention and PyTorch's SDPA; when they differ it says which usual
mistake your output matches (the scale, the mask, the softmax's axis, ...). Predict before you run:
what does a row of the weights sum to, and what does row 0 attend to?
"""
import sys
from pathlib import Path

import torch  # noqa: F401  (you will need it)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere: the repo's modules
from lab.attention_check import check_attention  # noqa: E402


def my_attention(q, k, v):
    raise NotImplementedError("write your attention here: scores, scale, mask, softmax, then the weighted sum of v")


if __name__ == "__main__":
    sys.exit(0 if check_attention(my_attention) else 1)
