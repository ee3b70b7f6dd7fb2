#!/usr/bin/env bash
# Downloads, on a machine with internet, the wheels the three services import that the GPU
# machine's image lacks, for its Python (CPython 3.12, manylinux x86_64), into .whl/ at the
# repository root (ignored through .git/info/exclude). The device command then starts with
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
#
# and names .whl in the run's `carry`. python -m bench.server passes PYTHONPATH on to the
# stages it starts.
#
# What the image has (KINDS.md): torch, triton, numpy, grpcio 1.84, PyYAML, safetensors,
# tokenizers, filelock, prometheus_client, matplotlib, transformers. What it lacks:
#   posix_ipc                        talker / Code2Wav rings (POSIX shared memory, semaphores)
#   soxr                             resampling (gateway, Code2Wav voice clips); needs numpy (there)
#   av                               gateway OGG/Opus encoding (bundled FFmpeg; no dependencies)
#   grpcio-health-checking==1.84.0   every stage's health service; needs grpcio, protobuf
#   grpcio-reflection==1.84.0        every stage's server reflection; needs grpcio, protobuf
#   grpcio-status==1.84.0            every stage's rich error details (google.rpc.Status with an
#                                    ErrorInfo); needs grpcio, protobuf, googleapis-common-protos
#   googleapis-common-protos==1.76.0 google.rpc's messages (needs protobuf >= 6.33.5, < 8)
#   protobuf (7.x)                   the committed voxring/v1 code is generated for protobuf >= 7.35.1
#                                    and the two grpcio packages need it; the image's version is
#                                    not on record, so a 7.x wheel travels (shadows the image's one
#                                    only for processes with /tmp/site on PYTHONPATH)
#   fastapi, starlette, pydantic, pydantic_core, annotated-types, typing-inspection, uvicorn,
#   python-multipart                 the gateway's HTTP API (imported whenever the gateway starts);
#                                    typing_extensions travels too: pydantic needs a newer one than
#                                    the image may hold, anyio (starlette needs >= 4) and
#                                    opentelemetry-api (fastapi imports it) (click, h11,
#                                    annotated-doc: in the image)
#   websockets                       uvicorn's WebSocket protocol (the gateway's incremental-text
#                                    WebSocket; uvicorn imports it when the gateway starts)
#   py-spy                           the server bench's --profile-tier (bench/server/profile.py):
#                                    only with PROFILER=1 (2.9 MB of the 64 MiB a call carries, for a
#                                    run that sets PROFILE=); without it one left in DEST is removed
# Usage: [PROFILER=1] bench/server/fetch_wheels.sh [DEST]   (default: .whl at the repository root)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DEST="${1:-$ROOT/.whl}"
PYTHON="${PYTHON:-python3}"
MAX_MB=50
PACKAGES=(
  "posix_ipc==1.3.2"
  "soxr==1.1.0"
  "av==19.0.2"
  "grpcio-health-checking==1.84.0"
  "grpcio-reflection==1.84.0"
  "grpcio-status==1.84.0"
  "googleapis-common-protos==1.76.0"
  "protobuf==7.36.2"
  "fastapi==0.165.0"
  "starlette==1.10.0"
  "pydantic==2.14.4"
  "pydantic_core==2.50.5"
  "annotated-types==0.8.0"
  "typing-inspection==0.4.5"
  "typing_extensions==4.16.0"
  "uvicorn==0.55.0"
  "python-multipart==0.0.34"
  "anyio==4.16.0"
  "opentelemetry-api==1.45.2"
  "websockets==17.4"
)
if [ "${PROFILER:-0}" = 1 ]; then
  PACKAGES+=("py-spy==0.4.3")
fi

mkdir -p "$DEST"
[ "${PROFILER:-0}" = 1 ] || find "$DEST" -maxdepth 1 -iname 'py_spy-*.whl' -delete
if [ "$DEST" = "$ROOT/.whl" ] && ! grep -qxF '/.whl/' "$ROOT/.git/info/exclude" 2>/dev/null; then
  if [ -d "$ROOT/.git/info" ]; then echo '/.whl/' >> "$ROOT/.git/info/exclude"; fi
fi
# One version of each package: two stop the whole install on the device.
for spec in "${PACKAGES[@]}"; do
  name="${spec%%==*}"
  pattern="$(echo "$name" | tr '-' '_')"
  find "$DEST" -maxdepth 1 -iname "${pattern}-*.whl" ! -iname "${pattern}-${spec##*==}-*.whl" -delete
done

"$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d "$DEST" "${PACKAGES[@]}"

echo "wheels in $DEST:"
total=0
for whl in "$DEST"/*.whl; do
  size=$(stat -c %s "$whl")
  total=$((total + size))
  printf '  %8.2f MB  %s\n' "$(echo "$size / 1000000" | bc -l)" "$(basename "$whl")"
  # their needs, for the record: every one must be in the image or in this folder
  unzip -p "$whl" '*.dist-info/METADATA' | grep '^Requires-Dist' | grep -v 'extra ==' \
    | sed 's/^/              /' || true
done
printf '  %8.2f MB  in all (limit %d MB; the working tree that travels is at most 64 MiB)\n' \
  "$(echo "$total / 1000000" | bc -l)" "$MAX_MB"
if [ "$total" -gt $((MAX_MB * 1000000)) ]; then
  echo "fetch_wheels.sh: the wheels exceed $MAX_MB MB" >&2
  exit 1
fi
