"""The suite's own layout: tests sit in rooms that mirror the packages, and the ``ray`` and
``slow`` markers mean what they say (so ``-m "not ray"`` and ``-m "not slow"`` can be trusted)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import RAY_ROOMS, SLOW_MODULES

TESTS = Path(__file__).resolve().parents[1]
ROOMS = ("unit", "kernels", "model", "engine", "server", "http", "deploy")
# What starts Ray without the session's fixture: a served process (its own head), a head itself.
STARTS_RAY = re.compile(r"ServeProcess|EmbeddedHead|ray start|ray\.init|\"coordinator\.cli\"|deploy\.serve")


def test_every_test_module_sits_in_a_room():
    assert not list(TESTS.glob("test_*.py")), "a test module at the top of tests/"
    rooms = {p.parent.name for p in TESTS.rglob("test_*.py")}
    assert rooms == set(ROOMS), rooms
    for room in ROOMS:
        assert (TESTS / room / "__init__.py").is_file(), room


def test_modules_that_start_ray_on_their_own_are_marked_ray():
    """The session's ``ray_session`` marks its users; a module that starts a served process or a
    head without it must sit in a room whose every test is marked ``ray``."""
    for path in TESTS.rglob("test_*.py"):
        source = path.read_text()
        if path.name != "test_suite_layout.py" and STARTS_RAY.search(source):
            assert path.parent.name in RAY_ROOMS or "ray_session" in source, path.relative_to(TESTS)


def test_the_slow_modules_exist():
    names = {p.stem for p in TESTS.rglob("test_*.py")}
    assert SLOW_MODULES <= names, sorted(SLOW_MODULES - names)
