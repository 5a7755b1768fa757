# The code of the tour's notebooks: one source for notebooks/tour.ipynb and notebooks/tour.zh.ipynb, which
# scripts/make_notebooks.py builds from this file and the pages docs/tour.md and docs/tour.zh.md. Edit the
# code here and the text in the pages, then run `python scripts/make_notebooks.py`.
#
# A cell starts at a line `# %% <where>`:
#   `# %% setup`          the cells before the first step, in this order;
#   `# %% step REGEX`     a cell of the step whose command (the page's one-line block) REGEX matches
#                         (re.search). In such a cell `run(PAGE_COMMAND)` becomes `run("<the page's command>")`;
#                         a step none of whose cells says PAGE_COMMAND gets a first cell `run("<command>")`,
#                         so every step runs the command its page shows, as the page shows it.
# This file is never imported or run as a whole: each cell runs in the notebook's kernel, after the ones above.
# flake8: noqa

# %% setup
# Setup. In a checkout of attnlab this cell only finds it (the notebook's folder or one above it). Anywhere
# else (Colab) it clones REPO_URL and installs what the tour needs: the torch already installed stays when it is
# at least the version requirements.txt names; only a missing or older torch is installed.
REPO_URL = ""  # outside a checkout only: the address of a copy of attnlab to clone (your fork's, say)

import importlib.metadata
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

# what the tour's commands never import (requirements.txt says what each line is for): the test tools, the
# Hugging Face export's packages, the BPE tokenizers and the URL loader (the tour's data is characters, on disk)
NOT_FOR_THE_TOUR = {"pytest", "pytest-xdist", "nbclient", "ipykernel", "transformers", "tokenizers", "safetensors",
                    "tiktoken", "rustbpe", "aiohttp"}


def find_repo(start):
    for p in (start, *start.parents):
        if (p / "attention.py").is_file() and (p / "tools" / "claims.py").is_file():
            return p
    return None


def release(version):
    """(2, 13, 0) for "2.13.0", "2.13.0+cu126" or "2.13"."""
    return tuple(int(x) for x in re.match(r"\d+(?:\.\d+)*", version).group().split("."))


def requirement_name(line):
    return re.match(r"[A-Za-z0-9_.\-]+", line).group().lower().replace("_", "-")


def install_plan(requirements, torch_version):
    """(the requirement lines pip installs, a constraint that keeps torch or None). `requirements` is the text
    of requirements.txt, `torch_version` the installed torch's version or None. torch's line is left out when
    the installed torch is at least the version that line names, and the constraint then pins the installed
    one, so that no other package can pull a different torch in (Colab's CUDA build stays)."""
    lines = [l.split("#")[0].strip() for l in requirements.splitlines()]
    lines = [l for l in lines if l and requirement_name(l) not in NOT_FOR_THE_TOUR]
    torch_line = next(l for l in lines if requirement_name(l) == "torch")
    floor = re.search(r"(?:==|>=|~=)\s*([\d.]+)", torch_line).group(1)
    keep = torch_version is not None and release(torch_version) >= release(floor)
    if keep:
        lines.remove(torch_line)
    return lines, (f"torch=={torch_version}" if keep else None)


def installed_torch():
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def install(repo, quiet=True):
    """pip install what the tour needs into this kernel's Python (never a `python` found on PATH)."""
    lines, constraint = install_plan((repo / "requirements.txt").read_text(encoding="utf-8"), installed_torch())
    print("torch", installed_torch() or "missing", "stays" if constraint else "is installed from requirements.txt")
    with tempfile.TemporaryDirectory() as tmp:
        extra = []
        if constraint:
            (Path(tmp) / "keep_torch.txt").write_text(constraint + "\n")
            extra = ["-c", str(Path(tmp) / "keep_torch.txt")]
        subprocess.run([sys.executable, "-m", "pip", "install", *(["-q"] if quiet else []), *lines, *extra], check=True)


