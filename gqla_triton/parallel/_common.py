"""What both tensor-parallel layers share: the process group, the state-dict sharding rule, the all-reduce."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import NoReturn

import torch
from torch import nn

from ..layers._state import check_state_dict, entry_problem, load_or_restore
from ..ops._common.validation import check_device


def resolve_group(group) -> tuple[object, int, int]:
    """``(group, rank, size)`` of ``group`` (None: the default group) in an initialised ``torch.distributed``."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call torch.distributed.init_process_group (NCCL "
                           "on GPUs, gloo on the CPU) in every rank before building a tensor-parallel layer")
    if group is None:
        group = dist.group.WORLD
    elif group is dist.GroupMember.NON_GROUP_MEMBER:  # what new_group returns in the ranks it leaves out
        raise ValueError("group: this process is not a member of the process group")
    elif not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group: expected None or a torch.distributed.ProcessGroup, got {type(group).__name__}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("group: this process is not a member of the process group")
    return group, rank, dist.get_world_size(group)


def resolve_device(group, device) -> torch.device:
    """``device`` (None: the CPU) as a ``torch.device`` the shard's weights can live on and one of ``group``'s
    backends reduces (its backend config, e.g. ``cuda:nccl`` or ``cpu:gloo,cuda:nccl``, names the device types)."""
    import torch.distributed as dist

    dev = check_device(device, storage=True) or torch.device("cpu")
    config = str(dist.get_backend_config(group)).lower()
    types = {part.split(":")[0].strip() for part in config.split(",") if ":" in part}
    if dev.type not in types:
        raise ValueError(f"device: the process group has no backend for {dev.type} tensors (its backends: "
                         f"{config}); got {dev}")
    return dev


def check_divides(tp_size: int, n: int, what: str, from_group: bool, note: str = "") -> None:
    """``tp_size`` divides ``what`` (``n``), or a ``ValueError`` naming the argument that set ``tp_size``: ``group``
    (``from_group``: a parallel layer, whose TP size is its group's) or ``tp_size`` (the state-dict functions)."""
    if n % tp_size:
        who = (f"group: the process group has {tp_size} ranks, which does" if from_group
               else f"tp_size: {tp_size} does")
        raise ValueError(f"{who} not divide {what} {n}{note}")


def _chunk(src: torch.Tensor, shape: torch.Size, tp_rank: int) -> torch.Tensor:
    """The rank's contiguous block of ``src`` along the one dim where ``shape`` (the shard's) is smaller."""
    dims = [d for d in range(src.dim()) if src.shape[d] != shape[d]]
    if not dims:
        return src
    (d,) = dims
    return src.narrow(d, tp_rank * shape[d], shape[d])


