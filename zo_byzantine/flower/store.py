"""A node's own disk, kept between the messages of a run: Flower starts a fresh ClientApp process for every message,
so what a node computes once (its checked settings, the partition) or carries from round to round (its replica's
weights) lives here, never in Flower's ``Context`` (which would send it between SuperNode and ClientApp on every
message) and never on the wire.

    <root>/node-<node id>/run-<run id>/
        settings.json                               the run config's checked settings a node uses (node_deployment)
        partition.npz                               every client's partition of the training set, computed once
        weights-<start>-<applied>.safetensors       the replica's trainable weights after ``applied`` ledger rounds
                                                    from start weights ``<start>`` (a fingerprint prefix); only the
                                                    newest is kept

``<root>``: the node config's ``store-dir`` ("" or absent: :func:`default_root`). Every file is written to a
temporary name in the same folder and renamed into place (``os.replace``), so a process killed mid-write leaves the
previous file or none, never half of one; weights are read through a memory map (safetensors). A node that loses its
store (or its ``Context``) asks the server for the ledger rounds it lacks and replays them: the store is a cache of
what the ledger determines, never a source of truth (a weights file is checked against the server's fingerprint).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import tempfile
from collections.abc import Callable

import numpy as np

STORE_KEY = "store-dir"  # node config key: the folder of the node's store
SETTINGS_FILE, PARTITION_FILE = "settings.json", "partition.npz"
FINGERPRINT_PREFIX = 16  # hex digits of the start fingerprint in a weights file's name (the whole one is inside)


def default_root() -> str:
    """``$XDG_CACHE_HOME/zo_byzantine/flower`` (``~/.cache/zo_byzantine/flower`` without it)."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "zo_byzantine", "flower")


def store_root(node_config) -> str:
    """The node config's ``store-dir`` as an absolute path, or :func:`default_root`; raises ``ValueError`` naming the
    key for anything but a string."""
    root = node_config.get(STORE_KEY, "")
    if not isinstance(root, str):
        raise ValueError(f"node config {STORE_KEY!r}: expected a string (a folder on the node; \"\": "
                         f"{default_root()}), got {root!r}.")
    return os.path.abspath(os.path.expanduser(root)) if root else default_root()


class NodeStore:
    """The files of one node in one run (see the module docstring); ``folder`` is created if missing."""

    def __init__(self, folder: str):
        self.folder = str(folder)
        os.makedirs(self.folder, exist_ok=True)

    @classmethod
    def of(cls, node_config, node_id: int, run_id: int) -> NodeStore:
        """The store of SuperNode ``node_id`` in run ``run_id`` under the node config's ``store-dir``."""
        return cls(os.path.join(store_root(node_config), f"node-{int(node_id)}", f"run-{int(run_id)}"))

    def path(self, name: str) -> str:
        return os.path.join(self.folder, name)

    def _write(self, name: str, write: Callable[[str], None]) -> None:
        """``write(temporary path)``, then rename it to ``name`` (atomic on one file system)."""
        fd, temporary = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=self.folder)
        os.close(fd)
        try:
            write(temporary)
            os.replace(temporary, self.path(name))
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary)
            raise

    # ----- small records ----------------------------------------------------------------------------------------

    def read_json(self, name: str) -> dict | None:
        """The JSON object kept as ``name``, or ``None`` if it is missing or unreadable."""
        try:
            with open(self.path(name)) as f:
                value = json.load(f)
        except (OSError, ValueError):
            return None
        return value if isinstance(value, dict) else None

    def write_json(self, name: str, value: dict) -> None:
        def write(path: str) -> None:
            with open(path, "w") as f:
                json.dump(value, f, sort_keys=True)

        self._write(name, write)

    # ----- the partition ----------------------------------------------------------------------------------------

    def partitions(self, key: str, build: Callable[[], list]) -> list[np.ndarray]:
        """Every client's partition (index arrays): read back if kept for ``key``, else ``build()`` and kept."""
        try:
            with np.load(self.path(PARTITION_FILE), allow_pickle=False) as kept:
                if str(kept["key"]) == key:
                    flat, offsets = kept["flat"], kept["offsets"]
                    return [flat[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]
        except (OSError, KeyError, ValueError):
            pass
        parts = [np.asarray(p, dtype=np.int64) for p in build()]
        offsets = np.cumsum([0] + [len(p) for p in parts], dtype=np.int64)
        flat = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

        def write(path: str) -> None:
            with open(path, "wb") as f:
                np.savez(f, key=np.array(key), flat=flat, offsets=offsets)

        self._write(PARTITION_FILE, write)
        return parts

    # ----- the replica's weights --------------------------------------------------------------------------------

    @staticmethod
    def weights_name(start: str, applied: int) -> str:
        return f"weights-{start[:FINGERPRINT_PREFIX]}-{int(applied):08d}.safetensors"

    def weight_files(self) -> list[str]:
        """Names of the weights files in the store, in name order (start prefix, then applied rounds)."""
        return sorted(os.path.basename(p) for p in glob.glob(os.path.join(glob.escape(self.folder),
                                                                          "weights-*.safetensors")))

    def has_weights(self, start: str, applied: int) -> bool:
        return os.path.exists(self.path(self.weights_name(start, applied)))

    def save_weights(self, start: str, applied: int, tensors: dict) -> None:
        """Keep ``tensors`` (name -> tensor, exact bytes) as the weights after ``applied`` rounds from ``start``; every
        other weights file of the store is removed."""
        from safetensors.torch import save_file

        name = self.weights_name(start, applied)
        plain = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
        self._write(name, lambda path: save_file(plain, path, metadata={"start": start, "applied": str(int(applied))}))
        for other in self.weight_files():
            if other != name:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path(other))

    def load_weights(self, start: str, applied: int, names: list[str]) -> dict | None:
        """The kept weights after ``applied`` rounds from ``start`` (read through a memory map), or ``None`` if the
        file is missing, unreadable, or does not hold exactly ``names`` for these start weights."""
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(self.path(self.weights_name(start, applied)), framework="pt") as f:
                metadata = f.metadata() or {}
                if metadata.get("start") != start or metadata.get("applied") != str(int(applied)):
                    return None
                if set(f.keys()) != set(names):
                    return None
                return {name: f.get_tensor(name) for name in names}
        except (OSError, SafetensorError, ValueError):
            return None

    def remove_weights(self) -> None:
        """Forget every kept weights file (a node out of sync starts over from the start weights)."""
        for name in self.weight_files():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path(name))
