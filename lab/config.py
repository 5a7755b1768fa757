"""The config schema: dataclasses registered in Hydra's ConfigStore.

Each YAML under configs/ names its schema first in its defaults list (`- /model_schema@_here_`), so a
misspelt key or a wrong type fails at composition, before anything runs. The model schema is
model.GPTConfig itself: one definition of the architecture's knobs.

Each schema declares the legal values of its keys in its RULES table (rules.Range, OneOf, Rule:
key, allowed values, why), and rules.check_values checks any config against its schemas' tables;
every entry point calls it before doing anything (check_train_config for training). A numeric key
without a rule fails a test by name.
"""
import hashlib
import math
import sys
from dataclasses import dataclass, field
from typing import ClassVar, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from rules import FRACTION, NON_NEGATIVE, POSITIVE, SEED, Needs, OneOf, Range, UserError, check_values, warn_ignored
from model import GPTConfig
from attention import CausalSelfAttention
from variants import KINDS, ROPE_SCALINGS, SELECTS, kinds, softmax_kinds
from lab.optim import LR_SCHEDULES, MUON_ADJUST_LR, MUON_NS_DTYPES, OPTIMIZERS, WEIGHT_DECAY_MODES, min_lr
from lab.device import DTYPES
from lab.parallel import PARALLEL
from lab.tracking import WANDB_MODES, check_wandb_mode

INDEPENDENT_DECAY_WARN = 1e-3  # an lr-independent decay above this per step shrinks weights faster than they learn
DTYPE_NAMES = ("auto", *DTYPES)  # "auto": the device's own choice (device.pick_dtype)

# ----------------------------------------------------------------------------- a sweep job's directory name

NAME_LIMIT = 200  # bytes of a job directory's name (file systems allow 255)


def override_key(override: str) -> str:
    """The key of a command-line override: `train.lr` of `train.lr=1e-3`, `+x=1` and `~x`."""
    return override.split("=", 1)[0].lstrip("+~")


def swept_keys(argv=None) -> set:
    """The keys a sweep's command line gives several values (key=a,b): what sets its jobs apart."""
    return {override_key(a) for a in (sys.argv[1:] if argv is None else argv)
            if "=" in a and "," in a.split("=", 1)[1] and not a.split("=", 1)[1].startswith("[")}


def short_name(name: str, limit: int = NAME_LIMIT) -> str:
    """`name` (a job's overrides joined) as is when short, else the swept keys' settings first, cut, and a
    hash of the whole: two jobs' names stay apart, and a person still reads what sets them apart."""
    if len(name.encode()) <= limit:
        return name
    swept = swept_keys()
    parts = name.split(",")
    name = ",".join(sorted(parts, key=lambda p: override_key(p) not in swept))
    digest = hashlib.sha1(",".join(parts).encode()).hexdigest()[:10]
    head = name.encode()[:limit - len(digest) - 1].decode(errors="ignore")
    return f"{head}-{digest}"


if not OmegaConf.has_resolver("short"):
    OmegaConf.register_new_resolver("short", short_name)



