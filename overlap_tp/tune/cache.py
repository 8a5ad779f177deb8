"""The tuner's decisions on disk: one JSON file, written atomically by rank 0, read by every rank.

File format (FORMAT_VERSION 1):

    {"format": 1,
     "entries": {
       "<device>|<op>|<dtype>|t<t>|<M>x<N>x<K>": {
          "stamp":  {"format": 1, "overlap_tp": "0.1.0", "torch": "...", "triton": "...", "nccl": "2.28.9",
                     "device": "NVIDIA H200"},
          "config": {OverlapConfig fields; groups as a list},
          "label": "row_slice/nccl/sm0/g4-8-4", "how": "predicted+verified" | "exhaustive",
          "times": {"<label>": ms, ...},               the numbers the decision was made from
          "measurements": {...},                       Measurements.to_dict() (re-predict offline)
          "created": "2026-11-23T10:00:00"}}}

An entry whose stamp differs from this process's (another device, another overlap_tp / torch / triton /
NCCL version, another format) is not used: `get` returns None and the entry is listed in `ignored`
(and warned about once), so an upgrade re-tunes instead of trusting numbers from other software.
Writes hold an exclusive lock (fcntl.flock on the sidecar file `<path>.lock`, never deleted: removing
a lock file while another process waits on it would let two writers in) around the read-merge-write,
so two jobs sharing the file do not drop each other's entries, and go through a temporary file in
the same folder plus os.replace (atomic on POSIX): a reader, which takes no lock, sees the old file
or the new one, never a torn one. A missing or unreadable file is an empty cache.

Path: an explicit path, else $OVERLAP_TP_TUNE_CACHE; there is no default under the home directory
(docs/tuner.md: a file nobody asked for, shared by every job of the user). Training runs get one
under Megatron's --save folder (overlap_tp.megatron.arguments.tune_cache_path).
"""
import dataclasses
import datetime
import fcntl
import json
import os
import tempfile
import warnings
from typing import Dict, List, Optional, Tuple

from overlap_tp.ops.config import OverlapConfig

FORMAT_VERSION = 1
ENV_VAR = "OVERLAP_TP_TUNE_CACHE"


def default_path() -> Optional[str]:
    """$OVERLAP_TP_TUNE_CACHE, or None: without an explicit location the tuner keeps its decisions in
    the process only."""
    return os.environ.get(ENV_VAR) or None


def location_problem(path: str) -> Optional[str]:
    """Why the tune cache cannot live at `path` (None if it can): a folder, an unwritable file, or a
    nearest existing ancestor folder that this process cannot create the file in. Creates nothing."""
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.isdir(path):
        return f"{path} is a folder; give a file path (e.g. {os.path.join(path, 'tune.json')})"
    if os.path.exists(path):
        return None if os.access(path, os.W_OK) else f"{path} is not writable"
    folder = os.path.dirname(path)
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        return f"{folder} is a file, so {path} cannot be created"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"{folder} is not writable, so {path} cannot be created"
    return None


def _package_version() -> Optional[str]:
    """overlap_tp's installed version (setup.py's), None when it runs from a source tree not installed."""
    from importlib import metadata
    try:
        return metadata.version("overlap_tp")
    except metadata.PackageNotFoundError:
        return None


def software_stamp(device_name: str) -> Dict[str, Optional[str]]:
    """What an entry is valid for: this device and these versions."""
    import torch

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    nccl = None
    try:
        if torch.cuda.is_available():
            v = torch.cuda.nccl.version()
            nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except (AttributeError, RuntimeError):
        nccl = None
    return {"format": FORMAT_VERSION, "overlap_tp": _package_version(), "torch": torch.__version__,
            "triton": triton_version, "nccl": nccl, "device": device_name}


