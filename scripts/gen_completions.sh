#!/usr/bin/env bash
# Regenerate the committed shell completion scripts from the CLI itself (typer's completion
# support): completions/eepctl.{bash,zsh,fish}. Usage: scripts/gen_completions.sh [OUT_DIR]
# tests/test_completions.py regenerates them into a temp dir and fails when they drift.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$ROOT/completions}"
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
    if [[ -x "$ROOT/.venv/bin/python" ]]; then PY="$ROOT/.venv/bin/python"; else PY="python3"; fi
fi
mkdir -p "$OUT"
cd "$ROOT"
for shell in bash zsh fish; do
    "$PY" -m eepctl completion "$shell" > "$OUT/eepctl.$shell.tmp"
    mv "$OUT/eepctl.$shell.tmp" "$OUT/eepctl.$shell"
done
echo "wrote $OUT/eepctl.{bash,zsh,fish}"