@dataclass
class DataConfig:
    name: str = "python_docs"  # preset name; also names the token cache
    path: Optional[str] = None  # local UTF-8 text file(s), a glob allowed; wins over url and hub
    url: Optional[str] = None  # a text file on the web, loaded through `datasets`
    hub: Optional[str] = None  # a Hugging Face Hub dataset name, loaded through `datasets`
    hub_config: Optional[str] = None  # the Hub dataset's configuration (subset) name
    text_column: str = "text"  # the column that holds the documents
    val_split: Optional[str] = None  # the source's own validation split; unset: carve one off
    val_fraction: float = 0.1  # carved off: the text's tail (one document) or a seeded draw of documents
    split_seed: int = 1337  # seed of that draw
    tokenizer: str = "char"  # char | bpe (trained here) | a tiktoken encoding: r50k_base (GPT-2), cl100k_base
    vocab_size: Optional[int] = None  # tokens in all, for tokenizer=bpe (>= 257) or data=mqar
    streaming: bool = False  # stream a Hub dataset instead of downloading it whole (needs max_tokens)
    max_tokens: Optional[float] = None  # cap on training tokens, e.g. 1e9
    num_proc: int = 1  # processes for tokenization (Dataset.map)
    cache_dir: Optional[str] = None  # where prepared token files live; default <repo>/data/cache
    bos: bool = False  # start every window with a beginning-of-sequence token (an id of its own): a fixed first token
    pairs: List[int] = field(default_factory=lambda: [8])  # data=mqar: key-value pairs per example (each asked once); several: an equal mix, recall logged for each

    examples: int = 20000  # data=mqar: training examples (a tenth as many, at least 256, for validation)

    RULES: ClassVar[dict] = {
        "val_fraction": Range(0, 1, lo_open=True, hi_open=True),
        "split_seed": SEED,
        "vocab_size": Range(3, why="data=mqar: a filler, a key and a value at least; tokenizer=bpe: 257"),
        "max_tokens": Range(1, why="a cap on training tokens"),
        "num_proc": Range(1, 4096), "pairs": Range(1), "examples": Range(1, 10**7, why="generated in memory"),
    }
    NEEDS: ClassVar[dict] = {
        "vocab_size": Needs(lambda d: d.tokenizer == "bpe" or d.name == "mqar",
                            "{p}tokenizer=bpe or data=mqar (the other tokenizers have their own)"),
        "pairs": Needs(lambda d: d.name == "mqar", "data=mqar"), "examples": Needs(lambda d: d.name == "mqar", "data=mqar"),
        "bos": Needs(lambda d: d.name != "mqar", "the data is text (data=mqar's examples have a fixed layout)"),
        **{key: Needs(lambda d: d.name != "mqar", "the data is text (data=mqar generates its examples in memory)")
           for key in ("path", "url", "hub", "text_column", "val_split", "max_tokens", "num_proc", "cache_dir")},
        "val_fraction": Needs(lambda d: d.name != "mqar" and d.val_split is None,
                              "the data is text and {p}val_split is unset (data=mqar: a tenth of data.examples)"),
        "tokenizer": Needs(lambda d: (d.name == "mqar") == (d.tokenizer == "mqar"),
                           "the data is text (data=mqar brings its own tokens, and {p}tokenizer=mqar "
                           "goes only with it)"),
        "hub_config": Needs(lambda d: d.hub is not None, "{p}hub=NAME"),
        "streaming": Needs(lambda d: d.hub is not None, "{p}hub=NAME (a file or URL is read whole)"),
    }


