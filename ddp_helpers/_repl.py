"""The rank REPL: the script each rank of a rank group runs (``ranks.RankGroup``, the ``%ranks`` magics).

It joins the process group as the series' scripts do (``environment.choose_backend``: NCCL and a GPU per rank
where there are GPUs, else gloo and the CPU), connects back to the kernel (``_protocol``: the cells socket)
and runs each cell it is sent in one namespace that lasts as long as the group, holding ``rank``,
``local_rank``, ``world_size``, ``device``, ``torch`` and ``dist`` from the start. A cell runs as IPython runs
one: every statement, and the value of the last one when it is an expression.

The parts the kernel uses too (``split_cell``, ``unpack_value``) and the parts tested without a process
(``pack_value``, ``cell_traceback``) import nothing of torch; only ``main`` does.
"""

from __future__ import annotations

import ast
import base64
import ctypes
import gc
import io
import linecache
import os
import pickle
import signal
import socket
import sys
import time
import tokenize
import traceback
import types
from dataclasses import dataclass

from ddp_helpers import _protocol as protocol

VALUE_LIMIT = 1 << 20  # the most bytes a cell's value may pickle to, unless the cell says otherwise
MAX_VALUE_LIMIT = 8 << 20  # the most a cell may ask for: in base64 it still fits one message
MAX_ERROR = 100_000  # characters of a traceback sent back; a longer one is cut in its middle
CELL_PREFIX = "<ranks cell "  # every cell is compiled as "<ranks cell N>" (``cell_filename``)


@dataclass(frozen=True)
class Cell:
    """A cell compiled as IPython runs one: its statements, then its last one when that is an expression."""

    body: types.CodeType
    last: types.CodeType | None  # evaluated for the cell's value; None: no value (a statement, or `x;`)


def cell_filename(number: int) -> str:
    """The name cell ``number`` of a rank group is compiled under, as its tracebacks show it."""
    return f"{CELL_PREFIX}{number}>"


def split_cell(code: str, filename: str) -> Cell:
    """Compile ``code`` under ``filename`` (a SyntaxError as Python reports it), its last expression apart,
    unless it ends with a semicolon, which (as in IPython) keeps its value to itself."""
    tree = ast.parse(code, filename, "exec")
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr) and not _ends_with_semicolon(code):
        last = compile(ast.Expression(tree.body.pop().value), filename, "eval")
    return Cell(compile(tree, filename, "exec"), last)


def _ends_with_semicolon(code: str) -> bool:
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(code).readline))
    except (tokenize.TokenError, SyntaxError):
        return False
    skip = (tokenize.ENDMARKER, tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT, tokenize.DEDENT)
    last = next((t for t in reversed(tokens) if t.type not in skip), None)
    return last is not None and last.type == tokenize.OP and last.string == ";"


def remember_source(filename: str, code: str) -> None:
    """Let tracebacks show the lines of the cell compiled as ``filename``, as they do for a file."""
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)


class ValueTooLarge(ValueError):
    """A cell's value pickles to more bytes than its limit."""


