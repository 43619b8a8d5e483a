"""The small files of an ``S3Checkpointer`` save (:mod:`dcp_s3.integrations.nemo_automodel`): per-rank state files
and what NeMo's recipes write with ``open``/``torch.save`` themselves.

A NeMo AutoModel checkpoint holds, beside its DCP parts, the RNG state of every rank
(``rng/rng_global_rank_<r>.pt``, :meth:`RecipeFiles.save_on_global_ranks`), the data loader state of every
data-parallel rank (``dataloader/dataloader_dp_rank_<d>.pt``, :meth:`RecipeFiles.save_on_dp_ranks`) and rank 0's
``losses.json``, ``config.yaml`` and ``<key>.pt``. On S3 each is an object of the save in progress
(:meth:`dcp_s3.integrations.nemo_commit.Saves.write_file`, listed in the commit with its size) and is read back only
from the committed save, checked against its recorded size; ``.pt`` files are loaded with dcp_s3's checks of untrusted
archives (``weights_only`` unless the config's ``allow_legacy_pickle_restore`` trusts them). A local path keeps NeMo's
behaviour (its own methods, or files under the path). Nothing here imports NeMo: :class:`RecipeFiles` is a mixin
placed before NeMo's ``Checkpointer`` in ``S3Checkpointer``'s bases, so ``super()`` is NeMo's.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import yaml

from dcp_s3._checkpointer.ranks import distributed
from dcp_s3._untrusted.torch_files import torch_load, torch_save_bytes
from dcp_s3.errors import CheckpointFormatError, CheckpointNotFoundError, ConfigError
from dcp_s3.integrations._locations import s3_location
from dcp_s3.integrations.nemo_commit import COMPONENT, Saves

__all__ = ["RecipeFiles"]


def _global_rank() -> int:
    return dist.get_rank() if distributed() else 0


class RecipeFiles:
    """The small-file methods of ``S3Checkpointer`` (see the module docstring); needs ``_s3``, ``config``,
    ``dp_rank``, ``tp_rank``, ``pp_rank`` from the class it is mixed into."""

    _s3: Saves
    config: Any
    dp_rank: int
    tp_rank: int
    pp_rank: int

    # -- reading ----------------------------------------------------------------------------------------------

    def checkpoint_file(self, path: str, rel: str) -> bytes | None:
        """File ``rel`` of the checkpoint at ``path``: on S3 of its committed save (checked against the size its
        commit records); None when there is none."""
        location = s3_location(path)
        if location is not None:
            return self._s3.read_file(location, rel)
        file = os.path.join(path, rel)
        if not os.path.isfile(file):
            return None
        with open(file, "rb") as f:
            return f.read()

    def load_pt(self, ckpt: str, rel: str, *fallbacks: str) -> Any:
        """The ``.pt`` file ``rel`` (else the first of ``fallbacks`` there is) of the checkpoint at ``ckpt``, loaded with
        dcp_s3's checks of untrusted archives (``weights_only`` unless ``allow_legacy_pickle_restore``)."""
        for name in (rel, *fallbacks):
            data = self.checkpoint_file(ckpt, name)
            if data is not None:
                return torch_load(data, f"{ckpt}/{name}", weights_only=not self.config.allow_legacy_pickle_restore)
        raise CheckpointNotFoundError(f"{ckpt}: no {rel} (on S3: its commit lists none)")

    def _load_doc(self, path: str, rel: str, parse: Callable[[str], Any]) -> dict[str, Any] | None:
        location = s3_location(path) or path
        data = self.checkpoint_file(location, rel)
        if data is None:
            return None
        try:
            doc = parse(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError, yaml.YAMLError) as exc:
            raise CheckpointFormatError(f"{location}/{rel}: unreadable ({type(exc).__name__})") from None
        if not isinstance(doc, dict):
            raise CheckpointFormatError(f"{location}/{rel}: holds a {type(doc).__name__}, not a mapping")
        return doc

    # -- per-rank state files (NeMo's methods; on S3 objects of the save) --------------------------------------

    def _rank_file(self, state_name: str, kind: str, rank: int) -> str:
        return f"{state_name}/{state_name}_{kind}_rank_{rank}.pt"

    def save_on_dp_ranks(self, state: Any, state_name: str, path: str) -> None:
        # docstring inherited
        if s3_location(path) is None:
            return super().save_on_dp_ranks(state, state_name, path)  # type: ignore[misc, no-any-return]
        if self.tp_rank == 0 and self.pp_rank == 0:
            self._write_state(path, self._rank_file(state_name, "dp", self.dp_rank), state)
        return None

    def save_on_global_ranks(self, state: Any, state_name: str, path: str) -> None:
        # docstring inherited
        if s3_location(path) is None:
            return super().save_on_global_ranks(state, state_name, path)  # type: ignore[misc, no-any-return]
        self._write_state(path, self._rank_file(state_name, "global", _global_rank()), state)
        return None

    def _write_state(self, path: str, rel: str, state: Any) -> None:
        """This rank's ``state.state_dict()`` as file ``rel`` of the save in progress at S3 location ``path``."""
        self._s3.write_file(s3_location(path) or path, rel, torch_save_bytes(state.state_dict()))

    def load_on_dp_ranks(self, state: Any, state_name: str, path: str) -> None:
        # docstring inherited
        location = s3_location(path)
        if location is None:
            return super().load_on_dp_ranks(state, state_name, path)  # type: ignore[misc, no-any-return]
        state.load_state_dict(self.load_pt(location, self._rank_file(state_name, "dp", self.dp_rank)))
        return None

    def load_on_global_ranks(self, state: Any, state_name: str, path: str) -> None:
        # docstring inherited
        location = s3_location(path)
        if location is None:
            return super().load_on_global_ranks(state, state_name, path)  # type: ignore[misc, no-any-return]
        own = self._rank_file(state_name, "global", _global_rank())
        older = self._rank_file(state_name, "dp", self.dp_rank)  # NeMo's fallback for older checkpoints
        state.load_state_dict(self.load_pt(location, own, older))
        return None

    # -- rank 0's files: what NeMo's recipes write themselves ---------------------------------------------------

    def _rank0_file(self, path: str, rel: str, data: Callable[[], bytes]) -> None:
        """Rank 0: write ``data()`` as file ``rel`` of the save in progress at ``path`` (a local one: a file there)."""
        if _global_rank() != 0:
            return
        location = s3_location(path)
        if location is not None:
            self._s3.write_file(location, rel, data())
            return
        file = os.path.join(path, rel)
        os.makedirs(os.path.dirname(file), exist_ok=True)
        with open(file, "wb") as f:
            f.write(data())

    def save_losses(self, losses: dict[str, Any], path: str) -> None:
        """Rank 0 (others do nothing): ``losses.json`` of the save in progress at ``path`` (NeMo's ``save_losses``)."""
        self._rank0_file(path, "losses.json", lambda: json.dumps(losses).encode())

    def save_config(self, config: dict[str, Any], path: str) -> None:
        """Rank 0 (others do nothing): ``config.yaml`` of the save in progress at ``path`` (NeMo's ``save_config``)."""
        self._rank0_file(
            path, "config.yaml", lambda: yaml.safe_dump(config, sort_keys=False, default_flow_style=False).encode()
        )

    def save_state(self, state: Any, key: str, path: str) -> None:
        """Rank 0 (others do nothing): ``<key>.pt``, ``state.state_dict()`` (what NeMo's recipes ``torch.save``)."""
        if not COMPONENT.fullmatch(key):
            raise ConfigError(f"state key {key!r}: not a name of one path component")
        self._rank0_file(path, f"{key}.pt", lambda: torch_save_bytes(state.state_dict()))

    def load_state(self, state: Any, key: str, path: str) -> None:
        """Every rank: ``state.load_state_dict`` of ``<key>.pt`` from the checkpoint at ``path``."""
        state.load_state_dict(self.load_pt(s3_location(path) or path, f"{key}.pt"))

    def load_losses(self, path: str) -> dict[str, Any] | None:
        """``losses.json`` of the committed save at ``path`` (None when it has none)."""
        return self._load_doc(path, "losses.json", json.loads)

    def load_config(self, path: str) -> dict[str, Any] | None:
        """``config.yaml`` of the committed save at ``path`` (None when it has none), read with ``yaml.safe_load``."""
        return self._load_doc(path, "config.yaml", yaml.safe_load)
