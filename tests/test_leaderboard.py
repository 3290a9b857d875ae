"""The leaderboard is built from records only: tables per dataset, mean/std/n over seeds, the n < 3
flag, setting labels, filters, the sortable HTML page, and broken records skipped with a warning."""

import csv
import statistics
from html.parser import HTMLParser

import pytest

from backdoorbench.errors import ConfigError
from backdoorbench.leaderboard import main, setting_labels, write_leaderboard
from backdoorbench.records import save_record
from tests.test_records import make_record


def config(epochs=10, rate=0.1, mode="all2one", attack="badnets", defense=None):
    return {"seed": 0, "results_dir": "ignored", "trainer": {"epochs": epochs, "progress": False},
            "attack": {"_target_": f"backdoorbench.attacks.{attack}.X", "poison_rate": rate, "target_mode": mode},
            "defense": defense}


def stealth(psnr, ssim, lpips=None):
    return {"psnr": {"mean": psnr, "std": 1.0}, "ssim": {"mean": ssim, "std": 0.01},
            "lpips": None if lpips is None else {"mean": lpips, "std": 0.0}}


def save(runs, name, *, group, seed, dataset="mnist5k", model="mnist_cnn", attack="badnets", mode="all2one",
         defense="none", attacked=(0.97, 1.0, 0.0), defended=None, der=None, detection=None, cfg=None, st=None):
    ca, asr, ra = attacked
    metrics = {"attacked": {"clean_acc": ca, "asr": asr, "ra": ra},
               "defended": None if defended is None else dict(zip(("clean_acc", "asr", "ra"), defended)),
               "der": der, "detection": detection}
    record = make_record(run_id=name, group_id=group, seed=seed, dataset={"name": dataset}, model={"name": model},
                         attack={"name": attack, "target_mode": mode, "target": 0 if mode == "all2one" else None,
                                 "poison_rate": 0.1, "n_poisoned": 400, "poisoned_indices_sha256": "0" * 64},
                         defense={"name": defense}, metrics=metrics, stealth=st, config=cfg or config())
    save_record(record, runs / dataset / f"{attack}_{mode}" / f"{name}.json")


BADNETS = [(0, 0.97, 1.0, 21.0, 0.90), (1, 0.95, 0.98, 22.0, 0.92), (2, 0.96, 0.99, 23.0, 0.94)]


def write_runs(results_dir):
    runs = results_dir / "runs"
    for seed, ca, asr, psnr, ssim in BADNETS:  # 3 seeds, default setting
        save(runs, f"a{seed}", group="ga", seed=seed, attacked=(ca, asr, 0.0), st=stealth(psnr, ssim, 0.01 * (seed + 1)))
    for seed in (0, 1):  # the same attack at another epoch count: another row, flagged n < 3
        save(runs, f"e{seed}", group="ge", seed=seed, attacked=(0.90 + seed / 100, 0.5, 0.4), cfg=config(epochs=1),
             st=stealth(21.0, 0.9))
    save(runs, "w0", group="gw", seed=0, attack="wanet", mode="all2all", attacked=(0.93, 0.8, 0.1),
         cfg=config(attack="wanet", mode="all2all"))
    for seed, after_asr in ((0, 0.10), (1, 0.20), (2, 0.30)):
        save(runs, f"ft{seed}", group="gft", seed=seed, defense="fine_tuning", defended=(0.95, after_asr, 0.8),
             der=0.9 - seed / 20, cfg=config(defense={"_target_": "backdoorbench.defenses.fine_tuning.FineTuning"}))
    save(runs, "s0", group="gs", seed=0, defense="strip", defended=(0.90, 0.05, 0.0), der=0.95,
         detection={"tpr": 0.9, "fpr": 0.01, "auroc": 0.97},
         cfg=config(defense={"_target_": "backdoorbench.defenses.strip.Strip"}))
    save(runs, "c0", group="gc", seed=0, dataset="cifar10", model="preact_resnet18", attacked=(0.93, 1.0, 0.0))


def read_csv(path):
    return list(csv.DictReader(path.open()))


