#!/usr/bin/env bash
# The dataset benchmark's peers (MosaicML streaming, the S3 Connector for PyTorch) in a venv of
# their own: they pull an older numpy, torchvision and much else that the project must not depend on.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
[ -x .venv-bench/bin/python ] || "$PY" -m venv .venv-bench
.venv-bench/bin/python -m pip install -q --upgrade pip
.venv-bench/bin/python -m pip install -q torch==2.13.0
.venv-bench/bin/python -m pip install -q -e '.[test]' torch==2.13.0
.venv-bench/bin/python -m pip install -q 'mosaicml-streaming==0.13.0' 's3torchconnector==1.5.0' torch==2.13.0
.venv-bench/bin/python -c "import s3torchconnector, streaming.base.format.mds.writer" 2>/dev/null \
  || echo "note: streaming imports torchvision, which does not load beside this torch; bench_dataset.py stubs it"
