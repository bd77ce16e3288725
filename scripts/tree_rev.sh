#!/usr/bin/env bash
# The revision a dated log ran on, for its header: the commit, plus how many tracked files differ
# from it when the working tree is not clean (a machine that receives a copy of a working tree
# can hold git metadata older than the files: the commit alone would then name the wrong code).
cd "$(dirname "${BASH_SOURCE[0]}")/.."
rev=$(git rev-parse --short HEAD 2>/dev/null) || { echo "?"; exit 0; }
changed=$(git status --porcelain --untracked-files=no 2>/dev/null | wc -l)
if [[ $changed -gt 0 ]]; then
    echo "$rev + $changed changed tracked file(s)"
else
    echo "$rev"
fi
