"""Rounds over a model larger than the client's memory: a model dispatched by accelerate with CPU or disk offload
(``from_pretrained(..., device_map=..., max_memory=..., offload_folder=...)``), its weights streamed layer by layer
(ZO2, liangyuwang/zo2, does this for OPT without federation).

Where each tensor of an offloaded module lives, its *home*:

- ``file``: the stream's own store, one file holding every disk-offloaded tensor at a page-aligned offset, mapped
  shared (``MAP_SHARED``) into the process;
- ``memory``: a pinned CPU tensor (accelerate's CPU offload of a model that runs on a GPU);
- tensors accelerate placed on the execution device stay there (resident, not streamed).

Between forwards a streamed parameter's ``.data`` *is* its home, so whatever reads or writes weights outside a forward
(the ledger's fingerprints, replay, saving, a node's catch-up) sees the current weights, unchanged code. A forward of
an offloaded module (forward pre-hook, forward hook):

1. its tensors become private copies on the execution device: read from the file with ``pread`` (the file's pages
   never enter the process's resident set) or copied from CPU memory, by the stream's thread while the modules
   before it compute (those that followed it in the previous forward, up to ``window_bytes`` ahead, at least one),
   and moved to an accelerator on a CUDA stream of its own;
2. ``perturbation.perturbed`` adds ``sum_k c_k z_k`` to those copies in place (no second copy), after they reached
   the execution device, with the arithmetic of a resident tensor's perturbed forward (the same bits);
3. after the module ``.data`` is the home again and the copy is freed: a perturbed value is never written back.

The round's update ``w <- w - lr sum_k c_k z_k`` (``perturbation.apply_update``) runs on each home in place, with the
same fused kernel and generator streams as a resident tensor, exactly once: a file home through the shared mapping,
its pages faulted in by a helper thread (``MADV_POPULATE_WRITE``) while the tensor before it is updated, then dropped
from the process (``MADV_DONTNEED``: the page cache keeps them dirty and the kernel writes them to the file while the
next tensors are updated); a memory home on the CPU where it lives.

Why not accelerate's own store: for a safetensors checkpoint its disk offload reads the user's checkpoint file
itself (the offload index points into it) and its ``.dat`` files are opened read-only, so the update would have
nowhere to land but the user's checkpoint; its hooks load a module's weights only when that module starts (no
prefetch) and put new ``Parameter`` objects into the module at every load and offload (a table that names trainable
tensors by identity, and their ties, would lose them). So the stream copies each offloaded tensor once into its own
file (unlinked at once: nothing is left on disk when the process ends) and leaves accelerate's hooks moving inputs only
(``offload=False``).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import os
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from torch import nn

logger = logging.getLogger(__name__)

__all__ = ["WeightStream", "check_offload_schedule", "check_offload_settings", "is_offloaded", "stream_of",
           "stream_weights"]

ALIGN = max(4096, mmap.PAGESIZE)  # each tensor's offset in the store: pages of its own (dropped one tensor at a time)
OFFLOADED = "the model is offloaded (accelerate device_map with 'cpu'/'disk' entries)"  # the refusals' reason
DEFAULT_WINDOW = 32 << 20  # bytes read ahead of the running module (at least the next module; 0: no read-ahead)
M_MMAP_THRESHOLD = -3  # glibc malloc.h
MADV_DONTNEED, MADV_POPULATE_WRITE = 4, 23  # linux/mman.h; POPULATE_WRITE since Linux 5.14 (skipped where refused)
_ATTRIBUTE = "_zo_weight_stream"


def _libc():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _libc()


def _return_freed_memory() -> None:
    """Large allocations (a streamed module's copies, its activations) each in a mapping of their own, given back to
    the system when freed: glibc's default raises its mapping threshold to the largest block freed (up to 32 MB) and
    keeps later blocks below it in its heaps, which do not shrink while anything sits above them."""
    mallopt = getattr(_LIBC, "mallopt", None)
    if mallopt is not None and mallopt(M_MMAP_THRESHOLD, 1 << 20) != 1:
        logger.info("weight stream: mallopt(M_MMAP_THRESHOLD) refused; freed copies may stay in the heap.")


def _madvise(tensor: torch.Tensor, advice: int) -> bool:
    """``madvise`` over the whole pages of ``tensor`` (a view of the mapping, page-aligned); through ctypes, which
    releases the GIL. Returns whether the kernel took the advice."""
    size = tensor.numel() * tensor.element_size()
    if _LIBC is None or not size:
        return False
    return _LIBC.madvise(tensor.data_ptr(), (size + ALIGN - 1) // ALIGN * ALIGN, advice) == 0


def _accelerate_hooks(module: nn.Module) -> list:
    hook = getattr(module, "_hf_hook", None)
    if hook is None:
        return []
    from accelerate.hooks import AlignDevicesHook, SequentialHook

    hooks = hook.hooks if isinstance(hook, SequentialHook) else [hook]
    return [h for h in hooks if isinstance(h, AlignDevicesHook)]


def _offloading_hooks(model: nn.Module) -> list[tuple[nn.Module, object]]:
    return [(module, hook) for module in model.modules() for hook in _accelerate_hooks(module) if hook.offload]


def is_offloaded(model: nn.Module) -> bool:
    """Whether ``model`` has modules accelerate offloads to CPU memory or disk (or a stream already runs them)."""
    return stream_of(model, attach=False) is not None or bool(_offloading_hooks(model))


def stream_of(model: nn.Module, attach: bool = True) -> WeightStream | None:
    """The model's weight stream: the one already attached, else (``attach``) a new one when accelerate offloads some
    of its modules; ``None`` for a model whose weights are all resident."""
    stream = model.__dict__.get(_ATTRIBUTE)
    if stream is None and attach and _offloading_hooks(model):
        stream = WeightStream(model)
    return stream


def stream_weights(model: nn.Module, folder: str | None = None, window_bytes: int = DEFAULT_WINDOW,
                   budget_bytes: int | None = None, read_thread: bool | None = None) -> WeightStream:
    """Attach a weight stream to an accelerate-offloaded ``model`` with these settings (a trainer or a parameter table
    built afterwards uses it). ``folder``: where the store file goes (default: accelerate's ``offload_folder``, else
    the temporary folder); ``window_bytes``: how far ahead of the running module weights are read (at least the next
    module; 0: none, and no prefault of the next tensor's pages during the update); ``budget_bytes``: the memory the
    model may take (``None``: accelerate's placement as it is); ``read_thread``: who reads ahead (see
    :class:`WeightStream`)."""
    if model.__dict__.get(_ATTRIBUTE) is not None:
        raise ValueError("stream_weights: this model already has a weight stream.")
    if not _offloading_hooks(model):
        raise ValueError("stream_weights: no module of this model is offloaded by accelerate (device_map with 'cpu' "
                         "or 'disk' entries, offload_folder): its weights are resident, nothing to stream.")
    return WeightStream(model, folder, window_bytes, budget_bytes, read_thread)


def check_offload_settings(args, model: nn.Module) -> None:
    """Refuse, before any work, the settings a round cannot run exactly within the memory of an offloaded model,
    naming each setting and what is accepted. ``args``: :class:`ZOByzantineArguments`."""
    if not is_offloaded(model):
        return
    if args.estimator in ("first_order", "gradient_projection"):
        raise ValueError(f"estimator={args.estimator!r} needs backprop gradients of every weight, and {OFFLOADED}: its "
                         "streamed layers keep no gradients. Accepted with offload: 'two_point', 'one_point'.")
    if args.aggregation_space != "projection":
        raise ValueError(f"aggregation_space={args.aggregation_space!r} holds every client's estimate in R^d "
                         f"(n x d values in memory), and {OFFLOADED}. Accepted with offload: 'projection'.")
    if args.server_optimizer != "sgd":
        raise ValueError(f"server_optimizer={args.server_optimizer!r} keeps a dense state of 3 d values in memory, and "
                         f"{OFFLOADED}. Accepted with offload: 'sgd'.")
    check_offload_schedule(args, model)


def check_offload_schedule(args, model: nn.Module) -> None:
    """The part of :func:`check_offload_settings` a client checks (a Flower node: the dense settings are refused for
    every deployment): the schedules an offloaded model cannot run. ``args``: ``zo_schedule``,
    ``zo_cache_budget_gb``, ``num_perturbations``, ``local_steps``."""
    if not is_offloaded(model):
        return
    if args.zo_schedule == "antithetic":
        raise ValueError(f"zo_schedule='antithetic' evaluates +mu and -mu in stacked forwards (each module's weights "
                         f"copied once per model, out of place, doubled activations), and {OFFLOADED}: a streamed "
                         "layer is perturbed in place, once per forward. Accepted with offload: 'auto', "
                         "'two_forwards', 'cached' (when the round's directions fit zo_cache_budget_gb).")
    if args.zo_schedule == "cached":
        params = {id(p): p for p in model.parameters() if p.requires_grad}.values()
        kept = 4 * sum(p.numel() for p in params) * args.num_perturbations * args.local_steps
        if kept > args.zo_cache_budget_gb * 2**30:
            raise ValueError(f"zo_schedule='cached' keeps the round's directions ({kept / 2**30:.3g} GB: nu x K x d "
                             f"float32), more than zo_cache_budget_gb={args.zo_cache_budget_gb}, and {OFFLOADED}. "
                             "Accepted: zo_schedule='auto' or 'two_forwards' (directions regenerated), or a "
                             "zo_cache_budget_gb the client's memory holds.")


def _pread_into(fd: int, tensor: torch.Tensor, offset: int) -> None:
    view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
    done = 0
    while done < len(view):
        count = os.preadv(fd, [view[done:]], offset + done)
        if count <= 0:
            raise OSError(f"weight stream: short read at offset {offset + done} of the store file")
        done += count


def _pwrite_from(fd: int, tensor: torch.Tensor, offset: int) -> None:
    view = memoryview(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    done = 0
    while done < len(view):
        done += os.pwritev(fd, [view[done:]], offset + done)


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attribute = name.rpartition(".")
    return (module.get_submodule(path) if path else module), attribute


class _Ties:
    """Which offloaded tensors are one tensor. A forward run by accelerate's hooks puts a new ``Parameter`` in each
    module (tied weights become separate objects), so ties are read from the model's declared ties
    (``all_tied_weights_keys``, transformers >= 5) and from accelerate's offload index (two names read from one
    checkpoint entry)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.declared = dict(getattr(model, "all_tied_weights_keys", None) or {})

    def canonical(self, name: str) -> str:
        seen = set()
        while name in self.declared and name not in seen:
            seen.add(name)
            name = self.declared[name]
        return name

    def keys(self, full: str, weights_map, name: str) -> list:
        keys = [("name", self.canonical(full))]
        index = getattr(getattr(weights_map, "dataset", None), "index", None) or {}
        source = index.get(getattr(weights_map, "prefix", "") + name)
        if isinstance(source, dict) and "safetensors_file" in source:
            keys.append(("checkpoint", source["safetensors_file"], source.get("weight_name")))
        return keys

    def resident(self, full: str, owner: nn.Module, attribute: str, is_parameter: bool) -> bool:
        """Tie ``full`` again to the resident tensor it is declared tied to, if that one is resident."""
        source = self.canonical(full)
        if source == full or not is_parameter:
            return False
        try:
            tensor = self.model.get_parameter(source)
        except AttributeError:
            return False
        if tensor.device.type == "meta":
            return False
        owner._parameters[attribute] = tensor
        return True


def _own_memory(modules: list[nn.Module]) -> None:
    """The modules' tensors in memory of their own: a view of the checkpoint file (transformers maps it) keeps the
    whole mapping alive, with every page a load or a forward ever touched in the process's resident set."""
    done = set()
    for module in modules:
        for tensors in (module._parameters, module._buffers):
            for name, tensor in tensors.items():
                if tensor is None or id(tensor) in done:
                    continue
                done.add(id(tensor))
                if isinstance(tensor, nn.Parameter):
                    tensor.data = tensor.data.clone()
                else:
                    tensors[name] = tensor.clone()


@dataclass(eq=False)
class Entry:
    """One streamed tensor: the object its modules hold (a ``Parameter``, whose ``.data`` is swapped, or a buffer,
    replaced in each owner), its home, and its offset in the store file (``None``: a memory home)."""

    tensor: torch.Tensor
    owners: list[tuple[nn.Module, str]]
    home: torch.Tensor
    offset: int | None
    is_parameter: bool
    loaded: bool = False  # a module of its unit is running: ``tensor`` holds a private copy on the execution device
    perturbed: bool = False  # that copy already holds w + sum c z (a tied tensor's owners perturb it once)

    @property
    def nbytes(self) -> int:
        return self.home.numel() * self.home.element_size()

    def nbytes_of(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def install(self) -> None:
        """Its home as the owners' tensor. A meta parameter (accelerate's) becomes one new ``Parameter`` shared by
        every owner (a meta tensor's ``.data`` cannot be swapped; ties stay ties), the object a table holds from then
        on; a resident one keeps its object, its ``.data`` the home."""
        if self.is_parameter and self.tensor.device.type == "meta":
            kind = type(self.tensor)
            self.tensor = kind(self.home, requires_grad=self.tensor.requires_grad)
            for module, name in self.owners:
                module._parameters[name] = self.tensor
        else:
            self.set(self.home)

    def set(self, value: torch.Tensor) -> None:
        if self.is_parameter:
            self.tensor.data = value
        else:
            for module, name in self.owners:
                module._buffers[name] = value


@dataclass(eq=False)
class Unit:
    """A module accelerate offloaded, with its streamed tensors (its own, or its submodules' too)."""

    module: nn.Module
    entries: list[Entry]
    depth: int = 0  # calls running (a module may call itself)
    copies: list = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)


class WeightStream:
    """The offloaded modules of ``model`` (accelerate ``AlignDevicesHook(offload=True)``) streamed by the process
    itself (module docstring). Built by :func:`stream_of` (a :class:`~zo_byzantine.perturbation.ParameterTable`
    builds it for an offloaded model) or :func:`stream_weights` (with settings).

    ``budget_bytes``: the memory the model may take on the execution device (CPU memory when it runs on the CPU).
    Modules accelerate left resident are streamed too (from the store file; from CPU memory for an accelerator)
    until what stays resident fits ``budget_bytes`` minus the largest module (the one running, as a private copy or,
    resident, its perturbed copy), what the stream's thread reads ahead (``window_bytes``) and a quarter of the budget
    (the activations: SmolLM2's logits and their log-softmax take 50 MB for 128 tokens), kept in module order.
    ``None``: accelerate's placement as it is.

    ``read_thread``: who reads ahead. ``True`` (default): the stream's thread makes the private copies (``pread``, then
    the copy to an accelerator on a stream of its own), within ``window_bytes`` and the room ``budget_bytes`` leaves;
    ``False``: the kernel is asked for the next modules' pages (``POSIX_FADV_WILLNEED``) and the copy is made when the
    module starts. The thread is what overlaps a copy to an accelerator with compute. On 2 CPU cores
    (``benchmarks/offload.py``, a 1.2 GB Llama, rounds against the in-memory round) either read-ahead saves 3-10 %:
    1.29x with the thread, 1.33x without read-ahead; with the store's pages dropped from the page cache (a client whose
    memory cannot cache the model) 1.89x, 1.95x without, 1.77x with the kernel's read-ahead. Copying from the page
    cache is work for the forward's own cores; runs differ by about as much as the modes.
    """

    def __init__(self, model: nn.Module, folder: str | None = None, window_bytes: int = DEFAULT_WINDOW,
                 budget_bytes: int | None = None, read_thread: bool | None = None):
        for name, value in (("window_bytes", window_bytes), ("budget_bytes", budget_bytes)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(f"{name}={value!r} must be an integer number of bytes >= 0.")
        found = _offloading_hooks(model)
        devices = {torch.device(h.execution_device if h.execution_device is not None else "cpu") for _, h in found}
        if len(devices) > 1:
            raise ValueError(f"weight stream: offloaded modules run on several devices {sorted(map(str, devices))}; "
                             "one execution device is supported.")
        self.device = devices.pop() if devices else torch.device("cpu")
        self.window, self.budget = window_bytes, budget_bytes
        self.pin = self.device.type == "cuda"
        self.read_thread = True if read_thread is None else bool(read_thread)
        self.entries: dict[int, Entry] = {}  # id(tensor object) -> entry
        units: dict[nn.Module, list[Entry]] = {}
        sources: list[tuple[Entry, Callable, bool]] = []  # each entry's value (read once below), to the file or not
        from accelerate.utils import named_module_tensors

        paths = {id(m): path for path, m in model.named_modules()}
        ties = _Ties(model)
        by_key: dict = {}  # a tensor's identity (object, tied name, checkpoint entry) -> its entry
        covered = set()  # modules whose tensors an offloaded module streams
        for module, hook in found:
            entries = units.setdefault(module, [])
            covered.update(id(m) for m in (module.modules() if hook.place_submodules else [module]))
            for name, _ in named_module_tensors(module, include_buffers=hook.offload_buffers,
                                                recurse=hook.place_submodules, remove_non_persistent=True):
                owner, attribute = _owner(module, name)
                is_parameter = attribute in owner._parameters
                tensor = owner._parameters[attribute] if is_parameter else owner._buffers[attribute]
                if tensor is None or tensor.device.type != "meta":
                    continue  # resident (accelerate placed it, or it is tied to a resident tensor)
                full = f"{paths[id(module)]}.{name}".lstrip(".")
                if ties.resident(full, owner, attribute, is_parameter):
                    continue  # tied to a resident tensor (an accelerate load broke the tie): that tensor again
                keys = [("object", id(tensor)), *ties.keys(full, hook.weights_map, name)]
                entry = next((by_key[k] for k in keys if k in by_key), None)
                if entry is None:
                    entry = Entry(tensor, [], tensor, None, is_parameter)
                    self.entries[id(tensor)] = entry
                    sources.append((entry, functools.partial(hook.weights_map.__getitem__, name),
                                    self._on_disk(hook.weights_map, name)))
                by_key.update(dict.fromkeys(keys, entry))
                if (owner, attribute) not in entry.owners:
                    entry.owners.append((owner, attribute))
                if entry not in entries:
                    entries.append(entry)
        if budget_bytes is not None:
            self._evict(model, covered, units, sources)
        folder = folder or self._accelerate_folder(found) or tempfile.gettempdir()
        self._store(sources, folder)
        for _, hook in found:  # accelerate's hooks now only move inputs: the stream loads the weights
            hook.offload, hook.weights_map, hook.tied_params_names = False, None, set()
        order = {id(m): k for k, m in enumerate(model.modules())}
        streamed = [(m, [e for e in es if e.offset is not None or self.device.type != "cpu"])
                    for m, es in units.items()]
        self.units = sorted((Unit(m, es) for m, es in streamed if es), key=lambda u: order[id(u.module)])
        self.streamed = {id(e.tensor) for u in self.units for e in u.entries}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zo-weight-stream")
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # unit -> its private copies read ahead by the stream's thread (None: by the kernel) in the running forward
        self._ahead: dict[int, Future | None] = {}
        self._advising: list[Future] = []  # the kernel asked for pages (on the stream's thread)
        self._next: dict[int, int] = {}  # unit -> the unit that ran after it in the last forward
        self._last: int | None = None
        self._forwards = 0  # model forwards running (read-ahead is dropped when the outermost one ends)
        self._prefault_ok = True
        self._lock = threading.Lock()  # the copies' memory: used by this thread and the stream's
        self._spare: dict[int, list[torch.Tensor]] = {}  # size -> memory of copies given back
        self._spare_bytes = self._in_use = 0
        self._cap = max((u.nbytes for u in self.units), default=0) + (self.window if self.read_thread else 0)
        self.handles = []
        for k, unit in enumerate(self.units):
            self.handles.append(unit.module.register_forward_pre_hook(self._pre_hook(k), prepend=True))
            self.handles.append(unit.module.register_forward_hook(self._post_hook(k), always_call=True))
        self.handles.append(model.register_forward_pre_hook(self._model_starts, prepend=True))
        self.handles.append(model.register_forward_hook(self._model_ends, always_call=True))
        model.__dict__[_ATTRIBUTE] = self
        _return_freed_memory()
        logger.info("Weight stream: %d modules streamed, %.3g GB in the store file, %.3g GB in CPU memory, execution "
                    "on %s, reading %.3g MB ahead.", len(self.units), self.stored_bytes / 2**30,
                    sum(e.nbytes for e in self.entries.values() if e.offset is None and id(e.tensor) in self.streamed)
                    / 2**30, self.device, self.window / 2**20)

    # ----- the store ----------------------------------------------------------------------------------------------

    def _evict(self, model: nn.Module, covered: set, units: dict, sources: list) -> None:
        """Stream modules accelerate left resident (module docstring of the class) until the rest fits the budget.
        Modules that share a tensor (tied weights) go together."""
        groups: list[list[nn.Module]] = []
        group_of: dict[int, list] = {}  # id(tensor) -> its group
        for module in model.modules():
            if id(module) in covered:
                continue
            tensors = [t for t in module._parameters.values() if t is not None and t.device.type != "meta"]
            tensors += [t for n, t in module._buffers.items()
                        if t is not None and n not in module._non_persistent_buffers_set]
            if not tensors:
                continue
            joined = {id(g): g for t in tensors if (g := group_of.get(id(t))) is not None}
            group = [module]
            for other in joined.values():
                group.extend(other)
                groups.remove(other)
            groups.append(group)
            for member in group:
                for t in [*member._parameters.values(), *member._buffers.values()]:
                    if t is not None:
                        group_of[id(t)] = group

        def size(group) -> int:
            unique = {id(t): t for m in group for t in [*m._parameters.values(), *m._buffers.values()]
                      if t is not None and t.device.type != "meta"}
            return sum(t.numel() * t.element_size() for t in unique.values())

        largest = max([size(g) for g in groups] + [sum(e.nbytes_of() for e in es) for es in units.values()] + [0])
        if self.read_thread and self.window:  # read ahead within the room the budget leaves (at least the next module)
            self.window = max(1, min(self.window, self.budget - largest - self.budget // 4))
        ahead = self.window if self.read_thread else 0  # the kernel's read-ahead fills the page cache, not the RSS
        working = largest + ahead + self.budget // 4  # the module running, the copies read ahead, the activations
        allowance = self.budget - working
        kept = 0
        for group in groups:
            if kept + size(group) <= allowance:
                kept += size(group)
                if self.device.type == "cpu":
                    _own_memory(group)
                continue
            for module in group:
                entries = units.setdefault(module, [])
                for attribute, tensor in [*module._parameters.items(), *module._buffers.items()]:
                    if tensor is None or attribute in module._non_persistent_buffers_set:
                        continue
                    entry = self.entries.get(id(tensor))
                    if entry is None:
                        entry = Entry(tensor, [], tensor, None, attribute in module._parameters)
                        self.entries[id(tensor)] = entry
                        sources.append((entry, lambda t=tensor: t, self.device.type == "cpu"))
                    entry.owners.append((module, attribute))
                    entries.append(entry)
        if working > self.budget:
            logger.warning("weight stream: budget_bytes=%d is below what a round needs beside resident modules: the "
                           "largest module (%d bytes), what is read ahead (%d) and a quarter for the activations.",
                           self.budget, largest, ahead)

    @staticmethod
    def _accelerate_folder(found) -> str | None:
        for _, hook in found:
            folder = getattr(getattr(hook.weights_map, "dataset", None), "save_folder", None)
            if folder:
                return folder
        return None

    @staticmethod
    def _on_disk(weights_map, name: str) -> bool:
        """Whether accelerate reads ``name`` from disk (its offload index) rather than from a CPU state dict."""
        dataset = getattr(weights_map, "dataset", None)
        key = getattr(weights_map, "prefix", "") + name
        index = getattr(dataset, "index", None) or {}
        return key in index and key not in (getattr(dataset, "state_dict", None) or {})

    def _store(self, sources: list, folder: str) -> None:
        """Each entry's value read once into its home: the store file, or pinned CPU memory (a model that runs on an
        accelerator); then installed as the owners' tensor."""
        offsets, size = {}, 0
        for entry, _, to_file in sources:
            if to_file:
                offsets[id(entry)] = size
                size += (entry.nbytes_of() + ALIGN - 1) // ALIGN * ALIGN
        self.stored_bytes, self.fd, self._map = size, None, None
        if size:
            os.makedirs(folder, exist_ok=True)
            self.fd, path = tempfile.mkstemp(prefix="zo_byzantine-weights-", dir=folder)
            try:
                os.unlink(path)  # the open descriptor and the mapping keep it: nothing left behind
            except OSError:
                logger.warning("weight stream: could not unlink %s; remove it after the run.", path)
            os.ftruncate(self.fd, size)
        for entry, read, _ in sources:
            value = read().detach().to(entry.tensor.dtype)
            if id(entry) in offsets:
                entry.offset = offsets[id(entry)]
                _pwrite_from(self.fd, value, entry.offset)
            elif self.device.type == "cpu":  # accelerate's CPU offload of a model that runs on the CPU: resident
                entry.home = value
            else:
                entry.home = value.to("cpu").pin_memory() if torch.cuda.is_available() else value.to("cpu").clone()
            del value
        if size:
            self._map = mmap.mmap(self.fd, size)
        for entry, _, _ in sources:
            if entry.offset is not None:
                shape, dtype = entry.tensor.shape, entry.tensor.dtype
                numel = entry.tensor.numel()
                entry.home = (torch.frombuffer(self._map, dtype=dtype, count=numel, offset=entry.offset).view(shape)
                              if numel else torch.empty(shape, dtype=dtype))
            entry.install()
        self.entries = {id(entry.tensor): entry for entry in self.entries.values()}

    # ----- forwards -------------------------------------------------------------------------------------------------

    def _read(self, unit: Unit) -> list[tuple[Entry, torch.Tensor]]:
        """Private copies of ``unit``'s tensors on the execution device (runs on the stream's thread)."""
        copies = []
        for entry in unit.entries:
            if entry.offset is not None:
                copy = self._buffer(entry)
                if copy.numel():
                    _pread_into(self.fd, copy, entry.offset)
            else:
                copy = entry.home
            if self.device.type != "cpu":
                copy = self._to_device(copy)
            copies.append((entry, copy))
        return copies

    def _buffer(self, entry: Entry) -> torch.Tensor:
        """Memory for a private copy of ``entry``: pinned for a copy to an accelerator; on the CPU the memory of a copy
        of the same size given back (:meth:`_give_back`), else a mapping of its own (the heap would keep it: a
        thread's arena keeps what it once held). A fresh mapping costs a page fault and a zeroed page every 4 KB:
        measured, reading into one runs at 40 % of the speed of reading into memory read into before."""
        shape, dtype, size = entry.home.shape, entry.home.dtype, entry.nbytes
        if self.pin or not size:
            return torch.empty(shape, dtype=dtype, pin_memory=self.pin)
        with self._lock:
            spare = self._spare.get(size)
            raw = spare.pop() if spare else None
            if raw is not None:
                self._spare_bytes -= size
            while raw is None and self._spare_bytes and self._spare_bytes + self._in_use + size > self._cap:
                self._drop_spare()
            self._in_use += size
        if raw is None:
            raw = torch.frombuffer(mmap.mmap(-1, size), dtype=torch.uint8)
        return raw.view(dtype).view(shape)

    def _give_back(self, entry: Entry, copy: torch.Tensor) -> None:
        """A private copy's memory, free again: kept for the next copy of its size while the copies in use and kept
        stay within the largest module (and what the thread reads ahead), the memory the budget counts for them."""
        if entry.offset is None or self.pin or not entry.nbytes:
            return
        size = entry.nbytes
        with self._lock:
            self._in_use -= size
            self._spare.setdefault(size, []).append(copy.reshape(-1).view(torch.uint8))
            self._spare_bytes += size
            while self._spare_bytes and self._spare_bytes + self._in_use > self._cap:
                self._drop_spare()

    def _drop_spare(self) -> None:
        size = max(k for k, kept in self._spare.items() if kept)
        self._spare[size].pop()
        self._spare_bytes -= size

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._copy_stream is None:
            return tensor.to(self.device)
        with torch.cuda.stream(self._copy_stream):
            moved = tensor.to(self.device, non_blocking=True)
        self._copy_stream.synchronize()  # this thread waits; the computing thread never does unless it needs it
        return moved

    def _pre_hook(self, k: int):
        def hook(module, args):
            unit = self.units[k]
            unit.depth += 1
            if unit.depth > 1:
                return
            future = self._ahead.pop(k, None)
            copies = future.result() if future is not None else self._read(unit)
            if self._copy_stream is not None:
                for _, copy in copies:  # allocated on the copy stream, used on this one
                    copy.record_stream(torch.cuda.current_stream(self.device))
            for entry, copy in copies:
                entry.set(copy)
                entry.loaded, entry.perturbed = True, False
            unit.copies = copies
            if self._last is not None:
                self._next[self._last] = k
            self._last = k
            if self._forwards and self.window:
                self._read_ahead(k)
        return hook

    def _post_hook(self, k: int):
        def hook(module, args, output):
            unit = self.units[k]
            unit.depth -= 1
            if unit.depth:
                return
            for entry, copy in unit.copies:
                entry.set(entry.home)
                entry.loaded = entry.perturbed = False
                self._give_back(entry, copy)
            unit.copies = []
        return hook

    def _read_ahead(self, k: int) -> None:
        """Read the units expected after ``k`` (the order of the last forward; module order at first): at least the
        next one, then more while the bytes read ahead stay within the window."""
        queued = sum(self.units[u].nbytes for u in self._ahead)
        seen, u = {k}, k
        while True:
            u = self._next.get(u, u + 1)
            if u >= len(self.units) or u in seen:
                return
            seen.add(u)
            if u in self._ahead or self.units[u].depth:
                continue
            size = self.units[u].nbytes
            if self._ahead and queued + size > self.window:
                return
            if self.read_thread:
                self._ahead[u] = self._pool.submit(self._read, self.units[u])
            else:  # the kernel reads it into the page cache (DMA: no core taken from the forward); copied when it runs
                self._advising.append(self._pool.submit(self._advise, self.units[u]))  # asking may wait for the disk
                self._ahead[u] = None
            queued += size

    def _advise(self, unit: Unit) -> None:
        for entry in unit.entries:
            if entry.offset is not None and entry.nbytes:
                os.posix_fadvise(self.fd, entry.offset, entry.nbytes, os.POSIX_FADV_WILLNEED)

    def _model_starts(self, module, args):
        self._forwards += 1
        if self._forwards == 1:
            self._last = None
            self.release_pages()  # whatever read the weights whole since (a fingerprint, saving) left them mapped

    def _model_ends(self, module, args, output):
        self._forwards -= 1
        if not self._forwards:
            self.drop_read_ahead()

    def before_update(self) -> None:
        """The update is about to write the homes: copies read ahead would be stale."""
        self.drop_read_ahead()

    def drop_read_ahead(self) -> None:
        """Forget copies read ahead (before anything writes the homes: they would be stale), and the memory of copies
        given back: outside a forward it is room the loss (a language model's logits) or the update needs."""
        ahead, self._ahead = self._ahead, {}
        advising, self._advising = self._advising, []
        for future in advising:
            future.exception()
        for future in ahead.values():
            if future is not None and future.exception() is None:  # waits: the thread must not be writing a copy
                for entry, copy in future.result():
                    self._give_back(entry, copy)
        with self._lock:
            while self._spare_bytes:
                self._drop_spare()

    def private(self, tensor: torch.Tensor) -> Entry | None:
        """The entry of ``tensor`` when it holds a private copy now (a module of its unit is running), else ``None``:
        that copy may be perturbed in place (see ``perturbation.perturbed``)."""
        entry = self.entries.get(id(tensor))
        return entry if entry is not None and entry.loaded else None

    # ----- the update -----------------------------------------------------------------------------------------------

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is streamed (its home is the store file or CPU memory)."""
        return id(tensor) in self.streamed

    def prefault(self, tensor: torch.Tensor) -> None:
        """Fault ``tensor``'s file pages into the process, writable, on the stream's thread (its update comes next)."""
        entry = self.entries.get(id(tensor))
        if entry is not None and entry.offset is not None and self._prefault_ok and self.window:
            self._pool.submit(self._populate, entry)

    def _populate(self, entry: Entry) -> None:
        if not _madvise(entry.home, MADV_POPULATE_WRITE):
            self._prefault_ok = False  # a kernel before 5.14: the update faults the pages itself

    def updated(self, tensor: torch.Tensor) -> None:
        """``tensor``'s update is written: its file pages leave the process (the page cache keeps them, dirty, and the
        kernel writes them back while the next tensors are updated)."""
        entry = self.entries.get(id(tensor))
        if entry is not None and entry.offset is not None:
            _madvise(entry.home, MADV_DONTNEED)

    def release_pages(self) -> None:
        """Drop every file page from the process's resident set (after something read all the weights whole, e.g. a
        fingerprint): they stay in the page cache."""
        for entry in self.entries.values():
            if entry.offset is not None:
                _madvise(entry.home, MADV_DONTNEED)

    def close(self) -> None:
        """Remove the stream's hooks (the homes stay the tensors' data)."""
        self.drop_read_ahead()
        for handle in self.handles:
            handle.remove()
        self.handles = []
