"""``dcp_s3.testing`` as another backend uses it: the suites run from a test module of its own,
outside dcp_s3's ``tests/`` (no conftest, no fixture of ours), its backend plugged in only through
the documented fixtures; and pytest stays out of every other module of dcp_s3."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

from dcp_s3 import _local_server as local_server
from dcp_s3 import testing
from dcp_s3.testing import ObjectStoreConformance, StoreConformance

REPO = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    """This checkout first on the path (the editable install may point at another)."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=_env(), capture_output=True, text=True, timeout=300
    )


def test_no_module_but_dcp_s3_testing_imports_pytest() -> None:
    out = _python(
        """
        import sys
        from pathlib import Path
        import dcp_s3, dcp_s3._dcp, dcp_s3._checkpointer, dcp_s3.admin
        assert "pytest" not in sys.modules and "_pytest" not in sys.modules, "the public modules load pytest"
        top = Path(dcp_s3.__file__).parent
        for path in sorted(top.rglob("*.py")):  # not pkgutil.walk_packages: it imports dcp_s3.testing to descend
            parts = path.relative_to(top.parent).with_suffix("").parts
            if parts[1:2] == ("testing",) or parts[-1] == "__main__":
                continue
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            __import__(name)
            assert "pytest" not in sys.modules and "_pytest" not in sys.modules, f"{name} loads pytest"
        print("ok")
        """
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_without_pytest_the_import_names_the_extra() -> None:
    out = _python(
        """
        import sys

        class NoPytest:  # pytest not installed
            def find_spec(self, name, path=None, target=None):
                if name == "pytest" or name.startswith(("pytest.", "_pytest")):
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
                return None

        sys.meta_path.insert(0, NoPytest())
        from dcp_s3._local_server import LocalS3Server  # the documented path needs no pytest
        try:
            import dcp_s3.testing
        except ImportError as exc:
            print(exc)
        else:
            raise SystemExit("dcp_s3.testing imported without pytest")
        """
    )
    assert out.returncode == 0, out.stderr
    assert "dcp_s3.testing needs pytest" in out.stdout and "pip install 'dcp-s3[testing]'" in out.stdout, out.stdout


def test_the_face() -> None:
    assert testing.LocalS3Server is local_server.LocalS3Server
    assert sorted(testing.__all__) == [
        "LocalRaw",
        "LocalS3Server",
        "ObjectStore",
        "ObjectStoreConformance",
        "Raw",
        "S3Raw",
        "StoreConformance",
        "Target",
    ]


THIRD_PARTY = '''
"""A backend's own tests: nothing from dcp_s3's tests/, only dcp_s3.testing and the backend."""

from pathlib import Path

import pytest

from dcp_s3._objstore.local import LocalObjectStore
from dcp_s3.testing import LocalRaw, ObjectStoreConformance, StoreConformance, Target


class MyStore(LocalObjectStore):
    """The backend under test (here a subclass of the local store, standing in for a new one)."""


class TestMyObjectStore(ObjectStoreConformance):
    @pytest.fixture
    def objstore(self, tmp_path: Path) -> MyStore:
        return MyStore(tmp_path / "container")


class TestMyObjectStoreUnderAPrefix(ObjectStoreConformance):
    @pytest.fixture
    def objstore(self, tmp_path: Path) -> MyStore:
        return MyStore(tmp_path / "shared")

    @pytest.fixture
    def base(self) -> str:
        return "mine/"


class TestMyDirectory(StoreConformance):
    @pytest.fixture
    def target(self, tmp_path: Path) -> Target:
        root = tmp_path / "checkpoints"
        return Target("mine", str(root), LocalRaw(root))


class TestForgotTheHook(ObjectStoreConformance):
    pass


class LossyStore(LocalObjectStore):
    def get(self, key, *args, **kwargs):
        data = super().get(key, *args, **kwargs)
        return data[:-1] if key.endswith("b.bin") else data


class TestLossy(ObjectStoreConformance):
    @pytest.fixture
    def objstore(self, tmp_path: Path) -> LossyStore:
        return LossyStore(tmp_path / "container")
'''


def test_a_backend_of_its_own_runs_the_suites_through_the_hooks_only(tmp_path: Path) -> None:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not dcp_s3's configuration, no conftest
    (tmp_path / "test_mine.py").write_text(THIRD_PARTY)
    report = tmp_path / "report.xml"
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", "test_mine.py"],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    outcomes: dict[str, dict[str, str]] = {}
    for case in ET.parse(report).iter("testcase"):
        cls = case.get("classname", "").rpartition(".")[2]
        problem = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
        outcome = "passed" if problem is None else f"{problem.tag}: {problem.get('message', '')}"
        outcomes.setdefault(cls, {})[case.get("name", "")] = outcome

    def names(suite: type) -> set[str]:
        return {n for n in dir(suite) if n.startswith("test_")}

    for cls, suite in (
        ("TestMyObjectStore", ObjectStoreConformance),
        ("TestMyObjectStoreUnderAPrefix", ObjectStoreConformance),
        ("TestMyDirectory", StoreConformance),
    ):
        assert set(outcomes[cls]) == names(suite), cls
        assert set(outcomes[cls].values()) == {"passed"}, outcomes[cls]
    # A subclass without its hook is told which fixture to define, test by test.
    forgot = outcomes["TestForgotTheHook"]
    assert set(forgot) == names(ObjectStoreConformance)
    assert all(o.startswith("error") and "it defines the objstore fixture" in o for o in forgot.values()), forgot
    # A backend that gets a byte wrong fails, with pytest's explanation of the suite's assert.
    lossy = outcomes["TestLossy"]["test_put_get_head_and_etags"]
    assert lossy.startswith("failure") and "b'on'" in lossy, lossy
