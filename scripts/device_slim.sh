#!/usr/bin/env bash
# A device call (the `device` tool) sends the checkout's tracked files, 64 MiB at most; the embedded models in
# assets/ are about 170 MB, so a call sends the code alone and carries the asset folders its command needs:
#   bash scripts/device_slim.sh slim             # assets/ untracked in the index and ignored (.git/info/exclude)
#   bash scripts/device_slim.sh size PATH...     # MiB a call carrying PATHs would send (at most 64)
#   bash scripts/device_slim.sh restore          # assets/ tracked again (from HEAD), the exclude line dropped
# Between slim and restore the index lacks assets/, so a commit would delete them: slim installs a pre-commit hook
# that refuses commits until restore (which removes it). Asset folders carried in one call stay on a warm device
# machine for the next (ignored outputs are kept), so a later call need not carry them again.
set -euo pipefail
EXCLUDE=$(git rev-parse --git-path info/exclude)
HOOK=$(git rev-parse --git-path hooks/pre-commit)
MARK="# device_slim: refuse commits while assets/ is untracked"
case "${1:-}" in
  slim)
    [ -z "$(git status --porcelain -- assets)" ] ||
      { echo "assets/ has changes: commit or drop them first" >&2; exit 1; }
    [ ! -e "$HOOK" ] || { echo "$HOOK exists: slim would replace it; move it away first" >&2; exit 1; }
    git rm -r -q --cached assets
    grep -qx "/assets/" "$EXCLUDE" 2>/dev/null || echo "/assets/" >>"$EXCLUDE"
    mkdir -p "$(dirname "$HOOK")"
    printf '#!/bin/sh\n%s\necho "%s" >&2\nexit 1\n' "$MARK" \
      "assets/ is untracked for a device call: bash scripts/device_slim.sh restore" >"$HOOK" && chmod +x "$HOOK"
    echo "assets/ untracked; carry what the command needs, then: bash scripts/device_slim.sh restore" ;;
  restore)
    git reset -q -- assets
    sed -i '\#^/assets/$#d' "$EXCLUDE"
    ! grep -qxF "$MARK" "$HOOK" 2>/dev/null || rm "$HOOK"
    git status --short -- assets | head -5 ;;
  size)
    shift
    { git ls-files -z --cached --others --exclude-standard; for path in "$@"; do find "$path" -type f -print0; done; } \
      | sort -zu | du -cb --files0-from=- | tail -1 | awk '{printf "%.1f MiB\n", $1 / 1048576}' ;;
  *) echo "usage: bash scripts/device_slim.sh slim | size PATH... | restore" >&2; exit 2 ;;
esac
