#!/usr/bin/env bash
# Download the wheels tools/gpu_check.sh installs on a GPU machine that has no package index.
#
#   bash tools/fetch_gpu_wheels.sh            # needs PyPI; ~26 MiB into .gpu_wheels/ (ignored by git)
#
# The GPU image (Python 3.12, x86-64) already has torch, numpy, pyarrow, pandas, requests, httpx,
# huggingface-hub, tqdm, pyyaml, xxhash, tiktoken, matplotlib and pytest, but not hydra-core,
# omegaconf, antlr4, datasets (nor dill, multiprocess), wandb (nor pydantic, opentelemetry, ...) or
# rustbpe. This fetches exactly those, at the versions our tests run with, plus four small packages
# the image has but perhaps at a version our pins refuse (fsspec: datasets caps it; typing-extensions:
# pydantic's floor; protobuf, click: wandb's). pip then takes a folder wheel only where the image's
# own version does not fit. Everything must stay under the GPU run's 64 MiB (tree and wheels).
#
# GPU_WHEELS=DIR picks the folder, GPU_PYTHON=3.12 the Python version the wheels are for.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${GPU_WHEELS:-.gpu_wheels}
PY=${GPU_PYTHON:-3.12}
MAX_MIB=60

# the top-level pins come from requirements.txt, so the GPU runs what CI runs
pin() { grep -E "^$1==" requirements.txt || { echo "error: requirements.txt pins no $1==" >&2; exit 1; }; }
TOP="$(pin hydra-core) $(pin datasets) $(pin wandb) $(pin rustbpe)"
# their dependencies that the image lacks (pip install --dry-run --report, minus the image's list)
DEPS="omegaconf==2.3.1 dill==0.4.1 multiprocess==0.70.19
      pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2 platformdirs==4.14.8
      cwevals==0.0.1b1 distro==1.9.0 sniffio==1.3.1 googleapis-common-protos==1.76.0
      opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2
      opentelemetry-proto==1.45.2 opentelemetry-exporter-otlp-proto-http==1.45.2
      opentelemetry-exporter-otlp-proto-common==1.45.2 opentelemetry-exporter-otlp-common==0.66b2
      opentelemetry-exporter-http-transport==0.66b2"
# in the image, but maybe at a version outside our pins' ranges
SAFETY="fsspec==2026.9.0 typing-extensions==4.16.0 protobuf==7.36.2 click==8.5.1"
# antlr4 4.9.3 (hydra-core's and omegaconf's parser) exists only as a source archive: pure Python,
# so a wheel built here works there
SDIST_ONLY="antlr4-python3-runtime==4.9.3"

rm -rf "$DIR"
mkdir -p "$DIR"
python3 -m pip wheel -q --no-deps --no-cache-dir -w "$DIR" $SDIST_ONLY
PLATFORMS=""
for p in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1; do
  PLATFORMS="$PLATFORMS --platform ${p}_x86_64"
done
# shellcheck disable=SC2086  # word splitting of the lists is intended
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp \
  --abi "cp${PY/./}" $PLATFORMS -d "$DIR" $TOP $DEPS $SAFETY

count=$(ls "$DIR"/*.whl | wc -l)
expected=$(echo $TOP $DEPS $SAFETY $SDIST_ONLY | wc -w)
[ "$count" -eq "$expected" ] || { echo "error: $count wheels in $DIR, expected $expected (one per package)" >&2; exit 1; }
mib=$(du -sm "$DIR" | cut -f1)
ls -l "$DIR" | awk 'NR > 1 {printf "%8.1f KiB  %s\n", $5 / 1024, $9}'
echo "$count wheels, $mib MiB in $DIR (for Python $PY, x86-64)"
[ "$mib" -le "$MAX_MIB" ] || { echo "error: $DIR is $mib MiB, over the $MAX_MIB MiB the GPU run can carry" >&2; exit 1; }
