"""The IPython magics ``%ranks`` and ``%%ranks`` (``%load_ext ddp_helpers``): one rank group per kernel.

``%ranks start -n 2`` starts a ``RankGroup``, ``%%ranks`` runs a cell on its ranks and returns
``{rank: value}``, ``%ranks stop`` ends it. What the ranks do, and every guarantee, belongs to ``ranks``;
this module only parses the magics' arguments and holds the group.
"""

from __future__ import annotations

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.core.magic_arguments import MagicArgumentParser

from ddp_helpers import _repl, launcher
from ddp_helpers.ranks import GROUP_DEFAULT, RankGroup

USAGE = (
    "%ranks start -n 2 starts 2 ranks, %%ranks runs a cell on each of them, %ranks stop ends them "
    "(%ranks? says more)"
)


def _seconds(text: str) -> float | None:
    """A number of seconds, or "none" for no limit."""
    return None if text.lower() == "none" else float(text)


def _rank_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UsageError(
            f"--ranks takes ranks separated by commas, such as --ranks 0,2, not {text!r}"
        ) from None


def _environment(text: str) -> tuple[str, str]:
    name, equals, value = text.partition("=")
    if not equals or not name:
        raise UsageError(f"--env takes NAME=VALUE, such as --env NCCL_DEBUG=INFO, not {text!r}")
    return name, value


# IPython writes a parser's usage with a "%" before its prog: "ranks start" reads "%ranks start".
START = MagicArgumentParser(prog="ranks start", description="Start a group of ranks under torchrun.")
START.add_argument("-n", "--nproc-per-node", type=int, default=2, help="ranks per node (default 2)")
START.add_argument("--nnodes", type=int, default=1, help="simulated nodes (default 1)")
START.add_argument("--backend", choices=("gloo", "nccl"), help="default: as the series' scripts choose")
START.add_argument(
    "--timeout",
    type=_seconds,
    default=launcher.LAUNCH_TIMEOUT,
    help=f"seconds the start, and each cell by default, may take (default {launcher.LAUNCH_TIMEOUT:g})",
)
START.add_argument("--stall-timeout", type=_seconds, help="each cell's default stall limit (default none)")
START.add_argument("--env", type=_environment, action="append", default=[], help="NAME=VALUE for the ranks")
START.add_argument("--cold", action="store_true", help="a fresh torchrun process instead of the warm one")

CELL = MagicArgumentParser(prog="%ranks", description="Run the cell on every rank (or on --ranks).")
CELL.add_argument("--ranks", type=_rank_list, help="the ranks to run it on, such as 0,2 (default: all)")
CELL.add_argument(
    "--timeout", type=_seconds, default=GROUP_DEFAULT, help="seconds the cell may take (default: the group's)"
)
CELL.add_argument(
    "--stall-timeout",
    type=_seconds,
    default=GROUP_DEFAULT,
    help="end the cell once no rank printed a line or finished it for this long (default: the group's)",
)
CELL.add_argument(
    "--max-bytes",
    type=int,
    default=_repl.VALUE_LIMIT,
    help=f"the most bytes a rank's value may pickle to (default {_repl.VALUE_LIMIT:,})",
)


def _usage(parser: MagicArgumentParser) -> str:
    """A parser's usage, as IPython prints it for a wrong argument: every option, written once, there."""
    return parser.format_usage().removeprefix("::\n\n").rstrip()


HELP = f"""Run code on every rank of a live process group.

{_usage(START)}
    Start N ranks under real torchrun, each in an initialised process group (gloo on the CPU, or NCCL
    with a GPU per rank, as the series' scripts choose), with ``rank``, ``local_rank``,
    ``world_size``, ``device``, ``torch`` and ``dist`` defined. A running group is stopped first.
{_usage(CELL)}
    Run the cell on every rank (or those listed), each in its own namespace that lasts between
    cells; their lines are shown live as [rank N]; returns {{rank: value of the last expression}}.
    An exception on some ranks raises CellError (the group runs on); a hang, or an interrupt that a
    rank blocked in a collective cannot answer, raises JobHungError after naming the stuck rank and
    ending the group; a rank that dies raises JobFailedError.
  %ranks stop
    End the ranks. A kernel restart, or the kernel's death, ends them too.
"""


@magics_class
class RankMagics(Magics):
    """``%ranks start|stop`` and ``%%ranks``; holds this kernel's one ``RankGroup``."""

    group: RankGroup | None = None

    @line_cell_magic
    def ranks(self, line: str, cell: str | None = None) -> dict[int, object] | None:
        __tracebackhide__ = True
        if cell is not None:
            return self._cell(line, cell)
        command, _, rest = line.strip().partition(" ")
        if command == "start":
            self._start(rest.strip())
        elif command == "stop":
            self._stop()
        else:
            raise UsageError(f"%ranks {line.strip()!r}: {USAGE}")
        return None

    ranks.__doc__ = HELP

    def _start(self, line: str) -> None:
        __tracebackhide__ = True
        args = START.parse_argstring(line)
        if self.group is not None and not self.group.closed:
            print(f"ddp_helpers: stopping the running group of {self.group.world_size} rank(s) first")
            self._stop(quiet=True)
        options = launcher.LaunchOptions(
            nproc_per_node=args.nproc_per_node,
            nnodes=args.nnodes,
            timeout=args.timeout,
            stall_timeout=args.stall_timeout,
            env=dict(args.env),
            backend=args.backend,
            warm=not args.cold,
        )
        self.group = RankGroup.from_options(options, restart=f"%ranks start {line}".strip())
        devices = ", ".join(sorted(set(self.group.devices.values())))
        print(
            f"ddp_helpers: {self.group.world_size} rank(s) ready ({self.group.backend}, {devices}); "
            "%%ranks runs a cell on each"
        )

    def _stop(self, quiet: bool = False) -> None:
        group, self.group = self.group, None
        if group is None or group.closed:
            if not quiet:
                print("ddp_helpers: no ranks are running")
            return
        group.stop()
        if not quiet:
            print(f"ddp_helpers: stopped {group.world_size} rank(s)")

    def _cell(self, line: str, cell: str) -> dict[int, object] | None:
        __tracebackhide__ = True
        args = CELL.parse_argstring(line)
        if self.group is None or self.group.closed:
            self.group = None
            raise UsageError("no ranks are running: start them with %ranks start -n 2 first")
        group = self.group
        try:
            values = group.run(
                cell,
                args.ranks,
                timeout=args.timeout,
                stall_timeout=args.stall_timeout,
                max_bytes=args.max_bytes,
            )
        finally:
            if group.closed:  # it hung or a rank died: the error says how to start again
                self.group = None
        return values if group.cell_has_value else None


def load(ipython) -> None:
    """Register the magics with ``ipython``, once per kernel."""
    ipython.register_magics(RankMagics)


def unload(ipython) -> None:
    """Stop this kernel's group, if any."""
    magics = ipython.magics_manager.registry.get("RankMagics")
    if magics is not None:
        magics._stop(quiet=True)
