"""Time training steps of the configured model on random tokens (no data preparation).

    python tools/bench.py model=cpu_small train.batch_size=12            # ms/iter, tokens/s, MFU, memory
    python tools/bench.py model=cpu_small train.batch_size=12 bench.compare=/path/to/nanoGPT
    python tools/bench.py model=cpu_small train.batch_size=12 bench.kinds=[gdn,mamba2,gdn+softmax]

With bench.compare pointing at a karpathy/nanoGPT checkout, its GPT is timed at the same shapes
(learned positions instead of RoPE, otherwise the same block), interleaved round by round with
ours in one process, and the ratio printed: these machines are too noisy for anything else.
bench.kinds times the same model with other layer kinds the same way (each entry a layer_kinds
pattern, its layers joined by +): the step time of each as a ratio to the configured model's.
"""
import sys
from pathlib import Path

import hydra

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as tools/X.py: the repo's modules

from benchmarks import bench, print_result  # noqa: E402  (registers the bench config schema)
from cli import cli, run_app  # noqa: E402
from device import is_oom  # noqa: E402
from rules import UserError  # noqa: E402


@hydra.main(version_base="1.3", config_path="../configs", config_name="bench")
@cli
def main(cfg):
    try:
        result = bench(cfg)
    except RuntimeError as e:
        if is_oom(e):
            raise UserError(f"out of memory at train.batch_size={cfg.train.batch_size}: lower it, "
                            "model.block_size or the model size") from None
        raise
    print_result(result)


if __name__ == "__main__":
    run_app(main)
