"""``check(script, *args)``: run a learner's own script under real torchrun, and check it against what the
series proves; ``python -m ddp_helpers check [OPTIONS] SCRIPT [ARGS...]`` from a terminal.

The script runs unchanged, as ``__main__`` with its own arguments, on ``nnodes`` simulated nodes of
``nproc_per_node`` ranks (default 2 x 2, so that a local rank taken for a global one shows), through the
launcher (``torchrun()``: the same timeout, diagnosis and cleanup), for at most ``steps`` optimizer steps per
rank. Each rank runs ``_check_rank.py`` first, which instruments torch in that rank and writes what it sees
to its own file in a folder of the check's; this module reads those files afterwards, compares the ranks
(pure functions over the observations, ``analyse``: tests/test_check.py feeds them made-up ones) and returns
a ``CheckReport``: a readable checklist in a notebook, and an object to assert on.

Each finding has a stable id (README.md, "Check your own script"), a level (``error``: the training is
wrong, will hang or lose data; ``warning``: costly or fragile), the ranks concerned, its evidence, the fix,
and the notebook section that proves it:

- ``same-data-on-ranks`` (error): two ranks train on the same samples (no sharding, a sampler given the
  local rank, an ``IterableDataset`` not split by rank).
- ``epoch-order-repeats`` (error): a shuffling ``DistributedSampler`` hands out the same order each epoch.
- ``replicas-diverge`` (error): parameters (after a step) or buffers (where DDP has just synchronised them)
  differ across ranks; the tensors and the step named.
- ``model-differs-across-ranks`` (error): DDP refused models that differ across ranks.
- ``rank-dependent-hang`` (error): a collective only some ranks reach (the stuck rank and its line).
- ``every-rank-saves`` (error): more than one rank writes the same checkpoint file.
- ``checkpoint-prefix`` (error): a saved state_dict whose keys all carry ``module.`` or ``_orig_mod.``.
- ``load-without-map-location`` (warning): ``torch.load`` without ``map_location``.
- ``unused-parameters``: DDP's error about parameters without a gradient, decoded (error); or
  ``find_unused_parameters=True`` where every parameter got one (warning: a cost every step).
- ``logs-from-every-rank`` (warning): every rank printed the same line (numbers aside).
- ``no-destroy`` (warning): the script ends with its process group alive.
- ``cuda-hardcoded`` (warning): the script cannot run without CUDA (a ``cuda:`` device, ``nccl``,
  SyncBatchNorm, ``device_ids``): not broken, not portable; the other checks are then not run.
- ``init-rank-mismatch`` (error): ``init_process_group`` given a rank or world size other than torchrun's.
- ``script-failed`` (error): the script raised for a reason none of the above names.

A check that does not apply (no DDP, no checkpoint saved during the run, a run stopped within its first
epoch) is listed in ``not_run`` with why: never as passed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shutil
import sys
import tempfile
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

from ddp_helpers import diagnose
from ddp_helpers.launcher import torchrun
from ddp_helpers.outcome import JobFailedError, JobHungError, TorchrunResult

__all__ = ["CHECKS", "CheckReport", "Finding", "Run", "analyse", "check", "main"]

DIR_VARIABLE = "DDP_CHECK_DIR"  # the check's folder, where each rank writes its observations
STEPS_VARIABLE = "DDP_CHECK_STEPS"  # optimizer steps per rank before the check stops the run
RANK_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_check_rank.py")
DEFAULT_STEPS = 20
DEFAULT_TIMEOUT = 300.0

# Every id, in the order the checklist shows them, with what it looks for.
CHECKS = {
    "cuda-hardcoded": "a script that cannot run without CUDA",
    "init-rank-mismatch": "init_process_group given a rank or world size other than torchrun's",
    "model-differs-across-ranks": "the ranks built different models",
    "same-data-on-ranks": "two ranks train on the same samples",
    "epoch-order-repeats": "every epoch draws the same order",
    "replicas-diverge": "parameters or buffers differ across ranks",
    "unused-parameters": "parameters without a gradient, or find_unused_parameters=True for none",
    "rank-dependent-hang": "a collective only some ranks reach",
    "every-rank-saves": "more than one rank writes the same checkpoint file",
    "checkpoint-prefix": "a saved state_dict whose keys carry module. or _orig_mod.",
    "load-without-map-location": "a checkpoint loaded without map_location",
    "logs-from-every-rank": "the same log line printed by every rank",
    "no-destroy": "the process group is never destroyed",
    "script-failed": "the script failed for a reason the other checks do not name",
}
LEVEL_MARK = {"error": "✗", "warning": "⚠"}
_CUDA_ONLY = re.compile(
    r"Found no NVIDIA driver|Torch not compiled with CUDA|No CUDA GPUs are available|no GPUs found|"
    r"invalid device ordinal|CUDA driver initialization failed|SyncBatchNorm layers only work with GPU|"
    r"SyncBatchNorm expected input tensor to be on GPU|deserialize object on a CUDA device|"
    r"device_ids and output_device arguments only work with|Distributed package doesn't have NCCL|"
    r"NCCL is not available|Tensors must be CUDA|No backend type associated with device type cpu"
)
_MODEL_DIFFERS = re.compile(
    r"DDP expects same model across all ranks|appears not to match (sizes|strides) of the same param"
)
_UNUSED = "Expected to have finished reduction in the prior iteration"
_UNUSED_INDICES = re.compile(r"Parameter indices which did not receive grad for rank (\d+): ([\d ]+)")
_PEER_GONE = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe", re.I)
_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


@dataclass
class Finding:
    """One thing found wrong: its stable ``id``, ``level`` ("error" or "warning"), the ``ranks`` concerned,
    the ``evidence``, the ``fix``, and ``see``: the notebook section that proves it."""

    id: str
    level: str
    ranks: list[int]
    evidence: str
    fix: str
    see: str


@dataclass
class CheckReport:
    """What ``check`` found: ``findings``; ``passed``, the checks that ran and found nothing; ``not_run``, the
    others, each with why. ``ok``: no error (warnings allowed). ``result``: the launch's ``TorchrunResult``
    (each rank's lines, ``records()``). Shown as a checklist."""

    script: str
    world: str
    findings: list[Finding] = field(default_factory=list)
    passed: list[str] = field(default_factory=list)
    not_run: list[str] = field(default_factory=list)
    result: TorchrunResult | None = field(default=None, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        return not self.errors

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "error"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "warning"]

    @property
    def ids(self) -> list[str]:
        """The ids found, in the checklist's order."""
        return [f.id for f in self.findings]

    def finding(self, id: str) -> Finding:
        """The finding with this id (KeyError if there is none)."""
        for f in self.findings:
            if f.id == id:
                return f
        raise KeyError(f"no {id!r} finding; found: {self.ids or 'none'}")

    def as_json(self) -> dict:
        """``--json``: ``{"ok", "findings": [{"id", "level", "ranks", "evidence", "fix", "see"}]}``."""
        return {"ok": self.ok, "findings": [asdict(f) for f in self.findings]}

    def headline(self) -> str:
        counts = f"{_count(len(self.errors), 'error')}, {_count(len(self.warnings), 'warning')}"
        return f"{os.path.basename(self.script)} on {self.world}: {counts}"

    def __str__(self) -> str:
        lines = [f"ddp_helpers check: {self.headline()}"]
        for f in self.findings:
            lines.append(f"{LEVEL_MARK[f.level]} {f.id} ({f.level}, {_ranks(f.ranks)}): {f.evidence}")
            lines += [f"    fix: {f.fix}", f"    proof: {f.see}"]
        lines += [f"✓ {name}: no problem found" for name in self.passed]
        lines += [f"· {entry}" for entry in self.not_run]
        return "\n".join(lines)

    def _repr_markdown_(self) -> str:
        lines = [f"**ddp_helpers check**: {self.headline()}", ""]
        for f in self.findings:
            lines.append(
                f"- {LEVEL_MARK[f.level]} **`{f.id}`** ({f.level}, {_ranks(f.ranks)}): {_md(f.evidence)}  "
                f"\n  *Fix:* {_md(f.fix)}  \n  *Proof:* {f.see}"
            )
        lines += [f"- ✓ `{name}`: no problem found" for name in self.passed]
        lines += [f"- · not run: {_md(entry)}" for entry in self.not_run]
        return "\n".join(lines)


@dataclass
class Run:
    """Everything one check's launch left: each rank's observations (``events``, from ``_check_rank``), its
    output, and how the launch ended (a failed rank and the launcher's message; or the ranks it found stuck,
    with every rank's stack dump)."""

    script: str  # the learner's script, absolute
    source: str  # its text
    world_size: int
    steps: int  # the check's limit, per rank
    events: dict[int, list[dict]]
    cwd: str = "."
    stdout: dict[int, list[str]] = field(default_factory=dict)
    stderr: dict[int, list[str]] = field(default_factory=dict)
    failed_rank: int | None = None
    failure: str | None = None  # JobFailedError's message
    stuck: list[int] | None = None  # JobHungError's stuck ranks: set when the launch hung
    stacks: dict[int, str] = field(default_factory=dict)
    hang: str = ""  # how the hang was caught ("timed out after 300 s")

    def of(self, event: str) -> dict[int, list[dict]]:
        """Each rank's observations of one kind, in order."""
        found = {r: [e for e in evs if e.get("event") == event] for r, evs in sorted(self.events.items())}
        return {r: evs for r, evs in found.items() if evs}

    def ends(self) -> dict[int, dict]:
        """How the script ended on each rank that got to say so."""
        return {r: evs[-1] for r, evs in self.of("end").items()}

    def errors(self) -> dict[int, str]:
        """Each rank's exception message: DDP's, then the script's; the launcher's for the rank it blames."""
        texts: dict[int, list[str]] = defaultdict(list)
        for r, evs in self.of("ddp_error").items():
            texts[r] += [e["message"] for e in evs]
        for r, end in self.ends().items():
            if end["how"] == "exception":
                texts[r].append(f"{end.get('type')}: {end.get('message')}")
        if self.failure:
            texts[self.failed_rank if self.failed_rank is not None else -1].append(self.failure)
        return {r: "\n".join(t) for r, t in texts.items()}

    def stopped_peer(self) -> bool:
        """Whether the check stopped some rank at its last step (a peer's failure after that may be ours)."""
        return any(end["how"] == "stopped" for end in self.ends().values())

    def completed(self) -> bool:
        """Whether every rank reached the check's last step or the script's end, without an error."""
        ends = self.ends()
        ok = {"stopped", "finished"}
        return len(ends) == self.world_size and all(
            e["how"] in ok or (e["how"] == "exit" and e.get("code") == 0) for e in ends.values()
        )

    def where(self, line: int | None) -> str:
        """``train.py:42 (`the line`)``."""
        if not line:
            return os.path.basename(self.script)
        lines = self.source.splitlines()
        text = lines[line - 1].strip() if 0 < line <= len(lines) else ""
        return f"{os.path.basename(self.script)}:{line}" + (f" (`{text}`)" if text else "")

    def path(self, path: str | None) -> str:
        """A file's path as the learner wrote it: relative to the run's folder when inside it."""
        if not path:
            return "an open file"
        rel = os.path.relpath(path, self.cwd)
        return path if rel.startswith("..") else rel


Verdict = list[Finding] | str | None  # findings (none: passed), why it did not run, or None: not to list


# ---- the checks: pure functions of a Run ----------------------------------------------------------------


def cuda_hardcoded(run: Run) -> Verdict:
    """A rank stopped by CUDA or NCCL missing: the script cannot run here without a GPU."""
    found = {r: text for r, text in run.errors().items() if _CUDA_ONLY.search(text)}
    if not found:
        return [] if run.completed() else "the run failed before its end or its last step"
    ends = run.ends()
    rank = min(found)
    message = next(line for line in found[rank].splitlines() if _CUDA_ONLY.search(line)).strip()
    place = run.where(ends.get(rank, {}).get("line")) if rank in ends else os.path.basename(run.script)
    nccl = "nccl" in message.lower() or "no gpus found" in message.lower()
    return [
        Finding(
            "cuda-hardcoded",
            "warning",
            sorted(r for r in found if r >= 0),
            f"the script cannot run without CUDA: at {place}, {message[:300]}. It is not broken, but it "
            "runs only where every rank has a GPU, so nothing else was checked here",
            'choose the backend and device at run time: backend = os.environ.get("DDP_BACKEND") or ("nccl" '
            'if torch.cuda.is_available() else "gloo"); device = torch.device("cuda", local_rank) with NCCL, '
            'else torch.device("cpu"); torch.cuda.set_device, device_ids=[local_rank] and SyncBatchNorm only '
            "on GPUs. Then this check can run it on CPUs",
            "notebooks/11_more_errors.ipynb §1c"
            if nccl
            else "notebooks/04_distributed_data_parallel.ipynb §1",
        )
    ]


def init_rank_mismatch(run: Run) -> Verdict:
    """``init_process_group(rank=..., world_size=...)`` that disagree with torchrun's RANK and WORLD_SIZE."""
    inits = run.of("init")
    if not inits:
        return "the script never called init_process_group"
    starts = {r: evs[0] for r, evs in run.of("start").items()}
    wrong: dict[int, str] = {}
    lines = set()
    for r, evs in inits.items():
        e = evs[0]
        given_rank, given_world = e.get("rank", -1), e.get("world_size", -1)
        parts = []
        if given_rank not in (-1, None) and given_rank != r:
            local = starts.get(r, {}).get("local_rank")
            parts.append(f"rank={given_rank}" + (" (its LOCAL_RANK)" if given_rank == local else ""))
        if given_world not in (-1, None) and given_world != run.world_size:
            parts.append(f"world_size={given_world}")
        if parts:
            wrong[r] = f"{', '.join(parts)} on global rank {r}"
            lines.add(_line(run, e))
    if not wrong:
        return []
    where = run.where(next(iter(lines))) if len(lines) == 1 else "several lines"
    return [
        Finding(
            "init-rank-mismatch",
            "error",
            sorted(wrong),
            f"init_process_group at {where} was given "
            + "; ".join(wrong[r] for r in sorted(wrong)[:4])
            + f": torchrun numbers the ranks 0..{run.world_size - 1} across all nodes, so two processes "
            "claim one rank and the group never forms (or forms wrong)",
            "init_process_group(backend) with no rank= and world_size=: env:// reads RANK and WORLD_SIZE "
            "from torchrun; LOCAL_RANK is only the device on this node",
            "notebooks/05_launching.ipynb §4",
        )
    ]


def model_differs(run: Run) -> Verdict:
    """DDP's own check that every rank built the same model, decoded."""
    refused = {}
    for r, evs in run.of("ddp_error").items():
        messages = [e["message"] for e in evs if _MODEL_DIFFERS.search(e["message"])]
        if messages:
            refused[r] = messages[0]
    if refused:
        first = refused[min(refused)].strip().splitlines()[0]
        return [
            Finding(
                "model-differs-across-ranks",
                "error",
                sorted(refused),
                f"DDP refused to wrap the model: {first[:300]}",
                "build the same model on every rank: no layer, size or option that depends on the rank or "
                "on each rank's data (a class count from the labels one rank saw, a config read on rank 0)",
                "notebooks/11_more_errors.ipynb §2a",
            )
        ]
    if run.of("ddp"):
        return []
    return "the script wrapped no model in DistributedDataParallel"


def same_data(run: Run) -> Verdict:
    """Ranks that draw the same indices, feed the model the same batches, or share most of their samples."""
    if run.world_size < 2:
        return "one rank: nothing to compare"
    samplers, batches = run.of("sampler"), run.of("batch")
    if not samplers and not batches:
        return "no training batch reached the model (through DDP, or a module in training mode)"
    evidence, ranks = [], set()
    given: dict[tuple, list[int]] = defaultdict(list)
    for r, evs in samplers.items():
        e = evs[0]
        if e.get("rank") is not None and (e["rank"] != r or e["num_replicas"] != run.world_size):
            given[(e["rank"], e["num_replicas"])].append(r)
    if given:
        evidence.append(
            "; ".join(
                f"ranks {_list(rs)} gave their DistributedSampler rank={g}, num_replicas={n}"
                for (g, n), rs in sorted(given.items())
            )
            + f" (the world has {run.world_size} ranks)"
        )
        ranks |= {r for rs in given.values() for r in rs}
    drawn: dict[tuple, set[int]] = defaultdict(set)
    for r, evs in samplers.items():
        for e in evs:
            drawn[(e["sampler"], e["epoch"], e["digest"], e["n"])].add(r)
    alike = [(key, rs) for key, rs in drawn.items() if len(rs) > 1]
    if alike:
        groups = _groups(rs for _, rs in alike)
        (_, epoch, _, n), _ = alike[0]
        evidence.append(
            f"ranks {' | '.join(_list(g) for g in groups)} drew the same {n} indices (epoch {epoch})"
        )
        ranks |= set().union(*groups)
    pairs = _same_batches(batches)
    if pairs:
        groups = _groups({a, b} for a, b, _, _ in pairs)
        same, compared = min(p[2] for p in pairs), max(p[3] for p in pairs)
        evidence.append(
            f"ranks {' | '.join(_list(g) for g in groups)} fed the model the same samples in the same "
            f"order ({same} of {compared} training steps compared)"
        )
        ranks |= set().union(*groups)
    shared = _shared_samples(batches, run.world_size)
    if shared and not pairs:
        groups = _groups({a, b} for a, b, _, _ in shared)
        a, b, count, size = shared[0]
        evidence.append(
            f"ranks {' | '.join(_list(g) for g in groups)} trained on largely the same samples (ranks {a} "
            f"and {b}: {count} of their first {size})"
        )
        ranks |= set().union(*groups)
    if not evidence:
        return []
    if given:
        fix = (
            "DistributedSampler(dataset) with no rank= or num_replicas=: it asks the process group, which "
            'knows the global rank (or rank=int(os.environ["RANK"])); LOCAL_RANK repeats on every node'
        )
        see = "notebooks/02_distributed_sampler.ipynb §6"
    elif not any(r in samplers for r in ranks):
        fix = (
            "shard the data by global rank: DataLoader(dataset, sampler=DistributedSampler(dataset)), no "
            "shuffle=True on the loader; an IterableDataset must split its stream by rank itself "
            "(notebook 11 §3a), a weighted sampler its draws (11 §3b)"
        )
        see = "notebooks/02_distributed_sampler.ipynb §4"
    else:
        fix = "give the DataLoader the DistributedSampler (sampler=sampler), with no rank= or num_replicas="
        see = "notebooks/02_distributed_sampler.ipynb §4"
    return [Finding("same-data-on-ranks", "error", sorted(ranks), "; ".join(evidence), fix, see)]


def _groups(pairs: Iterable[set[int]]) -> list[list[int]]:
    """Sets of ranks joined wherever they overlap (the ranks that share data, transitively), sorted."""
    groups: list[set[int]] = []
    for pair in pairs:
        joined = [g for g in groups if g & pair]
        merged = set(pair).union(*joined)
        groups = [g for g in groups if not g & pair] + [merged]
    return sorted(sorted(g) for g in groups)


def _same_batches(batches: Mapping[int, list[dict]]) -> list[tuple[int, int, int, int]]:
    """Pairs of ranks whose n-th training batches are the same at two or more steps, and at least half:
    (rank, rank, steps alike, steps compared)."""
    by_n = {r: {e["n"]: e["batch"] for e in evs} for r, evs in batches.items()}
    found = []
    for a, b in itertools.combinations(sorted(by_n), 2):
        common = sorted(set(by_n[a]) & set(by_n[b]))
        same = sum(by_n[a][n] == by_n[b][n] for n in common)
        if common and same >= min(2, len(common)) and 2 * same >= len(common):
            found.append((a, b, same, len(common)))
    return found


def _shared_samples(batches: Mapping[int, list[dict]], world_size: int) -> list[tuple[int, int, int, int]]:
    """Pairs of ranks that share far more samples than sharding allows, before either sees one twice."""
    first: dict[int, set[str]] = {}
    for r, evs in batches.items():
        seen: set[str] = set()
        for e in sorted(evs, key=lambda e: e["n"]):
            if any(s in seen for s in e["samples"]) or len(set(e["samples"])) < len(e["samples"]):
                break
            seen.update(e["samples"])
        first[r] = seen
    found = []
    for a, b in itertools.combinations(sorted(first), 2):
        shared, size = len(first[a] & first[b]), min(len(first[a]), len(first[b]))
        # A DistributedSampler pads an epoch with up to world_size - 1 samples another rank also draws.
        if shared > max(2 * world_size, size // 4):
            found.append((a, b, shared, size))
    return found


def epoch_order(run: Run) -> Verdict:
    """A shuffling DistributedSampler that hands out the same order in two epochs: set_epoch missing."""
    samplers = run.of("sampler")
    if not samplers:
        return "no DistributedSampler handed out indices"
    repeats, later_epoch = {}, False
    for r, evs in samplers.items():
        for seq in _trained_passes(run, r, evs).values():
            for p, q in itertools.pairwise(seq):
                later_epoch = True
                if p["shuffle"] and q["epoch"] == p["epoch"] and q["digest"] == p["digest"]:
                    repeats.setdefault(r, (p, q))
    if repeats:
        r = min(repeats)
        p, q = repeats[r]
        return [
            Finding(
                "epoch-order-repeats",
                "error",
                sorted(repeats),
                f"rank {r}'s DistributedSampler handed out the same order again after {q['step']} "
                f"optimizer steps (its epoch still {q['epoch']}; first indices {p['head']}): set_epoch was "
                "not called before the new epoch",
                "sampler.set_epoch(epoch) at the start of every epoch, on the sampler the DataLoader uses",
                "notebooks/02_distributed_sampler.ipynb §4",
            )
        ]
    if not later_epoch:
        return (
            f"the run ended within its first epoch ({_stop(run)}): give --steps more than one epoch's "
            "steps, or the script arguments for a shorter epoch"
        )
    return []


def _trained_passes(run: Run, rank: int, passes: Sequence[dict]) -> dict[int, list[dict]]:
    """Each sampler's passes that training followed, in order. A pass read for a look (``list(sampler)`` for a
    report, ``next(iter(loader))`` for the batch size), with no training before the sampler's next pass, is
    not an epoch of its own."""
    batches, steps = run.of("batch").get(rank, []), run.of("step").get(rank, [])
    end = (max((e["n"] for e in batches), default=0), max((e["step"] for e in steps), default=0))
    by_sampler: dict[int, list[dict]] = defaultdict(list)
    for e in passes:
        by_sampler[e["sampler"]].append(e)
    trained = {}
    for sampler, seq in by_sampler.items():
        after = [(q["forwards"], q["step"]) for q in seq[1:]] + [end]
        pairs = zip(seq, after, strict=True)
        trained[sampler] = [p for p, (f, s) in pairs if f > p["forwards"] or s > p["step"]]
    return trained


def replicas_diverge(run: Run) -> Verdict:
    """Parameters after each step, and buffers where DDP has just synchronised them, compared across ranks:
    one finding for the parameters, one for the buffers, each with its likely cause."""
    if run.world_size < 2:
        return "one rank: nothing to compare"
    steps = {r: {e["step"]: e["params"] for e in evs} for r, evs in run.of("step").items()}
    if len(steps) < 2:
        return "no optimizer step was observed on two ranks"
    return [f for f in (_parameters_differ(run, steps), _buffers_differ(run)) if f]


def _parameters_differ(run: Run, steps: Mapping[int, Mapping[int, Mapping[str, str]]]) -> Finding | None:
    """The first step after which some parameter differs across ranks, or ranks made different step counts."""
    evidence, causes, see = [], [], "notebooks/04_distributed_data_parallel.ipynb §3"
    differ = _first_difference(steps)
    if differ:
        step, names, groups = differ
        evidence.append(
            f"after optimizer step {step}, {len(names)} parameter tensor(s) differ between ranks "
            f"({' | '.join(_list(g) for g in groups)}): {_names(names)}"
        )
        ddps = run.of("ddp")
        frozen = sorted(set(names) & {n for evs in ddps.values() for e in evs for n in e.get("frozen", [])})
        if frozen:
            causes.append(
                f"{_names(frozen)} did not require a gradient when DDP wrapped the model, so DDP never "
                "averages theirs: wrap again after unfreezing (and give the optimizer the new parameters)"
            )
            see = "notebooks/11_more_errors.ipynb §2e"
        elif run.of("bypass"):
            causes.append(
                "a training step computed its loss through ddp.module (or a submodule), not the DDP "
                "wrapper, so its gradients were not averaged: every training forward through ddp(...)"
            )
            see = "notebooks/11_more_errors.ipynb §2f"
        elif not ddps:
            causes.append("no DistributedDataParallel wrapper averages the gradients: wrap the model in DDP")
    counts = {r: max(s) for r, s in steps.items()}
    if len(set(counts.values())) > 1:
        evidence.append(
            "ranks made different numbers of optimizer steps: "
            + ", ".join(f"rank {r} {n}" for r, n in sorted(counts.items()))
        )
        causes.append("every rank must step its optimizer at every step (no rank-dependent skip)")
    if not evidence:
        return None
    fix = (
        "; ".join(causes)
        or "find what differs between the ranks' steps (data, seeds, a rank-dependent branch)"
    )
    return Finding("replicas-diverge", "error", sorted(steps), "; ".join(evidence), fix, see)


def _buffers_differ(run: Run) -> Finding | None:
    """The first forward where DDP synchronises buffers at which some buffer differs across ranks."""
    found = _buffer_difference(run)
    if not found:
        return None
    model, n, names, groups = found
    evidence = (
        f"at training forward {n}, where DDP synchronises buffers, {len(names)} buffer(s) differed between "
        f"ranks ({' | '.join(_list(g) for g in groups)}): {_names(names)}"
    )
    off = [e for evs in run.of("ddp").values() for e in evs if e["model"] == model and not e["sync_buffers"]]
    if off:
        fix = (
            "DDP was built with broadcast_buffers=False, so each rank keeps its own running statistics "
            "and rank 0's alone are saved: leave it on (or SyncBatchNorm on GPUs)"
        )
    elif model < 0:
        fix = "no DDP wrapper synchronises the buffers: wrap the model in DDP"
    else:
        fix = "find what writes the buffers differently on each rank"
    ranks = sorted({r for g in groups for r in g})
    return Finding(
        "replicas-diverge", "error", ranks, evidence, fix, "notebooks/04_distributed_data_parallel.ipynb §8"
    )


def _disagreement(at: Mapping[int, Mapping[str, str]]) -> tuple[list[str], list[list[int]]] | None:
    """Where the ranks' digests of one moment differ: (the tensors that differ, the groups of ranks that
    agree), or None when they all agree (or fewer than two ranks made them)."""
    if len(at) < 2:
        return None
    names = sorted({n for d in at.values() for n in d if len({d2.get(n) for d2 in at.values()}) > 1})
    if not names:
        return None
    key = {r: tuple(d.get(n) for n in names) for r, d in at.items()}
    return names, [sorted(r for r in at if key[r] == k) for k in dict.fromkeys(key.values())]


def _first_difference(steps: Mapping[int, Mapping[int, Mapping[str, str]]]) -> tuple | None:
    """The first step at which some tensor's digest differs across the ranks that made it: (step, the tensors
    that differ, the groups of ranks that agree)."""
    for step in sorted(set().union(*[set(s) for s in steps.values()])):
        found = _disagreement({r: s[step] for r, s in steps.items() if step in s})
        if found:
            return step, *found
    return None


def _buffer_difference(run: Run) -> tuple | None:
    """The first synchronised forward at which some buffer differs across ranks: (model, n, names, groups)."""
    by_key: dict[tuple[int, int], dict[int, dict]] = defaultdict(dict)
    for r, evs in run.of("buffers").items():
        for e in evs:
            by_key[(e["model"], e["n"])].setdefault(r, e["digests"])
    for (model, n), at in sorted(by_key.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        found = _disagreement(at)
        if found:
            return model, n, *found
    return None


def unused_parameters(run: Run) -> Verdict:
    """DDP's error about parameters that got no gradient, decoded; or find_unused_parameters=True for none."""
    ddps = run.of("ddp")
    for r, text in sorted(run.errors().items()):
        if _UNUSED in text:
            trainable = ddps.get(r, [{}])[0].get("trainable", [])
            m = _UNUSED_INDICES.search(text)
            indices = [int(i) for i in m[2].split()] if m else []
            names = [trainable[i] if i < len(trainable) else f"#{i}" for i in indices]
            got = f"{_names(names)} got no gradient" if names else "some parameters got no gradient"
            return [
                Finding(
                    "unused-parameters",
                    "error",
                    sorted(r2 for r2, t in run.errors().items() if _UNUSED in t and r2 >= 0),
                    f"DDP raised at the next step: {got} (not used to compute the loss), and "
                    "find_unused_parameters is off",
                    "let every parameter take part in the loss at every step (or drop the unused layer); "
                    "if some steps really skip parameters, DDP(..., find_unused_parameters=True), which "
                    "costs time",
                    "notebooks/04_distributed_data_parallel.ipynb §4",
                )
            ]
    if not ddps:
        return "the script wrapped no model in DistributedDataParallel"
    searching = {e["model"] for evs in ddps.values() for e in evs if e["find_unused_parameters"]}
    searching -= {e["model"] for evs in ddps.values() for e in evs if e.get("static_graph")}
    if not searching:
        return []
    steps = [e for evs in run.of("step").values() for e in evs]
    if not steps:
        return "find_unused_parameters=True, but no optimizer step was observed"
    seen = [
        e["unused"][m]
        for e in steps
        for m in searching
        if m < len(e["unused"]) and e["unused"][m] is not None
    ]
    per_rank = max(len(evs) for evs in run.of("step").values())
    if seen and not any(seen):
        return [
            Finding(
                "unused-parameters",
                "warning",
                sorted(ddps),
                "DDP was built with find_unused_parameters=True, yet every parameter got a gradient, in "
                f"each of the {per_rank} steps observed: the search for unused ones costs a pass over the "
                "autograd graph every step",
                "drop find_unused_parameters=True (DDP raises if a later step does leave a parameter unused)",
                "notebooks/11_more_errors.ipynb §2c",
            )
        ]
    return []


def rank_dependent_hang(run: Run) -> Verdict:
    """A hang, or a peer gone, where some ranks wait in a collective that others never reach."""
    if run.stuck is not None:
        return _hang_finding(run)
    ends = run.ends()
    failed = run.failed_rank
    text = run.errors().get(failed, "") if failed is not None else ""
    left = sorted(
        r for r, e in ends.items() if e["how"] == "finished" or (e["how"] == "exit" and e.get("code") == 0)
    )
    if failed is not None and _PEER_GONE.search(text) and left and not run.stopped_peer():
        line = ends.get(failed, {}).get("line")
        return [
            Finding(
                "rank-dependent-hang",
                "error",
                sorted({failed, *left}),
                f"rank {failed} waited in a collective at {run.where(line)} after rank(s) {_list(left)} "
                "had finished the script: a collective only some ranks reach (gloo then reports the peer "
                "gone; where the peers wait elsewhere, it hangs)",
                "call every collective on every rank, in the same order: take it out of the `if rank == "
                "0:` branch (a barrier after rank 0's save goes after the branch)",
                "notebooks/07_debugging.ipynb §1c",
            )
        ]
    if run.completed():
        return []
    return "the run failed before its end or its last step, so it could not show a hang"


def _hang_finding(run: Run) -> Verdict:
    """The launcher's hang diagnosis, placed in the learner's script rather than the check's own."""
    places = {r: diagnose.place(stack, run.script) for r, stack in sorted(run.stacks.items()) if stack}
    waiting = {r: p for r, p in places.items() if p.collective}
    if not waiting:
        return f"the run {run.hang or 'hung'} with no rank in a collective: slow, not stuck on a peer"
    spots: dict[tuple[str, str], list[int]] = defaultdict(list)
    for r, p in waiting.items():
        spots[(p.collective, _at(run, p))].append(r)
    absent = [r for r in run.stuck or [] if r not in waiting]  # busy elsewhere, exited, or silent
    if not absent and len(spots) == 1:
        return f"the run {run.hang or 'hung'} with every rank in the same collective: a peer outside the job?"
    parts = []
    for r in absent:
        p = places.get(r)
        if p is not None and p.script_frame is not None:
            parts.append(f"rank {r} never reached it: busy at {_at(run, p)}")
        else:
            parts.append(f"rank {r} never reached it (it had exited, or sent no stack)")
    for (call, at), rs in sorted(spots.items(), key=lambda kv: kv[1]):
        parts.append(f"{_ranks(rs)} wait{'s' if len(rs) == 1 else ''} in `{call}` at {at}")
    return [
        Finding(
            "rank-dependent-hang",
            "error",
            sorted(set(absent) | set(waiting)),
            f"the run {run.hang or 'hung'}: " + "; ".join(parts),
            "call every collective on every rank, in the same order: no collective (barrier, all_reduce, "
            "a DDP forward, a checkpoint's barrier) inside a branch only some ranks take",
            "notebooks/07_debugging.ipynb §1a",
        )
    ]


def _line(run: Run, event: Mapping) -> int | None:
    """The line an observation names, if it is in the learner's script."""
    return event.get("line") if event.get("file") == run.script else None


def _at(run: Run, place: diagnose.Place) -> str:
    """Where a stack dump shows a rank in the learner's script, with the line's text."""
    frame = place.script_frame
    if frame is None:
        return "?"
    return (
        run.where(frame.line)
        if os.path.realpath(frame.path) == os.path.realpath(run.script)
        else frame.where()
    )


def every_rank_saves(run: Run) -> Verdict:
    """The files torch.save wrote (followed through a rename), and which ranks wrote each."""
    writers = _saved_files(run)
    if not writers:
        return f"the script saved no file with torch.save during the run ({_stop(run)})"
    shared = {p: rs for p, rs in writers.items() if len(rs) > 1}
    if not shared:
        return []
    path, ranks = sorted(shared.items())[0]
    local = {r: evs[0].get("local_rank") for r, evs in run.of("start").items()}
    if all(local.get(r) == 0 for r in ranks):
        who = f"ranks {_list(ranks)}, each node's local rank 0,"
        why = (
            "on nodes that share a filesystem (as these simulated ones do) they race for one file; with a "
            "disk per node, each keeps its own copy"
        )
    else:
        who, why = f"ranks {_list(ranks)}", "they race, and a reader can meet a half-written file"
    more = f" (and {len(shared) - 1} more shared file(s))" if len(shared) > 1 else ""
    return [
        Finding(
            "every-rank-saves",
            "error",
            sorted(set().union(*shared.values())),
            f"{who} all wrote {run.path(path)}{more}: {why}",
            "save on global rank 0 only (`if dist.get_rank() == 0:`, not LOCAL_RANK), atomically (a "
            "temporary file in the same folder, then os.replace), then dist.barrier() on every rank "
            "before any rank loads it",
            "notebooks/01_state_dict_prefixes.ipynb §2",
        )
    ]


def _saved_files(run: Run) -> dict[str, set[int]]:
    """Each file torch.save wrote, under its final name (after os.replace or os.rename), and its writers."""
    writers: dict[str, set[int]] = defaultdict(set)
    for r, evs in run.of("save").items():
        for e in evs:
            if e.get("path") and not e.get("library"):
                writers[_final(run, r, e["path"])].add(r)
    return writers


def _final(run: Run, rank: int, path: str | None) -> str | None:
    """A file's last name on a rank: where os.replace or os.rename moved what torch.save wrote."""
    moved = {e["src"]: e["dst"] for e in run.of("rename").get(rank, [])}
    for _ in range(10):
        if path not in moved:
            break
        path = moved[path]
    return path


def checkpoint_prefix(run: Run) -> Verdict:
    """A saved state_dict whose every key carries a wrapper's prefix."""
    saves = run.of("save")
    if not saves:
        return f"the script saved nothing with torch.save during the run ({_stop(run)})"
    bad = {r: e for r, evs in saves.items() for e in evs if e.get("prefixed")}
    if not bad:
        return []
    r = min(bad)
    p = bad[r]["prefixed"][0]
    return [
        Finding(
            "checkpoint-prefix",
            "error",
            sorted(bad),
            f"rank {r} saved {run.path(_final(run, r, bad[r].get('path')))} with every key of {p['where']} "
            f"starting with `{p['prefix']}` ({p['keys']} keys, e.g. `{p['key']}`): a plain model cannot "
            "load it as it is",
            "save the model inside the wrappers: ddp.module.state_dict() (and, under torch.compile, the "
            "module inside _orig_mod); to read files saved so, strip the prefix while every key carries it",
            "notebooks/01_state_dict_prefixes.ipynb §3",
        )
    ]


def load_without_map_location(run: Run) -> Verdict:
    """torch.load called by the script without map_location."""
    loads = {r: [e for e in evs if not e.get("library")] for r, evs in run.of("load").items()}
    loads = {r: evs for r, evs in loads.items() if evs}
    if not loads:
        return f"the script loaded nothing with torch.load during the run ({_stop(run)})"
    bare = {
        r: next(e for e in evs if not e["map_location"])
        for r, evs in loads.items()
        if not all(e["map_location"] for e in evs)
    }
    if not bare:
        return []
    e = bare[min(bare)]
    line = e.get("line") if e.get("file") == run.script else None
    return [
        Finding(
            "load-without-map-location",
            "warning",
            sorted(bare),
            f"torch.load({run.path(e.get('path'))}) without map_location at {run.where(line)}: tensors "
            "saved from a GPU load back onto that GPU, on every rank (all on GPU 0)",
            "torch.load(path, map_location=device, weights_only=True), device being this rank's own",
            "notebooks/01_state_dict_prefixes.ipynb §6",
        )
    ]


def logs_from_every_rank(run: Run) -> Verdict:
    """Lines every rank printed alike (numbers aside), but for lines that carry the rank printing them."""
    if run.world_size < 2:
        return "one rank: nothing to compare"
    printed: dict[int, dict[str, str]] = {}
    for r in range(run.world_size):
        printed[r] = {}
        for line in run.stdout.get(r, []):
            text = line.strip()
            if text and "rank" not in text.lower():
                printed[r].setdefault(_NUMBER.sub("#", text), text)
    common = set.intersection(*(set(p) for p in printed.values()))
    common = {t for t in common if not _names_its_rank(run, {r: p[t] for r, p in printed.items()})}
    if common:
        shown = sorted(common, key=lambda t: list(printed[0]).index(t))[:2]
        return [
            Finding(
                "logs-from-every-rank",
                "warning",
                list(range(run.world_size)),
                f"every rank printed {len(common)} line(s) alike (numbers aside), e.g. "
                + "; ".join(f"`{printed[0][t][:120]}`" for t in shown),
                "print on rank 0 only (`if rank == 0:`), or put the rank in lines that differ per rank; a "
                "progress bar: tqdm(..., disable=rank != 0)",
                "notebooks/09_errors_learners_meet.ipynb §5d",
            )
        ]
    if run.completed():
        return []
    return "the run failed before its end or its last step"


def _names_its_rank(run: Run, lines: Mapping[int, str]) -> bool:
    """Whether each rank's line has, at one place, its rank or its local rank as a number (`[GPU1]`)."""
    numbers = {r: [m[0] for m in _NUMBER.finditer(line)] for r, line in lines.items()}
    local = {r: evs[0].get("local_rank") for r, evs in run.of("start").items()}
    for i in range(min(len(n) for n in numbers.values())):
        for own in ({r: r for r in lines}, {r: local.get(r, r) for r in lines}):
            if all(numbers[r][i] == str(own[r]) for r in lines):
                return True
    return False


def no_destroy(run: Run) -> Verdict:
    """A script that ends with its default process group alive."""
    ends = run.ends()
    if not run.of("init") and not any(e.get("group_alive") for e in ends.values()):
        return "the script made no process group"
    ended = {
        r for r, e in ends.items() if e["how"] == "finished" or (e["how"] == "exit" and not e.get("code"))
    }
    alive = sorted(r for r in ended if ends[r].get("group_alive"))
    fix = (
        "end with dist.destroy_process_group(), after `del ddp_model; gc.collect()` so that the wrapper "
        "goes first (freed after its group, gloo can abort or hang at exit)"
    )
    see = "notebooks/11_more_errors.ipynb §4b"
    if alive:
        return [
            Finding(
                "no-destroy",
                "warning",
                alive,
                f"the script ended on rank(s) {_list(alive)} with its process group still alive: "
                "destroy_process_group() was never called",
                fix,
                see,
            )
        ]
    stopped = sorted(r for r, e in ends.items() if e["how"] == "stopped")
    if stopped and "destroy_process_group" not in run.source:
        return [
            Finding(
                "no-destroy",
                "warning",
                stopped,
                f"{_stop(run)}, before the script's end, and the script never names destroy_process_group",
                fix,
                see,
            )
        ]
    if stopped:
        return f"{_stop(run)}, before the script's end, where it would destroy its group"
    if run.completed():
        return []
    return "the run failed before the script's end"


# Failures whose text says which section proves them: (what the error says, the fix, the section).
KNOWN_FAILURES = (
    (
        "rank parameter missing",
        "init_process_group was given no rank (a --local_rank argument torchrun never passes, left at -1): "
        "read the rank from the environment, and let env:// do it: init_process_group(backend)",
        "notebooks/05_launching.ipynb §3",
    ),
)


def script_failed(run: Run, explained: bool) -> Verdict:
    """A failure none of the other checks explains: the launcher's message, the rank's own traceback."""
    if run.failure is None and run.stuck is None:
        return []
    if explained:
        return None
    if run.stuck is not None:
        return None  # rank-dependent-hang says what the hang was
    rank = run.failed_rank
    text = run.errors().get(rank, "") if rank is not None else run.failure
    if run.stopped_peer() and _PEER_GONE.search(text or ""):
        # A rank that still needed its peers after the check stopped them: replicas-diverge says why.
        return []
    end = run.ends().get(rank, {}) if rank is not None else {}
    if end.get("how") == "stopped":
        first = (run.failure or "").splitlines()[0]
        return f"rank {rank} failed after the check had stopped its script: {first}"
    trace = diagnose.last_traceback(run.stderr.get(rank, []), max_lines=12) if rank is not None else []
    trace = [t for t in trace if "_check_rank.py" not in t]
    first = (run.failure or "").splitlines()[0] if run.failure else "the script failed"
    evidence = first + ("\n" + "\n".join(trace) if trace else "")
    fix, see = (
        "fix the error in the traceback; run the script with ddp_helpers.torchrun(...) to see every "
        "rank's output as it runs",
        "notebooks/00_start_here.ipynb §6",
    )
    for said, known_fix, known_see in KNOWN_FAILURES:
        if said in (text or "") or said in evidence:
            fix, see = known_fix, known_see
    return [
        Finding(
            "script-failed",
            "error",
            [rank] if rank is not None else [],
            evidence,
            fix,
            see,
        )
    ]


# The checks, in the checklist's order; script-failed comes last, told whether the others explained a failure.
_CHECKS: dict[str, Callable[[Run], Verdict]] = {
    "cuda-hardcoded": cuda_hardcoded,
    "init-rank-mismatch": init_rank_mismatch,
    "model-differs-across-ranks": model_differs,
    "same-data-on-ranks": same_data,
    "epoch-order-repeats": epoch_order,
    "unused-parameters": unused_parameters,
    "replicas-diverge": replicas_diverge,
    "rank-dependent-hang": rank_dependent_hang,
    "every-rank-saves": every_rank_saves,
    "checkpoint-prefix": checkpoint_prefix,
    "load-without-map-location": load_without_map_location,
    "logs-from-every-rank": logs_from_every_rank,
    "no-destroy": no_destroy,
}
# A check whose evidence is only the echo of an earlier error: not run when that error was found.
_MASKED_BY = {
    "rank-dependent-hang": ("init-rank-mismatch", "model-differs-across-ranks"),
    "replicas-diverge": ("unused-parameters",),  # DDP's unfinished reduction left that step's gradients alone
}
_EXPLAIN_FAILURES = {
    "cuda-hardcoded",
    "init-rank-mismatch",
    "model-differs-across-ranks",
    "unused-parameters",
    "rank-dependent-hang",
}


def _has_error(verdict: Verdict) -> bool:
    return isinstance(verdict, list) and any(f.level == "error" for f in verdict)


def analyse(run: Run, world: str = "") -> CheckReport:
    """The report for one run: every check's verdict, as findings, passed checks and checks not run."""
    report = CheckReport(run.script, world or f"{run.world_size} ranks")
    verdicts: dict[str, Verdict] = {}
    for name, function in _CHECKS.items():
        causes = [n for n in _MASKED_BY.get(name, ()) if _has_error(verdicts.get(n))]
        verdicts[name] = f"{', '.join(causes)} (above) came first" if causes else function(run)
        if name == "cuda-hardcoded" and isinstance(verdicts[name], list) and verdicts[name]:
            for other in [*list(_CHECKS)[1:], "script-failed"]:
                verdicts[other] = "the script cannot run here without CUDA"
            break
    else:
        verdicts["script-failed"] = script_failed(
            run, any(_has_error(verdicts[n]) for n in _EXPLAIN_FAILURES)
        )
    for name in CHECKS:
        verdict = verdicts.get(name)
        if isinstance(verdict, list):
            report.findings += verdict
            if not verdict:
                report.passed.append(name)
        elif isinstance(verdict, str):
            report.not_run.append(f"{name}: not run: {verdict}")
    for r, evs in run.of("check_error").items():  # the check's own fault: said, never a finding
        e = evs[0]
        report.not_run.append(
            f"the check itself: its {e['where']} failed on rank {r} ({e['type']}: {e['message']}); what it "
            "would have seen after that is missing"
        )
    return report


# ---- helpers for the wording --------------------------------------------------------------------------


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def _list(ranks: Iterable[int]) -> str:
    return ", ".join(str(r) for r in sorted(ranks))


def _ranks(ranks: Sequence[int]) -> str:
    if not ranks:
        return "no rank"
    if len(ranks) > 2 and list(ranks) == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_list(ranks)}"


def _names(names: Sequence[str], most: int = 5) -> str:
    shown = ", ".join(f"`{n}`" for n in names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def _stop(run: Run) -> str:
    """How the run ended, for a reason a check did not run: ``the check stopped it after 20 steps``."""
    ends = run.ends()
    if ends and any(e["how"] == "stopped" for e in ends.values()):
        return f"the check stopped it after {run.steps} optimizer steps"
    return "it ran to its end" if run.completed() else "it failed before its end"


def _md(text: str) -> str:
    """Text for Markdown: underscores and asterisks outside `code` kept literal, newlines as line breaks."""
    parts = text.split("`")
    parts[::2] = [re.sub(r"([_*])", r"\\\1", p) for p in parts[::2]]
    return "`".join(parts).replace("\n", "  \n")


# ---- running it ------------------------------------------------------------------------------------------


def observation_file(folder: str, rank: int) -> str:
    """Where a rank writes its observations (JSON lines) in the check's folder."""
    return os.path.join(folder, f"observed-{rank}.jsonl")


def read_observations(folder: str) -> dict[int, list[dict]]:
    """Every rank's observations, by global rank; a line cut short by a killed rank is skipped."""
    events: dict[int, list[dict]] = {}
    for name in sorted(os.listdir(folder)):
        m = re.fullmatch(r"observed-(\d+)\.jsonl", name)
        if not m:
            continue
        found = []
        with open(os.path.join(folder, name), encoding="utf-8") as f:
            for line in f:
                try:
                    found.append(json.loads(line))
                except ValueError:
                    continue
        events[int(m[1])] = found
    return events


def check(
    script: str | os.PathLike,
    *args: object,
    nproc_per_node: int = 2,
    nnodes: int = 2,
    steps: int = DEFAULT_STEPS,
    timeout: float | None = DEFAULT_TIMEOUT,
    stall_timeout: float | None = None,
    backend: str | None = None,
    env: Mapping[str, object] | None = None,
    cwd: str | os.PathLike | None = None,
    live: bool | Iterable[int] = False,
    warm: bool = True,
) -> CheckReport:
    """Run ``script`` with ``args`` under real torchrun and check it against what the series proves.

    - ``nproc_per_node`` x ``nnodes``: the world (default 2 x 2: simulated nodes, so local and global ranks
      differ); ``backend``, ``env``, ``cwd``, ``live``, ``warm``, ``timeout``, ``stall_timeout``: as
      ``torchrun()``'s (``timeout`` bounds the whole run; default 300 s).
    - ``steps``: optimizer steps per rank after which every rank is stopped (the script may end sooner).

    The script really runs: give it arguments that keep its files out of the way (a scratch output folder).
    Returns a ``CheckReport`` (``.ok``, ``.findings``, ``.passed``, ``.not_run``); shown as a checklist.
    Raises ``FileNotFoundError`` for a missing script and ``ValueError`` for bad arguments, before any
    process starts.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    folder_cwd = os.path.abspath(os.fspath(cwd) if cwd is not None else os.getcwd())
    path = os.path.abspath(os.path.join(folder_cwd, os.fspath(script)))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no script {os.fspath(script)!r} in {folder_cwd}")
    with open(path, encoding="utf-8", errors="replace") as f:
        source = f.read()
    folder = tempfile.mkdtemp(prefix="ddp_check_")
    try:
        run = Run(path, source, nproc_per_node * nnodes, steps, {}, cwd=folder_cwd)
        extra = {**(env or {}), DIR_VARIABLE: folder, STEPS_VARIABLE: steps}
        try:
            with warnings.catch_warnings():  # the check chose the world: no advice about it per call
                warnings.filterwarnings("ignore", message=r"\d+ ranks on \d+ CPU core")
                result = torchrun(
                    RANK_SCRIPT,
                    path,
                    *args,
                    nproc_per_node=nproc_per_node,
                    nnodes=nnodes,
                    timeout=timeout,
                    stall_timeout=stall_timeout,
                    env=extra,
                    cwd=folder_cwd,
                    live=live,
                    backend=backend,
                    warm=warm,
                )
        except JobHungError as e:
            result, run.stuck, run.stacks, run.hang = e.result, e.stuck_ranks, e.stacks, str(e.hang)
        except JobFailedError as e:
            result, run.failed_rank, run.failure = e.result, e.rank, str(e)
        run.events = read_observations(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    run.stdout, run.stderr = result.stdout, result.stderr
    nodes = f"{nnodes} nodes x {nproc_per_node}" if nnodes > 1 else "1 node"
    report = analyse(run, f"{run.world_size} ranks ({nodes}), up to {steps} steps")
    report.result = result
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ddp_helpers check``: exit status 0 with no error found, 1 with an error, 2 on bad usage."""
    parser = argparse.ArgumentParser(
        prog="python -m ddp_helpers check",
        description="Run SCRIPT under torchrun on simulated nodes for a few optimizer steps and check it "
        "against what the ddp-notebooks series proves: sharding, set_epoch, equal replicas, checkpoints, "
        "hangs. Options go before SCRIPT; what follows it is the script's.",
    )
    parser.add_argument(
        "--nproc-per-node", "--nproc_per_node", type=int, default=2, help="ranks per node (2)"
    )
    parser.add_argument("--nnodes", type=int, default=2, help="simulated nodes (2)")
    parser.add_argument(
        "--steps", type=int, default=DEFAULT_STEPS, help=f"optimizer steps per rank ({DEFAULT_STEPS})"
    )
    parser.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT, help=f"wall-clock limit, s ({DEFAULT_TIMEOUT:g})"
    )
    parser.add_argument(
        "--stall-timeout", type=float, default=None, help="a hang once every rank printed, then none, s"
    )
    parser.add_argument(
        "--backend", choices=["gloo", "nccl"], default=None, help="default: the script's choice"
    )
    parser.add_argument("--json", action="store_true", help='print {"ok", "findings"} as JSON')
    parser.add_argument("script", help="the training script")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    try:
        ns = parser.parse_args(argv)
    except SystemExit as e:  # argparse has printed the usage and what was wrong
        return e.code if isinstance(e.code, int) else 2
    if not os.path.isfile(ns.script):
        print(f"ddp_helpers check: no such script: {ns.script}", file=sys.stderr)
        return 2
    if min(ns.nnodes, ns.nproc_per_node, ns.steps) >= 1:  # else check() refuses, and says why
        world = f"{ns.nproc_per_node * ns.nnodes} ranks ({ns.nnodes} node(s) x {ns.nproc_per_node})"
        print(f"ddp_helpers check: running {ns.script} on {world}, up to {ns.steps} steps", file=sys.stderr)
    try:
        report = check(
            ns.script,
            *ns.args,
            nproc_per_node=ns.nproc_per_node,
            nnodes=ns.nnodes,
            steps=ns.steps,
            timeout=ns.timeout,
            stall_timeout=ns.stall_timeout,
            backend=ns.backend,
            warm=False,  # one launch: nothing to reuse
        )
    except (TypeError, ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"ddp_helpers check: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report.as_json(), indent=1, ensure_ascii=False) if ns.json else report)
    return 0 if report.ok else 1
