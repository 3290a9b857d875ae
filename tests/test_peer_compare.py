"""benchmarks/peer_compare.py against a tiny fake BackdoorBench checkout made here: scripts with
BackdoorBench's names and arguments that write result files in its formats, so the data it is fed,
the commands, the parsing of its files and of our records, the table and the one-line errors are
tested for real, offline and in seconds."""

from __future__ import annotations

import json
import struct
import sys
import textwrap
from pathlib import Path

import pytest

from benchmarks import peer_compare as pc

# One script stands for all of BackdoorBench's: it reads the flags it is given and writes what
# the real script's trainer writes (a pandas CSV with an index column; NC's flags in its log).
FAKE_SCRIPT = textwrap.dedent('''
    import argparse, json, os, struct, sys
    p = argparse.ArgumentParser()
    for flag in ("--yaml_path", "--bd_yaml_path", "--patch_mask_path", "--save_folder_name", "--result_file",
                 "--dataset", "--dataset_path", "--device", "--random_seed", "--attack_target", "--pratio",
                 "--ratio", "--epochs", "--te_epochs", "--nc_epoch", "--n_rounds", "--K"):
        p.add_argument(flag)
    a = p.parse_args()
    script = os.path.relpath(sys.argv[0])
    raw = os.path.join(a.dataset_path, a.dataset, "MNIST", "raw")
    with open(os.path.join(raw, "train-images-idx3-ubyte"), "rb") as f:
        magic, n, h, w = struct.unpack(">IIII", f.read(16))
    assert (magic, n, h, w) == (2051, 4000, 28, 28), (magic, n, h, w)
    with open(os.path.join(os.environ["FAKE_LOG"]), "a") as f:
        f.write(json.dumps({"script": script, "args": vars(a)}) + "\\n")
    if os.environ.get("FAKE_FAIL") == script:
        sys.exit("RuntimeError: CUDA out of memory")
    seed = int(a.random_seed)
    header = ",epoch,batch,train_epoch_loss_avg_over_batch,train_acc,test_acc,test_asr,test_ra\\n"
    def write(folder, prefix, acc, asr, summary=False):
        os.makedirs(folder, exist_ok=True)
        rows = header + f"0,0,,0.5,0.9,0.5,0.5,0.4\\n1,1,,0.4,0.95,{acc},{asr},0.0\\n"
        with open(os.path.join(folder, prefix + ("_df_summary.csv" if summary else "_df.csv")), "w") as f:
            f.write(rows)
    if script == "attack/badnet.py":
        write(os.path.join("record", a.save_folder_name), "attack", 0.98 + seed / 100, 1.0)
    else:
        name = {"defense/ft.py": "ft", "defense/nad.py": "nad", "defense/nc.py": "nc", "defense/i-bau.py": "i-bau"}[script]
        folder = os.path.join("record", a.result_file, "defense", name)
        if name == "nc":  # nothing unlearned: BackdoorBench writes only the summary, and the flags to its log
            write(folder, "nc", 0.97, 0.99, summary=True)
            os.makedirs(os.path.join(folder, "log"), exist_ok=True)
            with open(os.path.join(folder, "log", "2026_01_01.log"), "w") as f:
                f.write("2026 [INFO] [nc.py:421] Flagged label list: 0: 2.81,7: 2.05\\n")
        else:
            write(folder, name, 0.9 + seed / 100, 0.5 - seed / 10)
''')

FAKE_OURS = textwrap.dedent('''
    import json, os, sys
    over = dict(a.split("=", 1) for a in sys.argv[1:])
    seed, defense = int(over["seed"]), over["defense"]
    out = os.path.join(over["results_dir"], f"{defense}_{seed}.json")
    os.makedirs(over["results_dir"], exist_ok=True)
    record = {"metrics": {"attacked": {"clean_acc": 0.981, "asr": 1.0},
                          "defended": {"clean_acc": 0.95 - seed / 100, "asr": 0.25 * seed}},
              "defense": {"name": defense, "extras": {"flagged": [8, 0]} if defense == "neural_cleanse" else {}}}
    json.dump(record, open(out, "w"))
    with open(os.environ["FAKE_LOG"], "a") as f:
        f.write(json.dumps({"script": "ours", "args": sys.argv[1:]}) + "\\n")
    print("a table\\nrecord: " + out)
''')