@dataclass
class TrainConfig:
    batch_size: int = 32  # sequences per micro-batch
    grad_accum: Optional[int] = None  # micro-batches per optimizer step, split across processes; unset: one per process
    max_iters: int = 2000  # optimizer steps
    lr: float = 2e-3  # peak learning rate
    min_lr: Optional[float] = 2e-4  # floor of the cosine decay (null with min_lr_ratio)
    min_lr_ratio: Optional[float] = None  # the floor as a fraction of lr instead (e.g. 0.1; then min_lr=null)
    warmup_iters: int = 100  # linear warmup steps
    lr_decay_iters: Optional[int] = None  # steps until min_lr; default max_iters
    lr_schedule: str = "cosine"  # cosine | wsd (constant, then a linear cooldown over the last cooldown_frac)
    cooldown_frac: float = 0.4  # wsd: fraction of the steps after warmup spent decaying to min_lr
    beta1: float = 0.9
    beta2: float = 0.99
    weight_decay: float = 0.1  # on matrices only
    weight_decay_mode: str = "coupled"  # coupled (AdamW's: a step shrinks by lr_t * wd) | independent (by lr_t / lr * wd: not by the peak lr)
    z_loss: float = 0.0  # > 0: add z_loss * (log Z)^2 of the output softmax to the loss (PaLM: 1e-4); train/log_z logged
    log_layer_grads: bool = False  # log each block's gradient norm (before clipping) at every log line: aux/grad_norm/L{i}
    qk_clip: Optional[float] = None  # tau: after each step, rescale W_q, W_k of heads whose largest logit on the batch > tau (lab/qk_clip.py)
    # optimizer: adamw, or muon = torch.optim.Muon on the blocks' Linear weights + AdamW (lr, betas, weight_decay
    # above) on everything else; the lr schedule scales both (lab/optim.py)
    optimizer: str = "adamw"  # adamw | muon
    muon_lr: Optional[float] = None  # Muon's peak lr; unset: train.lr (match_rms_adamw makes AdamW's lr fit)
    muon_weight_decay: Optional[float] = None  # decoupled, times lr; unset: train.weight_decay
    muon_momentum: float = 0.95  # Nesterov momentum
    muon_momentum_start: float = 0.85  # momentum at step 0 when muon_momentum_warmup > 0
    muon_momentum_warmup: int = 0  # steps of linear momentum warmup from muon_momentum_start; 0 = off
    muon_adjust_lr: str = "match_rms_adamw"  # match_rms_adamw (0.2*sqrt(max(A,B))) | original (sqrt(max(1,A/B)))
    muon_ns_steps: int = 5  # Newton-Schulz iterations per matrix and step
    muon_split_qkv: bool = False  # orthogonalise q, k and v's rows of the fused projection apart
    muon_ns_dtype: str = "auto"  # auto (bfloat16 on GPUs with native bf16, else float32) | bfloat16 (torch's) | float32
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    eval_interval: int = 250  # steps between evaluations (and checkpoints)
    eval_iters: int = 20  # fixed val (and train) batches per evaluation
    log_interval: int = 10  # steps between training-loss lines
    log_attn_interval: Optional[int] = None  # attention-statistics probe; default eval_interval, 0 = off
    probe_batch_size: int = 4  # sequences in the fixed attention probe batch
    ckpt_interval: Optional[int] = None  # steps between checkpoints; default eval_interval
    keep_ckpts: int = 2  # periodic checkpoints kept (best.pt is kept besides)
    skip_nonfinite: int = 0  # steps with NaN/Inf loss or gradients skipped; one more and the run has diverged
    collapse_entropy: float = 0.1  # warn when a layer's mean attention entropy on the probe falls below this (nats); 0 = off
    peak_flops: Optional[float] = None  # FLOP/s that MFU is measured against; default: the GPU's table entry
    data_seed: Optional[int] = None  # seed of the batch order, the eval windows and the probe batch; unset: seed
    final_eval_tokens: int = 1000000  # at the last step, val loss over the whole val split up to this many tokens; 0 = off
    parallel: str = "ddp"  # ddp | fsdp: how torchrun's processes share the model (lab/parallel.py); one process: neither
    activation_checkpointing: bool = False  # recompute each block's forward in the backward: less memory, more compute

    RULES: ClassVar[dict] = {
        "batch_size": POSITIVE, "grad_accum": POSITIVE, "max_iters": NON_NEGATIVE,
        "lr": Range(0, 10, lo_open=True, why="a larger lr diverges at once"),
        "min_lr": NON_NEGATIVE, "min_lr_ratio": Range(0, 1, why="a fraction of train.lr"),
        "weight_decay_mode": OneOf(WEIGHT_DECAY_MODES), "z_loss": Range(0, why="0 turns the z-loss off"),
        "qk_clip": Range(0, lo_open=True, why="a logit bound (Kimi K2 uses 100); null turns QK-Clip off"),
        "collapse_entropy": Range(0, why="0 turns the collapse warning off"), "warmup_iters": NON_NEGATIVE, "lr_decay_iters": POSITIVE,
        "lr_schedule": OneOf(tuple(LR_SCHEDULES)), "cooldown_frac": Range(0, 1, lo_open=True),
        "beta1": FRACTION, "beta2": FRACTION, "weight_decay": NON_NEGATIVE,
        "optimizer": OneOf(OPTIMIZERS),
        "muon_lr": Range(0, 10, lo_open=True, why="a larger lr diverges at once"),
        "muon_weight_decay": NON_NEGATIVE, "muon_momentum": FRACTION, "muon_momentum_start": FRACTION,
        "muon_momentum_warmup": NON_NEGATIVE, "muon_adjust_lr": OneOf(MUON_ADJUST_LR),
        "muon_ns_steps": Range(1, 100), "muon_ns_dtype": OneOf(("auto", *MUON_NS_DTYPES)),
        "grad_clip": Range(0, why="0 disables clipping"),
        "eval_interval": POSITIVE, "eval_iters": POSITIVE, "log_interval": POSITIVE,
        "log_attn_interval": Range(0, why="0 turns the probe off"), "probe_batch_size": POSITIVE,
        "ckpt_interval": POSITIVE, "keep_ckpts": POSITIVE, "skip_nonfinite": NON_NEGATIVE,
        "peak_flops": Range(0, lo_open=True), "data_seed": SEED, "final_eval_tokens": NON_NEGATIVE,
        "parallel": OneOf(PARALLEL),
    }
    MUON: ClassVar[Needs] = Needs(lambda t: t.optimizer == "muon", "{p}optimizer=muon")
    NEEDS: ClassVar[dict] = {
        **dict.fromkeys(("muon_lr", "muon_weight_decay", "muon_momentum", "muon_momentum_warmup", "muon_adjust_lr",
                         "muon_ns_steps", "muon_split_qkv", "muon_ns_dtype"), MUON),
        "muon_momentum_start": Needs(lambda t: t.optimizer == "muon" and t.muon_momentum_warmup > 0,
                                     "{p}optimizer=muon and {p}muon_momentum_warmup > 0"),
        "cooldown_frac": Needs(lambda t: t.lr_schedule == "wsd", "{p}lr_schedule=wsd"),
        "probe_batch_size": Needs(lambda t: t.log_attn_interval != 0, "the attention probe runs "
                                  "({p}log_attn_interval=0 turns it off)"),
        "collapse_entropy": Needs(lambda t: t.log_attn_interval != 0, "the attention probe runs "
                                  "({p}log_attn_interval=0 turns it off)"),
    }


