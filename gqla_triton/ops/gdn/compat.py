"""fla's keyword options of the gated delta rule, as the public GDN functions take them.

Options that leave the math as computed here are accepted at the value that does so (fla's default), with their
consistency checked where that costs no device read; every other value is refused by name (``ValueError``: not
supported here), and a keyword neither function knows is a ``TypeError`` naming it. FlashQLA's scheduling switches
(``auto_cp``, ``enable_fwd_cp_cache``, ``force_intra_cp``) change no result at either value and are taken as bools
by the chunked op, and so are fla's CUDA-graph options (``use_graph``, ``graph_mode``, the ``graph_*`` capacities and
counts, ``chunk_offsets``: ``graph_capture``), whose graph calls plan from cu_seqlens on its device. The decode step
takes fla's in-kernel gate / beta / eigenvalue options as its own keywords, and so does the chunked op; both
functions take fla's V-first layout flags at either value (``state_v_first``, and its deprecated name
``transpose_state_layout`` as fla takes it).
"""

from __future__ import annotations

import numbers
import warnings

import torch

from .._common.validation import check_choice, check_tensor
from .plan import CHUNK_SIZES

__all__ = ["check_chunk_indices", "check_chunk_size", "check_fla_options", "check_gate", "decode_state_v_first",
           "graph_capture", "state_v_first"]

# option -> (the value accepted here, what another value asks for)
_FLAGS = {"head_first": (False, "inputs in the head-first [B, H, T, ...] layout")}
_CHUNK_FLAGS: dict = {}
_DECODE_FLAGS = {
    "inplace_final_state": (True, "the final states returned in a new tensor (here the state pool is updated in "
                                  "place: its rows are the final states)"),
    "output_final_state": (False, "the final states returned (here the state pool is updated in place: its rows "
                                  "are the final states)"),
}
# fla's names of the V-first state layout: either value is taken by both functions
_LAYOUT = ("state_v_first", "transpose_state_layout")
# FlashQLA's switches of its intra-card context parallelism (how a long sequence is spread over the SMs): scheduling
# only, they leave the result as it is, so either value is taken; the split here is the plan's sequence splitting
# (chosen from shapes: results do not depend on it)
_CHUNK_SCHEDULING = ("auto_cp", "enable_fwd_cp_cache", "force_intra_cp")
# fla's CUDA-graph options of the chunked op (its fixed-capacity metadata for capture and replay): a varlen call
# here is capturable as it is (``graph_capture``), so they are checked and change no result
_GRAPH_MODES = ("eager", "force_graph", "auto")
_GRAPH_INTS = ("graph_t_max", "graph_n_max", "graph_nt_max", "graph_actual_tokens", "graph_actual_sequences",
               "graph_actual_nt")
_CHUNK_GRAPH = ("use_graph", "graph_mode", *_GRAPH_INTS, "min_graph_utilization", "chunk_offsets")
# option -> what a value other than None asks for
_CHUNK_NONE = {"cp_context": "context parallelism"}
_DECODE_NONE = {"num_accepted_tokens": "the initial state picked per sequence by its accepted draft count (here "
                                       "`accepted` commits the state after the accepted tokens instead)"}

CHUNK_OPTIONS = (*_FLAGS, *_CHUNK_FLAGS, *_LAYOUT, *_CHUNK_SCHEDULING, *_CHUNK_GRAPH, *_CHUNK_NONE)
DECODE_OPTIONS = (*_FLAGS, *_DECODE_FLAGS, *_LAYOUT, *_DECODE_NONE)
RECURRENT_OPTIONS = (*_FLAGS, _LAYOUT[1])  # fused_recurrent_gated_delta_rule: state_v_first is its argument


def check_fla_options(op: str, options: dict) -> None:
    """Check the fla keyword ``options`` of ``op`` (``"chunk_gated_delta_rule"``, ``"gated_delta_rule_decode"`` or
    ``"fused_recurrent_gated_delta_rule"``): each at the value that changes nothing here, else a ``ValueError``
    naming it; unknown names: ``TypeError``."""
    chunk = op == "chunk_gated_delta_rule"
    known = {"chunk_gated_delta_rule": CHUNK_OPTIONS, "gated_delta_rule_decode": DECODE_OPTIONS,
             "fused_recurrent_gated_delta_rule": RECURRENT_OPTIONS}[op]
    unknown = [name for name in options if name not in known]
    if unknown:
        raise TypeError(f"{op}() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}")
    flags = {**_FLAGS, **(_CHUNK_FLAGS if chunk else _DECODE_FLAGS)}
    nones = _CHUNK_NONE if chunk else _DECODE_NONE
    for name, value in options.items():
        if name in _CHUNK_GRAPH:
            _check_graph_option(name, value)
        elif name in _LAYOUT or name in _CHUNK_SCHEDULING:
            if not isinstance(value, bool):
                raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")
        elif name in flags:
            ok, meaning = flags[name]
            if not isinstance(value, bool):
                raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")
            if value is not ok:
                raise ValueError(f"{name}={value} is not supported by {op} ({meaning}); only {name}={ok}")
        elif name in nones:
            if value is not None:
                raise ValueError(f"{name}: not supported by {op} ({nones[name]}); pass None or leave it out")


