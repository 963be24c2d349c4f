"""The docs cannot drift from the code: every benchmark command in README.md
and docs/ parses with today's flags, the site builds with nothing dead
(`mkdocs build --strict`), and nothing points outside the repository."""
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
COMMAND = re.compile(r"python3? -m (onebit\.bench|benchmarks\.\w+)\b(.*)")


def shell_lines(text):
    """The lines of every fenced bash/sh/console block, continuations joined."""
    lines = []
    for block in re.findall(r"```(?:bash|sh|shell|console)\n(.*?)```", text, re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            lines.append(line)
    return lines


def commands():
    found = []
    for page in PAGES:
        for line in shell_lines(page.read_text()):
            for part in re.split(r"&&|;|\|", line.split(" #")[0]):
                match = COMMAND.search(part)
                if match:
                    found.append(pytest.param(match.group(1), match.group(2),
                                              id=f"{page.name}: {match.group(0).strip()}"[:120]))
    return found


def module_and_parser_args(module_name, rest):
    import importlib

    from onebit.bench.__main__ import COMMANDS

    argv = shlex.split(rest)
    if module_name == "onebit.bench":
        name = argv.pop(0) if argv and argv[0] in COMMANDS else "allreduce"
        return COMMANDS[name], argv
    return importlib.import_module(module_name), argv


def test_the_docs_show_benchmark_commands():
    names = {p.values[0] for p in commands()}
    assert {"onebit.bench", "benchmarks.lm"} <= names, names


@pytest.mark.parametrize("module_name,rest", commands())
def test_every_documented_command_parses(module_name, rest):
    from onebit.bench.command import parse

    module, argv = module_and_parser_args(module_name, rest)
    if any("$" in a for a in argv):
        pytest.fail(f"a documented command should run as written: {argv}")
    try:
        parse(module, argv, prog=module_name)
    except SystemExit as exc:
        pytest.fail(f"`python -m {module_name} {rest.strip()}` no longer parses (exit {exc.code})")


def test_nothing_points_outside_the_repository():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout")
    outside = "../" + "shared"  # spelled apart, so this file does not name it
    offenders = []
    for name in tracked:
        path = ROOT / name
        if path.is_file() and (path.suffix in (".py", ".md", ".sh", ".cpp", ".cu", ".toml", ".yml", ".txt")
                               or name == ".ci/run"):
            if outside in path.read_text(errors="replace"):
                offenders.append(name)
    assert offenders == [], offenders


def test_readme_links_lead_to_files():
    text = (ROOT / "README.md").read_text()
    links = [t for t in re.findall(r"\]\(([^)#\s]+)", text) if "://" not in t]
    assert links, "the README links to the docs"
    missing = [t for t in links if not (ROOT / t).exists()]
    assert missing == [], missing
    assert len(text.splitlines()) <= 250


def test_the_site_builds_strictly(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "site" / "design" / "index.html").exists()
