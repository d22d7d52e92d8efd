#!/usr/bin/env bash
# Whether benchmarks/gpu_first_look.py and the engine run with what the lent GPU machine's
# image holds (benchmarks/gpu_configs/image_requirements.txt: Python 3.12, torch 2.11,
# transformers 5.17, and no other package), so that a lease is not spent on an import error
# or an API that moved: the script's CPU forms (--tiny, then the lease's rehearsal,
# --rehearse --quick, minutes of compiling), with flyspec from src/ as on the lent machine,
# then the tests of the script, the lean and compiled forwards, the decoding loop,
# verification, -k auto, trace replay and the decoder's revision digests, on the CPU.
#   bash benchmarks/device_image_check.sh [VENV]
# VENV (default /tmp/flyspec-device-image) is made with $PYTHON (default python3.12);
# torch 2.11 from PyPI is its CUDA build with CUDA's libraries: about 5 GB installed.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-/tmp/flyspec-device-image}
python=${PYTHON:-python3.12}
pins=benchmarks/gpu_configs/image_requirements.txt
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
"$venv/bin/python" -m pip install -q -r "$pins"  # seconds once installed
"$venv/bin/python" - "$pins" <<'PY'
import importlib.metadata as metadata
import platform
import sys

lines = [line.split("#")[0].strip() for line in open(sys.argv[1])]
pins = dict(line.split("==") for line in lines if "==" in line)
found = {name: metadata.version(name) for name in pins}
wrong = [f"{n} {found[n]} (wants {v})" for n, v in pins.items() if found[n].split("+")[0] != v]
print(f"Python {platform.python_version()}; " + ", ".join(f"{n} {v}" for n, v in found.items()))
if wrong:
    sys.exit("not the image's versions: " + "; ".join(wrong))
PY
"$venv/bin/python" benchmarks/gpu_first_look.py --device cpu --tiny
"$venv/bin/python" benchmarks/gpu_first_look.py --device cpu --rehearse --quick
PYTHONPATH=src "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/test_gpu_first_look.py \
    tests/test_lean.py tests/test_decode.py tests/test_verify.py tests/test_decoder_revision.py \
    tests/test_replay.py tests/test_auto_k.py
