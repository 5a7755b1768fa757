"""The guided tour: docs/tour.md and docs/tour.zh.md show the same steps, commands and figures; every
step's command, and every command of a "now change" paragraph that quotes figures, runs and prints the figures
its page quotes (the notebook test checks the steps it runs as the page writes them, the chains the rest);
notebooks/tour.ipynb and notebooks/tour.zh.ipynb are what scripts/make_notebooks.py makes from the pages, and the
notebook runs from top to bottom.

How a page is read (the pages say it to their readers too):
- A step is a `## ` section that holds the marker `<!-- tour:step -->`; its command is the one line of
  the first fenced block after the marker.
- Its figures are its bold code spans, **`...`**: text copied from what the command prints.
  Without brackets, the span's numbers occur in the output in the span's order (after an occurrence of
  the span's leading words, where it starts with words; the output may wrap between them, as
  tools/claims.py's columns do); a span without numbers occurs as written. A number followed by
  `[LO, HI]` is a training run's figure and the range the page states for it: right after the first
  occurrence of the span's leading words the output's next numbers are the span's, a ranged one within
  its range, the others as written (after a `…`, the first number that fits).
"""
import ast
import base64
import functools
import hashlib
import html as htmllib
import importlib.util
import json
import os
import posixpath
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers import REPO, cli_env

PAGES = {"en": REPO / "docs" / "tour.md", "zh": REPO / "docs" / "tour.zh.md"}
NOTEBOOKS = {"en": REPO / "notebooks" / "tour.ipynb", "zh": REPO / "notebooks" / "tour.zh.ipynb"}
MARKER = "<!-- tour:step -->"
FIGURE = re.compile(r"\*\*`([^`]+)`\*\*")
# a number as the tools print them: 5,120  0.533  -0.12  4e-16  0e+00; not the digits of a name (L1H3, d_k, x10)
NUMBER = re.compile(r"(?<![A-Za-z0-9_.^])[-+−]?\d+(?:,\d{3})*(?:\.\d+)?(?:e[-+]\d+)?")
RANGED = re.compile(r"\[\s*([-+−]?[\d.]+(?:e[-+]\d+)?)\s*,\s*([-+−]?[\d.]+(?:e[-+]\d+)?)\s*\]")  # [LO, HI]
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s#]+)(?:#[^)]*)?\)")
NO_WANDB = {"WANDB_MODE": "disabled"}  # for the commands the tests run: W&B's start costs seconds per run
STEP_TIMEOUT = 1200  # seconds; the page promises at most 3 minutes on two idle cores


@dataclass
class Step:
    title: str
    command: str
    figures: list  # the bold spans the step's command prints
    text: str
    changes: list = None  # [(command, figures)]: the commands of its "now change" paragraph, each with the bold
    # figures the paragraph quotes from what it prints


def steps_of(page: str) -> list:
    """The page's steps, in order."""
    sections = re.split(r"^## ", page, flags=re.M)[1:]
    found = []
    for section in sections:
        if MARKER not in section:
            continue
        after = section.split(MARKER, 1)[1]
        block = re.search(r"^```[\w-]*\n(.*?)^```", after, flags=re.M | re.S)
        assert block, f"step {section.splitlines()[0]!r}: no fenced block after the marker"
        lines = [l for l in block.group(1).splitlines() if l.strip()]
        assert len(lines) == 1, f"step {section.splitlines()[0]!r}: the command is one line, not {lines}"
        command = lines[0].strip()
        para = next((m.group() for rx in NOW_CHANGE.values() for m in [rx.search(section)] if m), "")
        figures = FIGURE.findall(section.replace(para, "")) if para else FIGURE.findall(section)
        found.append(Step(section.splitlines()[0].strip(), command, figures, section, change_commands(command, para)))
    return found


OWN = re.compile(r"(OMP_NUM_THREADS=1 )?python3? ")


