#!/usr/bin/env bash
# Base-commit copies for tools/prefill_ab.py --before: every kernels/ and linrnn_serve/ Python file that differs
# between BASE and HEAD (batch.py excepted: its dataclass only gained a field), at its repository path under DIR.
#   tools/prefill_ab_before.sh BASE [DIR]      (DIR default .gpu/prefill-ab-before; .gpu is git-ignored)
set -e
BASE=${1:?base commit}; DIR=${2:-.gpu/prefill-ab-before}
rm -rf "$DIR"; mkdir -p "$DIR"
for f in $(git diff --name-only "$BASE" HEAD -- kernels linrnn_serve | grep '\.py$' | grep -v '^linrnn_serve/batch.py$'); do
  git cat-file -e "$BASE:$f" 2>/dev/null || continue  # files new since BASE have no before side
  mkdir -p "$DIR/$(dirname "$f")"; git show "$BASE:$f" > "$DIR/$f"
done
find "$DIR" -name '*.py' | sort
