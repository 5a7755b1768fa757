"""The tour's checker of a learner's attention (lab/attention_check.py): a right answer written three ways
passes; each usual mistake, written out here independently of the checker's own list, gets its line."""
import math

import pytest
import torch
import torch.nn.functional as F

from lab.attention_check import check_attention


def by_hand(q, k, v):  # the exercise's answer, as a learner writes it
    d = q.size(-1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(d)
    T = scores.size(-1)
    scores = scores.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def with_einsum(q, k, v):
    s = torch.einsum("bhid,bhjd->bhij", q, k) * q.size(-1) ** -0.5
    s = s + torch.full(s.shape[-2:], float("-inf")).triu(1)
    return torch.einsum("bhij,bhjd->bhid", s.softmax(-1), v)


def with_sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize("fn", [by_hand, with_einsum, with_sdpa])
def test_right_answers_pass(fn, capsys):
    assert check_attention(fn, seed=1)
    assert capsys.readouterr().out.startswith("correct")


def future(T):
    return torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)


WRONG = {
    "the scale is missing": lambda q, k, v: torch.softmax(
        (q @ k.mT).masked_fill(future(q.size(-2)), float("-inf")), -1) @ v,
    "divided by d_k": lambda q, k, v: torch.softmax(
        (q @ k.mT / q.size(-1)).masked_fill(future(q.size(-2)), float("-inf")), -1) @ v,
    "no mask": lambda q, k, v: torch.softmax(q @ k.mT / math.sqrt(q.size(-1)), -1) @ v,
    "after the softmax": lambda q, k, v: (torch.softmax(q @ k.mT / math.sqrt(q.size(-1)), -1)
                                          * ~future(q.size(-2))) @ v,
    "hides the past": lambda q, k, v: torch.softmax(
        (q @ k.mT / math.sqrt(q.size(-1))).masked_fill(future(q.size(-2)).mT, float("-inf")), -1) @ v,
    "over the queries": lambda q, k, v: torch.softmax(
        (q @ k.mT / math.sqrt(q.size(-1))).masked_fill(future(q.size(-2)), float("-inf")), -2) @ v,
    "k·qᵀ": lambda q, k, v: torch.softmax(
        (k @ q.mT / math.sqrt(q.size(-1))).masked_fill(future(q.size(-2)), float("-inf")), -1) @ v,
    "returned the weights": lambda q, k, v: torch.softmax(
        (q @ k.mT / math.sqrt(q.size(-1))).masked_fill(future(q.size(-2)), float("-inf")), -1),
    "NaN or inf": lambda q, k, v: torch.softmax(q @ k.mT / math.sqrt(q.size(-1)), -1).masked_fill(
        future(q.size(-2)), float("-inf")) @ v,
    "raised ZeroDivisionError": lambda q, k, v: 1 / 0,
    "has shape": lambda q, k, v: v[..., :1],
    "largest difference": lambda q, k, v: by_hand(q, k, v) + 0.1,
}


@pytest.mark.parametrize("needle", list(WRONG))
def test_each_usual_mistake_is_named_in_one_line(needle, capsys):
    assert not check_attention(WRONG[needle], seed=2)
    out = capsys.readouterr().out
    assert needle in out and out.count("\n") == 1


def test_the_exercise_file_as_shipped_says_what_to_do(capsys):
    """notebooks/my_attention.py before the learner writes anything: the check fails with the stub's line."""
    import importlib.util

    from helpers import REPO
    spec = importlib.util.spec_from_file_location("my_attention", REPO / "notebooks" / "my_attention.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert not check_attention(module.my_attention)
    assert "raised NotImplementedError: write your attention here" in capsys.readouterr().out