def _check_graph_option(name: str, value) -> None:
    """The type and range of one of fla's graph options (``chunk_offsets``: its shape and device are checked by
    ``graph_capture``, which knows the call)."""
    if name == "use_graph":
        if not isinstance(value, bool):
            raise TypeError(f"use_graph: expected a bool, got {type(value).__name__}")
    elif name == "graph_mode":
        check_choice("graph_mode", value, _GRAPH_MODES, optional=True)
    elif name in _GRAPH_INTS:
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
            raise TypeError(f"{name}: expected None or an int, got {type(value).__name__}")
        if value is not None and value < 0:
            raise ValueError(f"{name}: expected a count >= 0, got {value}")
    elif name == "min_graph_utilization":
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"min_graph_utilization: expected a float, got {type(value).__name__}")
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"min_graph_utilization: expected a fraction in [0, 1], got {value}")
    elif value is not None and not isinstance(value, torch.Tensor):  # chunk_offsets
        raise TypeError(f"chunk_offsets: expected None or a torch.Tensor, got {type(value).__name__}")


def graph_capture(options: dict, T: int, N: int, cu_seqlens) -> bool:
    """Whether fla's graph options (``use_graph``, ``graph_mode``; types checked by ``check_fla_options``) ask for a
    call that CUDA graphs may capture and replay with other lengths in the same ``cu_seqlens``: then the plan is
    built from ``cu_seqlens`` as it lies on its device, never from a host copy (``cu_seqlens_cpu`` is checked, not
    used). Any other call with cu_seqlens on a GPU and no host copy is planned that way too; the options change no
    result. As in fla, a graph call's ``graph_t_max`` is T and its ``graph_n_max`` is N, the count of sequences
    (``ValueError`` otherwise); ``chunk_offsets`` (fla's per-sequence chunk offsets of its static metadata,
    ``[N+1]`` on cu_seqlens' device) is checked and not read: the plan here comes from cu_seqlens."""
    mode = options.get("graph_mode")
    if mode is None:
        mode = "force_graph" if options.get("use_graph", False) else "eager"
    offsets = options.get("chunk_offsets")
    if offsets is not None:
        if cu_seqlens is None:
            raise ValueError("chunk_offsets: given without cu_seqlens (it indexes the chunks of a varlen input)")
        check_tensor("chunk_offsets", offsets, shape=(N + 1,), dtypes=(torch.int32, torch.int64),
                     device=cu_seqlens.device)
    if mode == "eager":
        return False
    for name, want, what in (("graph_t_max", T, "the tokens T of q"), ("graph_n_max", N, "the sequences")):
        got = options.get(name)
        if got is not None and got != want:
            raise ValueError(f"{name}: a graph call's capacity is its inputs' shape: expected {want} ({what}), got "
                             f"{got}")
    return True


