"""Notebook 08's template restores a checkpoint onto a model that is not on the CPU (issue 19).

What these tests prove, without a GPU: ``restore()`` loads the checkpoint onto the CPU, so that every RNG
setter gets the CPU ByteTensor it requires (``torch.set_rng_state`` and ``Generator.set_state`` raise "RNG
state must be a torch.ByteTensor" for any other tensor: ``check_rng_state`` in ``ATen/core/Generator.h``),
while the optimizer's state follows the parameters to their device, and ``main()`` resumes through
``restore()``. The ``meta`` device stands in for a GPU: a device that the saved tensors can be sent to and
that is not the CPU. ``torch.cuda.set_rng_state`` is replaced by a recorder, so the test sees what it would be
given (a CPU ByteTensor) without any CUDA code: none of this has run on a GPU.

Shown to fail, with ``DDP_TEMPLATE``: against a copy of the script whose ``restore()`` loads with the device
as ``map_location``, the meta-device test fails (``torch.set_rng_state`` raises "RNG state must be a
torch.ByteTensor" on the meta tensor); against the script before the fix (commit 8f52f1c, whose ``main()``
loaded with ``map_location=device`` itself) every test fails, because ``restore`` did not exist (nor
``checkpoint``, which the three tests that build a file reach first). ``test_main_resumes_through_restore``
fails if ``main()`` stops calling ``restore()``, or loads a file itself (shown with a copy whose ``main()``
does): the other tests call ``restore()`` directly, and could not see it.

The tests import the script's own ``checkpoint``, ``restore`` and ``rng_states``, and read ``main``'s source.
``DDP_TEMPLATE=PATH`` runs them against another copy of the script (an older commit's, say).
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import random
import warnings
from pathlib import Path

import pytest
import torch
from ddp_test_support import REPO

SCRIPT = Path(os.environ.get("DDP_TEMPLATE", REPO / "notebooks" / "scripts" / "08_train.py"))


@pytest.fixture(scope="module")
def template():
    spec = importlib.util.spec_from_file_location("template08", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines functions only: main() runs under __main__
    return module


@pytest.fixture
def rng_kept():
    """Leave this process's torch and Python RNGs as the test found them."""
    torch_state, python_state = torch.get_rng_state(), random.getstate()
    yield
    torch.set_rng_state(torch_state)
    random.setstate(python_state)


def training_objects(template, device: torch.device, fp16: bool = True):
    """The template's model, optimizer, schedule and scaler, as main() builds them (SGD with momentum)."""
    torch.manual_seed(0)
    model = template.build_model(4).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=3)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=9)
    scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, cosine], milestones=[3])
    scaler = torch.amp.GradScaler(device.type, enabled=fp16)
    return model, optimizer, scheduler, scaler


def saved_run(template, path: Path, world_size: int = 1, cuda: bool = False) -> tuple[dict, dict]:
    """Train two float16 steps on the CPU and save a checkpoint as main() does (``cuda``: with a CUDA stream's
    state in it, the CPU ByteTensor ``torch.cuda.get_rng_state`` returns); return it and rank 0's states."""
    model, optimizer, scheduler, scaler = training_objects(template, torch.device("cpu"))
    loader_generator = torch.Generator().manual_seed(5)
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(torch.randn(8, 3, 16, 16)), torch.arange(8) % 4)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
    torch.rand(3, generator=loader_generator)
    states = template.rng_states(loader_generator, torch.device("cpu"))
    if cuda:
        states["cuda"] = (
            torch.cuda.get_rng_state() if torch.cuda.is_available() else torch.get_rng_state()[:16].clone()
        )
    rng = [states] + [
        template.rng_states(torch.Generator().manual_seed(r), torch.device("cpu"))
        for r in range(1, world_size)
    ]
    template.save_atomically(
        template.checkpoint(model, optimizer, scheduler, scaler, 1, rng, [{"epoch": 0}], {"seed": 0}),
        str(path),
    )
    return torch.load(path, map_location="cpu", weights_only=True), states


