"""Every Python example users read runs here: the fences of README.md, of each page under
docs/, and of the public docstrings (the API reference is built from them).

A page's ```python fences run in order in one namespace, as a reader pastes them one after
another. A ```text fence that directly follows a ```python fence is that fence's output: what
it prints must equal it, line for line, where `...` in a shown line stands for any run of
characters (addresses, timings)."""

from __future__ import annotations

import contextlib
import inspect
import io
import re
import sys
import types
from dataclasses import dataclass

import pytest

import fastcall

from .conftest import ROOT

# A fence opens at the start of a line with three backticks and an info string, and closes at
# the next line of three backticks alone. Indented fences (inside list items) are not used.
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


@dataclass(frozen=True)
class Example:
    """One ```python fence, and the output shown after it (None: none shown)."""

    code: str
    output: str | None
    line: int  # where the fence starts, for the failure message


def examples(text: str) -> list[Example]:
    found: list[Example] = []
    fences = list(FENCE.finditer(text))
    for i, fence in enumerate(fences):
        if fence.group(1).split()[:1] != ["python"]:
            continue
        output = None
        after = fences[i + 1] if i + 1 < len(fences) else None
        if after is not None and after.group(1).split()[:1] == ["text"]:
            if text[fence.end() : after.start()].strip() == "":
                output = after.group(2)
        found.append(Example(fence.group(2), output, text.count("\n", 0, fence.start()) + 1))
    return found


def _matches(shown: str, printed: str) -> bool:
    shown_lines, printed_lines = shown.rstrip("\n").split("\n"), printed.rstrip("\n").split("\n")
    if len(shown_lines) != len(printed_lines):
        return False
    for want, got in zip(shown_lines, printed_lines):
        pattern = ".*".join(re.escape(part) for part in want.rstrip().split("..."))
        if not re.fullmatch(pattern, got.rstrip()):
            return False
    return True


def run_examples(found: list[Example], where: str) -> None:
    # The page runs as a module of its own, registered while it runs: a dataclass or an
    # eqx.Module defined in it looks its module up in sys.modules.
    module = types.ModuleType("doc_example_" + re.sub(r"\W", "_", where))
    sys.modules[module.__name__] = module
    try:
        for example in found:
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                exec(compile(example.code, f"{where}:{example.line}", "exec"), module.__dict__)
            if example.output is not None:
                assert _matches(example.output, out.getvalue()), (
                    f"{where}:{example.line} printed\n{out.getvalue()}\nwhere the page shows\n{example.output}"
                )
    finally:
        del sys.modules[module.__name__]


PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))]


@pytest.mark.parametrize("page", PAGES)
def test_page_examples_run_and_print_what_the_page_shows(page):
    run_examples(examples((ROOT / page).read_text()), page)


def public_docstrings() -> dict[str, str]:
    """The docstrings the API reference shows: each public name's and its public methods'."""
    docs: dict[str, str] = {}
    for name in sorted(n for n in dir(fastcall) if not n.startswith("_")):
        obj = getattr(fastcall, name)
        if not (inspect.isclass(obj) or callable(obj)):
            continue
        docs[f"fastcall.{name}"] = inspect.getdoc(obj) or ""
        if inspect.isclass(obj):
            for attr, member in vars(obj).items():
                if not attr.startswith("_") and callable(member) and member.__doc__:
                    docs[f"fastcall.{name}.{attr}"] = inspect.getdoc(member) or ""
    return docs


DOCSTRINGS = public_docstrings()


@pytest.mark.parametrize("name", sorted(DOCSTRINGS))
def test_docstring_examples_run_and_print_what_they_show(name):
    run_examples(examples(DOCSTRINGS[name]), name)


def test_every_public_name_has_its_sections_and_an_example():
    """As equinox's docstrings have them: a function's Arguments (where it takes any) and
    Returns, a record's Fields or Methods, and an example that runs (above)."""
    for n in sorted(n for n in dir(fastcall) if not n.startswith("_") and callable(getattr(fastcall, n))):
        obj, doc = getattr(fastcall, n), DOCSTRINGS[f"fastcall.{n}"]
        assert "**Example:**" in doc and examples(doc), n
        if inspect.isclass(obj) and not issubclass(obj, BaseException):
            assert "**Fields:**" in doc or "**Methods:**" in doc, n
        elif not inspect.isclass(obj):
            assert "**Returns:**" in doc, n
            if inspect.signature(obj).parameters:
                assert "**Arguments:**" in doc, n


def test_the_collector_compares_output_and_fails_on_a_difference():
    page = "```python\nprint('a', 1)\n```\n```text\na 1\n```\n"
    run_examples(examples(page), "inline")
    with pytest.raises(AssertionError, match="printed"):
        run_examples(examples(page.replace("a 1\n```\n", "a 2\n```\n")), "inline")
    # `...` stands for any run of characters on its line, nothing more
    run_examples(examples(page.replace("a 1\n```\n", "a ...\n```\n")), "inline")
    with pytest.raises(AssertionError):
        run_examples(examples(page.replace("a 1\n```\n", "a ...\nb\n```\n")), "inline")
    # a text fence separated from the code by prose is not its output
    assert examples("```python\npass\n```\nSome prose.\n```text\nx\n```\n")[0].output is None
    # fences of one page share a namespace, in order
    run_examples(examples("```python\nv = 3\n```\n\n```python\nprint(v)\n```\n```text\n3\n```\n"), "inline")
