"""An ``S3StorageWriter`` whose upload fails at a deadline: for async saves run where something waits for the upload
to end before the next save may start.

NeMo AutoModel 0.7.0 serializes torch's process-based async saves: its ``_torch_backports`` wraps torch's
``_ProcessBasedAsyncCheckpointExecutor`` so that one lock is held while a save's upload runs in torch's checkpoint
process (``_execute_save_impl``), and the next ``dcp.async_save`` takes that lock in the caller's thread
(``execute_save``) before it stages anything. An upload held up by the network therefore held the *training* thread
in the next ``save_model``/``save_optimizer`` for as long as the upload took (56 s, with a 4 s upload deadline),
after ``async_wait`` had already given up on it at its deadline.

:func:`bounded` gives a writer a deadline (wall-clock seconds since the epoch, comparable in torch's checkpoint
process, where the writer is unpickled): its ``write_data`` runs the upload in a thread of its own and, when the
deadline passes first, returns a failed future (``S3TransferError``). DCP's save then fails on that rank and in the
collective on the others, torch's checkpoint process answers the save with the error, and NeMo's lock is released:
the next save starts at most about the deadline after the previous one was called. The abandoned thread ends on its
own (each request is cut at ``request_deadline``); what it wrote is under that save's token and is never committed.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from torch.futures import Future

from dcp_s3._dcp.writer import S3StorageWriter
from dcp_s3.errors import S3TransferError

__all__ = ["bounded"]


class _BoundedUpload(S3StorageWriter):
    """``S3StorageWriter`` whose ``write_data`` fails at ``_upload_deadline`` (see the module docstring)."""

    _upload_deadline: float

    def write_data(self, plan: Any, planner: Any) -> Any:
        # docstring inherited
        done: dict[str, Any] = {}

        def upload() -> None:
            try:
                done["future"] = S3StorageWriter.write_data(self, plan, planner)
            except BaseException as exc:  # raised in the caller's thread below, as an unbounded upload would
                done["error"] = exc

        thread = threading.Thread(target=upload, name="dcp_s3-bounded-upload", daemon=True)
        thread.start()
        thread.join(max(self._upload_deadline - time.time(), 0.0))
        if "error" in done:
            raise done["error"]
        if "future" in done:
            return done["future"]
        failed: Future[Any] = Future()
        failed.set_exception(
            S3TransferError(  # type: ignore[arg-type]  # torch's stub types it as the result
                f"the upload of {self.checkpoint_id} did not complete by its deadline; abandoned (nothing of it is "
                "committed)"
            )
        )
        return failed


def bounded(writer: S3StorageWriter, timeout_s: float) -> S3StorageWriter:
    """``writer``, whose upload (``write_data``) now fails ``timeout_s`` seconds from this call if not done by then."""
    writer.__class__ = _BoundedUpload
    writer._upload_deadline = time.time() + timeout_s  # type: ignore[attr-defined]
    return writer
