"""SSBA (Li et al., ICCV 2021): a StegaStamp encoder hides one code in every poisoned image. The
defining property on a tiny training: the trigger (encoded minus clean) differs per image, and the
decoder reads the attacker's code back from encoded images; a fixed additive pattern fails the
first. Also the code's bits against the official packing, the content-hashed network cache (a hit
gives the same trigger; a killed training resumes to the same networks), the poisoning in both
modes, and BackdoorBench's pre-made files read as it reads them, wrong ones refused in one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from backdoorbench.attacks.ssba import SSBA, bch_parity, code_of
from backdoorbench.attacks.stegastamp import StegaStampDecoder, StegaStampEncoder
from backdoorbench.datasets.base import ImageDataset, Split, to_float
from backdoorbench.errors import ConfigError, DataError
from tests.tiny import one_thread  # noqa: F401  (autouse)

SHAPE = (1, 16, 16)
# A tiny training: narrow networks, 8-bit codes, 48 images, batches of 16 (3 steps an epoch), Adam 1e-3.
TINY = dict(code_bits=8, width=8, epochs=2, batch_size=16, lr=1e-3, l2_await=5, l2_ramp=10)
# StegaStamp's code loss sits at log 2 for its first hundred-odd steps before the decoder starts reading:
# the decoding test trains the residual encoder at width 8 for 900 steps (slow, ~15 s of one core), the L2
# term switching on once the decoder reads, the last quarter at lr / 10 (the quick protocol's recipe).
DECODING = dict(code_bits=8, width=8, epochs=300, batch_size=16, lr=1e-3, residual=True, l2_await=50, l2_ramp=100,
                lr_drop=0.25)


def images(n: int, seed: int = 0, shape=SHAPE) -> torch.Tensor:
    """uint8 (n, C, H, W): smooth random blobs, mid-grey on average (little clipping)."""
    g = torch.Generator().manual_seed(seed)
    low = torch.rand(n, shape[0], 4, 4, generator=g)
    x = torch.nn.functional.interpolate(low, size=shape[1:], mode="bilinear", align_corners=False)
    return (40 + 170 * x).round().to(torch.uint8)


def split(n: int, seed: int = 0, shape=SHAPE, classes: int = 4) -> Split:
    return Split(images(n, seed, shape), torch.arange(n) % classes)


class CPU:
    device = "cpu"


def attack(**kwargs) -> SSBA:
    return SSBA(num_classes=4, image_shape=SHAPE, target=0, poison_rate=0.25, **{**TINY, **kwargs})


@pytest.fixture(scope="module")
def trained():
    a = attack()
    a.prepare(trainer=CPU(), train=split(48), generator=torch.Generator().manual_seed(0), build_model=None)
    return a


def sample_specificity(apply_trigger, x: torch.Tensor) -> float:
    """How much the trigger differs between images: the mean distance of each image's change
    (triggered minus clean) from the mean change, over the mean change's norm. 0 for a fixed
    pattern added to every image (where nothing clips)."""
    with torch.no_grad():
        change = (apply_trigger(x) - x).flatten(1)
    spread = (change - change.mean(0)).norm(dim=1).mean()
    return float(spread / change.mean(0).norm().clamp_min(1e-12))


def bits_of(data: bytes) -> list[int]:
    return [int(b) for byte in data for b in format(byte, "08b")]


def test_the_code_is_the_official_packing_of_the_secret():
    code = code_of("a", 100)
    assert code.shape == (100,)
    # generate_fingerprints_from_bch: bytearray('a' + ' ' * 6), bchlib.BCH(137, 5).encode of it (5 bytes),
    # 4 zero bits; each byte's bits most significant first. The parity bytes are bchlib 2.1.3's
    # BCH(5, prim_poly=137).encode output, written down here.
    assert code.tolist() == bits_of(b"a      " + bytes.fromhex("8693e147e0")) + [0] * 4
    assert code_of("stega!!", 100).tolist() == bits_of(b"stega!!" + bytes.fromhex("348cc1e560")) + [0] * 4
    assert code_of("abcd", 100).tolist()[56:96] == bits_of(bytes.fromhex("58b5f29ae0"))
    # fingerprint_size 50: 4 characters, BCH(137, 2) (2 bytes), 2 zero bits
    assert code_of("a", 50).tolist() == bits_of(b"a   " + bytes.fromhex("7f80")) + [0] * 2
    assert code_of("abcd", 50).tolist()[32:48] == bits_of(bytes.fromhex("c088"))
    # other lengths (no official code): the padded string, then zeros
    assert code_of("ab", 16).tolist() == bits_of(b"ab")
    assert code_of("a", 32).tolist() == bits_of(b"a   ")


def test_bch_parity_against_bchlib_when_installed():
    bchlib = pytest.importorskip("bchlib")
    for t, data in ((5, b"a      "), (5, b"xyz\x00 !~"[:7]), (2, b"zz9 "), (3, b"hello")):
        assert bch_parity(data, t) == bytes(bchlib.BCH(t, prim_poly=137).encode(bytearray(data))), (t, data)


@pytest.mark.parametrize("shape", [(1, 28, 28), (3, 32, 32), (3, 64, 64), (3, 20, 24)])
def test_the_networks_take_any_image_size(shape):
    torch.manual_seed(0)
    enc, dec = StegaStampEncoder(*shape, 8), StegaStampDecoder(*shape, 8)
    x = torch.rand(2, *shape)
    with torch.no_grad():
        out = enc(torch.ones(2, 8), x)
    assert out.shape == x.shape and float(out.min()) >= 0 and float(out.max()) <= 1
    with torch.no_grad():
        assert dec(out).shape == (2, 8)
    if shape[1] == 32:  # the official decoder's dense layer: resolution^2 * 128 / 32 / 32 inputs
        assert dec.dense[0].in_features == 32 * 32 * 128 // 32 // 32


def test_defining_property_the_trigger_is_sample_specific(trained):
    stats = trained.stats["networks"]
    assert stats["source"] == "trained" and stats["cache"] == "off" and stats["steps"] == 2 * 3
    held_out = to_float(images(32, seed=5))
    assert sample_specificity(trained.apply_trigger, held_out) > 0.3
    # a wrong implementation, one fixed pattern added to every image, fails that
    pattern = trained.apply_trigger(held_out[:1]) - held_out[:1]
    assert sample_specificity(lambda x: x + pattern, held_out) < 1e-5
    # the record's numbers: seconds, final losses, the decoder's bit accuracy, a PSNR
    assert stats["seconds"] > 0 and stats["final_bce"] is not None and 0 <= stats["code_bit_accuracy"] <= 1
    assert stats["code_psnr_db"] > 0


@pytest.mark.slow
def test_defining_property_the_decoder_reads_the_code_back():
    """Trained jointly, the decoder reads the attacker's code from encoded (8-bit) images, and the
    trigger stays sample-specific."""
    a = attack(**DECODING)
    a.prepare(trainer=CPU(), train=split(48), generator=torch.Generator().manual_seed(0), build_model=None)
    stats = a.stats["networks"]
    assert stats["code_bit_accuracy"] >= 0.8 and stats["code_psnr_db"] >= 25, stats
    assert stats["l2_started_at_step"] is not None and stats["final_l2_weight"] == 10.0, stats
    # the change still differs per image (a fixed pattern gives < 1e-5, the test above)
    assert sample_specificity(a.apply_trigger, to_float(images(32, seed=5))) > 0.05


def test_poisoning_in_both_modes(trained):
    train = split(48)
    for mode in ("all2one", "all2all"):
        a = attack(target_mode=mode)
        a.load_state_dict(trained.state_dict())
        poisoned = a.poison_dataset(train, torch.Generator().manual_seed(1))
        idx = poisoned.indices
        assert len(idx) == 12
        assert torch.equal(poisoned.split.labels[idx], a.target_rule(train.labels[idx]))
        with torch.no_grad():
            expected = a.apply_trigger(to_float(train.images[idx]))
        assert (to_float(poisoned.split.images[idx]) - expected).abs().max() <= 0.5 / 255 + 1e-6
        rest = torch.ones(48, dtype=torch.bool)
        rest[idx] = False
        assert torch.equal(poisoned.split.images[rest], train.images[rest])


def test_network_cache_hit_and_resumed_training(tmp_path):
    train = split(32, seed=2)
    quick = dict(epochs=2)
    first = attack(**quick)
    first.bind_run(data=None, network_cache=tmp_path)
    first.prepare(trainer=CPU(), train=train, generator=torch.Generator().manual_seed(3), build_model=None)
    assert first.stats["networks"]["cache"] == "miss"
    # the record's cost: 2 epochs of 32 images, each through the encoder and the decoder, forward and backward
    assert first.stats["networks"]["forward_images"] == first.stats["networks"]["backward_images"] == 2 * 2 * 32
    assert len(list((tmp_path / "ssba").glob("*.pt"))) == 1  # the partial file is gone
    again = attack(**quick, target_mode="all2all")  # another mode shares the networks
    again.bind_run(data=None, network_cache=tmp_path)
    g = torch.Generator().manual_seed(3)
    again.prepare(trainer=CPU(), train=train, generator=g, build_model=None)
    assert again.stats["networks"]["cache"] == "hit" and again.stats["networks"]["seconds"] > 0
    assert again.describe()["prepare_cost"] == {"cached": True, "seconds": first.stats["networks"]["seconds"],
                                                "forward_images": 128, "backward_images": 128}
    assert torch.equal(g.get_state(), first_generator_after(3))  # a hit draws what a training draws
    x = to_float(train.images[:4])
    assert torch.equal(again.apply_trigger(x), first.apply_trigger(x))
    # a killed training resumes from its last epoch to the same networks
    seed = 11
    straight, _ = attack(**quick).train_networks(train, seed, torch.device("cpu"))
    partial = tmp_path / "resume.partial.pt"
    attack(epochs=1).train_networks(train, seed, torch.device("cpu"), partial=partial)
    assert partial.exists()
    resumed, stats = attack(**quick).train_networks(train, seed, torch.device("cpu"), partial=partial)
    assert stats["steps"] == 4 and stats["forward_images"] == stats["backward_images"] == 2 * 2 * 32  # both parts
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), name


def first_generator_after(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    torch.randint(0, 2**62, (1,), generator=g)
    return g.get_state()


def test_state_round_trip(trained):
    other = attack()
    other.load_state_dict(trained.state_dict())
    x = to_float(images(4, seed=9))
    assert torch.equal(other.apply_trigger(x), trained.apply_trigger(x))
    with pytest.raises(DataError, match="ssba state holds an encoder of another shape"):
        SSBA(num_classes=4, image_shape=(3, 16, 16), **TINY).load_state_dict(trained.state_dict())


# ---------------------------------------------------------------- BackdoorBench's pre-made files

def tiny_dataset(name: str = "tiny") -> ImageDataset:
    return ImageDataset(name=name, train=split(12, seed=1), test=split(6, seed=2), num_classes=4,
                        mean=(0.5,), std=(0.5,), hflip=False, crop_padding=0)


def write_resource(folder, data, name: str = "tiny", hwc: bool = False):
    """As pack_images.py writes them: every image of the split, in order, (N, H, W) for gray."""
    folder.mkdir(exist_ok=True)
    for part, s in (("train", data.train), ("test", data.test)):
        made = (255 - s.images).numpy()[:, 0]  # any image per row: here the negative
        np.save(folder / f"{name}_ssba_{part}_b1.npy", made[..., None] if hwc else made)


def test_resource_is_read_as_backdoorbench_reads_it(tmp_path):
    data = tiny_dataset()
    write_resource(tmp_path / "ssba", data)
    a = SSBA(num_classes=4, image_shape=SHAPE, dataset="tiny", resource=str(tmp_path / "ssba"))
    a.bind_run(data=data, network_cache=None)
    a.prepare(trainer=CPU(), train=data.train, generator=torch.Generator(), build_model=None)
    test = to_float(data.test.images)
    assert torch.allclose(a.apply_trigger(test[[3, 0]]), 1 - test[[3, 0]], atol=1e-6)  # each image's own row, by content
    poisoned = a.poison_dataset(data.train, torch.Generator().manual_seed(0))
    idx = poisoned.indices
    assert torch.equal(poisoned.split.images[idx], 255 - data.train.images[idx])
    assert a.describe()["networks"]["source"] == "resource"
    # the train file named directly; (N, H, W, 1) as well
    write_resource(tmp_path / "hwc", data, hwc=True)
    b = SSBA(num_classes=4, image_shape=SHAPE, resource=str(tmp_path / "hwc" / "tiny_ssba_train_b1.npy"))
    b.bind_run(data=data, network_cache=None)
    assert torch.allclose(b.apply_trigger(test[:2]), 1 - test[:2], atol=1e-6)
    with pytest.raises(DataError, match="not one of the dataset's"):
        b.apply_trigger(torch.full((1, *SHAPE), 0.123))


def test_wrong_resources_are_refused_in_one_line(tmp_path):
    data = tiny_dataset()
    write_resource(tmp_path / "ok", data)
    cases = []
    with pytest.raises(ConfigError) as info:
        SSBA(num_classes=4, image_shape=SHAPE, resource=str(tmp_path / "none"))
    cases.append((info, "does not exist"))
    (tmp_path / "only").mkdir()
    np.save(tmp_path / "only" / "tiny_ssba_train_b1.npy", np.zeros((12, 16, 16), np.uint8))
    with pytest.raises(ConfigError) as info:
        SSBA(num_classes=4, image_shape=SHAPE, dataset="tiny", resource=str(tmp_path / "only"))
    cases.append((info, "tiny_ssba_test_b1.npy"))
    with pytest.raises(DataError) as info:  # colour files for a gray dataset
        SSBA(num_classes=4, image_shape=(3, 16, 16), dataset="tiny", resource=str(tmp_path / "ok"))
    cases.append((info, "has shape (12, 16, 16); expected (N, 16, 16, 3)"))
    (tmp_path / "pickled").mkdir()
    for part in ("train", "test"):
        np.save(tmp_path / "pickled" / f"tiny_ssba_{part}_b1.npy", np.array([{"a": 1}], dtype=object))
    with pytest.raises(DataError) as info:
        SSBA(num_classes=4, image_shape=SHAPE, dataset="tiny", resource=str(tmp_path / "pickled"))
    cases.append((info, "cannot be read as a plain numpy array"))
    other = SSBA(num_classes=4, image_shape=SHAPE, dataset="tiny", resource=str(tmp_path / "ok"))
    with pytest.raises(DataError) as info:  # files of another dataset's size
        other.bind_run(data=ImageDataset(name="tiny", train=split(10), test=split(6), num_classes=4, mean=(0.5,),
                                         std=(0.5,), hflip=False, crop_padding=0), network_cache=None)
    cases.append((info, "the train file has 12 images, dataset tiny 10"))
    for info, fragment in cases:
        assert fragment in str(info.value) and "\n" not in str(info.value), str(info.value)


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(code_bits=4), "attack.code_bits=4 is invalid; use an integer >= 8"),
    (dict(secret="toolongsecret"), "attack.secret='toolongsecret' takes 13 bytes; a 100-bit code holds 7"),
    (dict(secret=""), "attack.secret='' is invalid"),
    (dict(residual="yes"), "attack.residual='yes' is invalid"),
    (dict(lr=0), "attack.lr=0 is invalid; use a number > 0"),
    (dict(lr_drop=1), "attack.lr_drop=1 is out of range; use a number in [0, 1)"),
    (dict(code_bits=50, secret="abcde"), "a 50-bit code holds 4"),
    (dict(resource=3), "attack.resource=3 is invalid"),
])
def test_bad_values_are_one_line(kwargs, fragment):
    with pytest.raises(ConfigError) as info:
        SSBA(num_classes=10, image_shape=(1, 28, 28), **kwargs)
    assert fragment in str(info.value) and "\n" not in str(info.value)