def change_commands(command: str, para: str) -> list:
    """[(command, figures)] of a "now change" paragraph that quotes bold figures, in the paragraph's order: each
    command of its own (a code span starting with python), and, where settings (code spans holding an =) come
    before the first of those, the step's command with them added, each replacing the same key. A figure is
    what the command before it prints (the first command's, before any)."""
    groups, settings = [], []
    for m in re.finditer(r"\*\*`([^`]+)`\*\*|`([^`]+)`", para):
        figure, span = m.groups()
        if figure is not None:
            if not groups:  # the step's command with the settings before it, or the command quoted next
                groups.append([with_settings(command, settings) if settings else "", []])
            groups[-1][1].append(figure)
        elif OWN.match(span):
            if groups and not groups[-1][0]:  # the figures quoted before any command
                groups[-1][0] = span
            else:
                groups.append([span, []])
        elif "=" in span and not groups:
            settings.append(span)
    return [(c, f) for c, f in groups if f]


def with_settings(command: str, settings: list) -> str:
    key = lambda token: token.strip("\"'").split("=", 1)[0]  # noqa: E731
    return " ".join([t for t in command.split() if "=" not in t or key(t) not in {key(c) for c in settings}] + settings)


def number(text: str) -> float:
    return float(text.replace(",", "").replace("−", "-"))


def collapse(text: str) -> str:
    return " ".join(text.replace("−", "-").split())


def leading_words(span: str) -> str:
    """The span's text before its first number, without trailing punctuation."""
    first = NUMBER.search(span)
    return collapse(span[:first.start() if first else len(span)]).rstrip(" :=(≥≤≈~<>")


def figure_items(span: str) -> list:
    """[(number text, (lo, hi) or None, skip)] of the span; skip: a `…` stands before it."""
    ranges = list(RANGED.finditer(span))
    items, last = [], 0
    for m in NUMBER.finditer(span):
        if any(r.start() <= m.start() < r.end() for r in ranges):
            continue  # a range's own bounds are no figures of the output
        r = next((r for r in ranges if r.start() >= m.end() and not span[m.end():r.start()].strip()), None)
        items.append((m.group(), (number(r.group(1)), number(r.group(2))) if r else None, "…" in span[last:m.start()]))
        last = m.end()
    return items


def fits(text: str, rng, got: str) -> bool:
    return rng[0] <= number(got) <= rng[1] if rng else number(text) == number(got)


def check_figure(span: str, output: str) -> str:
    """'' if the output prints the figure as the page quotes it, else why not."""
    out = collapse(output)
    items = figure_items(span)
    label = leading_words(span.split("…")[0])
    if not items:
        return "" if collapse(span) in out else f"{span!r} is not in the output"
    if any(rng for _, rng, _ in items):
        at = out.find(label) if label else -1
        if at < 0:
            return f"{span!r}: the output has no {label!r}"
        printed = iter(m.group() for m in NUMBER.finditer(out, at + len(label)))
        for text, rng, skip in items:
            if rng is not None and not rng[0] <= number(text) <= rng[1]:
                return f"{span!r}: the page's own figure {text} is outside its range"
            # after a `…`, the first number that fits; else the very next one
            got = next((g for g in printed if fits(text, rng, g)), None) if skip else next(printed, None)
            if got is None or not fits(text, rng, got):
                where = f"[{rng[0]}, {rng[1]}]" if rng else text
                return f"{span!r}: printed {got} where the page says {where}"
        return ""
    starts = [m.end() for m in re.finditer(re.escape(label), out)] if label else [0]
    wanted = [number(t) for t, _, _ in items]
    for start in starts:
        printed = iter(number(m.group()) for m in NUMBER.finditer(out, start))
        if all(any(p == w for p in printed) for w in wanted):  # a subsequence, in order
            return ""
    return f"{span!r}: its numbers are not in the output in this order" + (f" after {label!r}" if label else "")


def runnable(command: str) -> str:
    """The page's command with its script named by absolute path, so it runs from another directory
    (what it writes under outputs/ then lands there, not in the checkout)."""
    command = re.sub(r"^((?:\w+=\S*\s+)*)python3?\s+(\S+\.py)",
                     lambda m: f"{m.group(1)}{sys.executable} {REPO / m.group(2)}", command)
    # a snippet: this Python too, importing the checkout's modules as it does from the repository root
    return re.sub(r"^python3? -c ", lambda m: f"PYTHONPATH={shlex.quote(str(REPO))} {sys.executable} -c ", command)


def chains(steps: list) -> list:
    """Groups of steps to run together, in order: a step that reads an outputs/tour/... path joins the
    group of the step that wrote it first."""
    groups, owner = [], {}
    for i, step in enumerate(steps):
        paths = re.findall(r"outputs/tour/[\w.-]+", step.command)
        joined = next((owner[p] for p in paths if p in owner), None)
        if joined is None:
            joined = len(groups)
            groups.append([])
        groups[joined].append(i)
        for p in paths:
            owner.setdefault(p, joined)
    return groups


