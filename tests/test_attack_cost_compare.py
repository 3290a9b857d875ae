"""benchmarks/attack_cost_compare.py against a fake BackdoorBench checkout made here: its two transform
files as stubs of the same interface (identity transforms), so the one-line errors and the tables
are tested offline, in seconds, without BackdoorBench's code."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
import types

import numpy as np
import pytest

from benchmarks import attack_cost_compare as acc

FTROJANN = textwrap.dedent('''
    import numpy as np

    def RGB2YUV(x):
        return x.astype(np.float64)

    def YUV2RGB(x):
        return x.astype(np.float64)

    def DCT(x, window_size):
        return np.transpose(x, (0, 3, 1, 2)).astype(np.float64)

    def IDCT(x, window_size):
        return np.transpose(x, (0, 2, 3, 1))

    class ftrojann_version:
        def __init__(self, YUV, channel_list, window_size, magnitude, pos_list):
            self.magnitude = magnitude

        def __call__(self, img):
            return np.asarray(img).astype(np.float64)
''')
CTRL = textwrap.dedent('''
    class ctrl:
        def __init__(self, args, train):
            self.magnitude = 100

        def __call__(self, img, target=None, image_serial_id=None):
            return img
''')
YAMLS = {
    "config/attack/ftrojannn/default.yaml": "YUV: True\nchannel_list: [1, 2]\nwindow_size: 32\nmagnitude: 30\npos_list: [15, 15, 31, 31]\n",
    "config/attack/ctrl/default.yaml": "use_dct: False\nuse_yuv: True\ntrigger_channels: [1, 2]\npos_list: [15, 31]\n",
}


@pytest.fixture
def fake_bb(tmp_path, monkeypatch):
    root = tmp_path / "BackdoorBench"
    for relative, text in {**YAMLS, "utils/bd_img_transform/ftrojann.py": FTROJANN,
                           "utils/bd_img_transform/ctrl.py": CTRL}.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(text)
    # what the script would put back for BackdoorBench's code, kept from leaking into other tests
    monkeypatch.setattr(np, "float", float, raising=False)
    monkeypatch.setitem(sys.modules, "pkg_resources", types.ModuleType("pkg_resources"))
    return root


@pytest.mark.parametrize("where, message", [("missing", "no such folder"), ("empty", "is not a BackdoorBench checkout")])
def test_a_wrong_checkout_is_one_line_and_exit_2(tmp_path, capsys, where, message):
    path = tmp_path / where
    if where == "empty":
        path.mkdir()
    assert acc.main(["--backdoorbench", str(path), "--images", "4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: --backdoorbench") and message in err


def test_the_tables_time_all_six_of_ours_on_both_shapes(fake_bb, tmp_path, capsys):
    out = tmp_path / "cost.md"
    assert acc.main(["--backdoorbench", str(fake_bb), "--images", "6", "--repeats", "3", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert out.read_text() == text
    assert "load average before:" in text and "load average after:" in text and "torch CPU capability" in text
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| ") and "ms/image" not in line]
    timed = {(r[0][2:], r[1]) for r in rows if len(r) == 6 and r[2] != "---"}
    for shape in ("3x32x32 (random)", "1x28x28 (mnist5k)"):
        for name in ("ftrojan", "ctrl", "lf", "ssba", "poison_ink", "blind"):
            assert (name, shape) in timed, (name, shape, text)
    for r in rows:
        if len(r) == 6 and r[2] != "---":
            assert float(r[2]) > 0  # ours' ms per image
    ftrojan = next(r for r in rows if len(r) == 6 and r[0] == "| ftrojan" and r[1].startswith("3x32x32"))
    assert ftrojan[3] != "–" and ftrojan[4].endswith("x")  # the stub ran beside ours
    # the stub leaves the images as they are: the agreement table says how far ours moved them
    assert "max abs diff (levels)" in text and "| ftrojan | 3x32x32 (random) |" in text
    ctrl = next(r for r in rows if len(r) == 6 and r[0] == "| ctrl" and r[1].startswith("3x32x32"))
    if all(importlib.util.find_spec(m) for m in ("kornia", "pytorch_wavelets", "pywt")):
        assert ctrl[3] != "–", text
    else:
        assert "ctrl: skipped (needs kornia, pytorch_wavelets)" in text and ctrl[3] == "–"
    assert "blind, ours, 3x32x32 (random): victim training 2.00 forward / 2.00 backward" in text
