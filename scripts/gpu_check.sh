#!/usr/bin/env bash
# One short GPU session: the GPU-marked tests, then training and generation speed.
#   bash scripts/gpu_check.sh            (about 5 minutes on one H100/H200)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 WANDB_SILENT=true
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
pytest -q -m gpu -p no:cacheprovider
echo "== bench: baby (6x6x384, block 256), bf16 + compile"
python bench.py model=baby train.batch_size=64 device=cuda compile=true bench.iters=50
echo "== bench: GPT-2 124M shape (12x12x768, block 1024), bf16 + compile"
python bench.py model=gpt2_124m model.vocab_size=50304 train.batch_size=16 device=cuda compile=true bench.iters=30
echo "== attention memory: block 1024 vs 4096 (fast path, batch 1)"
for T in 1024 4096; do
  python bench.py model=gpt2_124m model.vocab_size=50304 model.block_size=$T train.batch_size=1 device=cuda compile=false bench.iters=5 | grep -E "ms/iter|peak memory" | sed "s/^/block $T: /"
done
echo "== generation: KV cache vs recompute (baby, 1000 tokens)"
python bench_sample.py device=cuda
