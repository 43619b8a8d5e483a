"""No inferred save boundaries (issue 50's rule), swept over the package and every integration.

A save begins and ends where the framework says it does (one of its calls that dcp_s3 wraps or implements) or where
dcp_s3's own call says it does — never where a side effect suggests (torch_checkpointing's ``mkdir`` of a stage
directory began a new save and dropped the model from the commit). Every save begins by drawing its token (its
generation, its writer), so the guard reads the code (``ast``):

1. the functions that draw a save's token are exactly those of :data:`BEGINS`, each with the call that is its
   boundary (a new place fails here and is reviewed, not inferred);
2. no function named like a file-system side effect or probe (``mkdir``, ``exists``, ``listdir``, …) anywhere in the
   package draws a token or calls a function that does.

The behaviour is tested per integration: torch_checkpointing's ``mkdir`` inside a save
(``tests/integrations/test_torch_checkpointing.py::test_a_callbacks_mkdir_of_the_stage_does_not_drop_the_model_from_the_commit``),
NeMo's ``reserve`` (``tests/integrations/test_nemo_recipe.py``), the Checkpointer's ``save`` and the writer's
``write_data`` (their own calls).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import dcp_s3

PACKAGE = Path(dcp_s3.__file__).parent

#: The calls that draw a save's token (``layout.new_token``; torch_checkpointing's writer id).
DRAWS = {"new_token", "new_writer"}

#: (module, function) that draws a token -> the boundary it stands for. Each is a framework's call or dcp_s3's own.
BEGINS = {
    ("_dcp/writer.py", "S3StorageWriter._write_all"): "DCP's StorageWriter.write_data (dcp.save)",
    ("_dcp/writer.py", "S3StorageWriter.prepare_global_plan"): "not a save: the conditional-write probe's key",
    ("_dcp/job_progress.py", "job_counts"): "not a save: a progress counter's key",
    ("_dcp/hf_writer.py", "S3HuggingFaceStorageWriter.prepare_global_plan"): (
        "DCP's StorageWriter.prepare_global_plan (dcp.save): the export's id and staging prefix"
    ),
    ("_dcp/hf_writer.py", "S3HuggingFaceStorageWriter._check_conditional_writes"): (
        "not a save: the conditional-write probe's key"
    ),
    ("_checkpointer/manager.py", "Checkpointer.save"): "Checkpointer.save",
    ("_checkpointer/tiers.py", "Tiers.save"): "Checkpointer.save (local tier)",
    ("integrations/nemo_commit.py", "Saves.begin"): "NeMo's CheckpointLifecycle.reserve",
    ("integrations/torch_checkpointing/writers.py", "StageWriters.for_file"): (
        "the first file of a save begun by torch_checkpointing's CheckpointWriter.write"
    ),
}

#: Names of side effects and probes: none of them may begin a save.
SIDE_EFFECTS = {
    "mkdir",
    "makedirs",
    "exists",
    "isdir",
    "isfile",
    "listdir",
    "iterdir",
    "ls",
    "glob",
    "walk",
    "stat",
    "touch",
    "rmdir",
    "rm",
    "rmtree",
    "remove",
    "unlink",
    "rename",
    "open",
}


def _callee(node: ast.Call) -> str | None:
    if isinstance(node.func, ast.Name):
        return node.func.id
    if isinstance(node.func, ast.Attribute):
        return node.func.attr
    return None


def functions(tree: ast.AST) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """(qualified name, node) of every function and method, nested ones under their outer function's name (a
    closure runs as part of the function that defines it)."""

    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield f"{prefix}{child.name}", child
            else:
                yield from walk(child, prefix)

    yield from walk(tree, "")


def calls(fn: ast.AST) -> set[str]:
    return {name for node in ast.walk(fn) if isinstance(node, ast.Call) and (name := _callee(node))}


def _index() -> dict[tuple[str, str], set[str]]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        for name, fn in functions(ast.parse(path.read_text(), str(path))):
            out[(rel, name)] = calls(fn)
    return out


def test_the_functions_that_begin_a_save_are_the_known_boundaries() -> None:
    drawing = {where for where, called in _index().items() if called & DRAWS}
    assert drawing == set(BEGINS), (
        "a save's token is drawn somewhere new (or a boundary moved): add it to BEGINS with the framework's or dcp_s3's "
        f"call that begins the save there — never a side effect. New: {sorted(drawing - set(BEGINS))}; "
        f"gone: {sorted(set(BEGINS) - drawing)}"
    )


def test_no_side_effect_begins_a_save() -> None:
    index = _index()
    beginners = DRAWS | {name.rsplit(".", 1)[-1] for _, name in BEGINS if not name.endswith(("save", "_write_all"))}
    offenders = [
        f"{rel}:{name} calls {sorted(called & beginners)}"
        for (rel, name), called in index.items()
        if name.rsplit(".", 1)[-1].lstrip("_") in SIDE_EFFECTS and called & beginners
    ]
    assert offenders == []


#: Integration classes that implement a file-system interface a framework calls during a save -> the behavioural test
#: that runs each of their side effects and probes inside a save and checks the commit still names every file.
FILE_SYSTEMS = {
    ("integrations/torch_checkpointing/storage.py", "S3Storage"): (
        "tests/integrations/test_torch_checkpointing.py::test_a_callbacks_mkdir_of_the_stage_does_not_drop_the_model_from_"
        "the_commit"
    ),
}


def test_every_file_system_an_integration_implements_is_swept_by_behaviour() -> None:
    """A framework that drives a file-system interface of dcp_s3's (``mkdir``, ``exists``, …) during a save is where
    a boundary gets inferred: each such class is listed in :data:`FILE_SYSTEMS` with its behavioural sweep."""
    found = {
        (rel, name.rsplit(".", 1)[0])
        for (rel, name) in _index()
        if rel.startswith("integrations/") and "." in name and name.rsplit(".", 1)[1] in SIDE_EFFECTS
    }
    assert found == set(FILE_SYSTEMS)
    for test in FILE_SYSTEMS.values():
        path, _, name = test.partition("::")
        assert f"def {name}(" in (PACKAGE.parent / path).read_text(), test


def test_the_guard_sees_a_side_effect_that_begins_a_save() -> None:
    """The guard itself: the bug it stands for (a ``mkdir`` that begins a save), written out, is found."""
    hostile = ast.parse(
        "class S3Storage:\n"
        "    def mkdir(self, path):\n"
        "        if self.wrote_in(path):\n"
        "            self._writers.begin(path)\n"
        "    def touch(self, path):\n"
        "        return new_token()\n"
    )
    found = {name for name, fn in functions(hostile) if calls(fn) & (DRAWS | {"begin"})}
    assert found == {"S3Storage.mkdir", "S3Storage.touch"}
