"""The test run's environment and the shared fixtures: configs composed through Hydra's compose API,
forced to CPU, tiny sizes and tmp_path, with W&B disabled unless a test turns it on; and the
fixtures that start processes, which mark their tests `slow`. What tests share besides fixtures is
in helpers.py."""
import os
import sys

# OpenMP threads that spin while they wait make every op take a scheduler time slice once more
# processes than cores compute (a test's subprocess next to the test itself, or a shared
# machine): ~10x slower tests. Passive waiting costs little when the cores are free. Set before
# torch loads OpenMP; subprocesses inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Under pytest-xdist (`-n N`) the cores are shared out among the N workers, and the processes a
# test starts inherit its worker's share: N workers of all the cores' threads each would oversubscribe.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
THREADS = max(1, min(2, (os.cpu_count() or 1) // WORKERS))
if WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))

import pytest  # noqa: E402
import torch  # noqa: E402

from helpers import TINY, compose_cfg, dead_pid as exited_pid, popen_cli, run_chromium, run_cli  # noqa: E402

os.environ.setdefault("WANDB_SILENT", "true")
os.environ.pop("WANDB_MODE", None)  # tests choose the mode explicitly
torch.set_num_threads(min(THREADS, torch.get_num_threads()))

# set by pytest, by inductor's first compile, by W&B's service, by scikit-learn's import (KMP_*, through
# lm-eval, datasets or TransformerLens), by lm-eval's import (HF_XET_*), by torch._dynamo.package's import
# (its default cache dir): the libraries' own bookkeeping, set once per process by whichever test first
# imports them (checked: importing each library the tests use, in one process, sets no other variable)
LIBRARIES_OWN_ENV = ("PYTEST_CURRENT_TEST", "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR", "WANDB_SERVICE",
                     "KMP_DUPLICATE_LIB_OK", "KMP_INIT_AT_FORK", "HF_XET_HIGH_PERFORMANCE", "TORCHINDUCTOR_CACHE_DIR")


def _global_state():
    """What one test can change for every later test in its worker: torch's threads, default dtype and
    grad mode, its compiler config modules, the signal handlers, and the environment."""
    import signal

    import torch._dynamo.config
    import torch._functorch.config
    import torch._inductor.config
    return {"threads": torch.get_num_threads(), "default dtype": torch.get_default_dtype(),
            "grad mode": torch.is_grad_enabled(),
            "torch._inductor.config": torch._inductor.config.get_config_copy(),
            "torch._functorch.config": torch._functorch.config.get_config_copy(),
            "torch._dynamo.config": torch._dynamo.config.get_config_copy(),
            "signal handlers": {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGALRM)},
            "unraisable hook": sys.unraisablehook,
            "environment": {k: v for k, v in os.environ.items() if k not in LIBRARIES_OWN_ENV}}


@pytest.fixture(autouse=True)
def leaves_global_state_as_found():
    """A test that changes global state must restore it (monkeypatch, torch's config.patch, a
    subprocess): a leak makes a later test in the same worker pass or fail by the order of the files."""
    before = _global_state()
    yield
    after = _global_state()
    changed = [k for k in before if before[k] != after[k]]
    if changed:
        detail = {k: sorted(str(n) for n in before[k].keys() | after[k].keys()
                            if before[k].get(n, "unset") != after[k].get(n, "unset"))[:4]
                  if isinstance(before[k], dict) else (before[k], after[k]) for k in changed}
        pytest.fail(f"the test left global state changed: {detail}", pytrace=False)


# Fixtures that start processes: every test that uses one (directly or through another fixture) is
# marked `slow` at collection, so `pytest -m "not slow"` starts none.
PROCESS_FIXTURES = ("cli", "chromium", "spawn", "dead_pid")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        if any(name in PROCESS_FIXTURES for name in getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    # the tests of a minute or more first: `-n auto` hands the first quarter of the tests out in turn, so each
    # worker starts on some of them, instead of one worker running one alone at the end while the other waits
    items.sort(key=lambda item: not item.nodeid.startswith(LONGEST))


LONGEST = ("tests/test_tour.py::test_the_notebook_runs_from_top_to_bottom",
           "tests/test_tour.py::test_each_steps_command_runs_and_prints_the_figures_the_page_quotes",
           "tests/test_parallel.py::test_fsdp_under_torchrun", "tests/tools/test_claims.py::test_trained_checks")


class Cli:
    """The repo's commands as real processes: cli("train.py", *args, env=, timeout=, cwd=, prefix=,
    torchrun=N, check=) runs one to its end (helpers.run_cli: a CompletedProcess); cli.popen(...)
    starts one and returns the live Popen (helpers.popen_cli). Processes still running when the test
    ends are killed."""

    def __init__(self):
        self.started = []

    def __call__(self, script, *args, **kwargs):
        return run_cli(script, *args, **kwargs)

    def popen(self, script, *args, **kwargs):
        proc = popen_cli(script, *args, **kwargs)
        self.started.append(proc)
        return proc

    def close(self):
        for proc in self.started:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


@pytest.fixture
def cli():
    runner = Cli()
    yield runner
    runner.close()


@pytest.fixture
def chromium():
    """chromium(profile_dir, *args, timeout=90): a headless Chromium run; its stdout (skipped without one)."""
    from helpers import CHROMIUM
    if CHROMIUM is None:
        pytest.skip("no headless Chromium on PATH (apt-get install chromium; .ci/run installs it where apt is available)")
    return run_chromium


@pytest.fixture
def spawn():
    """torch.multiprocessing.spawn, for tests that run a function in several processes."""
    return torch.multiprocessing.spawn


@pytest.fixture
def dead_pid():
    """The pid of a process that has exited (it starts one)."""
    return exited_pid()


@pytest.fixture
def train_cfg(tmp_path):
    """train_cfg(*overrides): a tiny CPU training config writing under tmp_path."""
    def make(*overrides):
        base = TINY + [f"out_dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}"]
        return compose_cfg("config", base + list(overrides))
    return make


@pytest.fixture
def sample_cfg():
    def make(*overrides):
        return compose_cfg("sample", ["device=cpu", *overrides])
    return make


@pytest.fixture
def text_file(tmp_path):
    """A small UTF-8 corpus file (a few thousand characters of varied text)."""
    lines = [f"line {i}: the quick brown fox jumps over the lazy dog {i * 7 % 13}." for i in range(200)]
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path
