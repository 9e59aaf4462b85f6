#!/usr/bin/env bash
# Build the demo REST datastore from the Python standard library into
# ~/.cache/specstack/datastore-stdlib (or $1), for `--drafter rest`.
#
# Every file in specstack/models/held_out.txt is excluded: those files are the
# benchmark prompts, and a store that contains them would be cheating.  Test
# suites, GUI and legacy packages and site-packages are left out to keep the
# store modest (about 2-3M tokens, a minute or less).  Rerunning with the same
# inputs does nothing.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python}"
STORE="${1:-$HOME/.cache/specstack/datastore-stdlib}"
STDLIB="$("$PYTHON" -c 'import os; print(os.path.dirname(os.__file__))')"
HELD_OUT="$REPO/specstack/models/held_out.txt"

[ -f "$HELD_OUT" ] || { echo "missing $HELD_OUT: run from a specstack checkout" >&2; exit 1; }
mkdir -p "$(dirname "$STORE")"

cd "$REPO"
"$PYTHON" -m specstack datastore build "$STDLIB" -o "$STORE" \
    --include '*.py' \
    --exclude-from "$HELD_OUT" \
    --exclude 'site-packages/*' --exclude 'dist-packages/*' \
    --exclude 'test/*' --exclude '*/test/*' --exclude '*/tests/*' --exclude '*/idle_test/*' \
    --exclude 'idlelib/*' --exclude 'lib2to3/*' --exclude 'tkinter/*' --exclude 'turtledemo/*' \
    --exclude 'distutils/*' --exclude 'ensurepip/*' --exclude 'encodings/*' \
    --exclude 'pydoc_data/*' --exclude 'config-*/*' \
    --max-tokens 3000000

# Belt and braces: prove no held-out file went in.
"$PYTHON" - "$STORE" "$HELD_OUT" <<'PY'
import json, sys
meta = json.load(open(f"{sys.argv[1]}/meta.json"))
held = {l.strip() for l in open(sys.argv[2]) if l.strip()}
leaked = sorted(held & {s["name"] for s in meta["sources"]})
if leaked:
    sys.exit(f"held-out files leaked into {sys.argv[1]}: {leaked}")
print(f"{sys.argv[1]}: {meta['n_tokens']} tokens from {meta['n_docs']} files; no held-out file included",
      file=sys.stderr)
PY
