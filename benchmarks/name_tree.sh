#!/usr/bin/env bash
# Name this tree for a copy that travels without its git checkout (the lent GPU machine's):
# writes TREE_COMMIT at the root, this checkout's commit (with -dirty where files changed),
# which flyspec.support.machine.git_commit reads there. git ignores the file: carry it along.
set -euo pipefail
cd "$(dirname "$0")/.."
git describe --always --dirty --abbrev=12 > TREE_COMMIT
cat TREE_COMMIT
