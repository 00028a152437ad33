"""Per-GPU launch configs: a lazy, cached ``DeviceInfo`` and ``select_config`` over typed, validated schemas.

Nothing here touches the driver at import time. ``device_info()`` queries the device the first time a kernel
launches and caches the answer; under ``TRITON_INTERPRET=1`` it returns a fixed ``interpreter`` description and
``select_config`` reads only ``configs/interpreter.json`` (one pinned config per op).

Config tables live in ``gqla_triton/configs/<gpu>.json``::

    {"<op>": [{"match": {"K": 128}, "config": {"wy_bk": 64, ...}}, ..., {"match": {}, "config": {...}}]}

The first entry whose ``match`` items all equal the caller's key wins (an empty match is the default); fields an
entry leaves out take the schema's defaults. Unknown GPUs use ``default.json`` (conservative configs sized for
about 100 KB of shared memory per program). A table written by ``python -m gqla_triton.tune`` into the user
config directory (``user_config_dir()``) takes precedence for its GPU: its rows of an op are matched before the
shipped rows of that op, which still serve the ops and shapes it leaves out. Every entry of a table is checked against
its op's schema when the table is first read: an unknown op, match key or field, or a value of the wrong type, is
a ``ValueError`` naming it. ``GQLA_TRITON_CONFIG`` (a JSON object or the path of a JSON file,
``{"<op>": {"<field>": value}}``; text that parses as JSON is JSON) and ``config_override`` (in-process, for tools
and tests) override fields of the selected entry, checked alike.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import os
import re
from collections.abc import Hashable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "DeviceInfo",
    "device_info",
    "is_interpreter",
    "gpu_key",
    "gpu_table",
    "select_config",
    "config_override",
    "table_swap",
    "reload_tables",
    "user_config_dir",
    "schema",
    "OPS",
    "SHARED_TABLES",
]

_CONFIG_DIR = Path(__file__).parent / "configs"

# op -> its schema ("module:class"), imported on first use (the schemas live beside their kernels)
_SCHEMAS = {
    "gdn_chunk": "gqla_triton.ops.gdn.config:ChunkConfig",
    "gdn_decode": "gqla_triton.ops.gdn.config:DecodeConfig",
    "mla_decode": "gqla_triton.ops.mla.config:MLADecodeConfig",
    "gqa_decode": "gqla_triton.ops.gqa.config:GQADecodeConfig",
    "combine": "gqla_triton.ops._common.combine:CombineConfig",
    "decode_path": "gqla_triton.decode_path:DecodePathConfig",
}
OPS = tuple(_SCHEMAS)


def is_interpreter() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@dataclass(frozen=True)
class DeviceInfo:
    name: str  # as the driver reports it, e.g. "NVIDIA H200"
    capability: tuple[int, int]
    sm_count: int
    smem_per_block: int  # bytes, opt-in maximum
    l2_bytes: int
    interpreter: bool = False

    @property
    def key(self) -> str:
        """Config-table name: ``interpreter``, ``h200``, ``h100``, ... or ``default``."""
        return "interpreter" if self.interpreter else gpu_key(self.name)

    @property
    def table(self) -> str:
        """The name of this GPU's tables (``gpu_table``): ``key``, or a GPU with no key its own name."""
        return "interpreter" if self.interpreter else gpu_table(self.name)


_INTERPRETER = DeviceInfo("interpreter", (0, 0), sm_count=4, smem_per_block=1 << 30, l2_bytes=0, interpreter=True)

# Model tokens of driver names (a name is split at every character that is not a letter or digit, so "NVIDIA
# A100-SXM4-80GB" holds "a100" and "NVIDIA RTX A1000" does not) and their table keys. The GH200's GPU is an
# H100-class Hopper die (sm_90, 132 SMs): it takes the H100's key, which runs the H200's kernel configs
# (``SHARED_TABLES``) but not the H200's measured ``decode_path`` rows.
_GPU_NAMES = (
    ("h200", "h200"),
    ("h100", "h100"),
    ("h800", "h100"),
    ("gh200", "h100"),
    ("h20", "h20"),
    ("a100", "a100"),
    ("a100x", "a100"),
    ("a800", "a100"),
    ("l40s", "l40s"),
)
GPU_KEYS = tuple(sorted({k for _, k in _GPU_NAMES}))

