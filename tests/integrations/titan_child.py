"""A torchtitan job on one gloo rank, for the SIGKILL test in ``test_torchtitan.py`` (run by ``held_child.HeldChild``).

``upload``: train, async-save steps 2 and 4 (committed), then step 6, whose ``.metadata`` PUT the test's
proxy holds (``async_mode`` "async": in this process; "async_with_pinned_mem": in torch's upload process); once the purge that save queued has run, write step 4's state and report *held* (the test
then SIGKILLs this process mid-upload). ``load``: resume and write what was loaded.
Arguments: held file, release file, phase, the config (JSON), dump folder, TMPDIR, output file.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from dist_utils import free_port  # noqa: E402
from test_torchtitan import _child_env, _snapshot, _step, _trainer  # noqa: E402
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # noqa: E402


def main() -> None:
    held, release, phase, config, dump, tmp, out = sys.argv[1:8]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo", rank=0, world_size=1)
    _child_env(tmp)
    t = _trainer(0, 1, json.loads(config), dump)
    manager = t["manager"]
    loaded = manager.load()
    if phase == "load":
        torch.save({"loaded": loaded, "state": _snapshot(t)}, out)
        manager.close()
        return
    if manager.async_mode == "async_with_pinned_mem":  # torchtitan's stager without pinned memory (CPU host)
        manager.stager = DefaultStager(StagingOptions(False, True, True, False))
    for step in range(1, 5):
        _step(t)
        manager.save(step)
        manager.maybe_wait_for_staging()
    manager.maybe_wait_for_saving()  # step 4 committed
    state = _snapshot(t)
    for step in (5, 6):
        _step(t)
        manager.save(step)  # step 6: its upload hangs at the .metadata PUT (in torch's upload process if pinned)
        manager.maybe_wait_for_staging()
    while not manager.purge_queue.empty():  # the purge thread took what this save queued...
        time.sleep(0.05)
    time.sleep(2.0)  # ...and deleted it (a wait for the crash to come after the purge, not a measurement)
    torch.save({"state": state}, out)
    Path(held).touch()
    while not Path(release).exists():
        time.sleep(0.1)


if __name__ == "__main__":
    main()