def check_chunk_size(chunk_size) -> int:
    """fla's ``chunk_size`` (tokens per chunk: 16, 32 or 64, as fla takes) as an int."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral):
        raise TypeError(f"chunk_size: expected an int, got {type(chunk_size).__name__}")
    if int(chunk_size) not in CHUNK_SIZES:
        raise ValueError(f"chunk_size: expected one of {CHUNK_SIZES}, got {chunk_size}")
    return int(chunk_size)


def check_chunk_indices(chunk_indices, cu_seqlens, cu_host: list[int] | None, chunk_size: int) -> None:
    """fla's ``chunk_indices [NT, 2]`` (the (sequence, chunk-in-sequence) pair of every ``chunk_size``-token chunk of
    the varlen input, in order): the plan here is built from ``cu_seqlens``, so it must describe the same chunks. Its
    shape is checked against the host copy of ``cu_seqlens`` (``cu_host``, when one exists), its values when it is
    a CPU tensor; values on a device are not read (no sync)."""
    if chunk_indices is None:
        return
    if cu_seqlens is None:
        raise ValueError("chunk_indices: given without cu_seqlens (it indexes the chunks of a varlen input)")
    if not isinstance(chunk_indices, torch.Tensor):
        raise TypeError(f"chunk_indices: expected a torch.Tensor, got {type(chunk_indices).__name__}")
    if chunk_indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"chunk_indices: expected int32 or int64, got {chunk_indices.dtype}")
    if chunk_indices.dim() != 2 or chunk_indices.shape[1] != 2:
        raise ValueError(f"chunk_indices: expected [NT, 2], got shape {list(chunk_indices.shape)}")
    if chunk_indices.device not in (cu_seqlens.device, torch.device("cpu")):
        raise ValueError(f"chunk_indices: expected a tensor on cu_seqlens' device {cu_seqlens.device} or the CPU, "
                         f"got one on {chunk_indices.device}")
    if cu_host is None:
        return
    want = [(n, c) for n, (a, b) in enumerate(zip(cu_host[:-1], cu_host[1:], strict=True))
            for c in range(-(-(b - a) // chunk_size))]
    if chunk_indices.shape[0] != len(want):
        raise ValueError(f"chunk_indices: {chunk_indices.shape[0]} chunks, but cu_seqlens {cu_host} has "
                         f"{len(want)} chunks of {chunk_size} tokens")
    reads = chunk_indices.device.type == "cpu" and not torch.compiler.is_compiling()
    if reads and [tuple(r) for r in chunk_indices.tolist()] != want:
        raise ValueError(f"chunk_indices: does not match cu_seqlens {cu_host} (expected the (sequence, chunk) "
                         f"pairs {want})")


def state_v_first(state_layout, options: dict) -> bool:
    """Whether the state rows (of the decode step's pool, of the chunked op's initial / final states and pool) are
    V-first: ``state_layout="vk"``, or fla's ``state_v_first`` / ``transpose_state_layout`` True in ``options``
    (their types are checked by ``check_fla_options``). As in fla, ``transpose_state_layout`` is the deprecated name
    of ``state_v_first``: passing it warns (``DeprecationWarning``, in eager calls: not while torch.compile traces)
    and sets the layout, and passing it together with ``state_v_first=True`` is a ``ValueError``. An fla name at
    False with ``state_layout="vk"`` is a ``ValueError``."""
    if not isinstance(state_layout, str):
        raise TypeError(f"state_layout: expected 'kv' or 'vk', got {type(state_layout).__name__}")
    if state_layout not in ("kv", "vk"):
        raise ValueError(f"state_layout: expected 'kv' ([..., K, V] rows) or 'vk' ([..., V, K] rows), got "
                         f"{state_layout!r}")
    name = "state_v_first" if "state_v_first" in options else None
    v_first = options.get("state_v_first", False)
    if "transpose_state_layout" in options:
        old = options["transpose_state_layout"]
        if v_first:
            raise ValueError(f"state_v_first=True and transpose_state_layout={old}: transpose_state_layout is fla's "
                             "deprecated name of state_v_first, pass state_v_first alone (fla refuses both together, "
                             "and at different values they contradict each other)")
        if not torch.compiler.is_compiling():  # (dynamo cannot trace warnings.warn: fullgraph would break)
            # stacklevel 3: the caller of the public function
            warnings.warn("transpose_state_layout is deprecated and renamed to state_v_first (as in fla)",
                          DeprecationWarning, stacklevel=3)
        name, v_first = "transpose_state_layout", old
    if state_layout == "vk" and name is not None and not v_first:
        raise ValueError(f"{name}=False contradicts state_layout='vk'")
    return state_layout == "vk" or v_first


decode_state_v_first = state_v_first


def check_gate(use_gate_in_kernel: bool, A_log, dt_bias, HV: int, q: torch.Tensor, *, reference: bool) -> None:
    """fla's in-kernel gate parameters (both GDN functions): A_log ``[HV]`` required with the gate, dt_bias
    optional, neither without it; float32 or q's dtype (float64 too for the torch reference), on q's device."""
    if not use_gate_in_kernel:
        for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
            if t is not None:
                raise ValueError(f"{name}: given without use_gate_in_kernel=True (it is a parameter of the gate "
                                 "computed in the kernel); pass use_gate_in_kernel=True or leave it out")
        return
    if A_log is None:
        raise ValueError("A_log: required with use_gate_in_kernel=True (g = -exp(A_log)·softplus(g + dt_bias))")
    pdt = tuple(dict.fromkeys((torch.float32, q.dtype) + ((torch.float64,) if reference else ())))
    check_tensor("A_log", A_log, shape=(HV,), dtypes=pdt, device=q.device)
    if dt_bias is not None:
        check_tensor("dt_bias", dt_bias, shape=(HV,), dtypes=pdt, device=q.device)
