"""docs/api.md stays true: every name it documents still exists, with the signature written there
(regenerate the page with `python docs/gen_api.py` after changing a public name)."""
import importlib
import importlib.util
import inspect
import re

import pytest

from launch import REPO

ENTRY = re.compile(r"^(?:#### |- )`(cupytp(?:\.\w+)+)(\([^`]*\))?`", re.M)


def gen_api():
    spec = importlib.util.spec_from_file_location("gen_api", REPO / "docs" / "gen_api.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def resolve(qualname):
    """The object named `qualname`: attributes from `cupytp` down (as a user reaches them),
    importing a subpackage where no attribute has its name yet; AttributeError if gone."""
    parts = qualname.split(".")
    obj = importlib.import_module(parts[0])
    for cut, part in enumerate(parts[1:], start=2):
        if not hasattr(obj, part) and inspect.ismodule(obj):
            try:
                importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                raise AttributeError(qualname) from None
        obj = getattr(obj, part)
    return obj


API = gen_api()
DOCUMENTED = ENTRY.findall((REPO / "docs" / "api.md").read_text())


def test_the_page_documents_the_packages():
    names = {name for name, _ in DOCUMENTED}
    assert len(names) > 100
    assert {"cupytp.DTensor", "cupytp.randn", "cupytp.DTensor.redistribute",
            "cupytp.parallel.apply_tensor_parallel", "cupytp.optim.AdamW"} <= names


@pytest.mark.parametrize("name, documented", DOCUMENTED, ids=[name for name, _ in DOCUMENTED])
def test_documented_name_exists_with_its_signature(name, documented):
    try:
        obj = resolve(name)
    except AttributeError:
        pytest.fail(f"docs/api.md documents {name}, which no longer exists: run "
                    "python docs/gen_api.py")
    if documented:
        assert API.signature(obj) == documented, (
            f"{name}: docs/api.md says {documented}, the code says {API.signature(obj)}; "
            "run python docs/gen_api.py")


def test_signature_leaves_out_self():
    class Example:
        def method(self, a, b=2, *, c):
            """One line."""

    assert API.signature(Example.method) == "(a, b=2, *, c)"
    assert API.first_paragraph(Example.method) == "One line."
