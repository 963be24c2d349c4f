#!/usr/bin/env bash
# Reproduce every table of docs/benchmarks.md, in the page's order: this runs the
# commands written in the page's bash blocks, so the page and this script cannot
# disagree. Run from the repository root with the [bench] extra installed.
# Shaped-link commands (benchmarks/shaped_net.sh) need root; without it they are
# listed and left out. Long: hours on a 2-core machine.
set -euo pipefail
cd "$(dirname "$0")/.."
mapfile -t commands < <(python - <<'PY'
import re
text = open("docs/benchmarks.md").read()
for block in re.findall(r"```bash\n(.*?)```", text, re.S):
    for line in re.sub(r"\\\n\s*", " ", block).splitlines():
        line = line.split(" #")[0].strip()
        # The benchmark runs only: not the page's install line, not this script.
        if re.search(r"python3? (-m |benchmarks/)", line):
            print(line)
PY
)
for cmd in "${commands[@]}"; do
  if [[ $cmd == sudo* ]]; then
    if [ "$(id -u)" != 0 ]; then
      echo "## skipped (needs root): $cmd"
      continue
    fi
    cmd=${cmd#sudo }
  fi
  echo "## $cmd"
  eval "$cmd"
done
