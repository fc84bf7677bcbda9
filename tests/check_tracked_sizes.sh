#!/usr/bin/env bash
# Fails when a file tracked by git is larger than 5 MB (a core dump or a model committed by
# accident bloats every clone and makes the working tree too large to copy to a GPU machine).
# Test fixtures that must be larger are listed by name in ALLOW below, with the reason.
set -euo pipefail
cd "$(dirname "$0")/.."
LIMIT=$((5 * 1024 * 1024))
ALLOW=(
)
if ! git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  echo "check_tracked_sizes: not a git checkout, skipped"; echo "check_tracked_sizes: 0 passed, 0 failed, 1 skipped"; exit 0
fi
bad=0
while IFS= read -r -d '' f; do
  [ -f "$f" ] || continue
  sz=$(stat -c %s -- "$f")
  if [ "$sz" -gt "$LIMIT" ]; then
    allowed=0
    for a in "${ALLOW[@]}"; do [ "$a" = "$f" ] && allowed=1; done
    if [ "$allowed" = 0 ]; then
      echo "check_tracked_sizes: $f is $sz bytes, over the 5 MB limit for tracked files" >&2
      echo "  (remove it with 'git rm --cached', or list it in ALLOW in $0 with the reason)" >&2
      bad=1
    fi
  fi
done < <(git ls-files -z)
if [ "$bad" = 0 ]; then echo "check_tracked_sizes: every tracked file is under 5 MB"; fi
# one check, for `make test`'s summary
echo "check_tracked_sizes: $((1 - bad)) passed, $bad failed, 0 skipped"
exit $bad
