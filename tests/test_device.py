"""lab/device.py: the dtype names the schemas accept are the dtypes a run can compute in; and the helpers
every command imports (rules, files, device, parallel, cli) import nothing command-side."""
from pathlib import Path

import torch

from lab.config import DTYPE_NAMES
from lab.device import pick_dtype

REPO = Path(__file__).resolve().parents[1]


def test_the_schemas_dtype_names_are_auto_and_the_runtime_dtypes():
    assert DTYPE_NAMES == ("auto", "float32", "bfloat16", "float16")  # what the schemas accept, written out
    for name in ("float32", "bfloat16", "float16"):  # each name is torch's dtype of that name
        assert pick_dtype(name, torch.device("cpu")) is getattr(torch, name)
    assert pick_dtype("auto", torch.device("cpu")) is torch.float32  # a CPU computes in fp32 unless told
