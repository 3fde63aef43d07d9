"""The check's side in each rank: instrument torch, run the learner's script unchanged, write what was seen.

``checker.check`` launches this file as the script, under real torchrun through the worker wrapper, with the
learner's script and its arguments after it: ``_check_rank.py SCRIPT ARGS``. It installs what torch offers
(a global optimizer step post-hook; a global module forward pre-hook, until a model is wrapped in DDP) and a
few wrappers, each of which calls the original with the same arguments and returns what it returns (listed,
with why, in CONTRIBUTING.md, "The check"); then runs the script as ``__main__`` with ``sys.argv`` as the
script expects. Every observation is one JSON object per line, appended to this rank's own file in the
check's folder (``checker.DIR_VARIABLE``): never the script's output, never its process group.

After ``checker.STEPS_VARIABLE`` optimizer steps the step hook raises ``StopCheck`` (a ``BaseException``,
which a script's ``except Exception`` lets through); caught here, the script's frames are dropped, its DDP
wrappers freed while their group exists, the group destroyed if the script made one, and the rank exits 0.
"""

from __future__ import annotations

import functools
import gc
import hashlib
import inspect
import json
import os
import runpy
import sys
import traceback
import weakref
from collections.abc import Callable, Iterator, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.data.distributed import DistributedSampler

from ddp_helpers import checker
from ddp_helpers._worker import name_process

PREFIXES = ("module.", "_orig_mod.")  # what DDP and torch.compile put before every key of a state_dict
_LIBRARIES = (f"{os.sep}torch{os.sep}", f"{os.sep}torchvision{os.sep}")


class StopCheck(BaseException):
    """Raised by the step hook after the check's last step: every rank stops after the same count."""


class Recorder:
    """This rank's observations: one JSON object per line, each written (and flushed) as it happens."""

    def __init__(self, path: str):
        self.file = open(path, "a", buffering=1, encoding="utf-8")  # open for the whole run: closed at exit

    def write(self, event: str, **fields: object) -> None:
        self.file.write(json.dumps({"event": event, **fields}, default=str) + "\n")


def strip_prefixes(name: str) -> str:
    """A state_dict key without the wrappers' prefixes in front (``module.``, ``_orig_mod.``, nested)."""
    while name.startswith(PREFIXES):
        name = name.split(".", 1)[1]
    return name


def tensor_digest(t: torch.Tensor) -> str:
    """An exact digest of a tensor's values: a hash of its bytes on the CPU; on a GPU, float64 sums."""
    t = t.detach()
    if t.device.type == "cpu" and t.layout == torch.strided and not t.is_quantized:
        data = t.contiguous().reshape(-1).view(torch.uint8)
        return hashlib.blake2b(data.numpy(), digest_size=8).hexdigest()
    t = t.to_dense() if t.layout != torch.strided else t
    total, squares = t.sum(dtype=torch.float64), (t * t).sum(dtype=torch.float64)
    return f"{total.item():.17g}/{squares.item():.17g}"


def sample_digests(t: torch.Tensor) -> list[str]:
    """One digest per sample (row along the first dimension) of a batch, from its bytes on the CPU."""
    rows = t.detach().cpu().contiguous()
    rows = rows.reshape(len(rows), -1).view(torch.uint8).numpy()
    return [hashlib.blake2b(row, digest_size=8).hexdigest() for row in rows]


def first_tensor(value: object, depth: int = 0) -> torch.Tensor | None:
    """The first tensor with a batch dimension in a forward's arguments (tuples, lists, dicts)."""
    if isinstance(value, torch.Tensor):
        return value if value.dim() > 0 and len(value) > 0 else None
    if depth > 3:
        return None
    items = value.values() if isinstance(value, Mapping) else value if isinstance(value, list | tuple) else ()
    for item in items:
        found = first_tensor(item, depth + 1)
        if found is not None:
            return found
    return None


