"""Build the tour's notebooks from its pages: notebooks/tour.ipynb from docs/tour.md and notebooks/tour.zh.ipynb
from docs/tour.zh.md, with the code of notebooks/tour_cells.py (one source for both languages).

    python scripts/make_notebooks.py            # write both notebooks (stored without outputs)
    python scripts/make_notebooks.py --check    # exit 1 if a stored notebook differs from what the pages make
    python scripts/make_notebooks.py --html     # also execute the tour once and render both, with its
                                                # outputs, as docs/tour_notebook.html and docs/tour_notebook.zh.html
    python scripts/make_notebooks.py --html --fast   # the same at the notebook's FAST settings
    python scripts/make_notebooks.py --html --outputs outputs/tour-notebook/executed.ipynb
                                                # render again with the outputs of the last execution
                                                # (after a change of the pages' text, not of a command)

Each notebook opens with the page's title, the page's introduction and a note on running it (from a clone, or
anywhere else once REPO_URL in tour_cells.py's first cell names a copy to clone), then the setup cells. Every step of the page (a `## ` section holding `<!-- tour:step -->`) becomes:
a markdown cell with the section's text up to its command; the step's code cells (its command, run as the page
writes it, and the cells of tour_cells.py whose pattern matches that command); a markdown cell with the rest of
the section (its "Look at", its figures, its checks). A section without a step is one markdown cell. Links are
rewritten relative to notebooks/; pictures travel inside their cell (attachments, at most 800 pixels wide in 256
colours), since a notebook opened outside a checkout (Colab) has no files beside it.

--html executes the English notebook once with nbclient (its code is the Chinese one's too, so both HTML copies
show the same outputs) and renders with nbconvert, which is not in requirements.txt: `pip install nbconvert`.
"""
import argparse
import base64
import copy
import functools
import hashlib
import json
import os
import posixpath
import re
import sys
import time
from pathlib import Path

import nbformat

REPO = Path(__file__).resolve().parents[1]
CELLS = REPO / "notebooks" / "tour_cells.py"
BOOKS = {  # language: (page, notebook, HTML copy)
    "en": ("docs/tour.md", "notebooks/tour.ipynb", "docs/tour_notebook.html"),
    "zh": ("docs/tour.zh.md", "notebooks/tour.zh.ipynb", "docs/tour_notebook.zh.html"),
}
EXECUTED = REPO / "outputs" / "tour-notebook" / "executed.ipynb"  # the last --html execution, with its outputs
MARKER = "<!-- tour:step -->"
COMMAND_BLOCK = re.compile(r"^```[\w-]*\n(.*?)^```[ \t]*\n?", re.M | re.S)
TARGET = re.compile(r"(\]\()([^)\s]+)(\))")  # the target of a markdown link or picture
PICTURE = re.compile(r"(!\[[^\]]*\]\()([^)\s]+)(\))")  # a markdown picture
NOTE = {
    "en": "This notebook is made from [docs/tour.md]({page}) by `scripts/make_notebooks.py`: each step's text, "
          "then its command, run here as the page writes it, then what to look at. Run the cells in order. Open it "
          "from a clone of attnlab (`jupyter notebook notebooks/tour.ipynb`, or your editor's notebook view): the "
          "first cell then finds the repository and installs nothing. Opened anywhere else (uploaded to Colab, "
          "say), it needs the address of a copy to clone: set `REPO_URL` in the first cell to your fork's (or "
          "the repository you cloned from), and it clones that and installs what the tour needs, keeping an "
          "installed torch that is recent enough. `FAST = True` in the second cell (or "
          "`TOUR_FAST=1`) cuts every training run short: on two CPU cores the notebook then takes about 2 minutes "
          "instead of 4, but the trained figures are not the page's. A copy with its outputs: "
          "[docs/tour_notebook.html](../docs/tour_notebook.html). [中文版](tour.zh.ipynb)",
    "zh": "本笔记本由 `scripts/make_notebooks.py` 从 [docs/tour.zh.md]({page}) 生成：每一步先是正文，然后是那一步的命令"
          "（在这里照页面上写的原样运行），最后是该看什么。请按顺序运行各个单元。请在 attnlab 的克隆里打开它"
          "（`jupyter notebook notebooks/tour.zh.ipynb`，或编辑器自带的笔记本视图）：这时第一个单元会找到仓库，什么都不安装。"
          "在别处打开（比如上传到 Colab）时，它需要一个可以克隆的地址：把第一个单元里的 `REPO_URL` 设成你的 fork"
          "（或你克隆时用的仓库）的地址，它就会克隆那个仓库，并只安装导览需要的包，已经装好且版本够新的 torch 保持不动。"
          "在第二个单元里设 `FAST = True`"
          "（或设环境变量 `TOUR_FAST=1`）会把每次训练都截短：在双核 CPU 上整个笔记本大约 2 分钟跑完，而不是 4 分钟，"
          "但训练得来的数字就不再是页面上的了。带输出的副本：[docs/tour_notebook.zh.html](../docs/tour_notebook.zh.html)。"
          "[English](tour.ipynb)",
}


