"""The config schema: dataclasses registered in Hydra's ConfigStore.

Each YAML under configs/ names its schema first in its defaults list (`- /model_schema@_here_`), so a
misspelt key or a wrong type fails at composition, before anything runs. The model schema is
model.GPTConfig itself: one definition of the architecture's knobs.
"""
from dataclasses import dataclass, field
from typing import List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from omegaconf import OmegaConf

from common import UserError
from model import GPTConfig


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
    vocab_size: Optional[int] = None  # tokens in all, for tokenizer=bpe
    streaming: bool = False  # stream a Hub dataset instead of downloading it whole (needs max_tokens)
    max_tokens: Optional[float] = None  # cap on training tokens, e.g. 1e9
    num_proc: int = 1  # processes for tokenization (Dataset.map)
    cache_dir: Optional[str] = None  # where prepared token files live; default <repo>/data/cache


@dataclass
class TrainConfig:
    batch_size: int = 32  # sequences per micro-batch
    grad_accum: Optional[int] = None  # micro-batches per optimizer step, split across processes; unset: one per process
    max_iters: int = 2000  # optimizer steps
    lr: float = 2e-3  # peak learning rate
    min_lr: float = 2e-4  # floor of the cosine decay
    warmup_iters: int = 100  # linear warmup steps
    lr_decay_iters: Optional[int] = None  # steps until min_lr; default max_iters
    beta1: float = 0.9
    beta2: float = 0.99
    weight_decay: float = 0.1  # on matrices only
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    eval_interval: int = 250  # steps between evaluations (and checkpoints)
    eval_iters: int = 20  # fixed val (and train) batches per evaluation
    log_interval: int = 10  # steps between training-loss lines
    log_attn_interval: Optional[int] = None  # attention-statistics probe; default eval_interval, 0 = off
    probe_batch_size: int = 4  # sequences in the fixed attention probe batch
    ckpt_interval: Optional[int] = None  # steps between checkpoints; default eval_interval
    keep_ckpts: int = 2  # periodic checkpoints kept (best.pt is kept besides)
    skip_nonfinite: int = 0  # steps with NaN/Inf loss or gradients skipped before the run stops
    peak_flops: Optional[float] = None  # FLOP/s that MFU is measured against; default: the GPU's table entry


@dataclass
class WandbConfig:
    mode: Optional[str] = None  # offline | online | disabled; unset: WANDB_MODE, else offline
    project: str = "attnlab"
    entity: Optional[str] = None
    group: Optional[str] = None  # unset: the multirun sweep directory, so a sweep is one group
    name: Optional[str] = None  # unset: the run's command-line overrides
    tags: List[str] = field(default_factory=list)


@dataclass
class LoggerConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class Config:
    model: GPTConfig = MISSING
    data: DataConfig = MISSING
    train: TrainConfig = MISSING
    logger: LoggerConfig = MISSING
    device: str = "auto"  # auto (cuda > mps > cpu) | cpu | cuda | cuda:N | mps
    dtype: str = "auto"  # auto (bfloat16 autocast on capable CUDA, else float32) | float32 | bfloat16 | float16
    compile: Optional[bool] = None  # torch.compile the model; unset: on for CUDA, off elsewhere
    seed: int = 1337
    out_dir: Optional[str] = None  # run directory; train.py sets it to Hydra's run dir
    resume: Optional[str] = None  # true: continue this run dir from its newest checkpoint; or a run dir / file


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
    stream: bool = False  # print tokens as they are produced (num_samples=1)
    stop: Optional[str] = None  # end a sample at the first occurrence of this string


def model_config(model_cfg, vocab_size=None) -> GPTConfig:
    """The GPTConfig of a `model` config group; an unset vocab_size comes from the tokenizer."""
    fields = OmegaConf.to_container(model_cfg, resolve=True) if OmegaConf.is_config(model_cfg) else dict(model_cfg)
    if vocab_size is not None:
        if fields.get("vocab_size") is not None and fields["vocab_size"] < vocab_size:
            raise UserError(f"model.vocab_size={fields['vocab_size']} is smaller than the tokenizer's "
                            f"{vocab_size}: leave it unset")
        fields["vocab_size"] = fields.get("vocab_size") or vocab_size
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