def page(lang="en") -> str:
    return PAGES[lang].read_text(encoding="utf-8")


# ----------------------------------------------------------------------------- the checker itself

CLAIMS_LIKE = """C2     holds          Worked example: q = (1,0,1); k = (1,0,1),     raw 2 / 0 / 1; scaled 1.155 / 0.000 / 0.577; weights 0.533 /
                      (0,1,0), (1,0,0); v = 10, 0, 2. Raw scores    0.168 / 0.299; output 5.927; smallest weight 0.168 > 0 (holds
intact: val loss 2.0412, in-context gain 0.5234
L1H3                +0.0812   -0.4521       +0.0700   -0.4000
done: val loss 2.4448 (best 2.4448) after 100 steps
done: val loss 2.0100 (best 2.0100) after 100 steps
| model.attn.scale=none | 3 | 2.0188 ± 0.0317 | 1.9401 to 2.0975 | 2.9125 ± 0.0457 | 0.749 ± 0.073 | 0.755 ± 0.010 |
  (a) the projections   2*d*(d+d_kv)  N = d + d_kv              =     5,120 tokens
"""


@pytest.mark.parametrize("span", ["weights 0.533 / 0.168 / 0.299", "output 5.927", "5,120 tokens", "holds",
                                  "in-context gain 0.51 [0.40, 0.60]", "L1H3 +0.0812 -0.4521 [-0.6, -0.3]",
                                  "done: val loss 2.4448 [2.40, 2.50]",  # the first run's line
                                  "model.attn.scale=none | 3 | … | 0.749 [0.57, 0.93]"])
def test_a_figure_the_output_prints_passes(span):
    assert check_figure(span, CLAIMS_LIKE) == ""


@pytest.mark.parametrize("span", ["weights 0.533 / 0.168 / 0.298",  # one digit off
                                  "weights 0.168 / 0.533",  # out of order
                                  "output 5.93", "5,121 tokens", "does not hold",
                                  "in-context gain 0.51 [0.55, 0.60]",  # printed outside the range
                                  "in-context gain 0.51 [0.52, 0.60]",  # the page's own figure outside it
                                  "L1H3 +0.0813 -0.4521 [-0.6, -0.3]",  # the exact one off
                                  "attention 2.4448 [2.40, 2.50]",  # no such words
                                  "model.attn.scale=none | 4 | … | 0.749 [0.57, 0.93]",  # the exact one off
                                  "model.attn.scale=none | 3 | … | 0.749 [0.57, 0.70]",  # nothing after in range
                                  "model.attn.scale=none | 3 | 0.749 [0.57, 0.93]"])  # without `…`: the next number
def test_a_figure_the_output_does_not_print_fails(span):
    assert check_figure(span, CLAIMS_LIKE) != ""


def test_a_now_change_paragraphs_figures_belong_to_the_command_before_them():
    para = ("Now change it: add `train.lr=1e-2` and `hydra.run.dir=outputs/tour/b` (not `d_k`), and see "
            "**`done: val loss 2.1 [2.0, 2.2]`**. Then report, `python tools/report.py outputs/tour/b`: "
            "**`+0.29 [0.1, 0.4]`** and **`3 runs`**. Last, `python -c \"print(1)\"` alone.")
    step = "python train.py experiment=x train.lr=3e-3 hydra.run.dir=outputs/tour/a"
    assert change_commands(step, para) == [
        ("python train.py experiment=x train.lr=1e-2 hydra.run.dir=outputs/tour/b", ["done: val loss 2.1 [2.0, 2.2]"]),
        ("python tools/report.py outputs/tour/b", ["+0.29 [0.1, 0.4]", "3 runs"])]  # the snippet quotes none
    before = "It prints **`0.605`** when you run `python -c \"print(0.605)\"`."
    assert change_commands(step, before) == [('python -c "print(0.605)"', ["0.605"])]
    assert change_commands(step, "Now change the seed: add `seed=2` and look.") == []  # no figure: nothing to run