# ----------------------------------------------------------------------------- reading

def code_cells(text: str) -> list:
    """[(where, source)] of tour_cells.py: where is "setup" or a step's command pattern."""
    parts = re.split(r"^# %% (.*)\n", text, flags=re.M)
    cells = []
    for where, source in zip(parts[1::2], parts[2::2]):
        where = where.strip()
        pattern = "setup" if where == "setup" else re.fullmatch(r"step (.+)", where).group(1)
        cells.append((pattern, source.strip("\n")))
    return cells


def sections(page: str) -> tuple:
    """(the text before the first `## `, [the `## ` sections])."""
    parts = re.split(r"^(?=## )", page, flags=re.M)
    return parts[0], parts[1:]


def relink(markdown: str) -> str:
    """Links and pictures of a page in docs/, as seen from notebooks/."""
    def fix(m):
        target = m.group(2)
        if re.match(r"[a-z]+:|#|/", target):
            return m.group(0)
        path, _, anchor = target.partition("#")
        return m.group(1) + posixpath.normpath(posixpath.join("../docs", path)) + ("#" + anchor if anchor else "") + m.group(3)
    return TARGET.sub(fix, markdown)


def attach(cell):
    """A markdown cell of a page in docs/ whose pictures travel inside it: each becomes an attachment (the PNG made
    smaller), and its metadata says where it came from (the path from notebooks/, the source file's sha256)."""
    pictures = {}

    def fix(m):
        target = m.group(2)
        if re.match(r"[a-z]+:|#|/", target) or not (REPO / "docs" / target).is_file():
            return m.group(0)
        name = target.replace("/", "_")
        pictures[name] = REPO / "docs" / target
        return m.group(1) + "attachment:" + name + m.group(3)
    cell.source = relink(PICTURE.sub(fix, cell.source))
    if pictures:
        raw = {name: path.read_bytes() for name, path in pictures.items()}
        cell.attachments = {name: {"image/png": smaller_png(base64.b64encode(b).decode("ascii"), width=800)}
                            for name, b in raw.items()}
        cell.metadata["pictures"] = {name: {"path": posixpath.relpath(path.relative_to(REPO).as_posix(), "notebooks"),
                                            "sha256": hashlib.sha256(raw[name]).hexdigest()}
                                     for name, path in pictures.items()}
    return cell


def unattached(cell):
    """The cell with its pictures as links again (to the files they came from): for the HTML copy in docs/."""
    cell = copy.deepcopy(cell)
    for name, origin in cell.metadata.pop("pictures", {}).items():
        cell.source = cell.source.replace(f"](attachment:{name})", f"]({origin['path']})")
    cell.pop("attachments", None)
    return cell


def comparable(text: str) -> str:
    """A stored notebook's text without its pictures' bytes, which depend on Pillow's version: the pictures are
    held by their names and their source files' hashes (cell metadata) instead."""
    nb = json.loads(text)
    for cell in nb["cells"]:
        for data in cell.get("attachments", {}).values():
            data["image/png"] = ""
    return json.dumps(nb, ensure_ascii=False, indent=1)


