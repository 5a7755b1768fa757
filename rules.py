"""The rules a config value must follow, and the one error a user sees when it does not: `UserError`
(its message is one line that says how to fix the input), the value types of every schema's table
(`Range`, `OneOf`, `Rule`: which values are legal, and `Needs`: which keys act only when others say
so) and `check_values`, which holds a config to its schemas' tables; `first_line` makes any exception
one line of such a message.

No torch and no process code here: the model files, lab/config.py and every tool import these, and the
export's custom-code route copies this file whole beside the model."""
import dataclasses
import logging
import math
from dataclasses import dataclass


class UserError(Exception):
    """Bad input (config value, data file, checkpoint, prompt); the message says how to fix it."""


def first_line(e, limit=200) -> str:
    """An exception's first line, for one-line messages."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:limit]


@dataclass(frozen=True)
class Range:
    """The legal values of a numeric key: finite, between lo and hi (each bound included unless
    marked open). None (unset) is always legal where the schema allows it."""
    lo: float = -math.inf
    hi: float = math.inf
    lo_open: bool = False
    hi_open: bool = False
    why: str = ""  # what the bound protects, added to the error

    def contains(self, v) -> bool:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            return False
        if isinstance(v, int) and abs(v) > 2**53:  # every count fits int64 and converts to float exactly
            return False
        return (v > self.lo if self.lo_open else v >= self.lo) and (v < self.hi if self.hi_open else v <= self.hi)

    def error(self, name: str, v, optional: bool) -> str:
        integer = isinstance(v, int) and not isinstance(v, bool)
        if integer and abs(v) > 2**53:
            return f"{name}={v} is beyond any sensible size (2**53): {self.describe(integer)}"
        return f"{name}={v} must be {self.describe(integer)}{' (or unset)' if optional else ''}" + \
            (f": {self.why}" if self.why else "")

    def describe(self, integer: bool) -> str:
        lo = f"{'>' if self.lo_open else '>='} {self.lo:g}" if self.lo > -math.inf else ""
        hi = f"{'<' if self.hi_open else '<='} {self.hi:g}" if self.hi < math.inf else ""
        what = "an integer" if integer else "a finite number"
        return f"{what} {lo}{' and ' if lo and hi else ''}{hi}".rstrip()


@dataclass(frozen=True)
class OneOf:
    """The legal values of a key that names a choice."""
    choices: tuple
    why: str = ""

    def contains(self, v) -> bool:
        return v in self.choices

    def error(self, name: str, v, optional: bool) -> str:
        return f"{name}={v!r} is unknown: use one of {', '.join(map(str, self.choices))}" + \
            (f" ({self.why})" if self.why else "")


@dataclass(frozen=True)
class Rule:
    """Any other test of one value: `test(v)` is True when legal; `legal` says what is."""
    test: object
    legal: str

    def contains(self, v) -> bool:
        return bool(self.test(v))

    def error(self, name: str, v, optional: bool) -> str:
        return f"{name}={v} is invalid: use {self.legal}"


def positive_number(v) -> bool:
    """A finite number > 0, or a string that reads as one (a Rule's test)."""
    try:
        return math.isfinite(float(v)) and float(v) > 0
    except (TypeError, ValueError):
        return False


POSITIVE, NON_NEGATIVE = Range(1), Range(0)
FRACTION = Range(0, 1, hi_open=True)  # [0, 1)
SEED = Range(0, why="seeds are non-negative")


@dataclass(frozen=True)
class Needs:
    """A key that acts only when other keys of its schema say so: `test(node)` is True then. Set to
    anything but its default while it cannot act, it is refused: the user asked for an effect the
    run would not have. `what` names the condition, {p} standing for the schema's prefix."""
    test: object
    what: str


def schema_nodes(node, prefix: str = ""):
    """(node, schema, prefix) of a config node and of every schema nested in it, parents first. A
    dataclass (a model's own config) needs no omegaconf; a DictConfig is read through it."""
    is_cfg = not dataclasses.is_dataclass(node)
    if is_cfg:
        from omegaconf import OmegaConf
    schema = OmegaConf.get_type(node) if is_cfg else type(node)
    yield node, schema, prefix
    for f in dataclasses.fields(schema):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value) or (is_cfg and OmegaConf.is_dict(value)):
            yield from schema_nodes(value, f"{prefix}.{f.name}" if prefix else f.name)


def check_values(node, prefix: str = "", warn: bool = True) -> list:
    """Every value of a config node in its schema's table, nested schemas included: a one-line
    UserError for the first that breaks its rule, naming the key as `prefix.key`. Returns the keys
    that cannot act in this config (its schema's NEEDS table) yet were set, each a line saying so
    (logged as a warning with `warn`): they are ignored, not refused, since a sweep's arm may well
    set what only another arm uses (a Muon lr beside optimizer=adamw,muon).

    Each schema (a dataclass: a config group, a tool's settings, GPTConfig) declares its table as
    the class attribute RULES, {field: Range | OneOf | Rule}, and NEEDS, {field: Needs}; `node` may
    be the dataclass itself or the DictConfig Hydra composed from it. None (unset) is legal wherever
    the schema allows it."""
    nodes = list(schema_nodes(node, prefix))
    for node, schema, prefix in nodes:
        is_cfg, rules = not dataclasses.is_dataclass(node), getattr(schema, "RULES", {})
        if is_cfg:
            from omegaconf import OmegaConf
        for f in dataclasses.fields(schema):
            value, rule = getattr(node, f.name), rules.get(f.name)
            if rule is None or value is None:
                continue
            name = f"{prefix}.{f.name}" if prefix else f.name
            listed = isinstance(value, (list, tuple)) or (is_cfg and OmegaConf.is_list(value))
            for v in (value if listed else [value]):  # a list's rule applies to each element
                if not rule.contains(v):
                    optional = not listed and (node._get_node(f.name)._is_optional() if is_cfg else f.default is None)
                    raise UserError(rule.error(name, v, optional))
    ignored = []
    for node, schema, prefix in nodes:
        defaults = {f.name: f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
                    for f in dataclasses.fields(schema)}
        for key, need in getattr(schema, "NEEDS", {}).items():
            value = getattr(node, key)
            if value != defaults[key] and not need.test(node):
                dot = f"{prefix}." if prefix else ""
                ignored.append(f"{dot}{key}={value!r} has no effect unless {need.what.format(p=dot)}: ignored "
                               f"(its default is {defaults[key]!r})")
    if warn:
        warn_ignored(ignored)
    return ignored


def warn_ignored(lines):
    """Each ignored setting as one warning line."""
    for line in lines:
        logging.getLogger("attnlab").warning("%s", line)


def check_value(name: str, value, rule):
    """One value against its rule (a library function's argument): a one-line UserError if illegal."""
    if value is not None and not rule.contains(value):
        raise UserError(rule.error(name, value, False))