def test_numbers_are_read_as_the_tools_print_them_and_names_are_no_numbers():
    assert [m.group() for m in NUMBER.finditer("L1H3 x10 d_k 5,120 tokens 4e-16, 0e+00 −0.035 (1/51) 91.8%")] == [
        "5,120", "4e-16", "0e+00", "−0.035", "1", "51", "91.8"]
    assert figure_items("gain 0.51 [0.40, 0.60] and 3") == [("0.51", (0.40, 0.60), False), ("3", None, False)]
    assert figure_items("arm | 3 | … | 0.749 [0.57, 0.93]") == [("3", None, False), ("0.749", (0.57, 0.93), True)]


# ----------------------------------------------------------------------------- the pages (fast)

def test_both_pages_have_the_same_steps_commands_and_figures():
    en, zh = steps_of(page("en")), steps_of(page("zh"))
    assert len(en) >= 12 and len(en) == len(zh), (len(en), len(zh))
    for a, b in zip(en, zh):
        assert a.command == b.command and a.changes == b.changes, (a.title, b.title)
        assert a.figures == b.figures, (a.title, b.title, set(a.figures) ^ set(b.figures))


NOW_CHANGE = {"en": re.compile(r"^Now change\b.*?(?=\n\n|\Z)", re.M | re.S),
              "zh": re.compile(r"^现在(?:自己)?改一改.*?(?=\n\n|\Z)", re.M | re.S)}


def test_every_step_has_one_now_change_paragraph_with_the_same_commands_in_both_languages():
    """The learner changes something in every step; the Chinese page asks for the same change."""
    changes = {}
    for lang in PAGES:
        for step in steps_of(page(lang)):
            found = NOW_CHANGE[lang].findall(step.text)
            assert len(found) == 1, f"{lang} {step.title}: {len(found)} 'now change' paragraphs"
            changes.setdefault(lang, []).append(re.findall(r"`([^`]+)`", found[0]))
    assert changes["en"] == changes["zh"]


def test_the_pages_link_each_other_at_the_top_and_the_readme_links_both():
    assert "(tour.zh.md)" in "\n".join(page("en").splitlines()[:4])
    assert "(tour.md)" in "\n".join(page("zh").splitlines()[:4])
    head = "\n".join((REPO / "README.md").read_text(encoding="utf-8").splitlines()[:8])
    assert "(docs/tour.md)" in head and "(docs/tour.zh.md)" in head


@pytest.mark.parametrize("lang", PAGES)
def test_every_step_has_figures_and_names_a_claim_or_a_tool_and_every_picture_exists(lang):
    text = page(lang)
    for step in steps_of(text):
        assert step.figures, f"{step.title}: no figure quoted"
        assert re.search(r"claims\.md|tools/\w+\.py", step.text), f"{step.title}: names no claim"
        assert re.match(r"^(OMP_NUM_THREADS=1 )?python3? ", step.command), step.command
    for target in IMAGE.findall(text) + LINK.findall(text):
        if "://" not in target:
            assert (PAGES[lang].parent / target).exists(), f"{lang}: {target} does not exist"


def test_ranged_figures_come_only_from_training_steps():
    """A figure with a range belongs to a step that trains (train.py) or reads a trained run; counted and
    seeded figures are quoted exactly."""
    for step in steps_of(page()):
        for command, figures in [(step.command, step.figures), *step.changes]:
            ranged = [f for f in figures if any(r for _, r, _ in figure_items(f))]
            if ranged:
                assert re.search(r"train\.py|ckpt=|report\.py|--out", command), (step.title, ranged)


# ----------------------------------------------------------------------------- the notebooks (fast)

@functools.cache
def make_notebooks():
    """scripts/make_notebooks.py as a module (scripts/ is no package), loaded once: it builds the notebooks once."""
    spec = importlib.util.spec_from_file_location("make_notebooks", REPO / "scripts" / "make_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def notebook(lang="en") -> dict:
    return json.loads(NOTEBOOKS[lang].read_text(encoding="utf-8"))


def sources(nb: dict, kind: str) -> list:
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == kind]


def setup_definitions() -> str:
    """The imports, functions and NOT_FOR_THE_TOUR of the notebook's first code cell (what it calls to install),
    without the statements that find, clone and install."""
    tree = ast.parse(sources(notebook(), "code")[0])
    tree.body = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom, ast.FunctionDef))
                 or (isinstance(n, ast.Assign) and n.targets[0].id == "NOT_FOR_THE_TOUR")]
    return ast.unparse(tree)


