"""Generation speed, side by side in one process: with and without the KV cache, eager and
compiled, batch 1 and batch 8, against the memory-bandwidth bound of a decode step.

    python tools/bench_sample.py                                   # baby preset (6 x 6 x 384, block 256), 1000 tokens, CPU
    python tools/bench_sample.py model=cpu_small tokens=500 device=cuda batch_sizes=[1,8] compile=[false,true]

Random weights (speed does not depend on what the model learned), greedy decoding. The bound:
a cached decode step must read every weight once and the cached keys and values, so
tokens/s <= batch x bandwidth / (weight bytes + KV bytes per step), with the bandwidth measured
here by copying a large tensor. Each case is timed `repeats` times in interleaved rounds (this
machine class is noisy) and the median printed with the range; a compiled case is warmed up at
the timed length, so no compilation is timed. `layouts=[row,column]` also times the weights as
training leaves them (row-major) against the layout sample.py uses on CPU; `kv_dtypes` (default
both) times an fp32 and a bf16 KV cache side by side (sample.py's kv_dtype).
"""
import sys
from pathlib import Path

import hydra

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as tools/X.py: the repo's modules

from benchmarks import bench_sample  # noqa: E402  (registers the bench_sample config schema)
from cli import cli, run_app  # noqa: E402


@hydra.main(version_base="1.3", config_path="../configs", config_name="bench_sample")
@cli
def main(cfg):
    bench_sample(cfg)


if __name__ == "__main__":
    run_app(main)