def prefixed_state_dicts(obj: object, path: str = "", depth: int = 0) -> list[dict]:
    """The state_dicts inside a saved object whose every key carries a wrapper's prefix."""
    if not isinstance(obj, Mapping) or depth > 3:
        return []
    keys = [k for k in obj if isinstance(k, str)]
    tensors = [k for k in keys if isinstance(obj[k], torch.Tensor)]
    if tensors and len(keys) == len(obj):
        for prefix in PREFIXES:
            if all(k.startswith(prefix) for k in tensors):
                return [
                    {
                        "where": path or "the object itself",
                        "prefix": prefix,
                        "key": tensors[0],
                        "keys": len(keys),
                    }
                ]
    found = []
    for k in keys:
        found += prefixed_state_dicts(obj[k], f"{path}[{k!r}]", depth + 1)
    return found


def file_path(f: object) -> str | None:
    """The absolute path torch.save or torch.load was given: a path, or an open file's name; else None."""
    if isinstance(f, str | os.PathLike):
        return os.path.abspath(os.fspath(f))
    name = getattr(f, "name", None)
    return os.path.abspath(name) if isinstance(name, str) else None


def in_library(filename: str) -> bool:
    """Whether a frame's file is part of torch or torchvision."""
    return any(part in filename for part in _LIBRARIES)


