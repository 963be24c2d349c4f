#!/usr/bin/env bash
# Reproduce every table of the benchmark pages (docs/benchmarks.md, then the
# topic pages under docs/benchmarks/ in the order below): this runs the commands
# written in the pages' bash blocks, each once, so the pages and this script
# cannot disagree. Run from the repository root with the [bench] extra installed.
# Shaped-link commands (benchmarks/shaped_net.sh) need root; without it they are
# listed and left out. Long: hours on a 2-core machine.
set -euo pipefail
cd "$(dirname "$0")/.."
mapfile -t commands < <(python - <<'PY'
import re
pages = ["docs/benchmarks.md"] + [f"docs/benchmarks/{name}.md" for name in
         ("frontier", "convergence", "diloco", "communication", "kernels", "sharded", "history")]
seen = set()
for page in pages:
    for block in re.findall(r"```bash\n(.*?)```", open(page).read(), re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = line.split(" #")[0].strip()
            # The benchmark runs only: not the page's install line, not this script;
            # a command the headline page repeats runs once.
            if re.search(r"python3? (-m |benchmarks/)", line) and line not in seen:
                seen.add(line)
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
