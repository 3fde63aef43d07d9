"""What older torch releases do differently, reproduced on the pinned one, where a script or the launcher
has to cope with it. tools/torch_matrix.py runs the real releases; these tests keep each fix in place."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
from ddp_test_support import REPO

from ddp_helpers import torchrun

pytestmark = pytest.mark.usefixtures("kernel_unchanged")

# torch before 2.14: an agent's store serves every tcp:// address as far as init_process_group is concerned.
BEFORE_2_14 = """
import runpy, sys
import torch.distributed.rendezvous
rendezvous = sys.modules["torch.distributed.rendezvous"]  # the attribute of that name is a function
rendezvous._agent_store_serves = lambda hostname, port: rendezvous._torchelastic_use_agent_store()
sys.argv[0] = {script!r}
runpy.run_path({script!r}, run_name="__main__")
"""


def test_a_tcp_url_forms_the_group_under_torchrun_also_where_torch_would_hang(tmp_path):
    """Notebook 05 hung in cell 14 on torch 2.6 and 2.10: under torchrun (TORCHELASTIC_USE_AGENT_STORE=True)
    init_process_group before torch 2.14 made every rank a client of the tcp:// address given, where nobody
    served a store, and each waited there for 30 minutes. With 2.14's check undone as in those releases,
    05_launch.py must still form its group on a tcp:// URL (its own_store does what 2.14 does)."""
    script = REPO / "notebooks" / "scripts" / "05_launch.py"
    wrapper = tmp_path / "05_launch_before_2_14.py"
    wrapper.write_text(BEFORE_2_14.format(script=str(script)))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = torchrun(
        str(wrapper),
        "--init-method",
        f"tcp://127.0.0.1:{port}",
        nproc_per_node=2,
        backend="gloo",
        live=False,
        timeout=120,
    )
    records = result.records()
    assert sorted(r["rank"] for r in records) == [0, 1] and {r["sum"] for r in records} == {3.0}, records
    assert {r["env"]["TORCHELASTIC_USE_AGENT_STORE"] for r in records} == {"True"}, records  # under the agent


DESTROY_WHILE_IN_FLIGHT = """
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() == 0:
        tensor = torch.ones(1)
        work = dist.all_reduce(tensor, async_op=True)  # in flight until rank 1 joins it
        del tensor, work  # only the work holds the tensor now: the worker thread that ends the work frees it
        store.set("rank 0 destroys", "now")
    else:
        store.wait(["rank 0 destroys"])
        dist.all_reduce(torch.ones(1))
    dist.destroy_process_group()
    print('{"rank": %d, "destroyed": true}' % int(__import__("os").environ["RANK"]), flush=True)
"""


def test_destroy_process_group_returns_while_a_worker_thread_frees_a_tensor(script):
    """Why the floor is torch 2.8. Before 2.8, ProcessGroupGloo's destructor (in destroy_process_group) held
    the GIL while it joined its worker threads, and a worker thread that freed the last reference to a tensor
    needed the GIL: each waited for the other. Scripts met it at their last line, at random:
    03_sync_batchnorm.py and 07_gallery.py hung there on torch 2.4 (gdb: the main thread in ~ProcessGroupGloo
    joining a gloo worker, which waited for the GIL in ~AsyncWork). This job frees a tensor in a worker thread
    while rank 0 destroys its group: it hung on 2.4 and 2.7 and ends on 2.8, where pytorch#154976 releases the
    GIL there."""
    result = torchrun(script(DESTROY_WHILE_IN_FLIGHT), nproc_per_node=2, live=False, timeout=120)
    assert sorted(r["rank"] for r in result.records() if r["destroyed"]) == [0, 1], result.records()


# Run in a fresh interpreter: a fork handler that the CUDA runtime registers cannot be removed again.
_FORK_AFTER_CONFIG = """
import os, types
import torch
from ddp_helpers import _internals

def config_from_args(args):  # what torchrun's config asks: torch.cuda (2.9-2.13), torch.accelerator (2.14)
    torch.cuda.is_available(), torch.cuda.device_count()
    if hasattr(torch, "accelerator"):
        torch.accelerator.is_available(), torch.accelerator.device_count()
    return "config"

real = torch.cuda.is_available
torchrun_module = types.SimpleNamespace(config_from_args=config_from_args, elastic_launch=None)
_internals.patch_agent(torchrun_module)
assert torchrun_module.config_from_args(None) == "config"
assert torch.cuda.is_available is real, "the real function is back once the config is built"
pid = os.fork()
if pid == 0:  # the agent's fork of a rank: may it still use CUDA (or find that there is none)?
    os._exit(3 if torch.cuda._is_in_bad_fork() else 0)
print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""


def test_building_torchruns_config_leaves_the_ranks_forks_able_to_use_cuda():
    """Notebook 04 failed on torch 2.10 in warm launches with "Cannot re-initialize CUDA in forked
    subprocess", on this machine without a GPU: torch 2.10's LaunchConfig asks torch.cuda.is_available(),
    which registers the CUDA runtime's fork handler in the agent, so every rank it forked was a bad fork."""
    torch = pytest.importorskip("torch")
    if torch.version.cuda is None:
        pytest.skip("a CPU-only build of torch has no CUDA fork handler")
    done = subprocess.run(
        [sys.executable, "-c", _FORK_AFTER_CONFIG], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0"], (
        f"the forked rank is a bad fork for CUDA: {done.stdout} {done.stderr}"
    )
