"""Generate the tables of docs/configuration.md from :mod:`hoplite_gpu.config` and
:mod:`hoplite_gpu.dataplane.ucx.settings`.

Every field of ``Config`` (its environment variable, default and the one-line description of its
docstring's ``Attributes`` list) and every entry of ``UCX_DEFAULTS`` (with the line its comment
gives it) go between the ``BEGIN GENERATED`` / ``END GENERATED`` markers of the page; the rest of
the page is written by hand.

Usage::

    python docs/config_reference.py          # rewrite docs/configuration.md (make docs)
    python docs/config_reference.py --check  # exit 1 if it is out of date (tests/test_docs.py)
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

from hoplite_gpu import config  # noqa: E402
from hoplite_gpu.dataplane.ucx import settings  # noqa: E402

PAGE = ROOT / "docs" / "configuration.md"
COMMAND = "make docs (python docs/config_reference.py)"
_BEGIN = "<!-- BEGIN GENERATED {name}: {command} writes this part -->"
_END = "<!-- END GENERATED {name} -->"


def field_docs(cls: type = config.Config) -> dict[str, str]:
    """The description of each attribute in ``cls``'s docstring (``Attributes:`` section), one line."""
    doc = inspect.cleandoc(cls.__doc__ or "")
    lines = doc.split("Attributes:", 1)[1].splitlines() if "Attributes:" in doc else []
    found: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in lines:
        entry = re.match(r"^    (\w+): (.*)$", line)
        if entry:
            current = found.setdefault(entry.group(1), [])
            current.append(entry.group(2))
        elif line.startswith("        ") and current is not None:
            current.append(line.strip())
        elif line.strip():
            break  # the next section
    return {name: " ".join(words) for name, words in found.items()}


def ucx_docs() -> dict[str, str]:
    """The line the comment above ``UCX_DEFAULTS`` gives each of its variables."""
    source = inspect.getsource(settings)
    block = source[: source.index("UCX_DEFAULTS: dict")].rsplit("\n\n", 1)[-1]
    found: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in block.splitlines():
        entry = re.match(r"^#: - ``(\w+)``: (.*)$", line)
        if entry:
            current = found.setdefault(entry.group(1), [])
            current.append(entry.group(2))
        elif line.startswith("#:   ") and current is not None:
            current.append(line[5:].strip())
        else:
            current = None
    return {name: " ".join(words) for name, words in found.items()}


def markdown(text: str) -> str:
    """reStructuredText of a docstring as Markdown: literals, roles, links to the repository's pages."""
    text = re.sub(r":\w+:`~?([\w.]+)`", lambda m: f"`{m.group(1)}`", text)
    text = text.replace("``", "`")
    text = re.sub(r"\bbench/((?:README|pages/[\w-]+)\.md(?:#[\w-]+)?)", r"[bench/\1](../bench/\1)", text)
    text = re.sub(r"\bdocs/([\w-]+\.md(?:#[\w-]+)?)", r"[\1](\1)", text)
    return re.sub(r"(?<![/\w])SECURITY\.md", "[SECURITY.md](../SECURITY.md)", text)


def default_text(f: dataclasses.Field[Any]) -> str:
    """A field's default as it is written in its environment variable (sizes also in KiB/MiB/GiB)."""
    value = f.default
    if isinstance(value, bool):
        return "`1` (on)" if value else "`0` (off)"
    if value == "":
        return "(empty)"
    text = f"`{value}`"
    if isinstance(value, int) and f.name.endswith("_bytes") and value and value % config.KiB == 0:
        for unit, size in (("GiB", config.GiB), ("MiB", config.MiB), ("KiB", config.KiB)):
            if value % size == 0:
                return f"{text} ({value // size} {unit})"
    return text


def _row(*cells: str) -> str:
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


def fields_table() -> str:
    """Markdown table of every ``Config`` field.

    Raises:
        ValueError: a field has no description in the ``Config`` docstring.
    """
    docs = field_docs()
    rows = [_row("Field", "Environment variable", "Default", "What it is"), "|---|---|---|---|"]
    for f in dataclasses.fields(config.Config):
        if f.name not in docs:
            raise ValueError(f"Config.{f.name} has no line in Config's docstring (Attributes:)")
        env = "HOPLITE_" + f.name.upper()  # as Config.from_env reads it
        rows.append(_row(f"`{f.name}`", f"`{env}`", default_text(f), markdown(docs[f.name])))
    return "\n".join(rows)


def ucx_table() -> str:
    """Markdown table of ``UCX_DEFAULTS``.

    Raises:
        ValueError: a variable has no line in the comment above ``UCX_DEFAULTS``.
    """
    docs = ucx_docs()
    rows = [_row("Variable", "Value", "What it does"), "|---|---|---|"]
    for name, value in settings.UCX_DEFAULTS.items():
        if name not in docs:
            raise ValueError(f"UCX_DEFAULTS[{name!r}] has no line in the comment above it in settings.py")
        rows.append(_row(f"`{name}`", f"`{value}`", markdown(docs[name])))
    return "\n".join(rows)


TABLES = {"config": fields_table, "ucx": ucx_table}


def update(page: str) -> str:
    """``page`` with every generated part written anew."""
    for name, make in TABLES.items():
        begin = _BEGIN.format(name=name, command=COMMAND)
        end = _END.format(name=name)
        head, sep, rest = page.partition(begin)
        if not sep:
            raise ValueError(f"{PAGE.name} lacks the line {begin}")
        _, sep, tail = rest.partition(end)
        if not sep:
            raise ValueError(f"{PAGE.name} lacks the line {end}")
        page = f"{head}{begin}\n{make()}\n{end}{tail}"
    return page


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is out of date")
    args = parser.parse_args(argv)
    current = PAGE.read_text()
    wanted = update(current)
    if args.check:
        if wanted != current:
            print(f"{PAGE} is out of date: run {COMMAND}", file=sys.stderr)
            return 1
        return 0
    if wanted != current:
        PAGE.write_text(wanted)
        print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
