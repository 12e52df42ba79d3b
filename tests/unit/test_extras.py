"""Optional parts: a missing extra is named with the command that installs it."""

import importlib.util

import pytest

from tether.extras import MissingExtra, installed, require


def test_an_installed_extra_is_taken_as_it_is():
    assert installed("ui") and installed("openai")
    require("ui")


def test_a_missing_extra_is_named_with_how_to_install_it(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "uvicorn" else real(name, *args))
    assert not installed("ui")
    with pytest.raises(MissingExtra) as missing:
        require("ui")
    assert str(missing.value) == ("the web timeline (`tether ui`, the `ui` service) needs the "
                                  "'ui' extra: pip install 'tether[ui]'")