# GPUs whose SM is another GPU's, and which run that GPU's shipped kernel configs where they have no table of their
# own: the H100 / H800 / GH200 (key h100) are sm_90a with the H200's SM count (SXM) and 227 KB of shared memory per
# block, so the H200's tiles, stage counts and Gluon kernels compile and fit alike (the choices are tuned on the
# H200). Entries of one GPU's own measurements (a schema with ``MEASURED``: ``decode_path``) are not shared.
SHARED_TABLES = {"h100": "h200"}


def gpu_key(name: str) -> str:
    """The config-table key of the GPU whose driver name is ``name`` (its model token, ``_GPU_NAMES``), else
    ``default``."""
    if not isinstance(name, str):
        raise TypeError(f"name: expected a GPU name (str), got {type(name).__name__}")
    tokens = set(re.split(r"[^a-z0-9]+", name.lower()))
    for token, key in _GPU_NAMES:
        if token in tokens:
            return key
    return "default"


_RESERVED_TABLES = ("", "default", "interpreter")


def gpu_table(name: str) -> str:
    """The name of the tables of the GPU whose driver name is ``name``: its ``gpu_key``, or for a GPU without one
    (which runs ``default.json``) its own name in lower case with each run of other characters than letters and
    digits as ``-`` (``NVIDIA RTX A1000``: ``nvidia-rtx-a1000``; ``gpu-`` before a name that is empty or a
    reserved table's): the table ``gqla_triton.tune`` writes for it, read by no other GPU."""
    key = gpu_key(name)
    if key != "default":
        return key
    own = "-".join(t for t in re.split(r"[^a-z0-9]+", name.lower()) if t)
    return f"gpu-{own}".rstrip("-") if own in _RESERVED_TABLES else own


@functools.cache
def _cuda_info(index: int) -> DeviceInfo:
    import torch

    p = torch.cuda.get_device_properties(index)
    smem = getattr(p, "shared_memory_per_block_optin", 0) or getattr(p, "shared_memory_per_block", 49152)
    return DeviceInfo(
        name=p.name,
        capability=(p.major, p.minor),
        sm_count=p.multi_processor_count,
        smem_per_block=int(smem),
        l2_bytes=int(getattr(p, "L2_cache_size", 0)),
    )


def device_info(device: Any = None) -> DeviceInfo:
    """Lazy, cached description of ``device`` (a torch device, index or tensor); interpreter aware."""
    if is_interpreter():
        return _INTERPRETER
    import torch

    if isinstance(device, torch.Tensor):
        if device.is_cuda:  # the index of an existing CUDA tensor is a valid device (the per-call path of every op)
            return _cuda_info(device.get_device())
        device = device.device
    if not torch.cuda.is_available():
        raise ValueError("device_info: no CUDA device here (set TRITON_INTERPRET=1 to run on the CPU)")
    if device is None:
        index = torch.cuda.current_device()
    else:
        if isinstance(device, bool):
            raise TypeError("device_info: expected a torch device, a CUDA index or a tensor, got bool")
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError, ValueError) as e:
            raise ValueError(f"device_info: expected a torch device, a CUDA index or a tensor, got {device!r}") from e
        if device.type != "cuda":
            raise ValueError(f"device_info: expected a CUDA device (or TRITON_INTERPRET=1), got {device}")
        index = device.index if device.index is not None else torch.cuda.current_device()
        if not 0 <= index < torch.cuda.device_count():
            raise ValueError(f"device_info: no CUDA device {index} ({torch.cuda.device_count()} visible)")
    return _cuda_info(index)


