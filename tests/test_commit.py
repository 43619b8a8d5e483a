"""dcp_s3._commit, the one commit primitive, on a real S3 server (SeaweedFS) and on local disk."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from dcp_s3 import _commit as commit
from dcp_s3._dcp.store import Store
from dcp_s3._dcp.store_opening import open_store
from dcp_s3._layout import new_token
from dcp_s3.errors import CheckpointFormatError, ConfigError


@pytest.fixture(params=["s3", "local"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    location = f"s3://{request.getfixturevalue('bucket')}/root" if request.param == "s3" else str(tmp_path)
    opened = open_store(location)
    yield opened
    opened.close()


def test_publish_once_never_replaces_and_recognises_its_own_retry(store: Store) -> None:
    objects, key = store.object_store, store.key("ck/.marker")
    assert commit.publish(objects, key, b"first save") is None
    assert commit.publish(objects, key, b"first save") is None  # a retried PUT finds its own bytes
    taken = commit.publish(objects, key, b"second save")
    assert taken == commit.Taken()
    assert commit.publish(objects, key, b"second save", conditional=False) == commit.Taken()  # HEAD first
    assert store.read("ck/.marker") == b"first save"


def test_read_marker_is_bounded_and_none_when_absent(store: Store) -> None:
    objects, key = store.object_store, store.key("ck/.marker")
    assert commit.read_marker(objects, key) is None
    store.write("ck/.marker", b"x" * 100)
    assert commit.read_marker(objects, key, max_bytes=100) == b"x" * 100
    for head in (True, False):  # by a HEAD before the GET, or after the one GET
        with pytest.raises(CheckpointFormatError, match="more than a marker's 99"):
            commit.read_marker(objects, key, max_bytes=99, head=head)
    assert commit.read_marker(objects, store.key("ck/none"), head=False) is None


class _Recording:
    """The real object store, with the keys of each delete call recorded in order."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.deletes = inner, []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def delete(self, keys: Sequence[str]) -> None:
        self.deletes.append(sorted(keys))
        self.inner.delete(keys)


def test_retire_deletes_the_marker_first_then_everything_below(store: Store) -> None:
    for name in ("ck/.marker", "ck/save.a/x", "ck/save.b/y", "other/z"):
        store.write(name, b"1")
    recording = _Recording(store.object_store)
    n = commit.retire(recording, [store.key("ck/.marker")], prefix=store.key("ck/"))  # type: ignore[arg-type]
    assert n == 2
    assert recording.deletes == [[store.key("ck/.marker")], [store.key("ck/save.a/x"), store.key("ck/save.b/y")]]
    assert [e.name for e in store.list_objects("")] == ["other/z"]


def test_retire_refuses_a_prefix_that_would_reach_a_sibling(store: Store) -> None:
    """``step_1`` as a prefix would also take ``step_10``: refused before anything is deleted."""
    for name in ("step_1/.marker", "step_1/a", "step_10/.marker", "step_10/a"):
        store.write(name, b"1")
    with pytest.raises(ConfigError, match="step_1"):
        commit.retire(store.object_store, [store.key("step_1/.marker")], prefix=store.key("step_1"))
    assert len(store.list_objects("")) == 4


def test_a_stored_marker_is_checked_as_untrusted_input() -> None:
    assert commit.check_token(new_token(), "m") and commit.check_token("a" * 32, "m", digits=32)
    for bad in ("A" * 16, "a" * 15, 16, None):
        with pytest.raises(CheckpointFormatError, match="save token"):
            commit.check_token(bad, "m")
    assert commit.check_name("model/.metadata", "m") == "model/.metadata"
    for bad in ("../x", "a/./b", "a//b", "/a", "mod\u00e8le", "a\\b", "", "x" * 513, 3):
        with pytest.raises(CheckpointFormatError, match="ASCII"):
            commit.check_name(bad, "m")
    commit.check_one_save({"a": "t1", "b": "t1"}, ["t1"], "m")
    with pytest.raises(CheckpointFormatError, match="'b' belongs to no save"):
        commit.check_one_save({"a": "t1", "b": "t2"}, ["t1"], "m")
    assert commit.load_json(b'{"a": 1}', "m", ["a"]) == {"a": 1}
    for bad in (b"[1]", b'{"b": 1}', b"\xff", b"[" * 100000):
        with pytest.raises(CheckpointFormatError, match="m: "):
            commit.load_json(bad, "m", ["a"])