@dataclass
class WandbConfig:
    mode: Optional[str] = None  # offline | online | disabled; unset: WANDB_MODE, else offline
    project: str = "attnlab"
    entity: Optional[str] = None
    group: Optional[str] = None  # unset: the multirun sweep directory, so a sweep is one group
    name: Optional[str] = None  # unset: the run's command-line overrides
    tags: List[str] = field(default_factory=list)

    RULES: ClassVar[dict] = {"mode": OneOf(WANDB_MODES)}


@dataclass
class LoggerConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    plots: bool = True  # at the end of a run: loss.png, the entropy plots and the attention maps (PNG + viewer)


@dataclass
class Config:
    model: GPTConfig = MISSING
    data: DataConfig = MISSING
    train: TrainConfig = MISSING
    logger: LoggerConfig = MISSING
    device: str = "auto"  # auto (cuda > mps > cpu) | cpu | cuda | cuda:N | mps
    dtype: str = "auto"  # auto (bfloat16 autocast on capable CUDA, else float32) | float32 | bfloat16 | float16
    compile: Optional[bool] = None  # torch.compile the model; unset: on for CUDA, off elsewhere
    seed: int = 1337  # the weights' initialisation and dropout; also the data's (train.data_seed) unless set
    out_dir: Optional[str] = None  # run directory; train.py sets it to Hydra's run dir
    resume: Optional[str] = None  # true: continue this run dir from its newest checkpoint; or a run dir / file
    # a new run from another run's weights (its best.pt, or the file given): step 0, a fresh optimizer; model.*
    # may differ where no weight does (attn.window, attn.select, ...), weights it adds start fresh
    init_from: Optional[str] = None

    RULES: ClassVar[dict] = {"seed": SEED, "dtype": OneOf(DTYPE_NAMES)}


