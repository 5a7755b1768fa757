"""Every command README.md and docs/*.md show still works as written, checked in-process without
running it: a Hydra command's overrides compose (each point of a sweep), an argparse tool's
arguments parse with the tool's own parser, and every script a command names exists.

A command is a line of a shell code block, or an inline code span, that starts with `python`,
`python3`, `torchrun`, `bash tools/` or `bash scripts/` (after any VAR=value assignments); prose never is.
Placeholders are fine where composing does not read files (DIR, input.txt, outputs/runs/<time>,
a `...` or `[overrides]` standing for more arguments)."""
import argparse
import importlib
import importlib.util
import itertools
import re
import shlex
import subprocess
import sys

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import OmegaConf

from helpers import REPO, compose_cfg

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL_FENCES = {"", "sh", "bash", "shell", "console", "text"}  # code blocks in another language hold no commands
COMMAND = re.compile(r"^(?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)*((?:python3?|torchrun)(?:\s|$)|bash\s+(?:tools|scripts)/)")
FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)")
SPAN = re.compile(r"(?<!`)`([^`]+)`(?!`)")
SHELL_OPERATORS = {">", ">>", "2>", "2>&1", "|", "||", "&&", ";", "&", "<"}
PLACEHOLDERS = re.compile(r"^(\.\.\.|…|\[[\w .-]+\])$")  # `...`, `[overrides]`: more arguments
PLACEHOLDER_VALUE = re.compile(r"^[A-Z][A-Z0-9_]*$")  # model.n_kv_head=K, resume=RUN_DIR: any value of the key
ANGLE_PLACEHOLDER = re.compile(r"<([\w.-]+)>")  # outputs/runs/<time>
ARGPARSE_TOOLS = {"tools/report.py", "tools/recall.py", "scripts/ladder_table.py", "tools/claims.py",
                  "scripts/stability_page.py", "scripts/practice_page.py", "scripts/bench_controls.py"}
NO_ARGUMENTS = {"notebooks/my_attention.py"}  # run as written (tests/test_attention_check.py runs it)
HYDRA_SWITCHES = {"-m", "--multirun", "--help", "-h", "--hydra-help", "--resolve"}
HYDRA_OPTIONS = {"--cfg", "-c", "--package", "-p"}  # each followed by its value
HYDRA_INFO = {"all", "config", "defaults", "defaults-tree", "plugins", "searchpath"}  # --info's optional value


# ----------------------------------------------------------------------------- finding the commands

def without_comment(line: str) -> str:
    """The line up to a shell comment: an unquoted # at the start of a word."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def commands(text: str) -> list:
    """(line number, command) of every command a markdown text shows, in order."""
    found, prose = [], []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            prose.append(lines[i])
            i += 1
            continue
        marker, lang = fence.group(1), fence.group(2).lower()
        close = re.compile(rf"^\s*{re.escape(marker[0])}{{{len(marker)},}}\s*$")
        start, i = i, i + 1
        body = []
        while i < len(lines) and not close.match(lines[i]):
            body.append(lines[i])
            i += 1
        i += 1  # the closing fence
        prose.extend([""] * (i - start))  # keeps prose line numbers; a blank line ends a paragraph
        if lang not in SHELL_FENCES:
            continue
        j = 0
        while j < len(body):
            first, line = j, without_comment(body[j])
            while line.rstrip().endswith("\\") and j + 1 < len(body):  # continuation lines
                j += 1
                line = line.rstrip()[:-1].rstrip() + " " + without_comment(body[j]).strip()
            j += 1
            line = line.strip().removeprefix("$ ")
            if COMMAND.match(line):
                found.append((start + 2 + first, line))
    text = "\n".join(prose)
    for para in re.finditer(r"(?:[^\n]+\n?)+", text):  # code spans never cross a paragraph
        for span in SPAN.finditer(para.group()):
            code = " ".join(span.group(1).split("\n")).strip()
            if COMMAND.match(code):
                found.append((text.count("\n", 0, para.start() + span.start()) + 1, code))
    return sorted(found)


def words(command: str) -> list:
    """The command's words as the shell splits them, environment assignments and redirections left out."""
    out = []
    for word in shlex.split(ANGLE_PLACEHOLDER.sub(r"\1", without_comment(command))):
        if word in SHELL_OPERATORS:
            break
        if out or not re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", word):
            out.append(word)
    return out