def setup_functions() -> dict:
    scope = {}
    exec(compile(setup_definitions(), "setup cell", "exec"), scope)
    return scope


@pytest.mark.parametrize("lang", NOTEBOOKS)
def test_the_notebooks_are_what_the_script_makes_from_the_pages(lang):
    """An edited page (or tour_cells.py) without `python scripts/make_notebooks.py` fails here."""
    script = make_notebooks()
    made = script.comparable(script.text_of(script.notebooks()[lang]))
    assert script.comparable(NOTEBOOKS[lang].read_text(encoding="utf-8")) == made, \
        f"{NOTEBOOKS[lang].name} is stale: run python scripts/make_notebooks.py"


@pytest.mark.parametrize("lang", NOTEBOOKS)
def test_the_notebook_is_stored_without_outputs(lang):
    for cell in notebook(lang)["cells"]:
        if cell["cell_type"] == "code":
            assert cell.get("outputs") == [] and cell.get("execution_count") is None, "".join(cell["source"])[:80]


@pytest.mark.parametrize("lang", NOTEBOOKS)
def test_every_step_is_its_text_then_its_command_then_what_to_look_at(lang):
    """Each step's heading, its command run as the page writes it, its figures and its pictures (as seen from
    notebooks/, where they exist) are in the notebook, in the page's order."""
    nb, text = notebook(lang), page(lang)
    cells = ["".join(c["source"]) for c in nb["cells"]]
    markdown = "\n".join(sources(nb, "markdown"))
    at = 0
    for step in steps_of(text):
        heading = next(i for i, c in enumerate(cells) if c.startswith("## " + step.title))
        ran = next(i for i, c in enumerate(cells) if f"run({json.dumps(step.command, ensure_ascii=False)})" in c)
        assert at < heading < ran, (step.title, at, heading, ran)
        at = ran
        assert MARKER not in cells[heading] and "```\n" + step.command not in markdown
        for span in step.figures:
            assert f"**`{span}`**" in markdown, (step.title, span)
    pictures = {}  # attachment name -> (its PNG, where it came from), over every markdown cell
    for c in nb["cells"]:
        for name, origin in c.get("metadata", {}).get("pictures", {}).items():
            assert f"](attachment:{name})" in "".join(c["source"]), name
            pictures[name] = (base64.b64decode(c["attachments"][name]["image/png"]), origin)
    for target in IMAGE.findall(text):
        if "://" not in target:
            seen = posixpath.normpath(posixpath.join("../docs", target))
            png, origin = next(v for v in pictures.values() if v[1]["path"] == seen)
            assert png.startswith(b"\x89PNG") and (NOTEBOOKS[lang].parent / seen).is_file(), seen
            assert origin["sha256"] == hashlib.sha256((NOTEBOOKS[lang].parent / seen).read_bytes()).hexdigest(), \
                f"{seen} changed since the notebook was made: python scripts/make_notebooks.py"


def test_the_chinese_notebook_carries_the_chinese_page_and_the_same_code():
    en, zh = notebook("en"), notebook("zh")
    assert sources(en, "code") == sources(zh, "code")
    han = lambda s: len(re.findall(r"[\u4e00-\u9fff]", s))
    assert han("".join(sources(zh, "markdown"))) > 0.8 * han(page("zh"))
    assert han("".join(sources(en, "markdown"))) <= han(page("en")) + 3  # the page's own, and the link 中文版
    assert "(tour.zh.ipynb)" in sources(en, "markdown")[0] and "(tour.ipynb)" in sources(zh, "markdown")[0]


@pytest.mark.parametrize("lang", NOTEBOOKS)
def test_the_notebook_names_no_address_that_leads_nowhere_and_says_how_to_open_it(lang):
    """No badge or URL to a placeholder owner: opened from a clone it finds the checkout; elsewhere the first cell
    refuses, in one message, until REPO_URL names a copy to clone."""
    first, setup = sources(notebook(lang), "markdown")[0], sources(notebook(lang), "code")[0]
    assert "colab.research.google.com/github" not in first and "your-github-name" not in first + setup
    assert NOTEBOOKS[lang].relative_to(REPO).as_posix() in first  # how to open it from a clone
    assert re.search(r'^REPO_URL = ""', setup, re.M) and "if not REPO_URL:" in setup


