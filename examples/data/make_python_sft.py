"""Build examples/data/python_sft.jsonl: prompt/completion pairs from the standard library.

prompt: a function's signature and docstring; completion: its body. Deterministic for a
given Python version; run `python examples/data/make_python_sft.py` to regenerate.
"""

from __future__ import annotations

import ast
import json
import random
import sysconfig
from pathlib import Path

MODULES = ["json", "textwrap", "string", "shlex", "fnmatch", "glob", "posixpath", "functools", "heapq", "bisect",
           "csv", "difflib", "fractions", "statistics", "calendar", "base64", "colorsys", "ipaddress", "pprint",
           "random", "secrets", "tokenize", "urllib/parse", "email/utils", "http/cookies", "configparser",
           "argparse", "dataclasses", "enum", "inspect", "pathlib", "shutil", "tempfile", "zipfile", "gettext"]


def functions(path: Path):
    source = path.read_text(encoding="utf-8")
    lines = source.splitlines(keepends=True)
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(node) and len(node.body) > 1:
            doc = node.body[0]
            head = "".join(lines[node.lineno - 1 - len(node.decorator_list) : doc.end_lineno])
            body = "".join(lines[doc.end_lineno : node.end_lineno])
            if 40 <= len(body) <= 1500:
                yield {"prompt": head, "completion": body}


def main() -> None:
    root = Path(sysconfig.get_paths()["stdlib"])
    rows = []
    for name in MODULES:
        path = root / f"{name}.py"
        if not path.exists():
            path = root / name / "__init__.py"
        if path.exists():
            rows.extend(functions(path))
    random.Random(0).shuffle(rows)
    out = Path(__file__).with_name("python_sft.jsonl")
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} rows to {out}")


if __name__ == "__main__":
    main()