@dataclass
class SampleConfig:
    ckpt: Optional[str] = None  # checkpoint file or run dir; default: newest under outputs/
    prompt: str = "\n"  # text to continue (quote trailing spaces for Hydra: prompt="'def '")
    prompt_file: Optional[str] = None  # read the prompt from this file instead (whitespace kept as is)
    max_new_tokens: int = 500
    num_samples: int = 1  # decoded together as one batch
    temperature: float = 0.8  # 0 = greedy
    top_k: Optional[int] = 200  # keep the k most likely tokens; null = all
    top_p: float = 1.0  # nucleus sampling: smallest set with this much probability
    seed: int = 1337
    device: str = "auto"
    kv_cache: bool = True  # false: recompute the whole context for every token
    compile: Optional[bool] = None  # torch.compile the cached decode step (CUDA graphs on CUDA); unset: on for CUDA
    threads: Optional[int] = None  # intra-op CPU threads; unset on a CPU: 1 for one cached sequence, every core for a batch
    dtype: str = "auto"  # autocast dtype as in training: auto = bfloat16 on capable GPUs, else float32
    kv_dtype: str = "auto"  # KV cache dtype: auto = dtype's if 16-bit, else float32; bfloat16 halves it; int8: quantised
    kv_sinks: int = 0  # past block_size, keep the first kv_sinks tokens in the cache besides the latest (StreamingLLM); 0: a plain ring
    rope_scaling: Optional[str] = None  # linear | ntk | yarn: stretch a RoPE checkpoint's positions, no training; unset: its own
    rope_scaling_factor: Optional[float] = None  # the context grows to this many times the trained length; unset: its own
    select: Optional[str] = None  # moba | oracle | indexer (a checkpoint trained with one) | none: each query reads only the keys it chooses (model.attn.select); unset: its own
    select_topk: Optional[int] = None  # with select: blocks (moba) or keys (oracle) each query reads; unset: its own
    select_block: Optional[int] = None  # with select=moba: keys per block; unset: its own
    stream: bool = False  # print tokens as they are produced (num_samples=1)
    stop: Optional[str] = None  # end a sample at the first occurrence of this string

    RULES: ClassVar[dict] = {
        "max_new_tokens": NON_NEGATIVE, "num_samples": POSITIVE, "temperature": Range(0, why="0 is greedy"),
        "top_k": POSITIVE, "top_p": Range(0, 1, lo_open=True), "seed": SEED, "threads": Range(1, 4096),
        "dtype": OneOf(DTYPE_NAMES), "kv_dtype": OneOf((*DTYPE_NAMES, "int8")), "kv_sinks": NON_NEGATIVE,
        "rope_scaling": OneOf(tuple(ROPE_SCALINGS)), "rope_scaling_factor": Range(1, why="1 is no scaling"),
        "select": OneOf(tuple(SELECTS)), "select_topk": POSITIVE, "select_block": POSITIVE,
    }
    SAMPLING: ClassVar[Needs] = Needs(lambda c: c.temperature > 0, "temperature > 0 (0 is greedy: the likeliest token)")
    CACHE: ClassVar[Needs] = Needs(lambda c: c.kv_cache, "kv_cache=true")
    NEEDS: ClassVar[dict] = {
        "top_k": SAMPLING, "top_p": SAMPLING, "seed": SAMPLING,
        "kv_dtype": CACHE, "compile": CACHE, "kv_sinks": CACHE,
        "prompt": Needs(lambda c: c.prompt_file is None, "prompt_file is unset (the file's text is the prompt)"),
    }


# ----------------------------------------------------------------------------- checks

