"""Runs on disk and their arms: finding the run dirs (those with metrics.jsonl) under some paths, a
run's resolved config, final figures and replicate (seed, data seed), and runs grouped into arms by
config, labelled by what differs. tools/report.py, recall.py, needle.py and eval_lengths.py group
runs here; lab/intervals.py holds the statistics over an arm's runs."""
import json
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import yaml

from files import new_output_dir
from rules import UserError
from lab.tracking import read_metrics


REPLICATES = ("seed", "train.data_seed")  # what sets runs of one arm apart
# keys that do not change what a run computes (paths, logging, bookkeeping)
IGNORED = ("out_dir", "resume", "device", "logger.", "data.cache_dir", "data.num_proc", "train.log_interval",
           "train.peak_flops", "train.keep_ckpts", "train.ckpt_interval")


def default_out(paths, name: str) -> Path:
    """Where a tool reading runs writes by default: a new directory per call (files.new_output_dir), inside
    the one sweep directory it was given (<sweep>/<name>/<time>/), else outputs/<name>/<time>/; a second
    report of the same sweep keeps the first one's files."""
    sweep = len(paths) == 1 and not (Path(paths[0]) / "metrics.jsonl").is_file()
    return new_output_dir(Path(paths[0]) / name if sweep else Path("outputs") / name)


def find_runs(paths) -> list:
    """Run dirs (those holding metrics.jsonl) among the paths and their subdirectories, each once (the same
    dir given twice, or a sweep dir and one of its jobs, is one run, not two seeds' worth)."""
    runs = []
    for p in map(Path, paths):
        if (p / "metrics.jsonl").is_file():
            runs.append(p)
        elif p.is_dir():
            runs.extend(sorted(q.parent for q in p.rglob("metrics.jsonl")))
        else:
            raise UserError(f"{p} is not a run dir or a sweep dir")
    if not runs:
        raise UserError(f"no metrics.jsonl under {' '.join(map(str, paths))}: pass run or sweep dirs")
    return list({run.resolve(): run for run in reversed(runs)}.values())[::-1]  # the first mention of each