def test_attack_and_defense_tables_are_means_over_seeds(tmp_path):
    write_runs(tmp_path)
    files = write_leaderboard(tmp_path)
    assert files.n_records == 11 and files.n_rows == 6
    assert files.markdown == tmp_path / "leaderboard" / "leaderboard.md"
    attacks = read_csv(files.csv["attacks"])
    default = next(r for r in attacks if r["group_id"] == "ga")
    assert default["n"] == "3" and default["seeds"] == "0 1 2" and default["target_mode"] == "all2one(0)"
    assert float(default["ca_mean"]) == pytest.approx(0.96)
    assert float(default["ca_std"]) == pytest.approx(statistics.stdev([0.97, 0.95, 0.96]))
    assert float(default["psnr_mean"]) == pytest.approx(22.0) and float(default["psnr_std"]) == pytest.approx(1.0)
    assert float(default["lpips_mean"]) == pytest.approx(0.02) and default["lpips_n"] == "3"
    # Different settings of one attack are different rows, labelled by what differs.
    assert default["setting"] == "epochs=10"
    short = next(r for r in attacks if r["group_id"] == "ge")
    assert default["training"] == "10 ep" and short["training"] == "1 ep"  # the budget is visible on every row
    assert short["setting"] == "epochs=1" and short["n"] == "2" and short["lpips_n"] == "0" and short["lpips_mean"] == ""
    defenses = read_csv(files.csv["defenses"])
    ft = next(r for r in defenses if r["defense"] == "fine_tuning")
    assert float(ft["asr_after_mean"]) == pytest.approx(0.2) and float(ft["asr_after_std"]) == pytest.approx(0.1)
    assert float(ft["der_mean"]) == pytest.approx(0.85) and ft["auroc_mean"] == ""
    strip = next(r for r in defenses if r["defense"] == "strip")
    assert float(strip["auroc_mean"]) == pytest.approx(0.97) and strip["n"] == "1"

    text = files.markdown.read_text()
    mnist, cifar = text.index("## mnist5k"), text.index("## cifar10")
    assert cifar < mnist  # one section per dataset, sorted
    assert text.count("### Attacks (no defense)") == 2 and text.count("### Defenses") == 1
    lines = {line.split("`")[-2]: line for line in text.splitlines() if line.startswith("| ") and "`" in line}
    assert "| 96.00 ± 1.00 |" in lines["ga"] and "†" not in lines["ga"]  # n = 3: no flag
    assert "| 22.00 ± 1.00 |" in lines["ga"]
    assert "†" in lines["ge"] and "| epochs=1 | 2 |" in lines["ge"]  # n = 2: flagged
    assert "| strip | mnist_cnn | badnets | all2one(0) | 10 ep | – | 1 |" in lines["gs"] and "0.970 †" in lines["gs"]
    assert "† fewer than 3 seeds" in text


def test_setting_labels_name_only_what_differs():
    a = {"trainer": {"epochs": 10}, "attack": {"poison_rate": 0.1}, "defense": {"epochs": 5}, "seed": 0}
    b = {"trainer": {"epochs": 1}, "attack": {"poison_rate": 0.05}, "defense": {"epochs": 5}, "seed": 1}
    c = {"trainer": {"epochs": 10}, "attack": {"poison_rate": 0.1}, "defense": {"epochs": 2}, "seed": 0}
    assert setting_labels([a, b]) == ["epochs=10, poison_rate=0.1", "epochs=1, poison_rate=0.05"]
    # two differing keys with the same last name keep their full path
    assert setting_labels([a, b, c])[2] == "defense.epochs=2, poison_rate=0.1, trainer.epochs=10"
    assert setting_labels([a]) == [""]
    assert setting_labels([a, {**a, "seed": 3, "results_dir": "x"}]) == ["", ""]  # seed and results_dir never count


def test_filters_select_dataset_model_and_target_mode(tmp_path):
    write_runs(tmp_path)
    files = write_leaderboard(tmp_path, dataset="mnist5k", target_mode="all2all")
    text = files.markdown.read_text()
    assert "## cifar10" not in text and "wanet" in text and "badnets" not in text and "target_mode=all2all" in text
    assert files.n_rows == 1 and read_csv(files.csv["defenses"]) == []
    files = write_leaderboard(tmp_path, model="preact_resnet18")
    assert "## mnist5k" not in files.markdown.read_text() and files.n_rows == 1


