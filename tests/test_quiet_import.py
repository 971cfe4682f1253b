"""rendezvous.quiet: a library's log level set for its import only."""

from __future__ import annotations

import os
import sys

import pytest

from rendezvous.quiet import import_quietly

pytestmark = pytest.mark.unit

MODULE = "tp_test_quiet_probe"
ENV = "TP_TEST_QUIET_LEVEL"


@pytest.fixture
def probe(tmp_path, monkeypatch):
    """A module that records the level it saw when imported."""
    (tmp_path / f"{MODULE}.py").write_text(f"import os\nSEEN = os.environ.get({ENV!r})\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop(MODULE, None)


@pytest.mark.parametrize("before", [None, "INFO"])
def test_the_level_holds_for_the_import_only(probe, monkeypatch, before):
    if before is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, before)
    import_quietly(MODULE, ENV, "FATAL")
    assert sys.modules[MODULE].SEEN == "FATAL"
    assert os.environ.get(ENV) == before


def test_an_imported_library_is_left_alone(probe, monkeypatch):
    monkeypatch.setenv(ENV, "INFO")
    import_quietly(MODULE, ENV, "FATAL")
    sys.modules[MODULE].SEEN = "untouched"
    import_quietly(MODULE, ENV, "NONE")
    assert sys.modules[MODULE].SEEN == "untouched"