def fake_checkout(root: Path) -> Path:
    bb = root / "BackdoorBench"
    needed = list(pc.CHECKOUT_FILES) + [p for row in pc.ROWS.values() for p in (row.script, row.yaml)]
    for rel in needed:
        (bb / rel).parent.mkdir(parents=True, exist_ok=True)
        (bb / rel).write_text(FAKE_SCRIPT if rel.endswith(".py") else "")
    (bb / "config/attack/prototype/cifar10.yaml").write_text("dataset: cifar10\nepochs: 100\nnum_workers: 4\n")
    return bb


@pytest.fixture()
def setup(tmp_path, monkeypatch):
    bb = fake_checkout(tmp_path)
    ours = tmp_path / "fake_ours.py"
    ours.write_text(FAKE_OURS)
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("FAKE_LOG", str(log))
    base = ["--backdoorbench", str(bb), "--work", str(tmp_path / "work"), "--no-gray-to-rgb",
            "--ours-command", f"{sys.executable} {ours}"]
    return bb, base, log


def calls(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_the_table_from_both_sides_files(setup, tmp_path, capsys) -> None:
    bb, base, log = setup
    out = tmp_path / "table.md"
    assert pc.main([*base, "--seeds", "0", "1", "--defenses", "fine_tuning", "neural_cleanse", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert out.read_text() == text
    rows = {line.split(" | ")[0].strip("| "): line for line in text.splitlines() if line.startswith("| ")}
    # BackdoorBench: the last row of each CSV, mean ± std over the two seeds; ours: the records
    assert rows["none (victim)"].endswith("| 98.5 ± 0.7 / 100.0 ± 0.0 | 98.1 ± 0.0 / 100.0 ± 0.0 |")
    assert rows["fine-tuning"] == "| fine-tuning | 20 epochs | 90.5 ± 0.7 / 45.0 ± 7.1 | 94.5 ± 0.7 / 12.5 ± 17.7 |"
    # NC left no nc_df.csv: its summary is read, and its flags from its log; ours from the record's extras
    assert rows["Neural Cleanse"].endswith("| 97.0 ± 0.0 / 99.0 ± 0.0, flags [0, 7]; [0, 7] | 94.5 ± 0.7 / 12.5 ± 17.7, flags [8, 0]; [8, 0] |")
    assert set(rows) == {"defense", "none (victim)", "fine-tuning", "Neural Cleanse"}

    made = calls(log)
    bb_calls = [c for c in made if c["script"] != "ours"]
    assert [c["script"] for c in bb_calls[:3]] == ["attack/badnet.py", "defense/ft.py", "defense/nc.py"]
    attack, ft = bb_calls[0]["args"], bb_calls[1]["args"]
    assert (attack["dataset"], attack["pratio"], attack["attack_target"], attack["random_seed"]) == ("mnist", "0.1", "0", "0")
    assert ft["result_file"] == attack["save_folder_name"] and (ft["epochs"], ft["ratio"]) == ("20", "0.05")
    assert (bb_calls[2]["args"]["nc_epoch"], bb_calls[2]["args"]["epochs"]) == ("15", "5")
    # the victim recipe BackdoorBench is given: its own prototype yaml with ours set, T_max included
    import yaml
    recipe = yaml.safe_load(Path(attack["yaml_path"]).read_text())
    assert recipe["num_workers"] == 4 and (recipe["dataset"], recipe["epochs"], recipe["cos_t_max"]) == ("mnist", 7, 7)
    assert (recipe["lr"], recipe["batch_size"], recipe["model"]) == (0.01, 128, "preactresnet18")
    ours = [c["args"] for c in made if c["script"] == "ours"]
    assert len(ours) == 4 and all("model=preact_resnet18" in a and "trainer.epochs=7" in a
                                  and "defense.clean_fraction=0.05" in a for a in ours)
    assert "defense.epochs=20" in ours[0] and "seed=1" in ours[-1]


def test_the_equal_budgets_on_both_sides() -> None:
    budgets = {k: (row.bb_args, row.ours) for k, row in pc.ROWS.items()}
    assert budgets["nad"] == (("--te_epochs", "10", "--epochs", "10"),
                              ("defense=nad", "defense.teacher_epochs=10", "defense.epochs=10"))
    assert budgets["i_bau"] == (("--n_rounds", "5", "--K", "5"),
                                ("defense=i_bau", "defense.rounds=5", "defense.hypergrad_iterations=5"))
    assert budgets["neural_cleanse"][1] == ("defense=neural_cleanse", "defense.epochs=15", "defense.unlearn_epochs=5")


def test_the_split_is_mnist5k_in_torchvisions_files(tmp_path, monkeypatch) -> None:
    from backdoorbench.datasets.mnist5k import load_mnist5k

    data = load_mnist5k()
    data_path = pc.prepare_data(tmp_path / "w", data)
    raw = data_path / "mnist" / "MNIST" / "raw"
    images = (raw / "t10k-images-idx3-ubyte").read_bytes()
    labels = (raw / "t10k-labels-idx1-ubyte").read_bytes()
    assert struct.unpack(">IIII", images[:16]) == (2051, 1000, 28, 28)
    assert struct.unpack(">II", labels[:8]) == (2049, 1000)
    assert images[16:] == data.test.images.numpy().tobytes() and labels[8:] == bytes(data.test.labels.tolist())
    # torchvision reads them as downloaded MNIST, and the launcher's patch hands BackdoorBench RGB images
    from torchvision.datasets import MNIST

    monkeypatch.setattr(MNIST, "__getitem__", MNIST.__getitem__)  # restored after the test
    exec(pc.TO_RGB, {})
    read = MNIST(str(data_path / "mnist"), train=True, download=True)
    image, label = read[0]
    assert (len(read), image.mode, image.size, label) == (4000, "RGB", (28, 28), int(data.train.labels[0]))
    assert pc.GRAY_TO_RGB.startswith(pc.TO_RGB) and pc.GRAY_TO_RGB.endswith(pc.PLAIN)


def test_a_missing_or_wrong_checkout_is_one_line(tmp_path, capsys) -> None:
    assert pc.main(["--backdoorbench", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no such folder" in err and "SCLBD/BackdoorBench" in err
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "attack").mkdir()
    (tmp_path / "other" / "attack" / "badnet.py").write_text("")
    assert pc.main(["--backdoorbench", str(tmp_path / "other")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a BackdoorBench checkout: attack/prototype.py is missing" in err
    with pytest.raises(SystemExit):
        pc.main(["--backdoorbench", str(tmp_path), "--defenses", "strip"])
    assert "--defenses 'strip' is unknown" in capsys.readouterr().err


def test_a_failing_script_and_a_missing_result_are_one_line(setup, monkeypatch, capsys) -> None:
    bb, base, log = setup
    monkeypatch.setenv("FAKE_FAIL", "defense/nad.py")
    assert pc.main([*base, "--defenses", "fine_tuning", "nad"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "BackdoorBench's defense/nad.py failed (exit 1): RuntimeError: CUDA out of memory; full log:" in err
    monkeypatch.delenv("FAKE_FAIL")
    (bb / "defense/ft.py").write_text("")  # runs, writes nothing
    assert pc.main([*base, "--defenses", "fine_tuning"]) == 2
    err = capsys.readouterr().err
    assert "BackdoorBench's defense/ft.py wrote no " in err and "ft_df.csv (nor ft_df_summary.csv)" in err
