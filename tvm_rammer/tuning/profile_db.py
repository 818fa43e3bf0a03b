"""Profile databases: measured rKernel and rProgram times, kept between compilations.

Rammer's profiler (OSDI'20, 3.2) gives the policy 1) each rTask's time on a vEU, 2) its resource use
and 3) an rProgram's time. Measuring needs the GPU; a database keeps the results, so a second
compilation of the same model measures nothing and a machine without a GPU can reuse them.

Records are keyed by ``(kind, key, device)``: ``kind`` is "kernel" (one rKernel version: its
structural hash, ``tuning.versions.func_key``), "rprogram" (a placed rProgram), "default" (the
same operators as TVM's default kernels) or "in_context" (an rKernel's rTask times as measured
inside a persistent kernel by ``tvm-rammer run --timeline --record-in-context``, keyed by the rKernel's
name ``op:version#hash``; marked ``"in_context": true``; written on request only, read by nothing
in the compiler yet) or "operator" (the rKernel versions one operator has and which of them
have kernel records, so a later compile makes only those it needs: ``tuning.operator_record``,
keyed by ``operator_record.operator_key``); ``device`` is ``gpu.DeviceId.key`` (name, arch, driver).
A record is a JSON object; a kernel record holds ``kernel_us``, ``registers``, ``shared_bytes``,
``valid`` (its outputs matched TVM's default kernel for the operator) and ``error``.

Two stores with the same methods, chosen by :func:`open_profile_db` from the path:

- :class:`SqliteProfileDB` (any path not ending in ``.json``; the per-user cache
  ``$XDG_CACHE_HOME/tvm-rammer/profiles.sqlite``): sqlite3 in WAL mode, every write one
  transaction, so concurrent compiles (bench workers, parallel builds, two users' jobs) lose nothing
  and never leave it half-written;
- :class:`JsonProfileDB` (``*.json``; the databases shipped in ``tvm_rammer/profiles/`` and
  ``--profile-db x.json``): one readable file; :meth:`flush` re-reads it and merges under an
  exclusive file lock, then replaces it atomically, so concurrent writers lose nothing either.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sqlite3
from pathlib import Path

from ..host.gpu import DeviceId

__all__ = ["FORMAT", "KINDS", "JsonProfileDB", "SqliteProfileDB", "open_profile_db",
           "default_cache_path", "shipped_profile_dbs", "SHIPPED_DIR"]

FORMAT = "tvm-rammer-profile-db/2"
KINDS = ("kernel", "rprogram", "default", "in_context", "operator")
SHIPPED_DIR = Path(__file__).resolve().parents[1] / "profiles"


def default_cache_path() -> str:
    """The per-user profile cache: ``$XDG_CACHE_HOME/tvm-rammer/profiles.sqlite`` (XDG's default
    ``~/.cache`` when the variable is unset). The one place tvm-rammer's library reads the
    environment: like pip's or TVM's own caches, the location is the user's to choose."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tvm-rammer", "profiles.sqlite")


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"profile record kind {kind!r}: use one of {KINDS}")


class _Store:
    """What both stores offer; ``_get``/``_put_many``/``_device_keys`` are theirs."""

    path: str | None

    def get(self, kind: str, key: str, device: DeviceId) -> dict | None:
        """The record of ``key`` measured on ``device``, or None."""
        _check_kind(kind)
        return self._get(kind, key, device.key)

    def put(self, kind: str, key: str, device: DeviceId, record: dict) -> None:
        self.put_many([(kind, key, device, record)])

    def put_many(self, items) -> None:
        """Store ``(kind, key, device, record)`` items together (one transaction)."""
        rows = []
        for kind, key, device, record in items:
            _check_kind(kind)
            rows.append((kind, key, device.key, dict(record)))
        if rows:
            self._put_many(rows)

    def devices(self) -> list[DeviceId]:
        """Every device with records, sorted by key."""
        return [DeviceId.from_key(k) for k in sorted(self._device_keys())]

    def device_for(self, arch: str, name: str | None = None) -> DeviceId | None:
        """A device of this database for compiling without a GPU: the same compute capability
        (and the same name when given), the newest driver first."""
        from ..target import same_arch

        found = [d for d in self.devices() if same_arch(d.arch, arch) and (name is None or d.name == name)]
        return sorted(found, key=lambda d: d.driver, reverse=True)[0] if found else None