def check_train_config(cfg) -> list:
    """Every value of a training config in its schema's table (model, data, train, logger, top
    level), the model's relations (GPTConfig), and the pairs of training keys that only make sense
    together: everything that needs no file, before anything is written. Returns the settings that
    have no effect in this config (each warned in one line): ignored, not refused."""
    ignored = check_values(cfg)
    mc = model_config(cfg.model, cfg.model.vocab_size or 1)
    more = [line for line in mc.ignored if line not in ignored]
    more += check_collapse_entropy(cfg.train, mc, ignored)
    warn_ignored(more)  # what the model's pieces ignore besides (GPTConfig: n_embd divisible by n_head, etc.)
    check_wandb_mode(cfg.logger.wandb)  # online needs a key
    if cfg.data.name == "mqar":
        from data.mqar import check_config
        check_config(cfg.data, cfg.model.block_size)  # the pairs against the window, the examples against memory
    t = cfg.train
    if (t.min_lr is None) == (t.min_lr_ratio is None):
        raise UserError(f"train.min_lr={t.min_lr} and train.min_lr_ratio={t.min_lr_ratio}: set exactly one floor "
                        "of the lr schedule (train.min_lr=null with train.min_lr_ratio=R, or min_lr_ratio=null)")
    if min_lr(t) > t.lr:
        raise UserError(f"train.min_lr={t.min_lr} is above train.lr={t.lr}: the cosine \"decay\" would raise the "
                        "learning rate; set min_lr <= lr (e.g. lr/10), or give the floor as train.min_lr_ratio "
                        "(with train.min_lr=null)")
    if t.optimizer == "muon" and t.parallel == "fsdp":
        raise UserError("train.optimizer=muon with train.parallel=fsdp is not supported: Muon's Newton-Schulz step "
                        "orthogonalises each whole matrix, and FSDP leaves each process only some of its rows; use "
                        "train.parallel=ddp (Muon under DDP is tested) or train.optimizer=adamw")
    if t.qk_clip is not None:
        check_qk_clip(t, mc)
    if t.log_layer_grads and t.parallel == "fsdp":
        raise UserError("train.log_layer_grads=true with train.parallel=fsdp is not supported: each process holds only "
                        "shards of a block's gradients; use train.parallel=ddp for the per-block norms")
    if t.lr_decay_iters is not None and t.lr_decay_iters <= t.warmup_iters:
        raise UserError(f"train.lr_decay_iters={t.lr_decay_iters} is not past train.warmup_iters={t.warmup_iters}: the "
                        "lr would drop from its peak straight to train.min_lr when the warmup ends; set "
                        f"lr_decay_iters > warmup_iters, or a shorter warmup (e.g. train.warmup_iters="
                        f"{max(t.lr_decay_iters // 10, 0)})")
    decays = (t.lr_decay_iters or t.max_iters) - t.warmup_iters  # steps of the decay
    if decays <= 0 and t.max_iters > 0:
        warn_ignored([f"train.max_iters={t.max_iters} ends before train.warmup_iters={t.warmup_iters} does: the lr "
                      f"never reaches train.lr={t.lr} (it ends at {t.max_iters / (t.warmup_iters + 1):.0%} of it) and "
                      f"never decays; set a shorter warmup, e.g. train.warmup_iters={t.max_iters // 10}"])
    for key, wd in (("weight_decay", t.weight_decay), ("muon_weight_decay", t.muon_weight_decay)):
        if t.weight_decay_mode != "independent" or wd is None:
            continue
        if wd >= 1:
            raise UserError(f"train.{key}={wd} with train.weight_decay_mode=independent is >= 1: each step would zero "
                            f"or flip every weight at the schedule's peak; use {key} < 1 (Wortsman et al. use about 1e-4)")
        if wd > INDEPENDENT_DECAY_WARN:
            warn_ignored([f"train.{key}={wd} with train.weight_decay_mode=independent shrinks every matrix by "
                          f"{wd:.1%} per step at the schedule's peak (the decay is not multiplied by the lr): "
                          f"Wortsman et al. use about 1e-4; set train.{key}=1e-4"])
    if t.weight_decay_mode == "coupled" and t.lr * t.weight_decay >= 1:
        raise UserError(f"train.weight_decay={t.weight_decay} times train.lr={t.lr} is >= 1: AdamW would zero or "
                        "flip every weight each step; use weight_decay < 1/lr, or train.weight_decay_mode=independent (the decay "
                        "then does not grow with the peak lr)")
    return ignored + more