def split(command: str):
    """(program, script, args): program python, torchrun or bash; script relative to the repo (for
    `python -m X`: "-m X")."""
    w = words(command)
    program = "python" if w[0] in ("python", "python3") else w[0]
    rest = w[1:]
    if program == "torchrun":  # its own options come first, then the script
        at = next(i for i, x in enumerate(rest) if x.endswith(".py"))
        return program, rest[at], rest[at + 1:]
    if program == "python" and rest[:1] == ["-m"]:
        return program, f"-m {rest[1]}", rest[2:]
    return program, rest[0], rest[1:]


def all_commands():
    return [pytest.param(command, id=f"{doc.relative_to(REPO)}:{line}")
            for doc in DOCS for line, command in commands(doc.read_text(encoding="utf-8"))]


# ----------------------------------------------------------------------------- checking one

def hydra_overrides(args: list):
    """(config name override or None, overrides) of a Hydra command line, flags left out."""
    overrides, config_name, i = [], None, 0
    while i < len(args):
        a = args[i]
        if a in HYDRA_SWITCHES:
            pass
        elif a in HYDRA_OPTIONS:
            i += 1
        elif a in ("--info", "-i"):
            i += 1 if i + 1 < len(args) and args[i + 1] in HYDRA_INFO else 0
        elif a in ("--config-name", "-cn"):
            config_name, i = args[i + 1], i + 1
        elif a.startswith("-") and "=" not in a:
            raise AssertionError(f"{a}: a flag test_docs.py does not know (add it to HYDRA_SWITCHES or HYDRA_OPTIONS)")
        elif not PLACEHOLDERS.match(a):
            overrides.append(a)
        i += 1
    return config_name, overrides


def sweep_points(overrides: list) -> list:
    """Each point of the sweep the overrides describe (one point without a sweep), as override lists.
    Parsed by Hydra's own parser, so a quoted comma (prompt="'a, b'") is no sweep."""
    choices = []
    for o in OverridesParser.create().parse_overrides(overrides):
        if o.is_sweep_override():
            key = o.get_key_element()
            choices.append([f"{key}={value}" for value in o.sweep_string_iterator()])
        else:
            choices.append([o.input_line])
    return [list(point) for point in itertools.product(*choices)]


def hydra_config_name(script: str):
    """The config_name of the script's @hydra.main, or None for a script that is no Hydra app."""
    found = re.search(r"@hydra\.main\(.*config_name=\"([\w-]+)\"", (REPO / script).read_text())
    return found and found.group(1)


def module_of(script: str) -> str:
    return script.removesuffix(".py").replace("/", ".")


def compose_point(config_name: str, point: list):
    """Compose one point. A placeholder value its key cannot take (model.n_kv_head=K) is checked for
    its key alone; a launcher whose plugin is not installed (submitit for SLURM) for its config file
    alone."""
    try:
        return compose_cfg(config_name, point)
    except MissingConfigException as e:
        launcher = [o for o in point if o.startswith(("hydra/launcher=", "hydra.launcher."))]
        if not launcher or "hydra/launcher/" not in str(e):
            raise
        for o in launcher:
            if o.startswith("hydra/launcher="):
                name = o.split("=", 1)[1]
                assert (REPO / "configs" / "hydra" / "launcher" / f"{name}.yaml").is_file(), o
        return compose_point(config_name, [o for o in point if o not in launcher])
    except ConfigCompositionException:  # (MissingConfigException is one too: caught above)
        placeholders = [o for o in point if "=" in o and PLACEHOLDER_VALUE.match(o.split("=", 1)[1])]
        if not placeholders:
            raise
        cfg = compose_point(config_name, [o for o in point if o not in placeholders])
        for o in placeholders:
            key = o.split("=", 1)[0]
            assert OmegaConf.select(cfg, key, default=KeyError) is not KeyError, f"{o}: no key {key}"
        return cfg


class Parsed(Exception):
    """Raised by parse_args instead of returning, so that main() stops once its arguments parse."""