def schema(op: str):
    """The config schema class of ``op`` (a ``KernelConfig`` subclass)."""
    from .ops._common.validation import check_str_type

    check_str_type("op", op, f"a config op name, one of {sorted(_SCHEMAS)}")
    if op not in _SCHEMAS:
        raise ValueError(f"op: unknown config op {op!r}; the ops are {sorted(_SCHEMAS)}")
    return _schema(op)


@functools.cache
def _schema(op: str):
    module, cls = _SCHEMAS[op].split(":")
    return getattr(importlib.import_module(module), cls)


def parse_table(raw: Mapping, *, where: str) -> dict[str, list[tuple[dict, Any]]]:
    """Validate a whole table ``{op: [{"match": {...}, "config": {...}}, ...]}``: ``{op: [(match, config)]}``."""
    from .ops._common.config import check_match_key

    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: expected a JSON object {{op: [entries]}}")
    table = {}
    for op, entries in raw.items():
        cls = schema(op) if op in _SCHEMAS else None
        if cls is None:
            raise ValueError(f"{where}: unknown op {op!r}; the ops are {sorted(_SCHEMAS)}")
        if not isinstance(entries, list):
            raise ValueError(f"{where}: {op!r} must hold a list of entries")
        rows = []
        for i, entry in enumerate(entries):
            at = f" ({where}, {op} entry {i})"
            if not isinstance(entry, Mapping) or set(entry) - {"match", "config"} or "config" not in entry:
                raise ValueError(f"{op} config{at}: an entry is {{'match': {{...}}, 'config': {{...}}}}, got {entry!r}")
            match = entry.get("match", {})
            if not isinstance(match, Mapping):
                raise ValueError(f"{op} config{at}: 'match' must be a JSON object of shape features, got {match!r}")
            match = dict(match)
            check_match_key(cls, match, where=at)
            # first match wins: an entry that every earlier one's match covers is never reached (a typo, or one
            # placed after a catch-all)
            for j, (earlier, _) in enumerate(rows):
                if earlier.items() <= match.items():
                    raise ValueError(f"{op} config{at}: never reached: entry {j}'s match {earlier} takes every "
                                     f"key this one's {match} does")
            rows.append((match, cls.from_fields(entry["config"], where=at)))
        table[op] = rows
    return table


def user_config_dir() -> Path:
    """Where tuned tables live: ``GQLA_TRITON_CONFIG_DIR``, else ``~/.config/gqla_triton``."""
    return Path(os.environ.get("GQLA_TRITON_CONFIG_DIR") or Path.home() / ".config" / "gqla_triton")


_SWAPPED: dict[str, list[dict]] = {}  # GPU key -> the tables of its open table_swap blocks, the latest last


@contextlib.contextmanager
def table_swap(key: str, raw: Mapping) -> Iterator[None]:
    """Within the block, GPU ``key`` reads the table ``raw`` (checked by ``parse_table``) instead of its own: the
    tuner measures the decode paths under the table it is about to write. For tools and tests; not thread-safe."""
    if not isinstance(key, str):
        raise TypeError(f"key: expected a GPU table key (str), got {type(key).__name__}")
    parsed = parse_table(raw, where="table_swap raw")
    _SWAPPED.setdefault(key, []).append(parsed)
    reload_tables()
    try:
        yield
    finally:
        _remove(_SWAPPED[key], parsed)
        if not _SWAPPED[key]:
            del _SWAPPED[key]
        reload_tables()


# reloads so far: part of the table caches' keys, so a lookup that read a table before a reload (another thread's)
# keeps its answer under the old count, never seen again
_RELOADS = [0]


def reload_tables() -> None:
    """Read the tables again at the next lookup (a table written since, another ``GQLA_TRITON_CONFIG_DIR``); the
    ``config_state`` changes, so what callers kept from the old tables is built again."""
    _RELOADS[0] += 1
    _table_at.cache_clear()
    _table_entry.cache_clear()
    _EPOCH[0] += 1