def cache_key(device_name: str, op: str, dtype: str, t: int, m: int, n: int, k: int, regime: str = "eager") -> str:
    """The entry of one shape; decisions timed as graph replays carry their regime (eager ones do not: the entries
    written before the regimes existed stay valid)."""
    return f"{device_name}|{op}|{dtype}|t{t}|{m}x{n}x{k}" + ("" if regime == "eager" else f"|{regime}")


def config_to_dict(config: OverlapConfig) -> dict:
    d = dataclasses.asdict(config)
    if isinstance(d["groups"], tuple):
        d["groups"] = list(d["groups"])
    return d


def config_from_dict(d: dict) -> OverlapConfig:
    known = {f.name for f in dataclasses.fields(OverlapConfig)}
    return OverlapConfig(**{k: v for k, v in d.items() if k in known})


class TuneCache:
    """The decisions file. `stamp`: this process's software_stamp (device name included)."""

    def __init__(self, path: Optional[str] = None, stamp: Optional[dict] = None):
        path = path or default_path()
        if not path:
            raise ValueError(f"overlap_tp tune cache: no path; pass one or set {ENV_VAR}")
        self.path = os.path.abspath(os.path.expanduser(path))
        self.stamp = stamp
        self.ignored: List[Tuple[str, str]] = []    # (key, why) of entries found but not used
        self._warned = set()

    def _load(self) -> Dict[str, dict]:
        try:
            with open(self.path) as f:
                data = json.load(f)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            warnings.warn(f"overlap_tp tune cache {self.path} is unreadable ({e}); treating it as empty")
            return {}
        if not isinstance(data, dict) or data.get("format") != FORMAT_VERSION or not isinstance(
                data.get("entries"), dict):
            self._report("*", f"file format {data.get('format') if isinstance(data, dict) else '?'} "
                              f"!= {FORMAT_VERSION}")
            return {}
        return data["entries"]

    def _report(self, key: str, why: str):
        self.ignored.append((key, why))
        if (key, why) not in self._warned:
            self._warned.add((key, why))
            warnings.warn(f"overlap_tp tune cache {self.path}: ignoring entry {key}: {why}")

    def entries(self) -> Dict[str, dict]:
        return self._load()

    def get(self, key: str) -> Optional[dict]:
        """The entry for `key` if it was made with this stamp, else None (reported in `ignored`)."""
        entry = self._load().get(key)
        if entry is None:
            return None
        stamp = entry.get("stamp", {})
        if self.stamp is not None and stamp != self.stamp:
            diff = sorted(k for k in set(stamp) | set(self.stamp) if stamp.get(k) != self.stamp.get(k))
            self._report(key, "made with other " + ", ".join(
                f"{k} ({stamp.get(k)!r} vs {self.stamp.get(k)!r})" for k in diff))
            return None
        if "config" not in entry:
            self._report(key, "no config")
            return None
        return entry

    def get_config(self, key: str) -> Optional[OverlapConfig]:
        entry = self.get(key)
        if entry is None:
            return None
        try:
            return config_from_dict(entry["config"])
        except (TypeError, ValueError) as e:
            self._report(key, f"invalid config ({e})")
            return None

    def put(self, key: str, config: OverlapConfig, **fields):
        """Record `config` for `key` (with this stamp and the given extra fields): under the file's lock,
        merged with what is on disk then, replaced atomically."""
        entry = {"stamp": self.stamp, "config": config_to_dict(config),
                 "created": datetime.datetime.now().isoformat(timespec="seconds"), **fields}
        folder = os.path.dirname(self.path)
        os.makedirs(folder, exist_ok=True)
        with open(self.path + ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)   # released when the file closes, also on an exception
            entries = self._load()             # read under the lock: another writer's entries are kept
            entries[key] = entry
            fd, tmp = tempfile.mkstemp(prefix=".tune.", suffix=".json.tmp", dir=folder)
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump({"format": FORMAT_VERSION, "entries": entries}, f, indent=1, sort_keys=True)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.path)
            except BaseException:
                if os.path.exists(tmp):
                    os.unlink(tmp)
                raise