def test_the_first_code_cell_finds_the_checkout_and_installs_only_elsewhere_with_this_kernels_python():
    setup = sources(notebook(), "code")[0]
    assert "attention.py" in setup  # how it recognises the repository
    assert re.search(r"^REPO = find_repo\(Path\.cwd\(\)\)", setup, re.M) and "if REPO is None:" in setup
    assert "os.environ" not in setup  # nothing to set in a checkout
    assert "sys.executable" in setup
    for code in sources(notebook(), "code"):
        assert not re.search(r"^\s*[!%]", code, re.M), code[:80]  # no shell escapes: the kernel's own Python


def test_the_install_keeps_a_recent_enough_torch_and_installs_what_the_tour_needs():
    f = setup_functions()
    requirements = (REPO / "requirements.txt").read_text(encoding="utf-8")
    lines = [l.split("#")[0].strip() for l in requirements.splitlines() if l.split("#")[0].strip()]
    torch_line = next(l for l in lines if f["requirement_name"](l) == "torch")
    floor = re.search(r"[\d.]+$", torch_line).group()
    assert {f["requirement_name"](l) for l in lines} >= f["NOT_FOR_THE_TOUR"]  # the list names real lines
    newer = ".".join(str(n + 1) if i == 1 else str(n) for i, n in enumerate(f["release"](floor)))
    for installed in (floor, floor + "+cu126", newer):  # Colab's CUDA build, or one newer than the floor
        plan, keep = f["install_plan"](requirements, installed)
        assert torch_line not in plan and not any(f["requirement_name"](l) == "torch" for l in plan), installed
        assert keep == f"torch=={installed}"  # the constraint that stops anything pulling another torch
    for installed in (None, "2.0.1", "1.13.1+cu117"):
        plan, keep = f["install_plan"](requirements, installed)
        assert torch_line in plan and keep is None, installed
    plan, _ = f["install_plan"](requirements, floor)
    assert set(plan) == {l for l in lines if f["requirement_name"](l) not in f["NOT_FOR_THE_TOUR"] | {"torch"}}
    assert f["release"]("2.13.0+cu126") == (2, 13, 0) and f["release"]("2.9") < f["release"]("2.13.0")
    # written out: what pip gets besides torch (the packages the tour's commands import), and names as pip reads them
    assert {f["requirement_name"](l) for l in plan} == {"hydra-core", "wandb", "datasets", "requests", "numpy",
                                                        "matplotlib", "scipy", "tqdm"}
    assert [f["requirement_name"](s) for s in ("torch==2.13.0", "Hydra_Core>=1.3", "pytest-xdist>=3.5", "numpy")] \
        == ["torch", "hydra-core", "pytest-xdist", "numpy"]


def test_fast_settings_shorten_only_the_training():
    """The second cell's `fast`: what TOUR_FAST=1 (the notebook test's setting) does to a command's words."""
    tree = ast.parse(sources(notebook(), "code")[1])
    tree.body = [n for n in tree.body if (isinstance(n, ast.FunctionDef) and n.name == "fast")
                 or (isinstance(n, ast.Assign) and n.targets[0].id == "FAST_ITERS")]
    scope = {"re": re}
    exec(compile(ast.unparse(tree), "settings cell", "exec"), scope)
    fast, few = scope["fast"], scope["FAST_ITERS"]
    assert fast("train.max_iters=1600") == f"train.max_iters={few}" and fast("train.max_iters=20") == "train.max_iters=20"
    assert fast("seed=1,2,3") == "seed=1,2" and fast("seed=1,2") == "seed=1,2" and fast("seed=3") == "seed=3"
    for word in ("train.lr_decay_iters=4000", "model.n_layer=2", "--only", "A2,A3,A4,A5", "outputs/tour/seeds"):
        assert fast(word) == word


@pytest.mark.parametrize("lang", NOTEBOOKS)
def test_the_html_copy_shows_the_outputs_of_the_pages_commands(lang):
    """docs/tour_notebook*.html (scripts/make_notebooks.py --html): executed, and running the commands its page
    shows now (a changed command needs a new execution; a changed sentence only a new rendering)."""
    path = REPO / make_notebooks().BOOKS[lang][2]
    html = path.read_text(encoding="utf-8")
    assert html.count("data:image/png") >= 8, f"{path.name}: not an executed notebook"
    assert path.stat().st_size < 2 ** 20, f"{path.name} is over 1 MiB: its pictures should be made smaller"
    shown = htmllib.unescape(re.sub(r"<[^>]+>", "", html))
    for step in steps_of(page(lang)):
        assert f"run({json.dumps(step.command, ensure_ascii=False)})" in shown, \
            f"{path.name} does not run {step.command!r}: python scripts/make_notebooks.py --html"