def _load_table(key: str) -> dict[str, list[tuple[dict, Any]]]:
    """The table of GPU ``key`` as read since the last ``reload_tables`` (``_table_at``)."""
    return _table_at(key, _RELOADS[0])


@functools.cache
def _table_at(key: str, reloads: int) -> dict[str, list[tuple[dict, Any]]]:
    """The table of GPU ``key``: one swapped in by ``table_swap``, else the shipped ``configs/<key>.json``, else the
    shipped table of the GPU whose SM it shares (``SHARED_TABLES``, without its measured ops), else
    ``configs/default.json``; a table in the user config directory (``gqla_triton.tune``, or written by hand) goes
    before it: its rows of an op are matched first, then the shipped rows of that op, so a table that names some
    ops or some shapes leaves the rest as shipped. A GPU that runs the shipped ``default.json`` reads the user
    ``default.json`` (one written by hand) between its own user table and the shipped one. The interpreter reads
    only the shipped table. ``reloads``: the ``_RELOADS`` count it is read under (a cache key only)."""
    if key in _SWAPPED:
        return _SWAPPED[key][-1]
    shared = SHARED_TABLES.get(key)
    paths = [_CONFIG_DIR / f"{key}.json", *([_CONFIG_DIR / f"{shared}.json"] if shared else []),
             _CONFIG_DIR / "default.json"]
    path = next(p for p in paths if p.exists())
    table = _read_table(path)
    if shared and path == _CONFIG_DIR / f"{shared}.json":
        table = {op: rows for op, rows in table.items() if not schema(op).MEASURED}
    if key == "interpreter":
        return table
    users = [key, *(["default"] if key != "default" and path == _CONFIG_DIR / "default.json" else [])]
    for user in reversed([p for p in map(_user_table, users) if p is not None]):
        tuned = _read_table(user)
        table = {op: [*tuned.get(op, ()), *table.get(op, ())] for op in {**table, **tuned}}
    return table


def _user_table(key: str) -> Path | None:
    """The path of GPU ``key``'s table in the user config directory, None where it holds none. A name there that
    is not a readable file (a link to nothing, a folder) is returned, so that reading it names it; a config
    directory that is not a directory is a ``ValueError``."""
    folder = user_config_dir()
    path = folder / f"{key}.json"
    try:
        if folder.exists() and not folder.is_dir():
            raise ValueError(f"GQLA_TRITON_CONFIG_DIR (the user config directory): {folder} is not a directory; "
                             "expected the folder of the tuned tables (<gpu>.json)")
        return path if path.is_symlink() or path.exists() else None
    except OSError as e:  # no permission to look into the folder
        raise ValueError(f"{path}: not a readable JSON config table ({type(e).__name__}: {e})") from None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    """``json.loads``' object hook: a JSON object naming a key twice is refused (JSON would keep the last one
    silently, so a duplicated field would look set to one value while another takes effect)."""
    seen = {}
    for k, v in pairs:
        if k in seen:
            raise ValueError(f"the key {k!r} appears twice in one object")
        seen[k] = v
    return seen


def load_json(text: str):
    """``json.loads`` of a config table or override, refusing repeated keys (``_unique_keys``)."""
    return json.loads(text, object_pairs_hook=_unique_keys)


def _read_table(path: Path) -> dict[str, list[tuple[dict, Any]]]:
    try:
        with open(path) as f:
            raw = load_json(f.read())
    except (OSError, ValueError) as e:  # unreadable, or not JSON (JSONDecodeError is a ValueError)
        raise ValueError(f"{path}: not a readable JSON config table ({type(e).__name__}: {e})") from None
    return parse_table(raw, where=str(path))


@functools.lru_cache(maxsize=4)
def _parses(raw: str) -> bool:
    try:
        load_json(raw)
    except ValueError:
        return False
    return True


def _env_is_path(raw: str) -> bool:
    """Whether ``GQLA_TRITON_CONFIG`` = ``raw`` is the path of a file rather than JSON text: text that parses as JSON
    is JSON text (a file whose name parses is named as ``./<name>``), and so is text that starts with ``{`` and
    names no file (an object with a syntax error, reported as such); anything else is a path."""
    if _parses(raw):
        return False
    return not (raw.lstrip().startswith("{") and not os.path.isfile(raw))