# ----------------------------------------------------------------------------- building

def build(lang: str, page: str, cells: list) -> nbformat.NotebookNode:
    def md(text, own=""):  # a markdown cell of the page's text (`own`: the notebook's words before it, as they are)
        cell = attach(nbformat.v4.new_markdown_cell(text.strip("\n")))
        cell.source = own + cell.source
        return cell
    code = lambda source: nbformat.v4.new_code_cell(source)
    intro, parts = sections(page)
    title, _, rest = intro.partition("\n")
    rest = "\n".join(l for l in rest.splitlines() if not re.search(r"\]\((tour(\.zh)?\.md|\.\./notebooks/)", l))
    nb = nbformat.v4.new_notebook()
    nb.metadata = {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
                   "language_info": {"name": "python"}}
    note = NOTE[lang].format(page="../" + BOOKS[lang][0])
    nb.cells.append(md(rest, own=f"{title}\n\n{note}\n\n"))
    nb.cells += [code(source) for where, source in cells if where == "setup"]
    steps = [(where, source) for where, source in cells if where != "setup"]
    used = set()
    for section in parts:
        if MARKER not in section:
            nb.cells.append(md(section))
            continue
        before, after = section.split(MARKER, 1)
        block = COMMAND_BLOCK.search(after)
        command = block.group(1).strip()
        mine = [i for i, (pattern, _) in enumerate(steps) if re.search(pattern, command)]
        used.update(mine)
        sources = [steps[i][1].replace("run(PAGE_COMMAND)", f"run({json.dumps(command, ensure_ascii=False)})")
                   for i in mine]
        if not any(f"run({json.dumps(command, ensure_ascii=False)})" in s for s in sources):
            sources.insert(0, f"run({json.dumps(command, ensure_ascii=False)})")
        nb.cells.append(md(before))
        nb.cells += [code(s) for s in sources]
        if (rest := after[:block.start()] + after[block.end():]).strip():
            nb.cells.append(md(rest))
    lost = [steps[i][0] for i in range(len(steps)) if i not in used]
    if lost:
        raise SystemExit(f"{CELLS.relative_to(REPO)}: no step of {BOOKS[lang][0]} has a command matching {lost}")
    for i, cell in enumerate(nb.cells):  # ids that stay the same from one build to the next
        cell["id"] = f"{lang}-{i}"
    return nb


@functools.cache
def notebooks() -> dict:
    """{lang: the notebook its page and tour_cells.py make}."""
    cells = code_cells(CELLS.read_text(encoding="utf-8"))
    return {lang: build(lang, (REPO / page).read_text(encoding="utf-8"), cells) for lang, (page, _, _) in BOOKS.items()}


def text_of(nb) -> str:
    return nbformat.writes(nb) + "\n"


# ----------------------------------------------------------------------------- executing, rendering

def execute(nb, fast: bool):
    """Run the notebook from notebooks/ with nbclient, as a reader would."""
    import nbclient
    nb = copy.deepcopy(nb)
    if fast:
        os.environ["TOUR_FAST"] = "1"  # the kernel inherits this process's environment
    t0 = time.perf_counter()
    nbclient.NotebookClient(nb, timeout=3600, kernel_name="python3",
                            resources={"metadata": {"path": str(REPO / "notebooks")}}).execute()
    print(f"executed in {time.perf_counter() - t0:.0f} s{' (FAST)' if fast else ''}", file=sys.stderr)
    EXECUTED.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, EXECUTED)
    print(f"wrote {EXECUTED.relative_to(REPO)}", file=sys.stderr)
    return nb


