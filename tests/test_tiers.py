"""The test tiers: tests/conftest.py marks what starts a process or loads a model, so that
`make test-fast` (scripts/dev.py's FAST_TIER) leaves it to `make test`."""

from __future__ import annotations

import importlib
import runpy
from pathlib import Path
from types import SimpleNamespace

import pytest
from _pytest.fixtures import FixtureFunctionDefinition

from tests import conftest

ROOT = Path(__file__).resolve().parent.parent
DEV = runpy.run_path(str(ROOT / "scripts" / "dev.py"))


@pytest.mark.parametrize(
    "module, name",
    sorted((module, name) for table in (conftest.LIVE_FIXTURES, conftest.MODEL_FIXTURES)
           for module, names in table.items() for name in names),
)
def test_each_fixture_the_tiers_name_is_a_fixture_of_its_module(module, name):
    """A renamed or moved fixture would silently bring its tests into the fast tier."""
    definition = getattr(importlib.import_module(module), name, None)
    assert isinstance(definition, FixtureFunctionDefinition), f"{module} has no fixture {name}"


def uses(**chains: list[tuple[str, tuple[str, ...]]]) -> SimpleNamespace:
    """A collected test whose fixture `name` has the definitions (module, argnames) given,
    overridden in order (the last one is used)."""
    return SimpleNamespace(_fixtureinfo=SimpleNamespace(name2fixturedefs={
        name: tuple(SimpleNamespace(func=SimpleNamespace(__module__=module), argnames=args)
                    for module, args in chain)
        for name, chain in chains.items()}))


def test_a_live_fixture_marks_its_test_and_an_override_of_its_name_does_not():
    assert conftest.fixture_kinds(uses(daemon=[("tests.conftest", ("web",))])) == {"live"}
    # tests/test_admin_live.py's own `daemon` (a published snapshot) overrides it
    assert conftest.fixture_kinds(uses(daemon=[
        ("tests.conftest", ("web",)), ("tests.test_admin_live", ("redis_client",))])) == set()
    # an override that asks for the fixture it overrides still starts it
    assert conftest.fixture_kinds(uses(daemon=[
        ("tests.conftest", ("web",)), ("tests.test_x", ("daemon",))])) == {"live"}
    assert conftest.fixture_kinds(uses(
        gemma_engine=[("tests.scheduler.conftest", ())],
        web=[("tests.conftest", ())])) == {"live", "model"}
    assert conftest.fixture_kinds(uses(redis_client=[("tests.conftest", ())])) == set()


def test_this_module_is_in_the_fast_tier(request):
    names = {mark.name for mark in request.node.iter_markers()}
    assert not names & {"slow", "live", "model"}


@pytest.mark.parametrize("markers, fast", [
    (set(), True),
    ({"database"}, True),  # in-process tests on the test database are fast
    ({"slow"}, False),
    ({"live", "database"}, False),
    ({"model"}, False),
])
def test_the_fast_tier_leaves_out_what_starts_a_process_or_loads_a_model(markers, fast):
    declared = {"slow", "live", "model", "database"}
    assert eval(DEV["FAST_TIER"], {}, {m: m in markers for m in declared}) is fast


def test_a_selection_is_anded_with_the_one_given():
    with_marker = DEV["with_marker"]
    assert with_marker("not live", ["-x"]) == ["-x", "-m", "not live"]
    assert with_marker("not live", ["-m", "database or slow", "-k", "auth"]) == [
        "-k", "auth", "-m", "(not live) and (database or slow)"]
    assert with_marker("database", ["-mslow"]) == ["-m", "(database) and (slow)"]