def test_bad_filters_are_one_line_errors_and_write_nothing(tmp_path, capsys):
    write_runs(tmp_path)
    with pytest.raises(ConfigError, match="no record has dataset='svhn'; the records have dataset: cifar10, mnist5k"):
        write_leaderboard(tmp_path, dataset="svhn")
    assert main([f"results_dir={tmp_path}", "target_mode=some2some"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: target_mode='some2some' is unknown; choose one of: all2one, all2all"]
    assert main(["nonsense=1"]) == 2 and "unknown argument 'nonsense=1'" in capsys.readouterr().err
    assert main([f"results_dir={tmp_path / 'empty'}"]) == 2 and "has no runs/ folder" in capsys.readouterr().err
    assert not (tmp_path / "leaderboard").exists() and not (tmp_path / "empty").exists()


class TableParser(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tables, self.scripts, self.cell = [], [], None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "table":
            self.tables.append({"class": attrs.get("class"), "header": [], "rows": []})
        elif tag == "tr":
            self.tables[-1]["rows"].append([])
        elif tag in ("th", "td"):
            self.cell = [tag, attrs.get("data-sort"), ""]
        elif tag == "script":
            self.scripts.append(attrs)

    def handle_data(self, data):
        if self.cell is not None:
            self.cell[2] += data

    def handle_endtag(self, tag):
        if tag in ("th", "td") and self.cell is not None:
            kind, sort, text = self.cell
            if kind == "th":
                self.tables[-1]["header"].append(text)
            else:
                self.tables[-1]["rows"][-1].append((sort, text))
            self.cell = None


def test_html_page_is_self_contained_with_sortable_tables(tmp_path):
    write_runs(tmp_path)
    page = write_leaderboard(tmp_path).html.read_text()
    parser = TableParser()
    parser.feed(page)
    assert len(parser.tables) == 3 and all(t["class"] == "sortable" for t in parser.tables)
    assert parser.scripts == [{}]  # one inline script, no src: nothing is fetched
    assert "http://" not in page and "https://" not in page and "addEventListener(\"click\"" in page
    attacks = next(t for t in parser.tables if "PSNR dB" in t["header"] and len(t["rows"]) > 2)
    body = [r for r in attacks["rows"] if r]
    assert all(len(r) == len(attacks["header"]) for r in body)
    ca = attacks["header"].index("CA %")
    sorts = sorted(float(r[ca][0]) for r in body)  # numeric sort keys: the means, unrounded
    assert sorts == pytest.approx(sorted([0.96, 0.905, 0.93]))
    assert any(text == "96.00 ± 1.00" for r in body for _, text in r)


def test_broken_records_are_skipped_with_a_warning(tmp_path, capsys):
    write_runs(tmp_path)
    (tmp_path / "runs" / "corrupt.json").write_text("{oops")
    (tmp_path / "runs" / "old.json").write_text('{"schema_version": 0}')
    invalid = make_record(run_id="bad", group_id="gbad").to_dict()
    invalid["metrics"]["attacked"]["asr"] = "1.0"  # a number stored as a string
    (tmp_path / "runs" / "invalid.json").write_text(__import__("json").dumps(invalid))
    with pytest.warns(UserWarning) as caught:
        files = write_leaderboard(tmp_path)
    assert files.n_records == 11 and len(caught) == 3
    messages = [str(w.message) for w in caught]
    assert any("corrupt.json" in m for m in messages) and any("old.json" in m and "schema_version" in m for m in messages)
    assert any("invalid.json" in m and "metrics.attacked.asr" in m for m in messages)
    assert main([f"results_dir={tmp_path}"]) == 0
    captured = capsys.readouterr()
    warned = [line for line in captured.err.splitlines() if line]
    assert len(warned) == 3 and all(line.startswith("warning: skipping record ") for line in warned)
    assert "6 rows from 11 records" in captured.out


def test_ca_vs_clean_compares_with_the_control_trained_the_same_way(tmp_path):
    runs = tmp_path / "runs"
    for seed, ca in ((0, 0.98), (1, 0.96)):  # the clean control of the default trainer, both seeds
        save(runs, f"n{seed}", group="gn", seed=seed, attack="none", attacked=(ca, 0.001, 0.97),
             cfg=config(attack="none"))
    save(runs, "a0", group="ga", seed=0, attacked=(0.95, 1.0, 0.0))  # default trainer: 0.95 - 0.97
    save(runs, "e0", group="ge", seed=0, attacked=(0.90, 0.5, 0.4), cfg=config(epochs=1))  # no control at 1 epoch
    write_leaderboard(tmp_path)
    rows = {r["group_id"]: r for r in read_csv(tmp_path / "leaderboard" / "attacks.csv")}
    assert float(rows["ga"]["ca_vs_clean_mean"]) == pytest.approx(-0.02)
    assert float(rows["ga"]["ca_vs_clean_std"]) == pytest.approx(statistics.stdev([0.98, 0.96]))
    assert rows["ge"]["ca_vs_clean_mean"] == "" and rows["gn"]["ca_vs_clean_mean"] == ""
    text = (tmp_path / "leaderboard" / "leaderboard.md").read_text()
    assert "ΔCA vs clean" in text and "-2.00 † " in text
    save(runs, "a1", group="ga", seed=1, attacked=(0.97, 1.0, 0.0))  # two seeds: mean ± std, the std unsigned
    write_leaderboard(tmp_path)
    assert "-1.00 ± 2.00 †" in (tmp_path / "leaderboard" / "leaderboard.md").read_text()


def test_a_defense_whose_threat_model_excludes_the_attack_is_n_a_not_a_success(tmp_path):
    runs = tmp_path / "runs"
    reason = "wanet controls the victim's training ...; abl works on the stored training split only"
    for seed in (0, 1, 2):
        record_defense = {"name": "abl", "applicable": False, "not_applicable": reason}
        metrics = {"attacked": {"clean_acc": 0.95, "asr": 0.9, "ra": 0.05}, "defended": None, "der": None,
                   "detection": None}
        record = make_record(run_id=f"n{seed}", group_id="gn", seed=seed, dataset={"name": "mnist5k"},
                             model={"name": "mnist_cnn"},
                             attack={"name": "wanet", "target_mode": "all2one", "target": 0, "poison_rate": 0.1,
                                     "n_poisoned": 0, "poisoned_indices_sha256": "0" * 64},
                             defense=record_defense, metrics=metrics, stealth=None,
                             config=config(attack="wanet", defense={"_target_": "backdoorbench.defenses.abl.X"}))
        save_record(record, runs / "mnist5k" / "wanet_all2one" / f"n{seed}.json")
    files = write_leaderboard(tmp_path)
    row = next(r for r in read_csv(files.csv["defenses"]) if r["group_id"] == "gn")
    assert row["der_mean"] == row["asr_after_mean"] == row["ca_after_mean"] == "n/a"
    line = next(line for line in files.markdown.read_text().splitlines() if "`gn" in line)
    assert line.count("| n/a ") == 4 and "–" not in line.split("| 3 |")[1]
    assert "n/a where the defense's threat model excludes the attack" in files.markdown.read_text()
    assert ">n/a<" in files.html.read_text()


def test_a_cut_defense_budget_is_named_in_the_setting_column(tmp_path):
    runs = tmp_path / "runs"
    defense = {"_target_": "backdoorbench.defenses.fine_tuning.FineTuning", "budget": "cpu", "epochs": None}
    save(runs, "b0", group="gb", seed=0, defense="fine_tuning", defended=(0.95, 0.1, 0.8), der=0.9,
         cfg=config(defense=defense))
    files = write_leaderboard(tmp_path)
    row = next(r for r in read_csv(files.csv["defenses"]) if r["group_id"] == "gb")
    assert row["setting"] == "budget=cpu"  # the only row: nothing else differs, the cut is still named
