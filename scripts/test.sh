#!/usr/bin/env bash
# Install what is missing, then run the whole test suite (extra args go to pytest).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$REPO/scripts/install.sh"
cd "$REPO"
exec "$REPO/.venv/bin/python" -m pytest tests "$@"