def smaller_png(b64: str, width: int = 1000) -> str:
    """A picture for the HTML copies and the notebooks' attachments: at most `width` pixels wide, 256 colours (a
    committed copy stays under 1 MiB; the figures are plots, which lose nothing visible)."""
    import io

    from PIL import Image

    im = Image.open(io.BytesIO(base64.b64decode(b64)))
    if im.width > width:
        im = im.resize((width, round(im.height * width / im.width)), Image.LANCZOS)
    out = io.BytesIO()
    im.convert("RGB").quantize(colors=256).save(out, "PNG", optimize=True)
    return base64.b64encode(out.getvalue()).decode("ascii")


def render(executed, nb, path: Path):
    """nb (a language's notebook) with the outputs of `executed` (the same code cells), as HTML."""
    try:
        from nbconvert import HTMLExporter
    except ImportError:
        raise SystemExit("--html needs nbconvert (not in requirements.txt): pip install nbconvert")
    nb = copy.deepcopy(nb)
    nb.cells = [unattached(c) if c.cell_type == "markdown" else c for c in nb.cells]  # the HTML sits beside the pictures
    ran = [c for c in executed.cells if c.cell_type == "code"]
    mine = [c for c in nb.cells if c.cell_type == "code"]
    assert [c.source for c in ran] == [c.source for c in mine], "the languages' code cells differ"
    for c, r in zip(mine, ran):
        c.outputs, c.execution_count = [], r.execution_count
        for out in r.outputs:  # a command's lines arrive one by one: one block of text per stream
            last = c.outputs[-1] if c.outputs else None
            if last and out.output_type == last.output_type == "stream" and out.name == last.name:
                last.text += out.text
            else:
                c.outputs.append(copy.deepcopy(out))
                if "image/png" in c.outputs[-1].get("data", {}):
                    c.outputs[-1].data["image/png"] = smaller_png(c.outputs[-1].data["image/png"])
    html, _ = HTMLExporter().from_notebook_node(nb, resources={"metadata": {"name": path.stem}})
    # the commands print tables wider than the page: scroll them sideways rather than wrap their columns
    html = html.replace("</head>", "<style>.jp-RenderedText pre { white-space: pre; overflow-x: auto; }</style>\n</head>", 1)
    path.write_text(html, encoding="utf-8")
    print(f"wrote {path.relative_to(REPO)} ({path.stat().st_size / 1e6:.1f} MB)", file=sys.stderr)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a notebook is stale")
    parser.add_argument("--html", action="store_true", help="also execute the tour and render the HTML copies")
    parser.add_argument("--fast", action="store_true", help="with --html: execute at the FAST settings")
    parser.add_argument("--outputs", type=Path, metavar="IPYNB",
                        help="with --html: take the outputs of this executed notebook instead of executing")
    args = parser.parse_args()
    if args.outputs is not None:  # before anything is written: a missing or unreadable notebook is one line
        try:
            if args.outputs.suffix != ".ipynb":
                raise ValueError("not an .ipynb file")
            nbformat.read(args.outputs, as_version=4)
        except (OSError, ValueError, nbformat.reader.NotJSONError) as e:
            raise SystemExit(f"error: --outputs {args.outputs}: not a readable notebook ({type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''}); give an executed .ipynb")
        if not args.html:
            raise SystemExit("error: --outputs takes effect with --html only: add --html")
    books = notebooks()
    stale = []
    for lang, nb in books.items():
        path = REPO / BOOKS[lang][1]
        if not path.is_file() or comparable(path.read_text(encoding="utf-8")) != comparable(text_of(nb)):
            stale.append(BOOKS[lang][1])
            if not args.check:
                path.write_text(text_of(nb), encoding="utf-8")
    if args.check:
        if stale:
            raise SystemExit(f"stale: {', '.join(stale)} (run python scripts/make_notebooks.py)")
        return
    print("wrote" if stale else "unchanged:", ", ".join(stale) or ", ".join(b[1] for b in BOOKS.values()))
    if args.html:
        executed = nbformat.read(args.outputs, as_version=4) if args.outputs else execute(books["en"], args.fast)
        for lang, nb in books.items():
            render(executed, nb, REPO / BOOKS[lang][2])


if __name__ == "__main__":
    main()
