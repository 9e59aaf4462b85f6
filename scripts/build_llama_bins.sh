#!/usr/bin/env bash
# Build llama.cpp's own example binaries (the "peers" specstack benchmarks against) from the
# llama.cpp tree vendored in the llama-cpp-python sdist we depend on, so the peers run the exact
# same llama.cpp version as specstack does.
#
#   scripts/build_llama_bins.sh [CACHE_DIR]      # default ~/.cache/specstack/llama-bins
#   KERNELS=specstack scripts/build_llama_bins.sh [CACHE_DIR]
#                                                # default ~/.cache/specstack/llama-bins-specstack
#
# KERNELS=specstack builds the same binaries with the same cmake flags from a tree with specstack's
# verification kernels edited into ggml-cpu (specstack.llama.kernel_edits, applied by
# `python3 -m specstack.llama.kernel_tree`), so the bench can tell the kernels' gain from the drafting's.
# Its BIN_DIR/KERNELS records a key of the llama-cpp-python version, our C sources and the edit list:
# a change to any of them rebuilds (incrementally: only changed files are rewritten in its tree).
# It needs the Python that runs specstack (PYTHON, default python3) and reuses the stock build's sdist.
#
# Prints CACHE_DIR/bin on stdout (everything else goes to stderr). Idempotent: if every binary is
# already in CACHE_DIR/bin it only prints the path. Set JOBS (default 2) and NICE (default 10) to
# change build parallelism and priority; LLAMA_CPP_PYTHON_VERSION to pick another sdist.
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
KERNELS="${KERNELS:-stock}"
STOCK_CACHE_DIR="${HOME}/.cache/specstack/llama-bins"
case "${KERNELS}" in
    stock) CACHE_DIR="${1:-${STOCK_CACHE_DIR}}" ;;
    specstack) CACHE_DIR="${1:-${HOME}/.cache/specstack/llama-bins-specstack}" ;;
    *) echo "build_llama_bins: error: KERNELS must be stock or specstack, not '${KERNELS}'" >&2; exit 2 ;;
esac
JOBS="${JOBS:-2}"
NICE="${NICE:-10}"
BIN_DIR="${CACHE_DIR}/bin"
# llama-simple is plain generation without the chat machinery; llama-completion is the
# non-interactive completion tool (this tree has no llama-cli).
# llama-server is the serving peer of `specstack serve` (benchmarks/serve_load.py).
TARGETS=(llama-speculative-simple llama-speculative llama-lookup llama-simple llama-completion llama-bench llama-server)

log() { echo "build_llama_bins: $*" >&2; }

REPO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
# specstack's modules from this checkout, whatever the caller's PYTHONPATH
kernel_tree() { PYTHONPATH="${REPO_DIR}${PYTHONPATH:+:${PYTHONPATH}}" "${PYTHON}" -m specstack.llama.kernel_tree "$@"; }

# What BIN_DIR/KERNELS must say: absent for stock bins, "specstack <key>" for ours.
KERNELS_LINE=""
if [[ "${KERNELS}" == specstack ]]; then
    KERNELS_LINE="specstack $(kernel_tree key "${VERSION}")"
fi

# BIN_DIR/VERSION is written last: the version, the targets asked for, then the binaries built.
all_built() {
    [[ -f "${BIN_DIR}/VERSION" ]] || return 1
    if [[ -z "${KERNELS_LINE}" ]]; then
        [[ ! -e "${BIN_DIR}/KERNELS" ]] || return 1
    else
        [[ "$(cat "${BIN_DIR}/KERNELS" 2>/dev/null)" == "${KERNELS_LINE}" ]] || return 1
    fi
    [[ "$(head -n1 "${BIN_DIR}/VERSION")" == "${VERSION}" ]] || return 1
    [[ "$(sed -n 2p "${BIN_DIR}/VERSION")" == "targets: ${TARGETS[*]}" ]] || return 1
    local t
    for t in $(tail -n +3 "${BIN_DIR}/VERSION"); do
        [[ -x "${BIN_DIR}/${t}" ]] || return 1
    done
}

if all_built; then
    log "already built (llama-cpp-python ${VERSION}${KERNELS_LINE:+, ${KERNELS_LINE}})"
    echo "${BIN_DIR}"
    exit 0
