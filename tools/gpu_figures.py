"""The GPU figures, each step tools/bench.py or tools/bench_sample.py in a process of its own:
training-step speed and MFU at the baby and GPT-2-124M shapes (bf16 autocast + torch.compile),
attention memory at two block sizes (eager), and decode speed with and without the KV cache (the
compiled step too). Each step is timed and printed; a failed step does not stop the others; all the
figures go to one JSON file.

    python tools/gpu_figures.py --out gpu_figures.json            # on a GPU: about 4-5 minutes
    python tools/gpu_figures.py --device cpu --out gpu_figures.json   # the same steps at tiny sizes

tools/gpu_check.sh runs it as its last step. Exit status 1 if any step failed.
"""
import argparse
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as tools/X.py: the repo's modules

import torch  # noqa: E402

from lab.cli import cli  # noqa: E402
from files import check_output_file  # noqa: E402
from rules import UserError  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

# (step name, command config, overrides): on a GPU, then at tiny sizes for a CPU dry run
GPU_STEPS = [
    ("train step, baby shape (6x6x384, block 256), bf16 + compile", "bench",
     ["model=baby", "train.batch_size=64", "dtype=bfloat16", "compile=true", "bench.warmup=10", "bench.iters=40"]),
    ("train step, GPT-2 124M shape (12x12x768, block 1024), bf16 + compile", "bench",
     ["model=gpt2_124m", "model.vocab_size=50304", "train.batch_size=16", "dtype=bfloat16", "compile=true",
      "bench.warmup=10", "bench.iters=20"]),
    ("attention memory, GPT-2 shape, block 1024, batch 1 (eager)", "bench",
     ["model=gpt2_124m", "model.vocab_size=50304", "model.block_size=1024", "train.batch_size=1", "dtype=bfloat16",
      "compile=false", "bench.warmup=2", "bench.iters=3"]),
    ("attention memory, GPT-2 shape, block 4096, batch 1 (eager)", "bench",
     ["model=gpt2_124m", "model.vocab_size=50304", "model.block_size=4096", "train.batch_size=1", "dtype=bfloat16",
      "compile=false", "bench.warmup=2", "bench.iters=3"]),
    ("decode, baby shape: recompute vs KV cache, eager and compiled (CUDA graphs), batch 1 and 8", "bench_sample",
     ["model=baby", "tokens=500", "batch_sizes=[1,8]", "compile=[false,true]", "kv_dtypes=[auto]", "repeats=1"]),
]
CPU_STEPS = [
    ("train step, tiny shape, fp32 eager", "bench", ["model=debug", "train.batch_size=4", "compile=false",
                                                     "bench.warmup=1", "bench.iters=2"]),
    ("train step, tiny shape, bf16 autocast + compile", "bench",
     ["model=debug", "train.batch_size=4", "dtype=bfloat16", "compile=true", "bench.warmup=1", "bench.iters=2"]),
    ("attention memory, tiny shape, block 64 (eager)", "bench",
     ["model=debug", "model.block_size=64", "train.batch_size=1", "compile=false", "bench.warmup=1", "bench.iters=2"]),
    ("attention memory, tiny shape, block 256 (eager)", "bench",
     ["model=debug", "model.block_size=256", "train.batch_size=1", "compile=false", "bench.warmup=1", "bench.iters=2"]),
    ("decode, tiny shape: recompute vs KV cache, eager and compiled, batch 1 and 2", "bench_sample",
     ["model=debug", "tokens=40", "batch_sizes=[1,2]", "compile=[false,true]", "kv_dtypes=[auto]", "repeats=1"]),
]


def run_step(kind, overrides, device) -> dict:
    """One step: tools/bench.py or tools/bench_sample.py in a process of its own (a fresh compiler), its
    output printed as it comes and kept."""
    command = [sys.executable, str(REPO / "tools" / f"{kind}.py"), f"device={device}", *overrides,
               *(["logger.wandb.mode=disabled"] if kind == "bench" else [])]
    lines = []
    with subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as p:
        for line in p.stdout:
            print(line, end="", flush=True)
            lines.append(line.rstrip("\n"))
    if p.returncode != 0:
        raise RuntimeError(f"{kind}.py exited {p.returncode}: {lines[-1] if lines else ''}")
    return {"output": lines}


def gpu_figures(device: str, out=None) -> dict:
    if out:
        check_output_file(out, "--out")  # before minutes of work
    steps = GPU_STEPS if device != "cpu" else CPU_STEPS
    figures = {"device": device, "torch": torch.__version__, "steps": {}}
    if device != "cpu":
        figures["gpu"] = torch.cuda.get_device_name(torch.device(device))
    t_all = time.perf_counter()
    for name, kind, overrides in steps:
        print(f"\n== {name}", flush=True)
        t0 = time.perf_counter()
        try:
            result = run_step(kind, overrides, device)
            figures["steps"][name] = {"ok": True, "seconds": round(time.perf_counter() - t0, 1), **result}
        except Exception as e:  # a failed step does not stop the others
            traceback.print_exc()
            figures["steps"][name] = {"ok": False, "seconds": round(time.perf_counter() - t0, 1),
                                      "error": f"{type(e).__name__}: {str(e)[:300]}"}
        if device != "cpu":
            torch.cuda.empty_cache()
        print(f"-- {name}: {'ok' if figures['steps'][name]['ok'] else 'FAILED'} in "
              f"{figures['steps'][name]['seconds']:.0f} s", flush=True)
    figures["seconds"] = round(time.perf_counter() - t_all, 1)
    if out:
        Path(out).write_text(json.dumps(figures, indent=1, default=str))
    return figures


@cli
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (the figures) or cpu (a dry run at tiny sizes)")
    parser.add_argument("--out", default=None, help="write the figures to this JSON file")
    args = parser.parse_args(argv)
    if args.device != "cpu" and not torch.cuda.is_available():
        raise UserError(f"--device {args.device} but no CUDA GPU is visible: use --device cpu for a dry run")
    figures = gpu_figures(args.device, args.out)
    failed = [n for n, s in figures["steps"].items() if not s["ok"]]
    print(f"\n{len(figures['steps']) - len(failed)} of {len(figures['steps'])} steps passed in {figures['seconds']:.0f} s"
          + (f"; FAILED: {'; '.join(failed)}" if failed else ""))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
