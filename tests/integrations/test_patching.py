"""dcp_s3.integrations._patching: the one scoped, re-entrant, exception-safe, per-context patch every integration uses.

Its users' own tests run it on the frameworks' real functions (test_dcp_route, test_accelerate, test_nemo_recipe);
here the rules themselves, on a module made for the test.
"""

from __future__ import annotations

import threading
import types
from typing import Any

import pytest

from dcp_s3.errors import DcpS3Error
from dcp_s3.integrations._patching import ContextPatch, Site


def _framework() -> types.ModuleType:
    module = types.ModuleType("framework")

    def save(path: str) -> str:
        return f"framework:{path}"

    module.save = save  # type: ignore[attr-defined]
    return module


def _patch(module: types.ModuleType) -> ContextPatch[str]:
    def routed(value: str, original: Any, path: str) -> str:
        return f"{value}:{path}"

    return ContextPatch("test", lambda: [Site(module, "save", routed)])


def test_scopes_nest_restore_on_the_last_exit_and_after_an_exception() -> None:
    module = _framework()
    original = module.save
    patch = _patch(module)
    with patch.scope("outer"):
        assert module.save("a") == "outer:a" and module.save.__wrapped__ is original
        with pytest.raises(KeyError), patch.scope("inner"):
            assert module.save("a") == "inner:a"
            raise KeyError("boom")
        assert module.save("a") == "outer:a"  # the inner scope's exception closed only it
    assert module.save is original and not patch.installed


def test_a_scope_acts_only_in_its_own_context() -> None:
    """Thread A's scope and thread B's each act with their own value, both open at once; a thread with none runs
    the framework's function."""
    module = _framework()
    patch = _patch(module)
    both_open = threading.Barrier(3)
    done = threading.Barrier(3)
    got: dict[str, str] = {}

    def job(name: str) -> None:
        with patch.scope(name):
            both_open.wait(timeout=30)
            got[name] = module.save(name)
            done.wait(timeout=30)

    threads = [threading.Thread(target=job, args=(n,)) for n in ("A", "B")]
    for t in threads:
        t.start()
    both_open.wait(timeout=30)
    got["none"] = module.save("none")
    done.wait(timeout=30)
    for t in threads:
        t.join(timeout=30)
    assert got == {"A": "A:A", "B": "B:B", "none": "framework:none"}
    assert module.save("x") == "framework:x" and not patch.installed


def test_a_site_that_cannot_be_found_replaces_nothing() -> None:
    module = _framework()
    original = module.save

    def sites() -> list[Site]:
        return [Site(module, "save", lambda *a: None), Site(module, "missing", lambda *a: None)]

    patch: ContextPatch[str] = ContextPatch("test", sites)
    with pytest.raises(AttributeError), patch.scope("x"):
        pass
    assert module.save is original and not patch.installed
    with _patch(module).scope("y"):  # and the patch opens normally afterwards
        assert module.save("p") == "y:p"


def test_hold_keeps_it_installed_and_release_needs_a_hold() -> None:
    module = _framework()
    patch = _patch(module)
    patch.hold()
    assert patch.installed and module.save("a") == "framework:a"  # no scope: the original runs
    with patch.scope("s"):
        assert module.save("a") == "s:a"
    assert patch.installed
    patch.release()
    assert not patch.installed
    with pytest.raises(DcpS3Error):
        patch.release()
