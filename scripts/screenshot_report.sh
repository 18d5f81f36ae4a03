#!/usr/bin/env bash
# Render a report.html to PNG with headless Chromium (no network, throwaway profile).
#
#   scripts/screenshot_report.sh REPORT_HTML OUT_PNG [WIDTH] [HEIGHT]
#
# REPORT_HTML may also be a report directory or a run directory (RUN_DIR/report/report.html).
# Needs chromium (Debian: apt-get install -y chromium) or google-chrome; CHROMIUM=/path overrides.
set -euo pipefail

usage() { echo "usage: $0 REPORT_HTML|REPORT_DIR|RUN_DIR OUT_PNG [WIDTH=1400] [HEIGHT=2000]" >&2; exit 2; }
[ $# -ge 2 ] || usage
src=$1 out=$2 width=${3:-1400} height=${4:-2000}

if [ -d "$src" ]; then
  if [ -f "$src/report.html" ]; then src=$src/report.html
  elif [ -f "$src/report/report.html" ]; then src=$src/report/report.html
  else echo "error: $src: no report.html (run: python -m mllm_rl.report $src)" >&2; exit 2; fi
fi
[ -f "$src" ] || { echo "error: $src: no such file" >&2; exit 2; }

browser=${CHROMIUM:-}
if [ -z "$browser" ]; then
  for b in chromium chromium-browser google-chrome google-chrome-stable; do
    if command -v "$b" >/dev/null 2>&1; then browser=$(command -v "$b"); break; fi
  done
fi
[ -n "$browser" ] || { echo "error: no chromium found (apt-get install -y chromium, or set CHROMIUM=)" >&2; exit 2; }

abs_src=$(cd "$(dirname "$src")" && pwd)/$(basename "$src")
mkdir -p "$(dirname "$out")"
abs_out=$(cd "$(dirname "$out")" && pwd)/$(basename "$out")
profile=$(mktemp -d)
trap 'rm -rf "$profile"' EXIT

"$browser" --headless --no-sandbox --disable-gpu --no-first-run --disable-background-networking \
  --disable-component-update --disable-sync --hide-scrollbars --user-data-dir="$profile" \
  --screenshot="$abs_out" --window-size="$width,$height" "file://$abs_src" >/dev/null 2>&1 || true

[ -s "$abs_out" ] || { echo "error: $browser wrote no screenshot to $abs_out" >&2; exit 1; }
echo "$abs_out"
