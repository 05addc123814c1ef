#!/usr/bin/env bash
# Base-commit copies for tools/prefill_ab.py --before: every Python file under PATHS (default: the prefill kernels,
# layers and model of prefill round 3) that differs between BASE and HEAD, at its repository path under DIR.
# Keep PATHS to what the change under test touched: other work merged since BASE would be swapped out too.
#   tools/prefill_ab_before.sh BASE [DIR] [PATHS...]      (DIR default .gpu/prefill-ab-before; .gpu is git-ignored)
set -e
BASE=${1:?base commit}; DIR=${2:-.gpu/prefill-ab-before}; shift $(( $# < 2 ? $# : 2 ))
PATHS=${*:-kernels/attention kernels/gdn linrnn_serve/layers linrnn_serve/models}
rm -rf "$DIR"; mkdir -p "$DIR"
for f in $(git diff --name-only "$BASE" HEAD -- $PATHS | grep '\.py$'); do
  git cat-file -e "$BASE:$f" 2>/dev/null || continue  # files new since BASE have no before side
  mkdir -p "$DIR/$(dirname "$f")"; git show "$BASE:$f" > "$DIR/$f"
done
find "$DIR" -name '*.py' | sort