def flat_config(run: Path) -> dict:
    """The run's resolved config (config.yaml) as {dotted key: value}; {} if it has none."""
    try:
        cfg = yaml.safe_load((run / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return {}
    out = {}

    def walk(node, prefix):
        for k, v in node.items():
            key = f"{prefix}{k}"
            if isinstance(v, dict):
                walk(v, key + ".")
            else:
                out[key] = v
    if isinstance(cfg, dict):
        walk(cfg, "")
    return out


def first_token_heads(m: dict) -> list:
    """Each head's weight on the first token (attn_first/L{l}/H{h}) in a probe line."""
    return [v for k, v in m.items() if k.startswith("attn_first/L") and k.count("/") == 2]


def final_values(metrics: list) -> dict:
    """A run's final figures: val loss and bits/char (the whole val split's where logged, else the
    last evaluation's), and the last probe's mean entropy, mean peak weight, largest logit, the weight
    on the first token (mean over heads, and the top head's: a sink) and the largest activation; the
    last evaluation's recall accuracy (data=mqar)."""
    evals = [m for m in metrics if "val/loss" in m]
    last = evals[-1] if evals else {}
    probes = [m for m in metrics if "attn_entropy/mean" in m]
    probe = probes[-1] if probes else {}
    logits = [v for k, v in probe.items() if k.startswith("attn_logit_max/L")]
    first = first_token_heads(probe)
    return {"steps": last.get("step"), "val_loss": last.get("val/loss_full", last.get("val/loss")),
            "val_bpc": last.get("val/bpc_full", last.get("val/bpc")), "attn_entropy": probe.get("attn_entropy/mean"),
            "attn_peak": probe.get("attn_peak/mean"), "attn_logit_max": max(logits) if logits else None,
            "attn_first": (sum(first) / len(first), max(first)) if first else None,
            "act_max": probe.get("act_max/max"), "recall_acc": last.get("val/recall_acc"),
            "full_val": "val/loss_full" in last}


@dataclass
class RunSummary:
    dir: Path
    config: dict
    metrics: list
    final: dict
    replicate: tuple  # (seed, data seed): which runs of two arms pair up
    ignored: list = field(default_factory=list)  # settings without effect in its config (run_info.json)
    outcome: dict = field(default_factory=dict)  # results.json's outcome, outcome_why, outcome_step ({}: unknown)

    @property
    def seed(self):
        return self.replicate[0]

    @property
    def unfinished(self):
        """A word for a run that did not end as trained (diverged, stopped, at the unigram loss), else None:
        from results.json's outcome, else from its metrics (a run that stopped before writing results)."""
        kind = self.outcome.get("outcome")
        if kind is None:
            kind = "diverged" if any(m.get("diverged") for m in self.metrics) else \
                "stopped" if not (self.dir / "results.json").is_file() else "finished"
        if kind == "finished":
            return None
        step = self.outcome.get("outcome_step", self.final.get("steps"))
        return f"{kind} at step {step}" if step is not None else kind


@dataclass
class Arm:
    label: str
    runs: list = field(default_factory=list)

    def values(self, name) -> list:
        return [r.final[name] for r in self.runs if r.final[name] is not None]

    def outcomes(self) -> str:
        """Its runs' outcomes in a few words: 'all finished', or '2 finished; seed 3 stopped at step 2801'."""
        odd = [f"seed {r.seed} {r.unfinished}" for r in self.runs if r.unfinished]
        done = len(self.runs) - len(odd)
        return "all finished" if not odd else "; ".join([f"{done} finished"] * bool(done) + odd)

    @property
    def ignored(self) -> list:
        """The settings its runs logged as having no effect (each once, in the order first seen)."""
        return list(dict.fromkeys(line for r in self.runs for line in r.ignored))


def with_top_sink(metrics: list) -> list:
    """Each probe line with attn_first/top added: the most weight one head puts on the first token
    (a sink, if any head parks there; which head varies from seed to seed)."""
    for m in metrics:
        heads = first_token_heads(m)
        if heads:
            m["attn_first/top"] = max(heads)
    return metrics


def ignored_settings(run: Path) -> list:
    """The settings train.py found without effect in the run's config (its run_info.json), or []."""
    try:
        return list(json.loads((run / "run_info.json").read_text()).get("ignored_settings") or [])
    except (OSError, ValueError, AttributeError):
        return []


def summarize(run: Path) -> RunSummary:
    config, metrics = flat_config(run), with_top_sink(read_metrics(run))
    seed = config.get("seed")
    data_seed = config.get("train.data_seed")
    try:
        results = json.loads((run / "results.json").read_text())
    except (OSError, ValueError):
        results = {}
    return RunSummary(run, config, metrics, final_values(metrics), (seed, seed if data_seed is None else data_seed),
                      ignored_settings(run), {k: v for k, v in results.items() if k.startswith("outcome")})


def arm_key(config: dict, run: Path, newer=()):
    """What an arm is: the resolved config without the replicate and bookkeeping keys and the keys in
    `newer` (a run without config.yaml is an arm of its own)."""
    if not config:
        return (("run", str(run)),)
    return tuple(sorted((k, repr(parent_mark(v) if k == "init_from" else v)) for k, v in config.items()
                        if k not in REPLICATES and k not in newer and not k.startswith(IGNORED)))


def parent_mark(init_from):
    """A run started from another's weights (init_from): its arm says so, not which run's, since each
    seed starts from its own (a window fine-tuned from full runs of seeds 1, 2, 3 is one arm)."""
    return None if init_from is None else "another run"


def newer_keys(configs: list) -> set:
    """Keys some runs lack and the others all set to one value: an option added after the older runs
    were made, at its default (runs of two attnlab versions with the same settings are one arm)."""
    configs = [c for c in configs if c]
    every = set().union(*configs) if configs else set()
    return {k for k in every if any(k not in c for c in configs)
            and len({repr(c[k]) for c in configs if k in c}) == 1}


def inert_keys(config: dict) -> set:
    """The model keys of a run's config that could not act in that run (their schema's Needs fails there, e.g.
    model.attn.select_block without select=moba): whatever their value, they say nothing of its arm."""
    from model import GPTConfig  # the schemas, whose NEEDS say when a key acts
    from variants import AttnConfig
    inert = set()
    for prefix, schema in (("model.", GPTConfig), ("model.attn.", AttnConfig)):
        node = SimpleNamespace(**{k[len(prefix):]: v for k, v in config.items()
                                  if k.startswith(prefix) and "." not in k[len(prefix):]})
        for key, needs in schema.NEEDS.items():
            try:
                if not needs.test(node):
                    inert.add(prefix + key)
            except (AttributeError, TypeError):  # an older run without a key the rule reads: the key stays
                pass
    return inert


def group_arms(runs: list) -> list:
    """Runs grouped into arms, in the order their first run appears; each arm labelled by the keys
    whose values differ between arms (`key=value, ...`); a lone arm by its run's dir name."""
    keyed, newer = {}, newer_keys([r.config for r in runs])
    for r in runs:
        keyed.setdefault(arm_key(r.config, r.dir, newer | inert_keys(r.config)), []).append(r)  # an inert key parts no arms
    configs = [dict(k) for k in keyed]
    every = set().union(*configs)
    differing = sorted(k for k in every if len({c.get(k, "(unset)") for c in configs}) > 1)
    arms = []
    for c, members in zip(configs, keyed.values()):
        inert = inert_keys(members[0].config)
        label = ", ".join(f"{k}={c.get(k, '(unset)')}".replace("'", "") for k in differing
                          if k != "run" and k not in inert)
        if not label:
            label = members[0].dir.name if len(members) == 1 else "all runs"
        arms.append(Arm(label, sorted(members, key=lambda r: (str(r.replicate), str(r.dir)))))
    return arms