def check_qk_clip(t, mc: GPTConfig):
    """train.qk_clip needs W_q and W_k it can rescale: softmax layers with a fused q|k|v projection, not undone by
    QK-Norm, whole on every process."""
    if mc.attn.qk_norm:
        raise UserError(f"train.qk_clip={t.qk_clip:g} with model.attn.qk_norm=true: QK-Norm normalises q and k after "
                        "W_q and W_k, so rescaling them changes no logit (the norm's bound is scale·hs times its gain); "
                        "use one of the two (model.attn.qk_norm=false, or train.qk_clip=null)")
    if t.parallel == "fsdp":
        raise UserError(f"train.qk_clip={t.qk_clip:g} with train.parallel=fsdp is not supported: each process holds "
                        "only some rows of W_q and W_k; use train.parallel=ddp")
    fused = CausalSelfAttention.make_projections  # the [Q | K | V] rows lab/qk_clip.py rescales
    if not any(KINDS[k].softmax and KINDS[k].make_projections is fused for k in kinds(mc.attn)):
        raise UserError(f"train.qk_clip={t.qk_clip:g} acts on no layer of model.attn.kind={mc.attn.kind}: it rescales "
                        "the q and k rows of a softmax layer's fused q|k|v projection; use kind=softmax (or a "
                        "layer_kinds list with softmax layers), or train.qk_clip=null")


def check_collapse_entropy(t, mc: GPTConfig, ignored: list) -> list:
    """train.collapse_entropy against the model: the ignored line of a model with no softmax layer (the
    probe reads no entropy there) when it was set, and a refusal of a threshold at or above ln(block_size),
    the most entropy a query's weights can have (uniform over every key): every layer would be called
    collapsed at step 0. Nothing more when check_values already named it ignored (the probe is off)."""
    if t.collapse_entropy == 0 or any(line.startswith("train.collapse_entropy=") for line in ignored):
        return []
    if not softmax_kinds(mc.attn):
        if t.collapse_entropy == TrainConfig.collapse_entropy:
            return []
        return [f"train.collapse_entropy={t.collapse_entropy:g} has no effect: no layer has softmax weights "
                f"(model.attn: {', '.join(sorted(kinds(mc.attn)))}), so the probe reads no attention entropy: ignored"]
    most = math.log(mc.block_size)
    if t.collapse_entropy >= most:
        raise UserError(f"train.collapse_entropy={t.collapse_entropy:g} is at or above ln(model.block_size="
                        f"{mc.block_size}) = {most:.3f} nats, the most a query's weights can have (uniform over every "
                        f"key): every layer would be called collapsed at step 0; the rule means about one key per "
                        f"query: use e.g. train.collapse_entropy={TrainConfig.collapse_entropy:g}")
    return []


def data_seed(cfg) -> int:
    """The seed of everything about the data a run sees: the order of its training batches, the
    windows its evaluations read and the probe batch. Unset, the run's seed; set apart from it, arms
    of an ablation can share data and differ only in their initialisation (or the reverse). `cfg`: a
    training config, or one as a checkpoint stores it (a dict)."""
    seed = cfg["train"].get("data_seed")
    return cfg["seed"] if seed is None else seed


def model_config(model_cfg, vocab_size=None) -> GPTConfig:
    """The GPTConfig of a `model` config group; an unset vocab_size comes from the tokenizer."""
    fields = OmegaConf.to_container(model_cfg, resolve=True) if OmegaConf.is_config(model_cfg) else dict(model_cfg)
    if vocab_size is not None:
        if fields.get("vocab_size") is not None and fields["vocab_size"] < vocab_size:  # 0 and negatives too
            raise UserError(f"model.vocab_size={fields['vocab_size']} is smaller than the tokenizer's "
                            f"{vocab_size}: leave it unset")
        fields["vocab_size"] = vocab_size if fields.get("vocab_size") is None else fields["vocab_size"]
    return GPTConfig(**fields)


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    cs.store(name="base_sample", node=SampleConfig)
    # group schemas live outside the groups (each group YAML pulls its one in with
    # `- /model_schema@_here_`), so `--help` lists only real choices
    cs.store(name="model_schema", node=GPTConfig)
    cs.store(name="data_schema", node=DataConfig)
    cs.store(name="train_schema", node=TrainConfig)
    cs.store(name="logger_schema", node=LoggerConfig)


register_configs()