REPO = find_repo(Path.cwd()) or find_repo(Path.cwd() / "attnlab")
if REPO is None:
    if not REPO_URL:
        raise RuntimeError("not inside a checkout of attnlab: open this notebook from a clone, or set REPO_URL at "
                           "the top of this cell to the address of a copy (your fork's) and run the cell again")
    subprocess.run(["git", "clone", "--depth", "1", REPO_URL, "attnlab"], check=True)
    REPO = Path("attnlab").resolve()
    install(REPO)
os.chdir(REPO)
sys.path.insert(0, str(REPO))
print("attnlab at", REPO)

# %% setup
# Settings, and three helpers: run a command of the page, show a PNG, show a matplotlib figure.
import io
import shlex
import time

import torch
from IPython.display import Image, display

# FAST: every training run stops at 60 steps and the claims' trained checks are skipped (the tests run the
# notebook so): on two CPU cores about 2 minutes instead of 4, but the trained figures are then not the page's.
FAST = os.environ.get("TOUR_FAST") == "1"  # or set it: FAST = True
FAST_ITERS = 60
OUT = Path(os.environ.get("TOUR_OUT") or f"outputs/tour-notebook/{time.strftime('%Y-%m-%d_%H-%M-%S')}")
OUT.mkdir(parents=True, exist_ok=True)
torch.set_num_threads(1)  # the models here are too small for a second thread to help (docs/tour.md)

from lab.plots import plt  # noqa: E402  (matplotlib, files only: figures are shown as PNGs below)


def fast(word):
    """A command word at the FAST settings."""
    if m := re.fullmatch(r"train\.max_iters=(\d+)", word):
        return f"train.max_iters={min(int(m.group(1)), FAST_ITERS)}"
    return "seed=1,2" if re.fullmatch(r"seed=\d+(,\d+){2,}", word) else word