def test_resume_onto_another_device_restores_every_rng_stream(template, tmp_path, monkeypatch, rng_kept):
    saved, states = saved_run(template, tmp_path / "last.pt", cuda=True)
    torch.rand(100), random.random()  # move this process's streams on, so that restoring them shows
    device = torch.device("meta")  # stands in for cuda:LOCAL_RANK: any device that is not the CPU
    model, optimizer, scheduler, scaler = training_objects(template, device)
    loader_generator = torch.Generator()
    cuda_states = []  # torch.cuda.set_rng_state, which needs a GPU: record what it would be given
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, dev: cuda_states.append((state, dev)))
    with warnings.catch_warnings():
        # meta holds no data
        warnings.filterwarnings("ignore", message=".*copying from a non-meta parameter.*")
        start_epoch, history = template.restore(
            str(tmp_path / "last.pt"),
            model,
            optimizer,
            scheduler,
            scaler,
            loader_generator,
            rank=0,
            world_size=1,
            device=device,
        )
    assert (start_epoch, history) == (2, [{"epoch": 0}]), (start_epoch, history)
    assert torch.equal(torch.get_rng_state(), states["torch"]), "the torch CPU stream was not restored"
    assert random.getstate() == states["python"], "Python's stream was not restored"
    assert torch.equal(loader_generator.get_state(), states["loader"]), (
        "the DataLoader's generator was not restored"
    )
    assert len(cuda_states) == 1 and cuda_states[0][1] == device, cuda_states
    state = cuda_states[0][0]
    # what it accepts
    assert state.device.type == "cpu" and state.dtype == torch.uint8, (
        state.device,
        state.dtype,
    )
    assert torch.equal(state, states["cuda"]), "the CUDA stream got another state than the saved one"
    # The rest went where the model is, or holds no tensors at all.
    momentum = [s["momentum_buffer"] for s in optimizer.state.values()]
    assert momentum and all(t.device == device for t in momentum), {t.device for t in momentum}
    assert scheduler.last_epoch == saved["step"] == 2, (scheduler.last_epoch, saved["step"])
    assert scaler.state_dict() == saved["scaler"], (scaler.state_dict(), saved["scaler"])


def test_resume_on_the_cpu_loads_the_weights_and_optimizer(template, tmp_path, rng_kept):
    saved, _ = saved_run(template, tmp_path / "last.pt")
    model, optimizer, scheduler, scaler = training_objects(template, torch.device("cpu"))
    torch.nn.init.zeros_(model[-1].weight)  # differ from the checkpoint somewhere
    template.restore(
        str(tmp_path / "last.pt"),
        model,
        optimizer,
        scheduler,
        scaler,
        torch.Generator(),
        rank=0,
        world_size=1,
        device=torch.device("cpu"),
    )
    differ = [k for k, v in model.state_dict().items() if not torch.equal(v, saved["model"][k])]
    assert not differ, differ
    restored = optimizer.state_dict()["state"]
    assert all(
        torch.equal(restored[i]["momentum_buffer"], s["momentum_buffer"])
        for i, s in saved["optimizer"]["state"].items()
    ), "momentum buffers differ"


def test_resume_refuses_a_checkpoint_of_another_world_size(template, tmp_path, rng_kept):
    saved, _ = saved_run(template, tmp_path / "last.pt", world_size=2)
    assert saved["world_size"] == 2 and len(saved["rng"]) == 2, (saved["world_size"], len(saved["rng"]))
    model, optimizer, scheduler, scaler = training_objects(template, torch.device("cpu"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(SystemExit) as refused:
        template.restore(
            str(tmp_path / "last.pt"),
            model,
            optimizer,
            scheduler,
            scaler,
            torch.Generator(),
            rank=0,
            world_size=1,
            device=torch.device("cpu"),
        )
    message = str(refused.value)
    assert "saved by 2 ranks, this run has 1" in message and "Resume with 2 ranks" in message, message
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), (
        "refused, yet it loaded weights"
    )


def test_main_resumes_through_restore(template):
    """The tests above call restore() directly: this fails if main() stops using it or loads a file itself."""
    source = inspect.getsource(template.main)
    assert "restore(" in source, "main() no longer resumes through restore()"
    assert "torch.load(" not in source, "main() loads a checkpoint itself, bypassing restore()"