fi

for tool in cmake python3; do
    command -v "$tool" >/dev/null || { log "error: '$tool' not found on PATH"; exit 1; }
done

mkdir -p "${CACHE_DIR}"
SDIST="$(ls "${CACHE_DIR}"/llama_cpp_python-"${VERSION}".tar.gz 2>/dev/null || true)"
if [[ -z "${SDIST}" && "${KERNELS}" == specstack ]]; then  # the stock build's download serves both
    SDIST="$(ls "${STOCK_CACHE_DIR}"/llama_cpp_python-"${VERSION}".tar.gz 2>/dev/null || true)"
fi
if [[ -z "${SDIST}" ]]; then
    log "downloading the llama-cpp-python ${VERSION} sdist"
    python3 -m pip download --quiet --no-deps --no-binary llama-cpp-python \
        "llama-cpp-python==${VERSION}" -d "${CACHE_DIR}" >&2
    SDIST="$(ls "${CACHE_DIR}"/llama_cpp_python-"${VERSION}".tar.gz)"
else
    log "reusing ${SDIST}"
fi

if [[ "${KERNELS}" == specstack ]]; then
    # a tree of its own (never the stock build's), synced to the sdist plus the current edits
    LLAMA_DIR="${CACHE_DIR}/src-specstack-${VERSION}/llama.cpp"
    BUILD_DIR="${CACHE_DIR}/build-specstack-${VERSION}"
    log "applying specstack's kernel edits to ${LLAMA_DIR}"
    kernel_tree prepare "${SDIST}" "${LLAMA_DIR}"
else
    SRC_DIR="${CACHE_DIR}/src/llama_cpp_python-${VERSION}"
    if [[ ! -d "${SRC_DIR}/vendor/llama.cpp" ]]; then
        mkdir -p "${CACHE_DIR}/src"
        tar -xzf "${SDIST}" -C "${CACHE_DIR}/src"
    fi
    LLAMA_DIR="${SRC_DIR}/vendor/llama.cpp"
    BUILD_DIR="${CACHE_DIR}/build-${VERSION}"
fi

log "configuring ${LLAMA_DIR}"
cmake -S "${LLAMA_DIR}" -B "${BUILD_DIR}" \
    -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_SERVER=ON -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF >&2

# Build only the targets this tree defines (names change between llama.cpp versions).
HELP="$(cmake --build "${BUILD_DIR}" --target help 2>/dev/null || true)"
AVAILABLE=()
for t in "${TARGETS[@]}"; do
    if grep -qE "(^|[ .])${t}(:|$| )" <<<"${HELP}"; then
        AVAILABLE+=("$t")
    else
        log "note: target ${t} does not exist in this llama.cpp tree, skipping"
    fi
done
[[ ${#AVAILABLE[@]} -gt 0 ]] || { log "error: none of ${TARGETS[*]} exist"; exit 1; }

log "building ${AVAILABLE[*]} with -j${JOBS} (takes about 8+ minutes on 2 cores)"
nice -n "${NICE}" cmake --build "${BUILD_DIR}" -j"${JOBS}" --target "${AVAILABLE[@]}" >&2

if [[ -n "${KERNELS_LINE}" ]]; then  # statically linked: our kernels' symbols are in every binary
    for t in "${AVAILABLE[@]}"; do
        grep -q specstack_verify_mul_mat "${BUILD_DIR}/bin/${t}" \
            || { log "error: ${t} was built without specstack's kernels"; exit 1; }
    done
fi

mkdir -p "${BIN_DIR}"
rm -f "${BIN_DIR}/VERSION" "${BIN_DIR}/KERNELS"
for t in "${AVAILABLE[@]}"; do
    cp -f "${BUILD_DIR}/bin/${t}" "${BIN_DIR}/${t}"
done
[[ -z "${KERNELS_LINE}" ]] || echo "${KERNELS_LINE}" >"${BIN_DIR}/KERNELS"
{ echo "${VERSION}"; echo "targets: ${TARGETS[*]}"; printf '%s\n' "${AVAILABLE[@]}"; } >"${BIN_DIR}/VERSION"
log "done"
echo "${BIN_DIR}"