@pytest.mark.slow
def test_in_a_venv_that_already_holds_torch_the_install_downloads_no_torch(tmp_path):
    """As in Colab: torch is there before the notebook runs (the environment this suite runs in, whether the
    machine's Python or a virtual environment: its site-packages joined to the new venv's by a .pth file).
    The first cell's install() must neither download nor replace it."""
    import sysconfig

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    where = [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
    site = Path(subprocess.run(where, capture_output=True, text=True, check=True).stdout.strip())
    ours = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))  # this suite's packages
    (site / "suite.pth").write_text("".join(f"{p}\n" for p in ours))
    script = tmp_path / "install.py"
    script.write_text(setup_definitions() + f"\ninstall(Path({str(REPO)!r}), quiet=False)\n", encoding="utf-8")
    version = [str(python), "-c", "import torch; print(torch.__version__, torch.__file__)"]
    before = subprocess.run(version, capture_output=True, text=True, check=True).stdout
    r = subprocess.run([str(python), str(script)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    pulled = [l for l in r.stdout.splitlines() if re.match(r"\s*(Collecting|Downloading|Installing).*\btorch\b", l)]
    assert not pulled and "stays" in r.stdout, pulled or r.stdout[:500]
    assert subprocess.run(version, capture_output=True, text=True, check=True).stdout == before


# ----------------------------------------------------------------------------- running it (slow)

def as_written_in_the_notebook(command: str) -> bool:
    """Does the notebook test (at its FAST settings, which cut training short) run this command as the page writes
    it? Its own assertion checks this against what the notebook printed."""
    shortened = re.search(r"\btrain\.max_iters=|\bseed=\d+,", command)
    return not shortened and ("tools/claims.py" not in command or "--quick" in command.split())


STEPS = steps_of(page()) if PAGES["en"].is_file() else []
# the steps whose own command the notebook test runs as written and checks (each reads and writes nothing another
# step uses); the chains run every other command, and every "now change" command
IN_THE_NOTEBOOK = [i for group in chains(STEPS) if len(group) == 1 for i in group
                   if as_written_in_the_notebook(STEPS[i].command)]
CHAINS = [c for c in chains(STEPS) if any(i not in IN_THE_NOTEBOOK or STEPS[i].changes for i in c)]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("tour")


@pytest.mark.slow
@pytest.mark.parametrize("chain", CHAINS, ids=["step" + "+".join(str(i + 1) for i in c) for c in CHAINS])
def test_each_steps_command_runs_and_prints_the_figures_the_page_quotes(chain, workdir):
    """In a fresh directory (its outputs/ stays out of the checkout), every command of the chain in turn (but the
    steps the notebook test runs as written and checks), with W&B off (WANDB_MODE=disabled: it prints nothing the
    page quotes, and its offline runs are tested elsewhere)."""
    wrong = []
    cwd = workdir / f"chain{chain[0] + 1}"
    (cwd / "outputs" / "tour").mkdir(parents=True)  # as the steps before it leave it (the first step that writes there makes it)
    for i in chain:
        step = STEPS[i]
        if i not in IN_THE_NOTEBOOK:  # else the notebook test runs it and checks its figures
            r = subprocess.run(runnable(step.command), shell=True, cwd=cwd, capture_output=True, text=True,
                               timeout=STEP_TIMEOUT, env=cli_env(NO_WANDB))
            assert r.returncode == 0, f"step {i + 1} ({step.command}) failed:\n{r.stderr[-3000:]}"
            wrong += [f"step {i + 1}: {why}" for why in (check_figure(f, r.stdout + r.stderr) for f in step.figures)
                      if why]
        for command, figures in step.changes:  # its "now change" paragraph quotes what other commands print
            r = subprocess.run(runnable(command), shell=True, cwd=cwd, capture_output=True, text=True,
                               timeout=STEP_TIMEOUT, env=cli_env(NO_WANDB))
            assert r.returncode == 0, f"step {i + 1}'s change ({command}) failed:\n{r.stderr[-3000:]}"
            wrong += [f"step {i + 1}, now change: {why}" for why in
                      (check_figure(f, r.stdout + r.stderr) for f in figures) if why]
    assert not wrong, "\n".join(wrong)


@pytest.mark.slow
def test_the_notebook_runs_from_top_to_bottom(tmp_path):
    """Executed by a Jupyter kernel (nbclient) from notebooks/, as a reader opens it in a checkout (no setting
    needed), at small settings (TOUR_FAST=1), writing under tmp_path, with W&B off."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(NOTEBOOKS["en"], as_version=4)
    env = {"TOUR_FAST": "1", "TOUR_OUT": str(tmp_path / "out"), **NO_WANDB}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the kernel inherits the test's environment
    try:
        nbclient.NotebookClient(nb, timeout=900, kernel_name="python3",
                                resources={"metadata": {"path": str(NOTEBOOKS["en"].parent)}}).execute()
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    ran = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count for c in ran)
    wrong = []
    for i in IN_THE_NOTEBOOK:  # the steps it runs as the page writes them: their figures, as the chains check the rest
        step = STEPS[i]
        cell = next(c for c in ran if c.source.startswith(f"run({json.dumps(step.command, ensure_ascii=False)})"))
        printed = "".join(o.get("text", "") for o in cell.outputs)
        as_run = printed.splitlines()[0].replace(env["TOUR_OUT"], "outputs/tour")
        assert shlex.split(as_run) == ["$", *shlex.split(step.command)], (as_run, step.command)  # as written
        wrong += [f"step {i + 1}: {why}" for why in (check_figure(f, printed) for f in step.figures) if why]
    assert not wrong, "\n".join(wrong)
    printed = "".join(o.get("text", "") for o in ran[0].outputs)
    assert f"attnlab at {REPO}" in printed, printed  # found the checkout, cloned nothing
    images = sum(1 for c in ran for o in c.outputs if "image/png" in o.get("data", {}))
    assert images >= 8, f"the notebook showed {images} pictures"


COUNTED = re.compile(r"\d{1,3}(?:,\d{3})+|\d+\.\d+%|\d+ KiB")  # counted figures in prose: 7,488,640  53.4%  512 KiB


def cost_changes(step) -> list:
    """The tools/cost.py commands a step's 'now change' paragraph asks for: a command of its own (and, where the
    paragraph compares it with the same command "without" its last setting, that one too), or settings added
    one after another to the step's own cost.py command."""
    para = NOW_CHANGE["en"].findall(step.text)[0]
    spans = re.findall(r"`([^`]+)`", para)
    if spans[0].startswith("python tools/cost.py"):
        return [spans[0]] + ([spans[0].rsplit(" ", 1)[0]] if " without " in para else [])
    if step.command.startswith("python tools/cost.py"):
        return [step.command] + [" ".join([step.command, *spans[:i + 1]]) for i in range(len(spans))]
    return []


@pytest.mark.slow
@pytest.mark.parametrize("step", [s for s in STEPS if cost_changes(s)], ids=lambda s: s.title.split(".")[0])
def test_the_counted_figures_of_a_now_change_paragraph_are_what_its_commands_print(step, tmp_path):
    """'Now change ...' quotes what tools/cost.py prints after the change: every counted figure of the paragraph
    (7,488,640, 53.4%, 512 KiB) is in the output of one of its commands."""
    para = NOW_CHANGE["en"].findall(step.text)[0]
    printed = ""
    for command in cost_changes(step):
        command = re.sub(r"plot=\S+", "", command) + " plot=null"
        r = subprocess.run(runnable(command), shell=True, cwd=tmp_path, capture_output=True, text=True,
                           timeout=300, env=cli_env())
        assert r.returncode == 0, f"{command}: {r.stderr[-2000:]}"
        printed += r.stdout
    figures = COUNTED.findall(re.sub(r"`[^`]+`", "", para))
    assert figures, para
    for figure in figures:
        pattern = re.escape(figure).replace(r"\ KiB", r"(?:\.0+)? KiB")
        assert re.search(r"(?<![\d.,])" + pattern, printed), f"{step.title}: {figure} is not printed by {cost_changes(step)}"
