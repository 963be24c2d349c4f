"""Regenerate onebit/bench/data/pydocs.txt.gz, the language-model benchmark's
text: every docstring of 80+ characters in CPython's standard library (tests
and IDLE left out) and the reference topics of pydoc_data, in a fixed order.
Real English prose (PSF-licensed documentation), about 1.5 MB, 9k distinct
words. It was made with CPython 3.11.7; the file is committed so the figures
do not depend on the Python that runs the benchmark."""
import ast
import gzip
import os
import sys
import sysconfig

import pydoc_data.topics


def docstrings(lib):
    for root, dirs, files in os.walk(lib):
        dirs.sort()
        parts = root.split(os.sep)
        if "site-packages" in parts or "test" in parts or "tests" in parts or "idlelib" in parts:
            continue
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            try:
                with open(os.path.join(root, name), encoding="utf-8") as f:
                    tree = ast.parse(f.read())
            except (SyntaxError, UnicodeDecodeError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node)
                    if doc and len(doc) >= 80:
                        yield doc


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "onebit/bench/data/pydocs.txt.gz"
    texts = list(docstrings(sysconfig.get_paths()["stdlib"]))
    texts += [pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics)]
    with gzip.open(out, "wt", encoding="utf-8", compresslevel=9) as f:
        f.write("\n\n".join(texts))
