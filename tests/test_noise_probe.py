"""benchmarks/noise_probe.py: the class a cached victim gives uniform noise, read from the victim cache."""

from __future__ import annotations

import json

import torch

from backdoorbench.models.base import Normalized
from backdoorbench.models.mnist_cnn import MnistCNN
from benchmarks import noise_probe


def _record(tmp_path, seed: int, bias_class: int, defense: str = "sentinet") -> None:
    torch.manual_seed(seed)
    net = MnistCNN(in_channels=1, num_classes=10, image_size=28, hidden=16)
    with torch.no_grad():  # a head that calls everything bias_class
        net.classifier.weight.zero_()
        net.classifier.bias.zero_()
        net.classifier.bias[bias_class] = 10.0
    model = Normalized(net, (0.1307,), (0.3081,))
    cache = tmp_path / "cache" / f"v{seed}.pt"
    cache.parent.mkdir(exist_ok=True)
    torch.save({"model": model.state_dict()}, cache)
    record = {"dataset": {"name": "mnist5k", "num_classes": 10, "image_shape": [1, 28, 28]},
              "config": {"model": {"_target_": "backdoorbench.models.mnist_cnn.MnistCNN", "hidden": 16}},
              "attack": {"name": "badnets", "target_mode": "all2one", "target": 0},
              "defense": {"name": defense}, "seed": seed, "victim": {"path": str(cache)}}
    folder = tmp_path / "runs" / "mnist5k" / "badnets_all2one"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"r{seed}{defense}.json").write_text(json.dumps(record))


def test_the_probe_reports_the_class_each_victim_gives_noise(tmp_path, capsys) -> None:
    _record(tmp_path, 0, bias_class=8)
    _record(tmp_path, 1, bias_class=8)
    _record(tmp_path, 2, bias_class=3, defense="strip")  # another defense's record: not probed
    assert noise_probe.main(["--results", str(tmp_path), "--n", "20"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1:] == ["mnist5k badnets all2one 0,1: class 8,8; 1.000 ± 0.000; 1.000"]


def test_no_records_of_the_defense_is_one_line_and_exit_1(tmp_path, capsys) -> None:
    _record(tmp_path, 0, bias_class=8, defense="strip")
    assert noise_probe.main(["--results", str(tmp_path)]) == 1
    assert "no records of defense 'sentinet'" in capsys.readouterr().err