class JsonProfileDB(_Store):
    """A profile database in one JSON file (``path``; None = memory only). Writes are buffered until
    :meth:`flush`, which merges them into the file under a lock."""

    def __init__(self, path: str | None = None, readonly: bool = False):
        self.path, self.readonly = path, readonly
        self._data: dict = {}
        self._pending: list = []
        if path is not None and os.path.exists(path):
            self._data = self._read(path)
        elif path is not None and readonly:
            raise ValueError(f"profile database {path!r} does not exist")

    @staticmethod
    def _read(path: str) -> dict:
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"profile database {path!r} is not readable JSON ({err}); "
                             "delete it or pass another --profile-db") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
            raise ValueError(f"profile database {path!r} has format {found!r}, expected {FORMAT!r}; "
                             "delete it or pass another --profile-db")
        return doc.get("devices", {})

    def _get(self, kind, key, device):
        return self._data.get(device, {}).get(kind, {}).get(key)

    def _merge(self, data: dict, rows) -> None:
        for kind, key, device, record in rows:
            data.setdefault(device, {}).setdefault(kind, {})[key] = record

    def _put_many(self, rows) -> None:
        if self.readonly:
            raise ValueError(f"profile database {self.path!r} is read-only")
        self._merge(self._data, rows)
        self._pending.extend(rows)

    def _device_keys(self):
        return self._data.keys()

    @property
    def dirty(self) -> bool:
        return bool(self._pending)

    def flush(self) -> None:
        """Merge the records put since the last flush into the file (a no-op in memory)."""
        if self.path is None or not self._pending:
            self._pending = []
            return
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(f"{self.path}.lock", "a", encoding="utf-8") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                data = self._read(self.path) if os.path.exists(self.path) else {}
                self._merge(data, self._pending)
                tmp = f"{self.path}.tmp{os.getpid()}"
                with open(tmp, "w", encoding="utf-8") as f:
                    json.dump({"format": FORMAT, "devices": data}, f, indent=1, sort_keys=True)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.path)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
        self._data, self._pending = data, []

    def close(self) -> None:
        self.flush()


class SqliteProfileDB(_Store):
    """A profile database in sqlite3 (WAL mode). Every :meth:`put_many` is one transaction."""

    _SCHEMA = ("CREATE TABLE IF NOT EXISTS records (kind TEXT NOT NULL, key TEXT NOT NULL, "
               "device TEXT NOT NULL, record TEXT NOT NULL, PRIMARY KEY (kind, key, device))")

    def __init__(self, path: str, readonly: bool = False):
        self.path, self.readonly = path, readonly
        if not readonly:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        if readonly and not os.path.exists(path):
            raise ValueError(f"profile database {path!r} does not exist")
        try:
            uri = f"file:{os.path.abspath(path)}?mode=ro" if readonly else path
            self._conn = sqlite3.connect(uri, timeout=60.0, isolation_level=None, uri=readonly)
            self._conn.execute("PRAGMA busy_timeout = 60000")
            if not readonly:
                self._conn.execute("PRAGMA journal_mode = WAL")
                self._conn.execute(self._SCHEMA)
        except sqlite3.DatabaseError as err:
            raise ValueError(f"profile database {path!r} is not a usable sqlite3 file ({err}); "
                             "delete it or pass another --profile-db") from None

    def _get(self, kind, key, device):
        row = self._query("SELECT record FROM records WHERE kind = ? AND key = ? AND device = ?",
                          (kind, key, device)).fetchone()
        return None if row is None else json.loads(row[0])

    def _query(self, sql, args=()):
        try:
            return self._conn.execute(sql, args)
        except sqlite3.OperationalError as err:
            if "no such table" in str(err):
                return self._conn.execute("SELECT NULL WHERE 0")
            raise

    def _put_many(self, rows) -> None:
        if self.readonly:
            raise ValueError(f"profile database {self.path!r} is read-only")
        with self._transaction():
            self._conn.executemany("INSERT OR REPLACE INTO records VALUES (?, ?, ?, ?)",
                                   [(k, key, d, json.dumps(r, sort_keys=True)) for k, key, d, r in rows])

    @contextlib.contextmanager
    def _transaction(self):
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        self._conn.execute("COMMIT")

    def _device_keys(self):
        return [row[0] for row in self._query("SELECT DISTINCT device FROM records")]

    dirty = False

    def flush(self) -> None:
        """Nothing to do: every put is already committed."""

    def close(self) -> None:
        self._conn.close()

    def export_json(self, path: str, device: DeviceId | None = None) -> JsonProfileDB:
        """Copy the records (of ``device`` only, when given) into a JSON database at ``path``."""
        out = JsonProfileDB(path)
        rows = self._query("SELECT kind, key, device, record FROM records").fetchall()
        items = [(k, key, DeviceId.from_key(d), json.loads(r)) for k, key, d, r in rows
                 if device is None or d == device.key]
        out.put_many(items)
        out.flush()
        return out


def open_profile_db(path: str, readonly: bool = False):
    """The profile database at ``path``: JSON for ``*.json``, sqlite3 otherwise (created when missing,
    unless ``readonly``)."""
    path = os.fspath(path)
    if path.endswith(".json"):
        return JsonProfileDB(path, readonly=readonly)
    return SqliteProfileDB(path, readonly=readonly)


def shipped_profile_dbs() -> list[JsonProfileDB]:
    """The profile databases shipped with tvm-rammer (``tvm_rammer/profiles/*.json``), read-only;
    ``scripts/gpu_check.sh`` records them on every GPU run."""
    if not SHIPPED_DIR.is_dir():
        return []
    return [JsonProfileDB(str(p), readonly=True) for p in sorted(SHIPPED_DIR.glob("*.json"))]
