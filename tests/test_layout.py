"""The floors, held: the model at the root imports nothing of the lab, the lab imports no entry point
or command, no command imports another, the data package imports nothing above it, no import circle,
and at most ten .py files at the root. Imports are read from the source (inside functions too), so a
late import cannot hide a floor crossed. Each rule is also shown failing on a planted import."""
import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOT_LIMIT = 10
CORE = {"model.py", "attention.py", "mixer.py", "kv_cache.py", "rules.py", "files.py"}  # and variants/
ENTRY = {"train.py", "sample.py"}


def room(path: str) -> str:
    """Which floor a repo file (relative path) is on."""
    top = path.split("/", 1)[0]
    if path in CORE or top == "variants":
        return "core"
    if path in ENTRY:
        return "entry"
    return {"lab": "lab", "data": "data", "tools": "tools", "claims": "claims", "scripts": "scripts",
            "notebooks": "notebooks"}.get(top, "other")


def module_file(name: str):
    """The repo file a dotted module name is, or None (a library outside the repo)."""
    path = REPO.joinpath(*name.split("."))
    for f in (path.with_suffix(".py"), path / "__init__.py"):
        if f.is_file():
            return f.relative_to(REPO).as_posix()
    return None


def imports_of(path: str) -> set:
    """The repo files one file imports, at any depth of its code."""
    tree = ast.parse((REPO / path).read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]  # a submodule imported by name
        else:
            continue
        for name in names:
            f = module_file(name)
            if f and f != path:
                found.add(f)
    return found


def source_files() -> list:
    skip = ("tests/", "tools/export_code/", "docs/")  # export_code runs inside an exported model's directory
    return sorted(p.relative_to(REPO).as_posix() for p in REPO.rglob("*.py")
                  if not p.relative_to(REPO).as_posix().startswith(skip) and ".git" not in p.parts)


def graph() -> dict:
    return {f: imports_of(f) for f in source_files()}


# what each floor may not import (by the imported file's floor)
FORBIDDEN = {"core": {"lab", "data", "entry", "tools", "claims", "scripts", "notebooks"},
             "data": {"lab", "entry", "tools", "claims", "scripts", "notebooks"},
             "lab": {"entry", "tools", "claims", "scripts", "notebooks"}}


def crossings(g: dict) -> list:
    """Every import that crosses a floor the wrong way: (importer, imported)."""
    bad = [(a, b) for a, bs in g.items() for b in bs if room(b) in FORBIDDEN.get(room(a), ())]
    bad += [(a, b) for a, bs in g.items() for b in bs if room(a) == room(b) == "tools"]  # no command imports another
    return sorted(bad)


def circles(g: dict) -> list:
    """The import circles of g, each as the list of files on it (Tarjan's strongly connected components)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    for v in list(g):
        if v not in index:
            visit(v)
    return out


@pytest.fixture(scope="module")
def imports():
    return graph()


def test_at_most_ten_python_files_at_the_root():
    root = sorted(p.name for p in REPO.glob("*.py"))
    assert len(root) <= ROOT_LIMIT, root
    assert CORE | ENTRY <= set(root)


def test_no_import_crosses_a_floor_the_wrong_way(imports):
    assert crossings(imports) == []


def test_no_import_circle(imports):
    assert circles(imports) == []


def test_the_rules_fail_on_a_planted_model_to_lab_import_and_a_planted_circle(imports):
    planted = {f: set(bs) for f, bs in imports.items()}
    planted["model.py"].add("lab/config.py")
    assert ("model.py", "lab/config.py") in crossings(planted)
    planted = {f: set(bs) for f, bs in imports.items()}
    assert "lab/config.py" in planted["lab/sweep.py"]
    planted["lab/config.py"].add("lab/sweep.py")
    assert ["lab/config.py", "lab/sweep.py"] in circles(planted)
    planted = {f: set(bs) for f, bs in imports.items()}
    planted["tools/report.py"].add("tools/recall.py")  # one command importing another
    planted["lab/arms.py"].add("train.py")  # the lab importing an entry point
    assert {("tools/report.py", "tools/recall.py"), ("lab/arms.py", "train.py")} <= set(crossings(planted))


def test_the_graph_is_read_from_the_source_late_imports_included(imports):
    """A known import inside a function is seen, so the rules above are not vacuous."""
    assert "lab/config.py" in imports["train.py"] and "model.py" in imports["lab/config.py"]
    assert "data/mqar.py" in imports["data/tokenizer.py"]  # imported inside a function there


def test_the_run_helpers_import_nothing_of_the_run_they_serve(imports):
    """device, parallel and cli are what every entry point needs: they import no config, model or run."""
    for low in ("lab/device.py", "lab/parallel.py", "lab/cli.py"):
        assert not imports[low] - {"rules.py", "files.py", "lab/device.py", "lab/parallel.py"}, (low, imports[low])


def test_a_default_forward_and_decode_step_stay_in_the_four_core_files():
    """Every Python frame of the repo that a default model's forward (training, with the loss) and a cached
    decode step run is in model.py, attention.py, mixer.py or kv_cache.py: no variant on the default path."""
    import sys

    import torch

    from model import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=40, block_size=16, n_layer=2, n_head=4, n_embd=32))
    idx = torch.randint(0, 40, (2, 16))
    cache = model.new_kv_cache(2, 16)
    seen = set()

    def profile(frame, event, arg):
        if event == "call":
            f = Path(frame.f_code.co_filename).resolve()
            if f.is_file() and REPO in f.parents and "tests" not in f.relative_to(REPO).parts:
                seen.add(f.relative_to(REPO).as_posix())
    sys.setprofile(profile)
    try:
        model(idx, idx)
        with torch.no_grad():
            model(idx[:, :8], cache=cache, pos=0)
            model(idx[:, 8:9], cache=cache, pos=8)
    finally:
        sys.setprofile(None)
    assert seen and seen <= {"model.py", "attention.py", "mixer.py", "kv_cache.py"}, sorted(seen)
    assert {"model.py", "attention.py", "kv_cache.py"} <= seen  # the trace is not empty of the core itself