def caller() -> tuple[str, int, bool]:
    """Who called the wrapped function: the innermost frame outside torch, torchvision and this file, and
    whether the direct caller was inside torch or torchvision (a library's own load, say torch.hub's)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back
    library = frame is not None and in_library(frame.f_code.co_filename)
    while frame is not None and in_library(frame.f_code.co_filename):
        frame = frame.f_back
    return (frame.f_code.co_filename, frame.f_lineno, library) if frame is not None else ("?", 0, library)


def guarded(method: Callable) -> Callable:
    """A hook or recorder that must never change what the script does: an exception of its own is written to
    the observations (once) instead of reaching the script. ``StopCheck`` still goes through."""

    @functools.wraps(method)
    def call(self: Watch, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except Exception as e:
            if not self.failed:
                self.failed = True
                self.out.write(
                    "check_error", where=method.__name__, type=type(e).__name__, message=str(e)[:500]
                )
            return None

    return call


class Watch:
    """What this rank's script does: its batches, steps, samplers, DDP wrappers, files; written as it goes."""

    def __init__(self, recorder: Recorder, steps: int):
        self.out = recorder
        self.limit = steps
        self.steps = 0  # optimizer steps so far
        self.forwards = 0  # training forwards recorded so far (DDP's, or the top module's without DDP)
        self.ddps: list[weakref.ref] = []  # weak: a script's `del ddp` must still free its wrapper
        self.inner: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # ddp.module -> its index
        self.through_ddp = False  # set by a DDP forward, read by its inner module's forward
        self.synced: list[int] = []  # per DDP wrapper: its forwards that synced buffers
        self.awaiting_top = True  # without DDP: the next training forward of a module is the model's
        self.top: weakref.WeakSet = weakref.WeakSet()
        self.names: dict[int, str] = {}  # id(parameter) -> its name in the model
        self.samplers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.saved: set[str] = set()
        self.bypassed = False
        self.forwards_at_step = 0  # training forwards seen by the last optimizer step
        self.global_hook = None
        self.failed = False  # an exception in the check's own code (written once, never raised)

    # ---- the model's inputs and buffers ---------------------------------------------------------------

    @guarded
    def record_batch(self, args: object, where: str) -> None:
        """One training forward's samples: a digest per sample of its first tensor argument."""
        tensor = first_tensor(args)
        self.forwards += 1
        if tensor is not None:
            samples = sample_digests(tensor)
            batch = hashlib.blake2b("".join(samples).encode(), digest_size=8).hexdigest()
            self.out.write(
                "batch", n=self.forwards, step=self.steps, where=where, batch=batch, samples=samples
            )

    @guarded
    def record_buffers(self, module: nn.Module, model: int, n: int) -> None:
        """The module's buffers, at a forward where they should be equal on every rank."""
        buffers = {strip_prefixes(k): tensor_digest(b) for k, b in module.named_buffers() if b is not None}
        if buffers:
            self.out.write("buffers", model=model, n=n, step=self.steps, digests=buffers)

    @guarded
    def on_any_forward(self, module: nn.Module, args: tuple) -> None:
        """Global forward pre-hook, until a DDP wrapper exists: the model's inputs, without DDP."""
        if self.ddps or not self.awaiting_top or not (module.training and torch.is_grad_enabled()):
            return
        if next(module.parameters(), None) is None:
            return  # a loss or activation module, not the model
        self.awaiting_top = False
        if module not in self.top:
            self.top.add(module)
            self.name_parameters(module)
        self.record_batch(args, "model")
        self.record_buffers(module, -1, self.forwards)

    @guarded
    def on_ddp_forward(self, ddp: DistributedDataParallel, args: tuple, kwargs: dict) -> None:
        """A DDP wrapper's forward pre-hook: the samples fed to the model."""
        self.through_ddp = True
        if ddp.training and torch.is_grad_enabled():
            self.record_batch((args, kwargs), "ddp")

    @guarded
    def on_inner_forward(self, module: nn.Module, args: tuple) -> None:
        """The wrapped module's forward pre-hook: after DDP has synchronised the buffers, if it does."""
        through, self.through_ddp = self.through_ddp, False
        if not (module.training and torch.is_grad_enabled()):
            return
        index = self.inner.get(module)
        if index is None:
            return
        if not through:
            if not self.bypassed:
                self.bypassed = True
                self.out.write("bypass", step=self.steps)
            return
        ddp = self.ddps[index]()
        if ddp is not None and getattr(
            ddp, "require_forward_param_sync", True
        ):  # this forward follows a synchronised backward
            self.synced[index] += 1
            self.record_buffers(module, index, self.synced[index])

    # ---- DDP wrappers ------------------------------------------------------------------------------------

    @guarded
    def on_ddp(self, ddp: DistributedDataParallel) -> None:
        """A DDP wrapper was built: its settings, and hooks on it and on the module it wraps."""
        index = len(self.ddps)
        self.ddps.append(weakref.ref(ddp))
        self.synced.append(0)
        self.inner[ddp.module] = index
        if self.global_hook is not None:
            self.global_hook.remove()  # DDP's own forwards say what the model is fed
            self.global_hook = None
        ddp.register_forward_pre_hook(self.on_ddp_forward, with_kwargs=True)
        ddp.module.register_forward_pre_hook(self.on_inner_forward)
        self.name_parameters(ddp.module)
        named = list(ddp.module.named_parameters())
        self.out.write(
            "ddp",
            model=index,
            step=self.steps,
            find_unused_parameters=bool(getattr(ddp, "find_unused_parameters", False)),
            static_graph=bool(getattr(ddp, "static_graph", False)),
            sync_buffers=bool(getattr(ddp, "forward_sync_buffers", getattr(ddp, "broadcast_buffers", True))),
            trainable=[strip_prefixes(n) for n, p in named if p.requires_grad],
            frozen=[strip_prefixes(n) for n, p in named if not p.requires_grad],
        )

    def name_parameters(self, module: nn.Module) -> None:
        """Remember each parameter's name in the model, without the wrappers' prefixes."""
        for name, p in module.named_parameters():
            self.names.setdefault(id(p), strip_prefixes(name))

    # ---- optimizer steps -------------------------------------------------------------------------------

    def on_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        """Global optimizer step post-hook: every parameter's digest; stop after the check's last step."""
        self.steps += 1
        self.awaiting_top = True
        self.record_step(optimizer)
        if self.steps >= self.limit:
            raise StopCheck

    @guarded
    def record_step(self, optimizer: torch.optim.Optimizer) -> None:
        """This step's parameters, and which ones got no gradient where DDP searches for unused ones."""
        if self.ddps and self.forwards == self.forwards_at_step and not self.bypassed:
            self.bypassed = True  # a step with no training forward through any DDP wrapper since the last one
            self.out.write("bypass", step=self.steps)
        self.forwards_at_step = self.forwards
        params = [p for group in optimizer.param_groups for p in group["params"]]
        digests = {self.names.get(id(p), f"param{i}"): tensor_digest(p) for i, p in enumerate(params)}
        # Per DDP wrapper built with find_unused_parameters=True: its parameters without a gradient.
        unused = []
        for ref in self.ddps:
            ddp = ref()
            if ddp is not None and getattr(ddp, "find_unused_parameters", False):
                unused.append(
                    [
                        strip_prefixes(n)
                        for n, p in ddp.module.named_parameters()
                        if p.requires_grad and p.grad is None
                    ]
                )
            else:
                unused.append(None)
        self.out.write("step", step=self.steps, params=digests, unused=unused)

    # ---- what the wrappers see ---------------------------------------------------------------------------

    @guarded
    def on_ddp_error(self, error: Exception) -> None:
        """DDP refused to wrap a model (on this rank): its own message."""
        self.out.write("ddp_error", type=type(error).__name__, message=str(error)[:4000], step=self.steps)

    @guarded
    def on_init(self, given: Mapping[str, object]) -> None:
        """What init_process_group was given, before it runs."""
        file, line, _ = caller()
        self.out.write(
            "init",
            backend=str(given.get("backend")),
            rank=given.get("rank", -1),
            world_size=given.get("world_size", -1),
            init_method=given.get("init_method"),
            file=file,
            line=line,
        )

    @guarded
    def on_save(self, obj: object, f: object) -> None:
        """A file torch.save wrote, and any state_dict in it whose keys carry a wrapper's prefix."""
        path = file_path(f)
        if path:
            self.saved.add(path)
        file, line, library = caller()
        prefixed = prefixed_state_dicts(obj)
        self.out.write("save", path=path, prefixed=prefixed, file=file, line=line, library=library)

    @guarded
    def on_load(self, f: object, map_location: object) -> None:
        """A file torch.load reads, and whether it was given a map_location."""
        file, line, library = caller()
        located = map_location is not None
        self.out.write("load", path=file_path(f), map_location=located, file=file, line=line, library=library)

    @guarded
    def on_rename(self, src: object, dst: object) -> None:
        """A file torch.save wrote, moved to its final name."""
        if isinstance(src, str | os.PathLike) and file_path(src) in self.saved:
            target = file_path(dst)
            self.saved.add(target)
            self.out.write("rename", src=file_path(src), dst=target)

    # ---- samplers ----------------------------------------------------------------------------------------

    @guarded
    def on_sampler(self, sampler: DistributedSampler, indices: list) -> None:
        """A DistributedSampler handed out an epoch's indices."""
        if sampler not in self.samplers:
            self.samplers[sampler] = len(self.samplers)
        self.out.write(
            "sampler",
            sampler=self.samplers[sampler],
            epoch=getattr(sampler, "epoch", None),
            rank=getattr(sampler, "rank", None),
            num_replicas=getattr(sampler, "num_replicas", None),
            shuffle=bool(getattr(sampler, "shuffle", False)),
            n=len(indices),
            head=[i if isinstance(i, int) else str(i) for i in indices[:8]],
            digest=hashlib.blake2b(repr(indices).encode(), digest_size=8).hexdigest(),
            step=self.steps,
            forwards=self.forwards,
        )


