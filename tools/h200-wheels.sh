#!/usr/bin/env bash
# Prepare .whl/ for `tools/h200-run.sh` on a GPU machine that has Python 3.12, torch,
# transformers, numpy, safetensors, tokenizers, aiohttp, uvloop, prometheus-client, psutil,
# pluggy and attrs, but not Ray, Starlette, uvicorn, httptools, orjson, jsonschema or py-spy
# (for PYSPY=1 of tools/h200-issue34.sh), and that
# can reach no package registry. Run it here, from any directory, with network access to PyPI:
#
#   tools/h200-wheels.sh            # writes .whl/ (ignored by git), about 45 MB
#
# It downloads the missing wheels for CPython 3.12 on manylinux x86_64, slims Ray's (79 MB:
# without its Java jars, its dashboard's web build and the libraries relax run never imports,
# about 40 MB; see tools/slim_wheel.py) and builds the repository's own distributions (the
# core, the hf engine, the three roles, the reward rules) as wheels, so their entry points are
# found once installed. Everything shipped to the machine must stay under 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
rm -rf .whl
mkdir -p .whl/download
platforms=(
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64
)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" -d .whl/download \
  ray==2.60.0 \
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 \
  starlette==1.10.0 uvicorn==0.54.0 httptools==0.9.0 orjson==3.13.0 py-spy==0.4.3
"$PY" tools/slim_wheel.py .whl/download/ray-*.whl .whl \
  ray/jars/ ray/dashboard/client/ ray/rllib/ ray/tune/ ray/train/ ray/serve/ ray/data/ ray/llm/
find .whl/download -name '*.whl' ! -name 'ray-*' -exec mv {} .whl/ \;
rm -rf .whl/download
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w .whl \
  . plugins/relax-hf plugins/relax-rollout plugins/relax-genrm plugins/relax-teacher \
  plugins/relax-torch-trainer plugins/relax-torch-weights plugins/relax-bench \
  contrib/relax-reward-rules
rm -rf build ./*.egg-info plugins/*/build contrib/*/build
ls -la .whl
du -sh .whl
