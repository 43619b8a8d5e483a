"""Names by one grammar (issue 50, items 2 and 9): ``gc`` never removes a complete DCP checkpoint whatever its
name, and no scheme takes the digits of another script for a step number (deletion, resume, listing)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_s3 import S3StorageReader, S3StorageWriter
from dcp_s3._checkpointer import Checkpointer
from dcp_s3._checkpointer.names import CHECKPOINTER_STEPS, number, scheme, step_iteration
from dcp_s3._local_server import LocalS3Server
from dcp_s3.admin import collect_garbage, find_garbage, list_steps

ARABIC = "٠١٢٣٤٥٦٧٨٩"  # Arabic-Indic digits: str.isdigit(), int() and \d take them
FULLWIDTH = "０１２３４５６７８９"


def _foreign(text: str, digits: str = ARABIC) -> str:
    return text.translate(str.maketrans("0123456789", digits))


@pytest.mark.parametrize("digits", [ARABIC, FULLWIDTH])
def test_the_grammar_takes_ascii_digits_only(digits: str) -> None:
    assert number("0000100") == 100 and step_iteration("0000100") == 100
    foreign = _foreign("0000100", digits)
    assert foreign.isdigit() and int(foreign) == 100  # what the grammar must not rely on
    assert number(foreign) is None and step_iteration(foreign) is None
    assert CHECKPOINTER_STEPS.fullmatch(foreign) is None
    assert scheme(r"step_\d+").fullmatch(f"step_{foreign}") is None  # a user's pattern: \d made ASCII
    assert scheme(re.compile(r"step_\d+")).fullmatch("step_12")
    for bad in ("", " 1", "+1", "1e3", "1_000", "١"):
        assert number(bad) is None


def _dcp_checkpoint(location: str) -> dict[str, torch.Tensor]:
    state = {"w": torch.randn(16), "b": torch.arange(4)}
    dcp.save(state, storage_writer=S3StorageWriter(location))
    return state


def test_gc_never_removes_a_complete_dcp_checkpoint_named_like_a_step_part(bucket: str) -> None:
    root = f"s3://{bucket}/run"
    names = ["llama.base_model", "exports/ema.student_model", "0000100x.m_model", "sub/0000100.m_model", "x.y_optim"]
    saved = {name: _dcp_checkpoint(f"{root}/{name}") for name in names}
    # Beside them, a Checkpointer's steps (re-saved: generation directories, the replaced ones gc's).
    ckpt = Checkpointer(root)
    ckpt.save({"model": torch.nn.Linear(2, 2)}, iteration=5)
    ckpt.save({"model": torch.nn.Linear(2, 2)}, iteration=5)  # a re-save: generation directories
    listed = {s.name: s for s in list_steps(root)}
    for name in names[:3] + names[4:]:  # names the Checkpointer does not make: plain checkpoints
        assert listed[name].kind == "dcp" and listed[name].complete, listed[name]
    assert "llama" not in listed and "0000100x" not in listed
    # sub/0000100.m_model is named as a step's part would be: listed as a step without a marker, yet gc keeps it
    assert not listed["sub/0000100"].complete

    garbage = find_garbage(root, older_than=0)
    doomed = {o.name for o in garbage.objects}
    assert not any(n.startswith(tuple(names)) for n in doomed), sorted(doomed)
    collect_garbage(garbage)
    for name, state in saved.items():
        got = {k: torch.zeros_like(v) for k, v in state.items()}
        dcp.load(got, storage_reader=S3StorageReader(f"{root}/{name}"))
        torch.testing.assert_close(got, state, rtol=0, atol=0)


def test_gc_removes_an_incomplete_step_but_not_its_committed_plain_parts(s3_env: LocalS3Server, bucket: str) -> None:
    root = f"s3://{bucket}/run"
    kept = _dcp_checkpoint(f"{root}/0000100.m_model")  # a plain DCP checkpoint where a part would be
    ckpt = Checkpointer(root)
    ckpt.save({"model": torch.nn.Linear(2, 2)}, iteration=200)
    ckpt.save({"model": torch.nn.Linear(2, 2)}, iteration=200)  # generation directories
    client = s3_env.client()
    client.delete_object(Bucket=bucket, Key="run/0000200.pth")  # the re-save never committed
    garbage = find_garbage(root, older_than=0)
    assert any(n.name.startswith("run/0000200.") for n in garbage.objects) or any(
        n.name.startswith("0000200.") for n in garbage.objects
    )
    assert not any("0000100.m_model" in o.name for o in garbage.objects)
    assert any("0000100.m_model" in where and "complete DCP checkpoint" in why for where, why in garbage.skipped)
    collect_garbage(garbage)
    got = {k: torch.zeros_like(v) for k, v in kept.items()}
    dcp.load(got, storage_reader=S3StorageReader(f"{root}/0000100.m_model"))
    torch.testing.assert_close(got, kept, rtol=0, atol=0)


@pytest.mark.parametrize("where", ["s3", "local"])
def test_resume_and_keep_last_ignore_a_foreign_step_of_other_digits(
    where: str, s3_env: LocalS3Server, bucket: str, tmp_path: Path
) -> None:
    root = f"s3://{bucket}/run" if where == "s3" else str(tmp_path / "run")
    own = Checkpointer(root, keep_last=1)
    model = torch.nn.Linear(3, 2)
    own.save({"model": model}, iteration=100)
    # A foreign, complete step named with Arabic-Indic digits (its marker says iteration 50), saved later.
    foreign_name = _foreign("0000999")
    Checkpointer(root).save({"model": torch.nn.Linear(3, 2)}, iteration=50, path=f"{root}/{foreign_name}")
    own.save({"model": model}, iteration=200)  # keep_last=1: deletes 100, never the foreign step
    listed = {s.name for s in list_steps(root)}
    assert foreign_name in listed and "0000200" in listed and "0000100" not in listed
    fresh = torch.nn.Linear(3, 2)
    assert Checkpointer(root).load({"model": fresh}) == 200
    torch.testing.assert_close(fresh.state_dict(), model.state_dict(), rtol=0, atol=0)


def _schemes() -> dict[str, tuple[re.Pattern[str], str]]:
    """Every naming scheme dcp_s3 deletes or resumes by, with a name it makes (ASCII digits)."""
    from dcp_s3._checkpointer.local_root import RANK_DIR_RE
    from dcp_s3.integrations import nemo_commit, torchtitan, trainer_dirs
    from dcp_s3.integrations.torch_checkpointing import S3StorageConfig

    return {
        "Checkpointer": (CHECKPOINTER_STEPS, "0000100"),
        "local tier rank directories": (RANK_DIR_RE, "rank00003"),
        "NeMo AutoModel": (nemo_commit.CHECKPOINT_NAMES, "epoch_0_step_3"),
        "torchtitan": (torchtitan._STEP_DIR, "step-30"),
        "Trainer (Accelerate)": (trainer_dirs.CHECKPOINT_DIR, "checkpoint-30"),
        "torch_checkpointing": (scheme(S3StorageConfig(root="s3://bkt/r").checkpoint_names), "step_30"),
    }


@pytest.mark.parametrize("digits", [ARABIC, FULLWIDTH])
def test_every_scheme_takes_ascii_digits_only(digits: str) -> None:
    for who, (pattern, name) in _schemes().items():
        assert pattern.fullmatch(name), who
        assert pattern.fullmatch(_foreign(name, digits)) is None, who


def test_no_module_reads_numbers_with_unicode_digit_rules() -> None:
    """A guard: ``\\d``, ``isdigit``/``isdecimal``/``isnumeric`` appear nowhere in the package but in the grammar's
    own explanation."""
    import dcp_s3

    root = Path(dcp_s3.__file__).parent
    offenders = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "names.py" and path.parent.name == "checkpointer":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if re.search(r"\\d|\.is(?:digit|decimal|numeric)\(", code):
                offenders.append(f"{path.relative_to(root)}:{n}: {line.strip()}")
    assert offenders == []