def wrap(owner: object, name: str, make: Callable[[Callable], Callable]) -> None:
    """Replace ``owner.name`` by ``make(original)``, which must call the original and return its result."""
    original = getattr(owner, name)
    setattr(owner, name, functools.wraps(original)(make(original)))


def install(watch: Watch) -> None:
    """The hooks and wrappers, in this rank only (CONTRIBUTING.md, "The check", says why each). Each wrapper
    calls the original with the same arguments and returns its result; what it records goes through a
    guarded ``Watch`` method, which never raises into the script."""
    register_optimizer_step_post_hook(watch.on_step)
    watch.global_hook = register_module_forward_pre_hook(watch.on_any_forward)

    def ddp_init(original: Callable) -> Callable:
        def __init__(self, *args, **kwargs):
            try:
                original(self, *args, **kwargs)
            except Exception as e:
                watch.on_ddp_error(e)
                raise
            watch.on_ddp(self)

        return __init__

    def sampler_iter(original: Callable) -> Callable:
        def __iter__(self) -> Iterator:
            indices = list(original(self))  # the original builds the whole list too, then iterates it
            watch.on_sampler(self, indices)
            return iter(indices)

        return __iter__

    signature = inspect.signature(dist.init_process_group)

    def init_process_group(original: Callable) -> Callable:
        def call(*args, **kwargs):
            try:
                given = signature.bind_partial(*args, **kwargs).arguments
            except TypeError:
                given = {}  # the original raises its own error about these arguments
            watch.on_init(given)
            return original(*args, **kwargs)

        return call

    def save(original: Callable) -> Callable:
        def call(obj, f, *args, **kwargs):
            result = original(obj, f, *args, **kwargs)
            watch.on_save(obj, f)
            return result

        return call

    def load(original: Callable) -> Callable:
        def call(f, *args, **kwargs):
            watch.on_load(f, args[0] if args else kwargs.get("map_location"))
            return original(f, *args, **kwargs)

        return call

    def rename(original: Callable) -> Callable:
        def call(src, dst, *args, **kwargs):
            result = original(src, dst, *args, **kwargs)
            watch.on_rename(src, dst)
            return result

        return call

    wrap(DistributedDataParallel, "__init__", ddp_init)
    wrap(DistributedSampler, "__iter__", sampler_iter)
    for module in (dist, dist.distributed_c10d):
        wrap(module, "init_process_group", init_process_group)
    wrap(torch, "save", save)
    wrap(torch, "load", load)
    for name in ("replace", "rename"):
        wrap(os, name, rename)


