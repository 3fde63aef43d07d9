"""The warm process: its socket's messages, both ends, without starting one (split and joined reads, a client
that leaves mid-request, a bad request: each of these failed on the code before the one message module), and
its guard on the torch internals warm launches need (a missing one is simulated), and its start's limit (a
warm process that never says ready is simulated)."""

from __future__ import annotations

import functools
import os
import socket
import sys
import tempfile
import threading

import pytest

from ddp_helpers import _internals, _warm, launcher
from ddp_helpers import _protocol as protocol


def test_a_reader_takes_messages_however_the_stream_splits_them():
    stream = protocol.pack_message({"pid": 7}) + protocol.pack_message({"exit": 0})
    for cut in range(len(stream) + 1):
        reader = protocol.MessageReader(stream[:cut])
        reader.feed(stream[cut:])
        assert reader.messages == [{"pid": 7}, {"exit": 0}], cut


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_an_exit_that_arrives_with_the_pid_is_not_lost(tmp_path):
    """An agent that ends at once: the warm process may send its pid and its exit in one read."""
    address = str(tmp_path / "warm.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(1)

    def serve_one():
        conn, _ = listener.accept()
        _, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
        for fd in fds:
            os.close(fd)
        conn.sendall(protocol.pack_message({"pid": 12345}) + protocol.pack_message({"exit": 3}))
        conn.close()

    server = threading.Thread(target=serve_one, daemon=True)
    server.start()
    process = _warm.WarmProcess.__new__(_warm.WarmProcess)  # its address only: no warm process is started
    process.address = address
    r, w = os.pipe()
    try:
        agent = process.start_agent(["--nproc-per-node=1", "x.py"], {}, str(tmp_path), (r, w, w))
    finally:
        os.close(r)
        os.close(w)
        server.join()
        listener.close()
    assert agent.pid == 12345
    assert agent.poll() == 3, "the exit message came in the same read as the pid"


@pytest.mark.parametrize(
    "request_bytes",
    [
        protocol.pack_message({"argv": [], "env": {}, "cwd": "/"})[:-5],  # the client leaves mid-message
        b"\x00\x00\x00\x05{not",  # a whole message that is not JSON
        b"\x00",  # not even a whole length
        protocol.pack_message([1, 2]),  # JSON, but not a request
        protocol.pack_message({"count_gpus": True}),  # a question that takes no descriptors, sent with three
    ],
)
def test_a_bad_request_is_answered_and_leaks_nothing(request_bytes):
    pytest.importorskip("torch")  # the warm process's side imports torch
    server_end, client_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    r, w = os.pipe()
    before = _open_fds()
    socket.send_fds(client_end, [request_bytes], [r, w, w])
    client_end.shutdown(socket.SHUT_WR)  # and then nothing more
    agents: dict = {}
    handler = threading.Thread(target=_warm._handle, args=(server_end, server_end, agents), daemon=True)
    handler.start()
    handler.join(timeout=120)  # a guard against the old endless loop, not a measure of speed
    assert not handler.is_alive(), "the warm process kept spinning on a client that had left"
    assert agents == {}, "no agent may be forked for a bad request"
    reply = protocol.MessageReader()
    while True:
        try:
            reply.receive(client_end)
        except EOFError:
            break
    assert len(reply.messages) == 1 and reply.messages[0]["error"].startswith("bad request"), reply.messages
    client_end.close()
    os.close(r)
    os.close(w)
    assert _open_fds() <= before, "the descriptors that came with the request were left open"


def test_the_guard_names_a_missing_internal(monkeypatch):
    pytest.importorskip("torch")
    from torch.distributed.elastic.multiprocessing import api

    assert _internals.missing() == [], "this torch has every internal warm launches use"
    monkeypatch.delattr(api, "_wrap")  # as if a torch release had renamed it
    assert _internals.missing() == ["torch.distributed.elastic.multiprocessing.api._wrap"]


def test_a_warm_process_on_such_a_torch_says_so_instead_of_ready(monkeypatch, capsys, tmp_path):
    pytest.importorskip("torch")
    from torch.distributed.elastic.multiprocessing import api

    monkeypatch.delattr(api, "_wrap")
    server = threading.Thread(target=_warm.serve, args=(str(tmp_path / "warm.sock"),), daemon=True)
    server.start()
    server.join(timeout=120)  # a guard against a warm process that went on to serve, not a measure of speed
    assert not server.is_alive(), "the warm process started serving on a torch that lacks an internal"
    assert (
        capsys.readouterr().out
        == "unsupported: this torch lacks torch.distributed.elastic.multiprocessing.api._wrap\n"
    )
    assert not (tmp_path / "warm.sock").exists(), "it never listened"


def test_a_torch_without_an_internal_launches_cold_with_one_note(monkeypatch, capsys):
    """What the warm process says (the test above) ends warm launches in this kernel: each launch runs cold,
    one note says why, and no second warm process is tried."""
    said = "unsupported: this torch lacks torch.distributed.elastic.multiprocessing.api._wrap"
    monkeypatch.setattr(_warm, "COMMAND", [sys.executable, "-c", f"print({said!r})"])  # stands in for serve()
    monkeypatch.setattr(_warm, "_process", None)  # this kernel's real warm process is left alone
    monkeypatch.setattr(_warm, "_unsupported", None)
    monkeypatch.setattr(launcher, "_NOTED", set())
    env = dict(os.environ)
    with pytest.raises(
        _warm.WarmUnsupported,
        match=r"this torch lacks torch\.distributed\.elastic\.multiprocessing"
        r"\.api\._wrap",
    ):
        _warm.warm_process(env)
    monkeypatch.setattr(_warm, "WarmProcess", None)  # from now on, starting one would fail loudly
    assert launcher._warm_process(env) is None and launcher._warm_process(env) is None  # two launches: cold
    lacks = "this torch lacks torch.distributed.elastic.multiprocessing.api._wrap"
    note = f"ddp_helpers: warm launches are off ({lacks}): every launch starts a fresh torchrun\n"
    assert capsys.readouterr().out == note


def _processes_running(marker: str) -> list[str]:
    """The pid of each live process whose command line holds ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(entry)
        except OSError:
            continue
    return found


def test_a_warm_process_that_never_says_ready_is_killed_and_launches_run_cold(monkeypatch, capsys, tmp_path):
    """A torch import that hangs must not hang the cell: past its limit, the warm process is killed, and this
    launch and the next run cold, with one note and no second warm process."""
    marker = f"never-ready-{os.getpid()}"
    # stands in for serve() stuck in its import of torch: it says nothing and ignores its stdin's end
    never_ready = f"import signal; signal.pause()  # {marker}"
    monkeypatch.setattr(_warm, "COMMAND", [sys.executable, "-c", never_ready])
    monkeypatch.setattr(_warm, "WarmProcess", functools.partial(_warm.WarmProcess, ready_limit=0.5))
    monkeypatch.setattr(_warm, "_process", None)  # this kernel's real warm process is left alone
    monkeypatch.setattr(_warm, "_unsupported", None)
    monkeypatch.setattr(launcher, "_NOTED", set())
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the warm process's folder goes
    env = dict(os.environ)
    assert launcher._warm_process(env) is None
    assert _processes_running(marker) == [], "the warm process that never said ready is still there"
    assert os.listdir(tmp_path) == [], "its folder is left behind"
    monkeypatch.setattr(_warm, "WarmProcess", None)  # from now on, starting one would fail loudly
    assert launcher._warm_process(env) is None  # the next launch: cold at once
    note = (
        "ddp_helpers: warm launches are off (the warm process did not finish importing torch within 0.5 s):"
        " every launch starts a fresh torchrun\n"
    )
    assert capsys.readouterr().out == note