def run(command, after=None, lines=None):
    """Run a command as the page writes it, from the repository root, with this kernel's Python; what the page
    writes under outputs/tour/ goes under OUT. Prints its output (from the first line holding `after`, and
    then `lines` lines, when given)."""
    words, env, assigned = shlex.split(command), dict(os.environ), []
    while "=" in words[0] and not words[0].startswith("python"):  # VAR=value before the command
        assigned.append(words.pop(0))
        key, value = assigned[-1].split("=", 1)
        env[key] = value
    assert words[0] in ("python", "python3"), command
    words = [sys.executable] + [w.replace("outputs/tour", str(OUT)) for w in words[1:]]
    if FAST:
        words = [fast(w) for w in words]
        if words[1] == "tools/claims.py" and "--quick" not in words:
            words.insert(2, "--quick")
    print("$", *assigned, "python", shlex.join(words[1:]), flush=True)
    p = subprocess.Popen(words, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    shown = 0 if after is None else None
    for line in p.stdout:
        if shown is None and after in line:
            shown = 0
        if shown is not None and (lines is None or shown < lines):
            print(line, end="", flush=True)
            shown += 1
    if p.wait():
        raise subprocess.CalledProcessError(p.returncode, command)


def show(path, width=900):
    display(Image(filename=str(path), width=width))


def show_fig(fig):
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    display(Image(data=buf.getvalue()))


print("outputs in", OUT, "| FAST" if FAST else "")

# %% step --only .*\bC1\b
# The same two curves for every distance k: a recurrence's γᵏ and uniform causal attention's 1/(k+1).
k = torch.arange(0, 51)
fig, ax = plt.subplots(figsize=(6, 3))
ax.semilogy(k, 0.9 ** k, label="recurrence, γ = 0.9: γᵏ")
ax.semilogy(k, 1 / (k + 1), label="uniform causal attention over k + 1 tokens: 1/(k+1)")
ax.set(xlabel="distance k (tokens)", ylabel="signal left")
ax.legend()
show_fig(fig)

# %% step --only .*\bC2\b
# C2's example through attention.py's own functions: scores, scale, softmax, weighted sum.
import attention as attn

q = torch.tensor([[1., 0., 1.]]).view(1, 1, 1, 3)  # (B, nh, T, hs): one query
k = torch.tensor([[1., 0., 1.], [0., 1., 0.], [1., 0., 0.]]).view(1, 1, 3, 3)  # three keys
v = torch.tensor([[10.], [0.], [2.]]).view(1, 1, 3, 1)  # their values
scale = attn.resolve_scale("sqrt_dk", 3)  # 1/√3
print("raw scores  ", attn.attention_scores(q, k, scale=1.0).flatten().tolist())
scores = attn.attention_scores(q, k, scale=scale)
weights = attn.softmax_with_sink(scores)
print("scaled      ", [round(x, 3) for x in scores.flatten().tolist()])
print("weights     ", [round(x, 3) for x in weights.flatten().tolist()])
print("output      ", attn.reference_attention(q, k, v, scale=scale).item())
fig, ax = plt.subplots(figsize=(4, 2.5))
ax.bar(["k1 (v=10)", "k2 (v=0)", "k3 (v=2)"], weights.flatten().tolist())
ax.set(ylabel="weight", title="softmax(q·k/√3)")
show_fig(fig)

# %% step --only .*\bC2\b
# Your turn: write causal attention yourself (predict first: with the mask, what does query 0 attend to, and what
# does each row of weights sum to?). The check compares it with attention.reference_attention and PyTorch's SDPA
# and names the usual mistake if yours differs (the scale, the mask, the softmax's axis).
from lab.attention_check import check_attention


def my_attention(q, k, v):  # q, k, v: (batch, heads, T, d); return softmax(q·kᵀ/√d + M)·v, M = -inf after each query
    raise NotImplementedError("write your attention here")


check_attention(my_attention)

# %% step --only .*\bA2\b
# Random q and k: without the scale the largest of six softmax weights goes to 1 as d_k grows.
import attention as attn

g = torch.Generator().manual_seed(0)
dks = [8, 32, 128, 512, 1024]
peak = {"no scale": [], "1/√d_k": []}
for dk in dks:
    qq = torch.randn(1, 1, 2048, dk, generator=g)
    kk = torch.randn(1, 1, 6, dk, generator=g)  # rows of 6 scores, as in the texts
    for name, s in (("no scale", 1.0), ("1/√d_k", attn.resolve_scale("sqrt_dk", dk))):
        peak[name].append(attn.softmax_with_sink(attn.attention_scores(qq, kk, scale=s)).amax(-1).mean().item())
fig, ax = plt.subplots(figsize=(5, 3))
for name, ys in peak.items():
    ax.semilogx(dks, ys, "o-", label=name)
ax.set(xlabel="d_k", ylabel="mean largest weight of 6", title="softmax saturates without the scale")
ax.legend()
show_fig(fig)

# %% step experiment=induction_cpu
run(PAGE_COMMAND)
show(OUT / "induction" / "attn_heads.png")
show(OUT / "induction" / "attention.png")

# %% step experiment=induction_cpu
# any text's maps, and each head's top keys for its last token (the page's example)
run("python tools/visualize.py ckpt=outputs/tour/induction prompt=\"'abcXYZabcXYZ'\" out=outputs/tour/maps top_k=3")
show(OUT / "maps" / "attention.png")

# %% step experiment=induction_cpu
# Sampling from this model prefills the prompt once, then decodes one token a step from its KV cache (the step
# on prefill, decode and the KV cache counts what that cache holds).
run("python sample.py ckpt=outputs/tour/induction prompt=\"'the cat sat. the cat '\" max_new_tokens=40 temperature=0.5")

# %% step tools/cost\.py model=llama3
run(PAGE_COMMAND)
show(OUT / "cost.png")

# %% step --only .*\bA10\b
# MoBA: how many keys a query reads when it chooses 2 blocks of 16
run("python tools/cost.py model=default seq_len=128 model.attn.select=moba model.attn.select_block=16 "
    "model.attn.select_topk=2 plot=null", after="select=moba", lines=7)

# %% step tools/ablate\.py
run(PAGE_COMMAND)
show(OUT / "ablate" / "ablate.png")

# %% step tools/report\.py
run(PAGE_COMMAND)
show(OUT / "seeds" / "val_loss_diff.png")
show(OUT / "seeds" / "attn_stats.png")
