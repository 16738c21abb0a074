"""The documentation stays true to the code: the configuration page is generated from ``Config``
and current, and every link between the repository's Markdown pages reaches a file and heading."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path
from types import ModuleType

from hoplite_gpu import config
from hoplite_gpu.dataplane.ucx import settings

ROOT = Path(__file__).resolve().parent.parent
PAGES = [
    ROOT / "README.md",
    ROOT / "SECURITY.md",
    ROOT / "bench" / "README.md",
    *sorted((ROOT / "bench" / "pages").glob("*.md")),
    *sorted((ROOT / "docs").glob("*.md")),
]


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("config_reference", ROOT / "docs" / "config_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_configuration_page_is_generated_from_config() -> None:
    gen = _generator()
    committed = gen.PAGE.read_text()
    assert gen.update(committed) == committed, (
        "docs/configuration.md is out of date with hoplite_gpu/config.py: run `make docs` "
        "(python docs/config_reference.py) and commit the page"
    )


def test_the_configuration_page_lists_every_field_and_ucx_default() -> None:
    page = (ROOT / "docs" / "configuration.md").read_text()
    for f in dataclasses.fields(config.Config):
        assert f"| `{f.name}` | `HOPLITE_{f.name.upper()}` |" in page, f.name
    for name, value in settings.UCX_DEFAULTS.items():
        assert f"| `{name}` | `{value}` |" in page, name


def test_each_config_field_is_described_in_one_entry() -> None:
    docs = _generator().field_docs()
    assert set(docs) == {f.name for f in dataclasses.fields(config.Config)}
    assert set(_generator().ucx_docs()) == set(settings.UCX_DEFAULTS)


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the headings of ``page``."""
    found: set[str] = set()
    in_code = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        text = line.lstrip("#").strip().lower()
        slug = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
        anchor, n = slug, 1
        while anchor in found:
            anchor, n = f"{slug}-{n}", n + 1
        found.add(anchor)
    return found


def test_links_between_pages_reach_a_file_and_a_heading() -> None:
    broken = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


#: ``bench/pages/<page>.md``, then ``#<heading>`` or ``, "<heading or phrase>"`` if there is one.
_BENCH_PAGE = r'bench/pages/([\w-]+\.md)(?:#([\w-]+))?(?:,? "([^"]+)")?'


def test_code_names_bench_pages_and_headings_that_exist() -> None:
    """A comment or docstring that points at a measurement (``bench/pages/<page>.md#<heading>``, or
    the page and a quoted heading or phrase of it) names a page, and a heading or text, that exist."""
    broken = []
    for path in sorted([*(ROOT / "hoplite_gpu").rglob("*.py"), *(ROOT / "bench").glob("*.py")]):
        text = re.sub(r"\n\s*#?:?\s*", " ", path.read_text())  # comments' lines joined
        for page, anchor, quoted in re.findall(_BENCH_PAGE, text):
            dest = ROOT / "bench" / "pages" / page
            if not dest.exists():
                broken.append(f"{path.relative_to(ROOT)}: bench/pages/{page} (no such file)")
            elif anchor and anchor not in _anchors(dest):
                broken.append(f"{path.relative_to(ROOT)}: bench/pages/{page}#{anchor} (no such heading)")
            elif quoted and quoted not in " ".join(dest.read_text().split()):
                broken.append(f'{path.relative_to(ROOT)}: bench/pages/{page} "{quoted}" (not on the page)')
        for anchor in re.findall(r"bench/README\.md#([\w-]+)", text):
            if anchor not in _anchors(ROOT / "bench" / "README.md"):
                broken.append(f"{path.relative_to(ROOT)}: bench/README.md#{anchor} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_readme_keeps_the_quick_start_and_the_gpu_check_section() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "make demo" in readme and "make test" in readme  # the two commands; .ci/run calls make test
    assert "GPU check" in _anchors_text(readme)  # the Makefile points here


def _anchors_text(text: str) -> list[str]:
    return [line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#")]
