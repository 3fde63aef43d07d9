"""Unit tests for ddp_helpers.datasets.make_image_folder."""

import subprocess
import sys
from pathlib import Path

import pytest

from ddp_helpers.datasets import class_names, make_image_folder


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*.png"))}


def test_layout_and_count(tmp_path):
    root = make_image_folder(tmp_path / "ds", num_classes=3, images_per_class=5, size=12, seed=1)
    assert root == tmp_path / "ds"
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == class_names(3)
    assert len(_files(root)) == 15


def test_deterministic_and_seed_dependent(tmp_path):
    a = _files(make_image_folder(tmp_path / "a", num_classes=2, images_per_class=4, size=10, seed=7))
    b = _files(make_image_folder(tmp_path / "b", num_classes=2, images_per_class=4, size=10, seed=7))
    c = _files(make_image_folder(tmp_path / "c", num_classes=2, images_per_class=4, size=10, seed=8))
    assert a == b
    assert a.keys() == c.keys() and a != c


def test_rerun_is_a_noop_and_new_settings_replace(tmp_path):
    root = make_image_folder(tmp_path / "ds", num_classes=2, images_per_class=3, size=8)
    first = next(root.rglob("*.png"))
    mtime = first.stat().st_mtime_ns
    make_image_folder(tmp_path / "ds", num_classes=2, images_per_class=3, size=8)
    assert first.stat().st_mtime_ns == mtime
    make_image_folder(tmp_path / "ds", num_classes=3, images_per_class=2, size=8)
    assert len(_files(root)) == 6


def test_refuses_foreign_folder(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError):
        make_image_folder(tmp_path / "mine")


def test_bad_arguments_leave_an_existing_folder_intact(tmp_path):
    root = make_image_folder(tmp_path / "ds", num_classes=2, images_per_class=4, size=8)
    before = _files(root)
    for bad in ({"val_fraction": 1.5}, {"images_per_class": 2, "val_fraction": 0.1}, {"size": 1}):
        with pytest.raises(ValueError):
            make_image_folder(tmp_path / "ds", **{"num_classes": 2, "images_per_class": 4, "size": 8, **bad})
        assert _files(root) == before, bad
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"], "nothing is left beside it"


def test_an_interrupted_rebuild_keeps_the_old_folder_and_can_be_rerun(tmp_path, monkeypatch):
    from ddp_helpers import datasets

    root = make_image_folder(tmp_path / "ds", num_classes=2, images_per_class=4, size=8)
    before = _files(root)
    real_png, calls = datasets._png, []

    def interrupted(raw, size):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # Kernel -> Interrupt while the new images are written
        return real_png(raw, size)

    monkeypatch.setattr(datasets, "_png", interrupted)
    with pytest.raises(KeyboardInterrupt):
        make_image_folder(tmp_path / "ds", num_classes=3, images_per_class=4, size=8)
    assert _files(root) == before, "the old dataset is still whole"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"], "the half-built folder is gone"
    monkeypatch.setattr(datasets, "_png", real_png)
    assert len(_files(make_image_folder(tmp_path / "ds", num_classes=3, images_per_class=4, size=8))) == 12


def test_train_val_split(tmp_path):
    root = make_image_folder(tmp_path / "ds", num_classes=2, images_per_class=10, size=8, val_fraction=0.2)
    for name in class_names(2):
        assert len(list((root / "train" / name).glob("*.png"))) == 8
        assert len(list((root / "val" / name).glob("*.png"))) == 2


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_classes": 0},
        {"num_classes": 99},
        {"size": 2},
        {"images_per_class": 0},
        {"val_fraction": 1.0},
        {"images_per_class": 2, "val_fraction": 0.1},
    ],
)
def test_bad_arguments(tmp_path, kwargs):
    with pytest.raises(ValueError):
        make_image_folder(tmp_path / "ds", **kwargs)


def test_imagefolder_reads_it_and_classes_differ(tmp_path):
    torch = pytest.importorskip("torch")
    datasets = pytest.importorskip("torchvision.datasets")
    transforms = pytest.importorskip("torchvision.transforms")
    root = make_image_folder(tmp_path / "ds", num_classes=4, images_per_class=6, size=16, seed=0)
    ds = datasets.ImageFolder(root, transform=transforms.ToTensor())
    assert ds.classes == class_names(4) and len(ds) == 24
    image, label = ds[0]
    assert image.shape == (3, 16, 16) and label == 0
    # Each class's brightest pixels have its own colour: the mean colour of shape pixels differs per class.
    means = []
    for label in range(4):
        imgs = torch.stack([ds[i][0] for i in range(len(ds)) if ds.targets[i] == label])
        mask = imgs.amax(dim=1, keepdim=True) > 0.4  # shape pixels, not the dark background
        means.append((imgs * mask).sum(dim=(0, 2, 3)) / mask.sum())
    for i in range(4):
        for j in range(i + 1, 4):
            assert (means[i] - means[j]).abs().max() > 0.1


def test_import_does_not_import_torch():
    code = "import sys, ddp_helpers.datasets; assert 'torch' not in sys.modules and 'PIL' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])
