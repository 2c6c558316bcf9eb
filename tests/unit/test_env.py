"""cupytp.env: every CUPYTP_* variable the package reads is declared there and parsed there; a
value that is not understood is one EnvError naming the variable, at `import cupytp`. And the
subpackages load on first use of `cupytp.<name>`."""
import re
import subprocess
import sys

import pytest

from cupytp import env
from launch import REPO


@pytest.mark.parametrize("name,value,parsed", [
    ("CUPYTP_DEBUG", "", False), ("CUPYTP_DEBUG", "1", True), ("CUPYTP_DEBUG", " TRUE ", True),
    ("CUPYTP_DEBUG", "off", False), ("CUPYTP_FUSED", "", True), ("CUPYTP_FUSED", "0", False),
    ("CUPYTP_TIMEOUT", "", 600.0), ("CUPYTP_TIMEOUT", "2.5", 2.5),
    ("CUPYTP_ATTENTION", "", "auto"), ("CUPYTP_ATTENTION", "Flash", "flash"),
    ("CUPYTP_DEVICE", "", ""), ("CUPYTP_DEVICE", "cpu", "cpu"),
    ("CUPYTP_ALLOCATOR", "cupy", "cupy"), ("CUPYTP_CHECKPOINT_FAULT", "1:index", "1:index"),
])
def test_values_parse(monkeypatch, name, value, parsed):
    monkeypatch.setenv(name, value)
    assert env.get(name) == parsed


@pytest.mark.parametrize("name,value,wants", [
    ("CUPYTP_DEBUG", "yes please", "use 1 or 0"),
    ("CUPYTP_LOG_RANKS", "2", "use 1 or 0"),
    ("CUPYTP_TIMEOUT", "abc", "use a number of seconds > 0"),
    ("CUPYTP_TIMEOUT", "-5", "use a number of seconds > 0"),
    ("CUPYTP_TIMEOUT", "inf", "use a number of seconds > 0"),
    ("CUPYTP_ATTENTION", "fastest", "use auto, flash, cudnn or matmul"),
    ("CUPYTP_DEVICE", "tpu", "use cpu or gpu"),
    ("CUPYTP_CHECKPOINT_FAULT", "x:index", "use <rank>:<point>"),
])
def test_bad_values_are_one_line_naming_the_variable(monkeypatch, name, value, wants):
    monkeypatch.setenv(name, value)
    with pytest.raises(env.EnvError) as caught:
        env.check()
    message = str(caught.value)
    assert message.startswith(f"{name}={value.strip()!r} is not understood: {wants}")
    assert "\n" not in message


def test_a_misspelt_name_is_an_error_and_other_names_pass(monkeypatch):
    monkeypatch.setenv("CUPYTP_DEBGU", "1")
    with pytest.raises(env.EnvError, match="CUPYTP_DEBGU is not a cupytp variable: did you mean "
                                           "CUPYTP_DEBUG"):
        env.check()
    monkeypatch.delenv("CUPYTP_DEBGU")
    monkeypatch.setenv("CUPYTP_SOMETHING_ELSE_ENTIRELY", "x")   # not close to any: left alone
    env.check()


def test_every_variable_read_is_declared():
    """No module reads a CUPYTP_* variable past cupytp.env, and each one it asks for exists."""
    asked = set()
    for path in list((REPO / "cupytp").rglob("*.py")) + list((REPO / "examples").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if path.name != "env.py":
            direct = re.findall(r"(?:environ\.get|getenv|environ\[)\(?\s*[\"'](CUPYTP_\w+)", text)
            assert not direct, f"{path} reads {direct} past cupytp.env"
        asked |= set(re.findall(r"env\.get\(\s*[\"'](CUPYTP_\w+)", text))
    assert asked and asked <= set(env.VARIABLES), asked - set(env.VARIABLES)


def test_import_checks_the_environment():
    result = subprocess.run([sys.executable, "-c", "import cupytp"], cwd=REPO, text=True,
                            capture_output=True, timeout=120,
                            env={"PATH": "", "PYTHONPATH": str(REPO), "CUPYTP_FUSED": "maybe"})
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1].startswith(
        "cupytp.env.EnvError: CUPYTP_FUSED='maybe' is not understood: use 1 or 0")


def test_subpackages_load_on_first_use():
    """The README's spelling: `import cupytp`, then `cupytp.checkpoint.save`, `cupytp.optim.SGD`
    (PEP 562: module __getattr__), in a fresh process where nothing imported them yet."""
    code = ("import sys, cupytp\n"
            "assert 'cupytp.checkpoint' not in sys.modules\n"
            "assert callable(cupytp.checkpoint.save) and cupytp.optim.SGD.__name__ == 'SGD'\n"
            "assert cupytp.models.gpt2.GPT2 and cupytp.data.TokenLoader and cupytp.parallel\n"
            "assert {'checkpoint', 'optim', 'models', 'nn'} <= set(dir(cupytp))\n"
            "try:\n    cupytp.chekpoint\nexcept AttributeError as err:\n"
            "    assert \"no attribute 'chekpoint'\" in str(err)\n"
            "else:\n    raise SystemExit('no AttributeError')\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, text=True,
                            capture_output=True, timeout=120,
                            env={"PATH": "", "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr[-3000:]