def _env_version(raw: str | None) -> tuple | None:
    """What identifies the content of ``GQLA_TRITON_CONFIG`` = ``raw`` beside the value itself: a file's inode,
    modification and change times and size (a stat per lookup, so an edited file, or one renamed over it, is read
    again), None for JSON text in the variable or a path that cannot be read (its error names it)."""
    if not raw or not _env_is_path(raw):
        return None
    try:
        st = os.stat(raw)
    except (OSError, ValueError):
        return None
    return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size


@functools.lru_cache(maxsize=4)
def _env_override(raw: str, version: tuple | None = None) -> dict:
    """The checked overrides of ``GQLA_TRITON_CONFIG`` = ``raw`` (``version``: ``_env_version``'s, a cache key)."""
    text, where = raw, "GQLA_TRITON_CONFIG"
    try:
        if _env_is_path(raw):
            where = f"GQLA_TRITON_CONFIG file {raw!r}"
            with open(raw) as f:
                text = f.read()
        value = load_json(text)
    except (OSError, ValueError) as e:
        raise ValueError(f"{where}: expected a JSON object {{op: {{field: value}}}} or the path of a file holding "
                         f"one ({type(e).__name__}: {e})") from None
    return _check_override(value, where)


def _check_override(value: Any, where: str) -> dict:
    if not isinstance(value, Mapping):
        raise ValueError(f"{where}: expected a JSON object {{op: {{field: value}}}}, got {type(value).__name__} "
                         f"{value!r:.60}")
    for op, fields in value.items():
        if op not in _SCHEMAS:
            raise ValueError(f"{where}: unknown op {op!r}; the ops are {sorted(_SCHEMAS)}")
        schema(op).from_fields(fields, where=f" ({where})")  # names and types checked up front
    return {op: dict(fields) for op, fields in value.items()}


_OVERRIDES: list[dict[str, tuple]] = []  # per block: op -> its fields, frozen (sorted (name, value) pairs)
_EPOCH = [0]  # bumped as a config_override or table_swap block opens and closes, and by reload_tables


def config_state() -> tuple:
    """What ``select_config``'s answer depends on beside its arguments: ``GQLA_TRITON_CONFIG`` (with its file's
    version) and an epoch bumped as each ``config_override`` or ``table_swap`` block opens and closes and by
    ``reload_tables``. Equal states give equal configs for equal arguments, so a caller may keep what it built from
    one."""
    env = os.environ.get("GQLA_TRITON_CONFIG")
    return env, _env_version(env), _EPOCH[0]


def _remove(stack: list, entry: object) -> None:
    """Remove ``entry`` (by identity, the latest occurrence) from a block's ``stack``: a block that ends while one
    opened after it is still open (two generators or tasks each holding one) takes its own entry, not the last."""
    for i in range(len(stack) - 1, -1, -1):
        if stack[i] is entry:
            del stack[i]
            return


def _frozen(value: Any) -> Any:
    return tuple(_frozen(v) for v in value) if isinstance(value, (list, tuple)) else value


@contextlib.contextmanager
def config_override(fields: Mapping[str, Mapping[str, Any]]) -> Iterator[None]:
    """Within the block, ``select_config`` applies ``{op: {field: value}}`` over the selected entry (after
    ``GQLA_TRITON_CONFIG``). Checked against the schemas on entry. For tools and tests; not thread-safe."""
    checked = _check_override(fields, "config_override fields")
    entry = {op: tuple(sorted((k, _frozen(v)) for k, v in f.items())) for op, f in checked.items()}
    _OVERRIDES.append(entry)
    _EPOCH[0] += 1
    try:
        yield
    finally:
        _remove(_OVERRIDES, entry)
        _EPOCH[0] += 1