def shard_state_dict(state_dict: Mapping[str, torch.Tensor], full: nn.Module, local: nn.Module, tp_rank: int,
                     special: Mapping[str, Callable[[torch.Tensor], torch.Tensor]] | None = None) -> dict:
    """Views of the shard of ``state_dict`` (a full layer's) that ``local`` holds.

    ``full`` / ``local``: the full and the shard layer (meta modules suffice: only keys and shapes are read). Each
    entry is checked as the layers' own ``load_state_dict`` checks it (``_state.check_state_dict``: a ``ValueError``
    naming the key). A tensor whose shard is smaller along one dim is split there into equal contiguous blocks; one
    of equal shape is replicated; ``special[key]`` maps the full tensor to its shard where the rule is another.
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict: expected a mapping of names to tensors, got {type(state_dict).__name__}")
    want, mine = full.state_dict(), local.state_dict()
    missing, unexpected = sorted(set(want) - set(state_dict)), sorted(set(state_dict) - set(want), key=str)
    if missing or unexpected:
        raise ValueError(f"state_dict: does not match the layer's parameters (missing {missing}, unexpected "
                         f"{unexpected})")
    # each entry as the layers' own load checks it; ``full`` lives on meta, where a meta entry would fit
    meta = [k for k in want if isinstance(state_dict[k], torch.Tensor) and state_dict[k].device.type == "meta"]
    if meta:
        raise ValueError(f"state_dict: {meta[0]}: on the meta device (it holds no values)")
    check_state_dict(full, state_dict, "")
    out = {}
    for k, w in mine.items():
        part = special[k](state_dict[k]) if special and k in special else _chunk(state_dict[k], w.shape, tp_rank)
        if part.shape != w.shape:  # a sharding rule that disagrees with the shard layer's shapes
            raise AssertionError(f"{k}: shard shape {list(part.shape)} != {list(w.shape)}")
        out[k] = part
    return out


def source_dtype(state_dict, key: str) -> torch.dtype | None:
    """The dtype of ``state_dict[key]`` where a layer can take it (``_state.entry_problem``: a real floating tensor
    of 16 bits or more), else None (the layer's default; ``shard_state_dict`` then refuses the entry by name)."""
    t = state_dict.get(key) if isinstance(state_dict, Mapping) else None
    if isinstance(t, torch.Tensor) and entry_problem(t, torch.empty(t.shape, device="meta")) is None:
        return t.dtype
    return None


def load_into(local: nn.Module, shards: Mapping[str, torch.Tensor], device) -> nn.Module:
    """Materialise the meta module ``local`` on ``device`` from ``shards``; parameters frozen."""
    local = local.to_empty(device=device)
    params = local.state_dict(keep_vars=True)
    with torch.no_grad():
        for k, p in params.items():
            p.copy_(shards[k])
    for p in local.parameters():
        p.requires_grad_(False)
    return local


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 1 << 22


def _digest(t: torch.Tensor) -> tuple[int, int]:
    """Two int64 (wrapping) sums of the bits of ``t``, plain and position-weighted: equal for equal tensors."""
    bits = t.detach().contiguous().view(_BITS[t.element_size()]).reshape(-1)
    s = w = 0
    for i in range(0, bits.numel(), _CHUNK):
        c = bits[i:i + _CHUNK].to(torch.int64)
        pos = torch.arange(i, i + c.numel(), device=c.device, dtype=torch.int64) % 65521 + 1
        s, w = s + int(c.sum()), w + int((c * pos).sum())
    return s, w


def _comparable(config: dict) -> dict:
    return {k: tuple(v.double().tolist()) if isinstance(v, torch.Tensor) else v for k, v in config.items()}


def _disagreement(mine: dict, gathered: list) -> str | None:
    """The first way the ranks' builds differ (``gathered[p]``: rank ``p``'s ``mine``), or None."""
    for p, theirs in enumerate(gathered):
        for k in mine["config"]:
            a, b = gathered[0]["config"][k], theirs["config"].get(k)
            if repr(a) != repr(b):
                return f"config: ranks disagree on {k} (rank 0: {a!r}, rank {p}: {b!r})"
        for what in ("dtype", "device"):
            if gathered[0][what] != theirs[what]:
                return (f"{what}: ranks disagree on the shard's {what} (rank 0: {gathered[0][what]}, rank {p}: "
                        f"{theirs[what]})")
    n = len(gathered)
    for p, theirs in enumerate(gathered):  # rank p's source of rank p+1's shard against rank p+1's own
        nxt = gathered[(p + 1) % n]
        for k, d in theirs["next"].items():
            if nxt["own"].get(k) != d:
                return (f"state_dict: {k}: ranks disagree on the weights (rank {p}'s of rank {(p + 1) % n}'s shard "
                        f"differ from rank {(p + 1) % n}'s own)")
    return None


def build(group, check: Callable[[], object], make: Callable) -> tuple:
    """``(local, group, rank, size, config)``: this rank's shard, built so that every rank of ``group`` raises or
    none does.

    ``check()`` validates the arguments that need no process group; ``make(group, rank, size)`` returns the loaded
    shard, the full layer's arguments and the next rank's shard (views of this rank's state dict). One
    ``all_gather_object`` over the group then compares the ranks' refusals, configs, dtypes, device types and
    weights (each rank's own shard against the previous rank's source of it: with the replicated tensors, a ring
    over the whole layer). A rank's refusal or any difference raises on every rank, before any all-reduce.
    """
    import torch.distributed as dist

    try:
        check()
        err = None
    except Exception as e:  # noqa: BLE001 -- re-raised below, after the ranks have agreed
        err = e
    if err is not None and not (dist.is_available() and dist.is_initialized()):
        raise err
    group, rank, size = resolve_group(group)
    local = config = None
    if err is None:
        try:
            local, config, nxt = make(group, rank, size)
        except Exception as e:  # noqa: BLE001
            err = e
    if size == 1:
        if err is not None:
            raise err
        return local, group, rank, size, config
    mine = {"error": None if err is None else (type(err).__name__, str(err))}
    if err is None:
        own, w = local.state_dict(), next(local.parameters())
        mine.update(config=_comparable(config), dtype=str(w.dtype), device=w.device.type,
                    own={k: _digest(v) for k, v in own.items()},
                    next={k: _digest(v.to(device=own[k].device, dtype=own[k].dtype)) for k, v in nxt.items()})
    gathered = [None] * size
    dist.all_gather_object(gathered, mine, group=group)
    if err is not None:
        raise err
    for p, theirs in enumerate(gathered):
        if theirs["error"] is not None:
            kind, msg = theirs["error"]
            cls = {"ValueError": ValueError, "TypeError": TypeError}.get(kind, RuntimeError)
            raise cls(f"group: rank {p} of the process group refused its shard ({kind}: {msg}); no rank builds one")
    why = _disagreement(mine, gathered)
    if why is not None:
        raise ValueError(f"{why}; every rank must build the same layer")
    return local, group, rank, size, config


def refuse(group, error: Exception) -> NoReturn:
    """Raise ``error`` here, after telling the ranks of ``group`` that build their shards (``build``) to refuse."""
    def check():
        raise error

    build(group, check, None)
    raise AssertionError("unreachable")


class TensorParallel(nn.Module):
    """A rank's shard ``local`` of a layer and the group it reduces over: ``forward`` runs the shard, whose output
    projection is row-parallel, and sums the ranks' partial outputs with one all-reduce."""

    def __init__(self, local: nn.Module, group, tp_rank: int, tp_size: int, config: dict):
        super().__init__()
        self.local = local
        self.group, self.tp_rank, self.tp_size = group, tp_rank, tp_size
        self.config = dict(config)

    def get_extra_state(self) -> dict:
        """The rank the state dict's shard belongs to: ``{"tp_rank", "tp_size"}``."""
        return {"tp_rank": self.tp_rank, "tp_size": self.tp_size}

    def set_extra_state(self, state) -> None:
        """Refuses another rank's shard (the same shapes, other heads), before any tensor is loaded."""
        want = self.get_extra_state()
        got = {k: state.get(k) for k in want} if isinstance(state, Mapping) else None
        if got != want:
            whose = f"rank {got['tp_rank']} of {got['tp_size']}'s shard" if got else f"{type(state).__name__}"
            raise ValueError(f"state_dict: _extra_state: {whose}, expected rank {self.tp_rank} of {self.tp_size}'s "
                             "(a parallel layer loads the state dict of its own rank)")

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """``nn.Module.load_state_dict``; a load that fails leaves the shard as it was (``_state.load_or_restore``)."""
        return load_or_restore(self, super().load_state_dict, state_dict, strict=strict, assign=assign)

    def __deepcopy__(self, memo):
        """A copy of the shard in the same process group (the group itself is shared, not copied)."""
        memo[id(self.group)] = self.group
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        new.__dict__.update({k: copy.deepcopy(v, memo) for k, v in self.__dict__.items()})
        return new

    def _check_inference(self, x) -> None:
        if torch.is_grad_enabled() and ((isinstance(x, torch.Tensor) and x.requires_grad)
                                        or any(p.requires_grad for p in self.local.parameters())):
            raise RuntimeError(f"{type(self).__name__}: inference only (the all-reduce has no backward here); run it "
                               "under torch.no_grad() / torch.inference_mode() with frozen parameters")

    def _reduce(self, out: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            import torch.distributed as dist

            dist.all_reduce(out, group=self.group)
        return out

    def extra_repr(self) -> str:
        return f"tp_rank={self.tp_rank}, tp_size={self.tp_size}"


def config_of(layer: nn.Module, names: tuple[str, ...]) -> dict:
    """The constructor arguments ``names`` of ``layer``, read from its attributes."""
    return {k: getattr(layer, k) for k in names}


def check_config(config, names: tuple[str, ...], what: str, required: tuple[str, ...] = ()) -> dict:
    """``config`` (a mapping of ``what``'s constructor arguments ``names``, holding at least ``required``) as a dict,
    or an error. ``device`` / ``dtype`` are refused: a shard function returns views of the state dict's tensors, and
    ``from_state_dict`` takes them as keyword arguments."""
    if not isinstance(config, Mapping):
        raise TypeError(f"config: expected a mapping of {what} arguments, got {type(config).__name__}")
    for k in ("device", "dtype"):
        if k in config:
            raise ValueError(f"config: {k!r} is not read from config (a shard's state dict holds views of the full "
                             f"tensors; from_state_dict takes {k}= as a keyword argument)")
    bad = sorted(set(config) - set(names), key=str)
    if bad:
        raise ValueError(f"config: unknown {what} arguments {bad} (expected some of {list(names)})")
    missing = [n for n in required if n not in config]
    if missing:
        raise ValueError(f"config: missing {what} arguments {missing} (required: {list(required)})")
    return dict(config)
