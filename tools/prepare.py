"""Prepare a dataset ahead of training: text -> token ids on disk, once (data/prepare.py does the work;
train.py would do the same at its start). Prints the prepared directory.

    python tools/prepare.py data=shakespeare_char data.path=input.txt
    python tools/prepare.py data=tinystories data.num_proc=8            # a Hub dataset (needs the network)
"""
import sys
from pathlib import Path

import hydra

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as tools/X.py: the repo's modules

from data.prepare import prepare  # noqa: E402
from lab import config  # noqa: E402,F401  (registers the schema)
from lab.cli import cli, run_app  # noqa: E402
from rules import check_values  # noqa: E402


@hydra.main(version_base="1.3", config_path="../configs", config_name="prepare")
@cli
def main(cfg):
    check_values(cfg)
    print(prepare(cfg.data))


if __name__ == "__main__":
    run_app(main)