class _Bounded(io.BytesIO):
    """Pickle's output, which stops the pickling once it passes ``limit`` bytes instead of growing on."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit

    def write(self, data: bytes) -> int:
        if self.tell() + len(data) > self.limit:
            raise ValueTooLarge(self.limit)
        return super().write(data)


class _CpuPickler(pickle.Pickler):
    """Pickles every tensor as a copy on the CPU, so the kernel never needs CUDA to load it."""

    def reducer_override(self, obj: object) -> object:
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor) and obj.device.type != "cpu":
            return obj.cpu().__reduce_ex__(pickle.HIGHEST_PROTOCOL)
        return NotImplemented


def pack_value(value: object, limit: int = VALUE_LIMIT) -> bytes:
    """``value`` pickled, tensors moved to the CPU; ValueError (``ValueTooLarge`` past ``limit`` bytes) if
    it cannot come back, saying what to do instead."""
    out = _Bounded(limit)
    kind = type(value).__qualname__
    try:
        _CpuPickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    except ValueTooLarge:
        raise ValueTooLarge(
            f"its value, a {kind}, pickles to more than {limit:,} bytes, the limit: return something smaller "
            f"(a slice, .shape, .sum().item()), print it, save it with torch.save to a file and load that in "
            f"the kernel, or raise the limit with %%ranks --max-bytes N (at most {MAX_VALUE_LIMIT:,})"
        ) from None
    except Exception as e:  # pickle's own errors, and whatever an object's __reduce__ raises
        raise ValueError(
            f"its value, a {kind}, cannot be pickled ({type(e).__name__}: {e}): return plain data instead "
            f"(numbers, strings, lists, dicts, tensors), or print it"
        ) from None
    return out.getvalue()


def unpack_value(data: bytes) -> object:
    """A value ``pack_value`` made (in the kernel: tensors arrive on the CPU)."""
    return pickle.loads(data)


def cell_traceback(error: BaseException) -> str:
    """``error``'s traceback as Python prints it, from the cell's first frame on (the REPL's frames go)."""
    tb = error.__traceback__
    while tb is not None and not tb.tb_frame.f_code.co_filename.startswith(CELL_PREFIX):
        tb = tb.tb_next
    text = "".join(traceback.format_exception(type(error), error, tb))
    if len(text) > MAX_ERROR:
        half = MAX_ERROR // 2
        text = f"{text[:half]}\n... ({len(text) - MAX_ERROR:,} characters cut) ...\n{text[-half:]}"
    return text


class _Interrupts:
    """SIGINT's handler: one KeyboardInterrupt in a running cell (the kernel sends one per interrupt); ignored
    between cells, where one may come late."""

    def __init__(self):
        self.running = False

    def __call__(self, signum: int, frame: object) -> None:
        if self.running:
            self.running = False  # disarmed: nothing can raise it again before the cell has replied
            raise KeyboardInterrupt


def run_cell(message: dict, namespace: dict, interrupts: _Interrupts) -> dict:
    """Run one cell message in ``namespace`` and build its reply (``_protocol``): its value, its error, or
    where the interrupt stopped it."""
    code, filename = message["code"], message["filename"]
    reply: dict = {"cell": message["cell"]}
    remember_source(filename, code)
    try:
        interrupts.running = True
        try:
            cell = split_cell(code, filename)
            exec(cell.body, namespace)
            value = None if cell.last is None else eval(cell.last, namespace)
        finally:
            interrupts.running = False
    except KeyboardInterrupt as e:
        reply.update(interrupted=True, error=cell_traceback(e), summary="was interrupted")
    except (Exception, SystemExit) as e:  # a rank of a live group stays: SystemExit is reported like the rest
        summary = traceback.format_exception_only(type(e), e)[-1].strip()
        reply.update(error=cell_traceback(e), summary=f"raised {summary}")
    else:
        try:
            data = pack_value(value, message.get("max_bytes", VALUE_LIMIT))
        except ValueError as e:
            reply.update(error=f"{e}\n", summary=str(e).partition(":")[0])
        else:
            reply.update(value=base64.b64encode(data).decode(), type=type(value).__qualname__)
    _flush_output()
    return reply


def _flush_output() -> None:
    """Flush Python's and C's output: every line of the cell is in the rank's files before it replies."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):  # no C library to ask (not Linux or macOS)
        pass


def serve(conn: socket.socket, namespace: dict) -> None:
    """Answer cells until the kernel closes the connection."""
    interrupts = _Interrupts()
    signal.signal(signal.SIGINT, interrupts)
    reader = protocol.MessageReader()
    while True:
        try:
            message = reader.next(conn)
        except (EOFError, OSError):
            return  # %ranks stop, or the kernel is gone (then the lifeline ends this process anyway)
        reply = run_cell(message, namespace, interrupts)
        try:
            conn.sendall(protocol.pack_message(reply))
        except OSError:
            return


def _connect(address: str) -> socket.socket:
    """Connect to the kernel's cells socket, waiting until it listens (it binds once the agents started)."""
    while True:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(address)
            return conn
        except (FileNotFoundError, ConnectionRefusedError):
            conn.close()
            time.sleep(0.01)


def _namespace(**names: object) -> dict:
    """The cells' namespace: a fresh ``__main__`` module, so what a cell defines pickles as in a script."""
    main = types.ModuleType("__main__")
    main.__dict__.update(names)
    sys.modules["__main__"] = main
    return main.__dict__


def main() -> None:
    import torch
    import torch.distributed as dist

    from ddp_helpers import environment

    backend, kind = environment.choose_backend()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank) if kind == "cuda" else torch.device("cpu")
    if kind == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    sys.path[0] = os.getcwd()  # a cell imports from the notebook's folder, not from ddp_helpers/
    namespace = _namespace(
        rank=rank, local_rank=local_rank, world_size=world_size, device=device, torch=torch, dist=dist
    )
    conn = _connect(protocol.cells_socket(os.environ[protocol.RUN_DIR]))
    ready = {"ready": rank, "pid": os.getpid(), "backend": backend, "device": str(device)}
    conn.sendall(protocol.pack_message(ready))
    try:
        serve(conn, namespace)
    finally:
        conn.close()
        namespace.clear()  # what the cells made (a DDP wrapper) goes while its process group still exists
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