@functools.lru_cache(maxsize=1024)
def _overridden(op: str, cfg: Any, fields: tuple) -> Any:
    """``cfg`` (an entry of ``op``'s schema, or None) with a ``config_override`` block's frozen ``fields`` applied:
    built and checked once per distinct pair, so a launcher's lookup inside the block stays a dictionary hit."""
    return schema(op).from_fields(dict(fields), base=cfg, where=" (override)")


def _match(table: dict, op: str, key: Mapping[str, Any]):
    for match, cfg in table.get(op, ()):
        if all(key.get(k) == v for k, v in match.items()):
            return cfg
    return None


def table_config(gpu: str, op: str, key: Mapping[str, Any] | None = None, *, fallback: bool = True):
    """First matching entry for ``op`` in ``configs/<gpu>.json`` (then ``default.json`` if ``fallback``), with the
    overrides applied; None when no entry matches and nothing is overridden."""
    frozen = tuple(sorted((key or {}).items()))
    env = os.environ.get("GQLA_TRITON_CONFIG")
    cfg = _table_entry(gpu, op, frozen, fallback, env, _env_version(env), _RELOADS[0])
    for layer in _OVERRIDES:
        if op in layer:
            cfg = _overridden(op, cfg, layer[op])
    return cfg


@functools.lru_cache(maxsize=4096)
def _table_entry(gpu: str, op: str, frozen: tuple, fallback: bool, env: str | None, version: tuple | None,
                 reloads: int):
    """``table_config`` without the in-process overrides, cached: the tables are read once and a launcher's lookup
    costs a dictionary hit (the key, the tables as of ``reloads`` and ``GQLA_TRITON_CONFIG``, with its file's
    ``version``, determine the answer)."""
    from .ops._common.config import check_match_key

    cls = schema(op)
    key = dict(frozen)
    check_match_key(cls, key, where=" (select_config key)")
    cfg = _match(_table_at(gpu, reloads), op, key)
    if cfg is None and fallback:
        cfg = _match(_table_at("default", reloads), op, key)
    overrides = _env_override(env, version) if env else {}
    if op in overrides:
        cfg = cls.from_fields(overrides[op], base=cfg, where=" (GQLA_TRITON_CONFIG)")
    return cfg


def select_config(op: str, key: Mapping[str, Any] | None = None, *, device: Any = None,
                  info: DeviceInfo | None = None):
    """Launch config of ``op`` on this GPU: an instance of its schema (``schema(op)``).

    ``key`` holds the shape features the table may match on (e.g. ``{"K": 128, "V": 128}``; the names are the
    schema's ``MATCH``). Lookup: the table of this GPU (``DeviceInfo.table``), then ``default.json``, then the
    overrides. Under the interpreter only ``interpreter.json`` is read, so exactly one config is ever seen.
    ``info``: the device's ``device_info`` where the caller has it (then ``device`` is not read).
    """
    from .ops._common.validation import check_str_type

    check_str_type("op", op, f"a config op name, one of {sorted(_SCHEMAS)}")
    if op not in _SCHEMAS:
        raise ValueError(f"select_config: unknown config op {op!r}; the ops are {sorted(_SCHEMAS)}")
    if key is not None and type(key) is not dict and not isinstance(key, Mapping):  # (a dict: no ABC check)
        raise TypeError(f"select_config: key expected a mapping of shape features or None, got {type(key).__name__}")
    if key is not None and not all(type(v) is int or isinstance(v, Hashable) for v in key.values()):
        from .ops._common.config import check_match_key

        check_match_key(schema(op), key, where=" (select_config key)")  # names the value of the wrong type
    if info is None:
        info = device_info(device)
    elif not isinstance(info, DeviceInfo):
        raise TypeError(f"info: expected a DeviceInfo or None, got {type(info).__name__}")
    cfg = table_config(info.table, op, key, fallback=not info.interpreter)
    if cfg is None:
        raise ValueError(f"select_config: no config for op {op!r} (key {dict(key or {})}) in configs/{info.key}.json")
    return cfg