def script_line(tb: object, script: str) -> int | None:
    """The innermost line of ``script`` in a traceback."""
    lines = [f.lineno for f in traceback.extract_tb(tb) if os.path.abspath(f.filename) == script]
    return lines[-1] if lines else None


def finish(watch: Watch, how: str, **fields: object) -> None:
    """The run's end on this rank, and whether the default process group is still alive."""
    alive = dist.is_available() and dist.is_initialized()
    watch.out.write("end", how=how, step=watch.steps, group_alive=alive, **fields)


def main(argv: list[str]) -> None:
    script, args = os.path.abspath(argv[0]), argv[1:]
    recorder = Recorder(checker.observation_file(os.environ[checker.DIR_VARIABLE], int(os.environ["RANK"])))
    watch = Watch(recorder, int(os.environ[checker.STEPS_VARIABLE]))
    recorder.write(
        "start",
        rank=int(os.environ["RANK"]),
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        world_size=int(os.environ.get("WORLD_SIZE", 1)),
        limit=watch.limit,
    )
    name_process(f"rank{os.environ['RANK']} {os.path.splitext(os.path.basename(script))[0]}")
    install(watch)
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(script)  # as `python SCRIPT` sets it: not this package's folder
    try:
        runpy.run_path(script, run_name="__main__")
    except StopCheck:
        pass  # leaving the except clause drops the traceback, and with it the script's frames
    except SystemExit as e:
        finish(watch, "exit", code=e.code if isinstance(e.code, int) else (0 if e.code is None else 1))
        raise
    except BaseException as e:
        where = script_line(e.__traceback__, script)
        finish(watch, "exception", type=type(e).__name__, message=str(e)[:4000], line=where)
        raise
    else:
        finish(watch, "finished")
        return
    gc.collect()  # DDP wrappers sit in reference cycles: freed now, while their process group exists
    finish(watch, "stopped")
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