def parse_only(script: str, args: list, monkeypatch):
    """Run the argparse tool's main(argv) up to its parse_args, with the tool's own parser."""
    real = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise Parsed(real(self, args, namespace))
    module = importlib.import_module(module_of(script))
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    try:
        module.main(args)
    except Parsed:
        return
    except SystemExit as e:
        pytest.fail(f"{script}'s parser refused {args} (exit status {e.code})")
    pytest.fail(f"{script}'s main() returned without parsing its arguments")


@pytest.mark.parametrize("command", all_commands())
def test_every_documented_command_composes(command, monkeypatch):
    program, script, args = split(command)
    if program == "python" and script == "-c":  # a snippet: it must run, and print something
        r = subprocess.run([sys.executable, "-c", args[0]], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and r.stdout.strip(), f"{command} failed:\n{r.stderr[-2000:]}"
        return
    if script.startswith("-m "):
        assert importlib.util.find_spec(script[3:]) is not None, f"no module {script[3:]}"
        return
    assert (REPO / script).is_file(), f"{script} does not exist"
    if program == "bash":
        return  # a shell script: that it exists
    if script in NO_ARGUMENTS:
        assert not args, f"{script} takes no arguments: {args}"
        return
    if script in ARGPARSE_TOOLS:
        if args:  # a bare `python tools/report.py` names the tool, it is no command to parse
            parse_only(script, args, monkeypatch)
        return
    config_name = hydra_config_name(script)
    assert config_name, f"{script} is neither a Hydra app nor in ARGPARSE_TOOLS: teach test_docs.py to check it"
    importlib.import_module(module_of(script))  # registers the command's schema
    named, overrides = hydra_overrides(args)
    for point in sweep_points(overrides):
        compose_point(named or config_name, point)


# ----------------------------------------------------------------------------- the finder itself

SAMPLE = '''Prose that mentions python train.py is no command, nor is `python_docs` or `pytest -m "not slow"`.
Inline: `python sample.py
prompt="'ROMEO: '" max_new_tokens=5` and `DEVICE=cpu bash tools/gpu_check.sh`.

```
python train.py -m model.attn.scale=sqrt_dk,none   # the run's sweep
model.attn.scale=sqrt_dk | none                    # an option list, no command
torchrun --standalone --nproc_per_node=2 \\
    train.py hydra.run.dir=outputs/ddp/run1 ...
python sample.py prompt="'a, b'" > out.txt
```

```python
python = "not a command: Python code"
```
'''


def test_commands_are_found_in_code_blocks_and_spans_and_nowhere_else():
    assert commands(SAMPLE) == [
        (2, "python sample.py prompt=\"'ROMEO: '\" max_new_tokens=5"),
        (3, "DEVICE=cpu bash tools/gpu_check.sh"),
        (6, "python train.py -m model.attn.scale=sqrt_dk,none"),
        (8, "torchrun --standalone --nproc_per_node=2 train.py hydra.run.dir=outputs/ddp/run1 ..."),
        (10, "python sample.py prompt=\"'a, b'\" > out.txt"),
    ]


def test_commands_split_into_script_and_hydra_overrides():
    found = [command for _, command in commands(SAMPLE)]
    assert split(found[1]) == ("bash", "tools/gpu_check.sh", [])
    program, script, args = split(found[3])
    assert (program, script) == ("torchrun", "train.py") and hydra_overrides(args) == (
        None, ["hydra.run.dir=outputs/ddp/run1"])
    program, script, args = split(found[4])
    assert (script, args) == ("sample.py", ["prompt='a, b'"])  # the redirection is the shell's
    assert sweep_points(args) == [["prompt='a, b'"]]  # a quoted comma is no sweep
    assert sweep_points(hydra_overrides(split(found[2])[2])[1]) == [["model.attn.scale=sqrt_dk"],
                                                                     ["model.attn.scale=none"]]
    assert words("python tools/report.py outputs/multirun/<time>  # it's a comment") == [
        "python", "tools/report.py", "outputs/multirun/time"]


def test_the_readme_shows_commands():
    assert any(split(c)[1] == "train.py" for _, c in commands((REPO / "README.md").read_text(encoding="utf-8")))
