"""The leaderboard is built from records only: the defense x attack matrix first, tables per dataset,
mean/std/n over seeds, the n < 3 flag, setting labels, filters, canonical rows apart from the sweeps,
columns that carry nothing hidden, the HTML page (sorted per table in a real headless Chromium), and
broken records skipped with a warning."""

import csv
import re
import statistics
import urllib.parse
from html.parser import HTMLParser

import pytest

from backdoorbench.errors import ConfigError
from backdoorbench.leaderboard import main, write_leaderboard
from backdoorbench.report.cells import DEFENSE_COLUMNS, Cell, cell_text
from backdoorbench.report.query import rerun_command, setting_label
from backdoorbench.records import save_record
from tests.chromium import Chromium, find_chromium
from tests.test_records import make_record


def config(epochs=10, rate=0.1, mode="all2one", attack="badnets", defense=None):
    return {"seed": 0, "results_dir": "ignored", "trainer": {"epochs": epochs, "progress": False},
            "attack": {"_target_": f"backdoorbench.attacks.{attack}.X", "poison_rate": rate, "target_mode": mode},
            "defense": defense}


def stealth(psnr, ssim, lpips=None):
    return {"psnr": {"mean": psnr, "std": 1.0}, "ssim": {"mean": ssim, "std": 0.01},
            "lpips": None if lpips is None else {"mean": lpips, "std": 0.0}}


def save(runs, name, *, group, seed, dataset="mnist5k", model="mnist_cnn", attack="badnets", mode="all2one",
         defense="none", attacked=(0.97, 1.0, 0.0), defended=None, der=None, detection=None, cfg=None, st=None,
         created="2026-12-01T00:00:00+00:00", overrides=None, env=None, defense_info=None, benign=None):
    ca, asr, ra = attacked
    metrics = {"attacked": {"clean_acc": ca, "asr": asr, "ra": ra},
               "defended": None if defended is None else dict(zip(("clean_acc", "asr", "ra"), defended)),
               "der": der, "detection": detection}
    record = make_record(run_id=name, group_id=group, seed=seed, dataset={"name": dataset}, model={"name": model},
                         attack={"name": attack, "target_mode": mode, "target": 0 if mode == "all2one" else None,
                                 "poison_rate": 0.1, "n_poisoned": 400, "poisoned_indices_sha256": "0" * 64},
                         defense={"name": defense, **(defense_info or {})}, metrics=metrics, stealth=st,
                         config=cfg or config(), created_at=created, benign=benign,
                         overrides=overrides or [f"attack={attack}", f"seed={seed}"],
                         env=env or {"torch": "x", "git_commit": None})
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
         detection={"tpr": 0.9, "fpr": 0.01, "auroc": 0.97}, defense_info={"stage": "input"},
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
    # Different settings of one attack are different rows; the setting column names the method's own
    # values off its defaults (none here), the training column the victim's budget.
    assert default["setting"] == ""
    short = next(r for r in attacks if r["group_id"] == "ge")
    assert default["training"] == "10 ep" and short["training"] == "1 ep"  # the budget is visible on every row
    assert short["setting"] == "" and short["n"] == "2" and short["lpips_n"] == "0" and short["lpips_mean"] == ""
    defenses = read_csv(files.csv["defenses"])
    ft = next(r for r in defenses if r["defense"] == "fine_tuning")
    assert float(ft["asr_after_mean"]) == pytest.approx(0.2) and float(ft["asr_after_std"]) == pytest.approx(0.1)
    assert float(ft["der_mean"]) == pytest.approx(0.85) and ft["auroc_mean"] == ""
    strip = next(r for r in defenses if r["defense"] == "strip")
    assert float(strip["auroc_mean"]) == pytest.approx(0.97) and strip["n"] == "1"

    text = files.markdown.read_text()
    mnist, cifar = text.index("## mnist5k"), text.index("## cifar10")
    assert text.index("## Defense x attack") < cifar < mnist  # the matrix first, then a section per dataset, sorted
    assert text.count("### Attacks (no defense)") == 2 and text.count("### Defenses") == 1
    lines = {line.split("`")[-2]: line for line in text.splitlines() if line.startswith("| ") and "`" in line}
    assert "| 96.00 ± 1.00 |" in lines["ga"] and "†" not in lines["ga"]  # n = 3: no flag
    assert "| 22.00 ± 1.00 |" in lines["ga"]
    assert "†" in lines["ge"] and "| 1 ep | 2 |" in lines["ge"]  # n = 2: flagged
    # model, mode, training and setting are the same in every defense row: stated once, not per row
    assert "| strip | badnets | 1 |" in lines["gs"] and "0.970 †" in lines["gs"]
    assert "In every row: model mnist_cnn, mode all2one(0), training 10 ep, setting –." in text
    assert "† fewer than 3 seeds" in text


def test_a_setting_label_names_the_methods_own_values_off_their_defaults():
    assert setting_label({"attack": {"poison_rate": 0.05, "pattern": "white"}, "defense": {"lr": 0.01}}) == \
        "lr=0.01, pattern=white, poison_rate=0.05"
    # a key both methods set keeps its owner; values print as %g, lists and null as JSON
    assert setting_label({"attack": {"epochs": 30}, "defense": {"epochs": 2, "betas": [500, 1000], "x": None}}) == \
        "attack.epochs=30, betas=[500, 1000], defense.epochs=2, x=null"
    assert setting_label({"attack": {}, "defense": {}}) == "" and setting_label({}) == ""
    assert setting_label({"defense": {"clean_fraction": 0.01, "u": 3.0}}, ("clean_fraction",)) == "u=3"


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
    grids = [t for t in parser.tables if t["class"] == "grid"]
    boards = [t for t in parser.tables if t["class"] == "sortable detection"]  # STRIP's detection
    parser.tables = [t for t in parser.tables if t["class"] not in ("grid", "sortable detection")]
    assert len(parser.tables) == 3 and all(t["class"] == "sortable" for t in parser.tables) and len(boards) == 1
    assert len(grids) == 2 and page.index('class="grid"') < page.index('class="sortable')  # the page opens on them
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


def test_a_record_of_an_older_trainer_schema_finds_its_control_by_what_it_computed(tmp_path):
    """Records of commit 6e38712 carry the retired `trainer.amp` and lack `rotation`; a CPU run never
    autocast, so amp: true on the CPU trained as precision=auto does there (fp32): the same control.
    On CUDA amp meant bf16, which a CPU fp32 control does not match."""
    runs = tmp_path / "runs"
    current = config(attack="none")
    current["trainer"].update(precision="auto", rotation=0.0, rotation_p=0.5)
    save(runs, "n0", group="gn", seed=0, attack="none", attacked=(0.98, 0.001, 0.97), cfg=current,
         env={"device": "cpu", "precision": "fp32"})
    old = config()
    old["trainer"]["amp"] = True
    save(runs, "a0", group="ga", seed=0, attacked=(0.95, 1.0, 0.0), cfg=old, env={"device": "cpu"})
    save(runs, "g0", group="gg", seed=0, attacked=(0.96, 1.0, 0.0), cfg=config(rate=0.2) | {"trainer": old["trainer"]},
         env={"device": "cuda:0"})
    rotated = config(rate=0.3)
    rotated["trainer"].update(precision="auto", rotation=10, rotation_p=0.5)
    save(runs, "r0", group="gr", seed=0, attacked=(0.96, 1.0, 0.0), cfg=rotated, env={"device": "cpu", "precision": "fp32"})
    write_leaderboard(tmp_path)
    rows = {r["group_id"]: r for r in read_csv(tmp_path / "leaderboard" / "attacks.csv")}
    assert float(rows["ga"]["ca_vs_clean_mean"]) == pytest.approx(-0.03)
    assert rows["gg"]["ca_vs_clean_mean"] == "" and rows["gr"]["ca_vs_clean_mean"] == ""


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
    # CA after, ASR after, DER, AUROC, ASR after reactivation, cost s, passes/img, benign FP, ASR spread
    assert line.count("| n/a ") == 9 and "–" not in line.split("| 3 |")[1]
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


def test_canonical_rows_are_one_per_attack_and_mode_the_rest_are_sweeps(tmp_path):
    write_runs(tmp_path)
    runs = tmp_path / "runs"
    # a later 3-seed setting of the same attack and mode supersedes the earlier one (a protocol rerun)
    for seed in (0, 1, 2):
        save(runs, f"l{seed}", group="gl", seed=seed, cfg=config(epochs=20), created="2026-12-02T00:00:00+00:00")
    # a clean control is canonical when a canonical row is compared with it (same trainer)
    save(runs, "n0", group="gn", seed=0, attack="none", attacked=(0.98, 0.0, 0.98), cfg=config(attack="none", epochs=20))
    save(runs, "m0", group="gm", seed=0, attack="none", attacked=(0.98, 0.0, 0.98), cfg=config(attack="none", epochs=1))
    # the same control under an older trainer schema (amp, no rotation key), made earlier: one control is enough
    older = config(attack="none", epochs=20)
    older["trainer"]["amp"] = True
    save(runs, "o0", group="go", seed=0, attack="none", attacked=(0.98, 0.0, 0.98), cfg=older,
         created="2026-11-01T00:00:00+00:00")
    files = write_leaderboard(tmp_path)
    attacks = {r["group_id"]: r["canonical"] for r in read_csv(files.csv["attacks"])}
    assert attacks == {"gl": "true", "ga": "false", "ge": "false", "gw": "true", "gc": "true", "gn": "true", "gm": "false",
                       "go": "false"}
    assert {r["canonical"] for r in read_csv(files.csv["defenses"])} == {"true"}  # one setting per defense x attack
    text = files.markdown.read_text()
    mnist = text[text.index("## mnist5k"):]
    canonical, other = mnist.index("#### Canonical (3 rows)"), mnist.index("#### Other settings: sweeps and earlier protocols (4 rows)")
    assert canonical < mnist.index("`gl`") < mnist.index("`gn`") < other < mnist.index("`ga`")
    assert "#### Canonical (2 rows)" in mnist  # the defenses
    page = files.html.read_text()
    assert page.count(' class="canonical">') == 6 and page.count(' class="other">') == 4


def test_columns_that_carry_nothing_are_hidden_and_zero_spreads_not_printed(tmp_path):
    runs = tmp_path / "runs"
    for seed in (0, 1, 2):  # a fixed trigger: the same stealth for every seed; LPIPS absent everywhere
        save(runs, f"a{seed}", group="ga", seed=seed, attacked=(0.96 + seed / 100, 1.0, 0.0), st=stealth(21.0, 0.9))
    save(runs, "e0", group="ge", seed=0, attacked=(0.9, 0.5, 0.4), cfg=config(epochs=1), st=stealth(21.0, 0.9))
    files = write_leaderboard(tmp_path)
    text = files.markdown.read_text()
    header = next(line for line in text.splitlines() if line.startswith("| attack"))
    assert header == "| attack | training | n | CA % | ASR % | RA % | PSNR dB | SSIM | config |"
    assert "In every row: model mnist_cnn, mode all2one(0), setting –. Not shown, no row has a value: LPIPS, ΔCA vs clean." in text
    row = next(line for line in text.splitlines() if "`ga`" in line)
    assert row.endswith("| 3 | 97.00 ± 1.00 | 100.00 | 0.00 | 21.00 | 0.9000 | `ga` |")  # no "± 0.00"
    assert "± 0.0" not in text and "± 0.0" not in files.html.read_text()
    parser = TableParser()
    parser.feed(files.html.read_text())
    sortable = [t for t in parser.tables if t["class"] == "sortable"]
    assert sortable[0]["header"][:3] == ["attack", "training", "n"] and "LPIPS" not in sortable[0]["header"]
    assert read_csv(files.csv["attacks"])[0]["lpips_n"] == "0"  # the CSV keeps every column


def test_each_row_links_its_records_and_the_command_that_reruns_it(tmp_path):
    write_runs(tmp_path)
    page = write_leaderboard(tmp_path).html.read_text()
    links = re.findall(r'href="\.\./([^"]+)"', page)
    assert len(links) == 12 and all((tmp_path / urllib.parse.unquote(link)).is_file() for link in links)
    assert len(set(links)) == 11  # STRIP's record twice: from the defense table and from the detection board
    assert "python -m backdoorbench --multirun attack=badnets seed=0,1,2" in page and "README.md" not in page
    (tmp_path / "README.md").write_text("the commands")
    assert 'href="../README.md"' in write_leaderboard(tmp_path).html.read_text()
    overrides = ["attack=wanet", "trainer.epochs=30", "seed=2", "results_dir=/x", "trainer.progress=False", "++cache=false"]
    records = [make_record(seed=seed, overrides=overrides) for seed in (2, 0)]
    assert rerun_command(records) == "python -m backdoorbench --multirun attack=wanet trainer.epochs=30 seed=0,2"
    assert rerun_command(records[:1]) == "python -m backdoorbench attack=wanet trainer.epochs=30 seed=2"


BROWSER = find_chromium()
PAGE_STATE = """(function () { return Array.prototype.map.call(document.querySelectorAll("table.sortable"), function (table) {
  return {headers: Array.prototype.map.call(table.tHead.rows[0].cells, function (th) {
            return {text: th.textContent, type: th.getAttribute("data-type")}; }),
          rows: Array.prototype.map.call(table.tBodies[0].rows, function (tr) {
            return Array.prototype.map.call(tr.cells, function (td) { return td.getAttribute("data-sort"); }); }),
          shown: Array.prototype.map.call(table.tBodies[0].rows, function (tr) {
            return tr.offsetParent === null ? "" : tr.className; }).filter(Boolean)};
}); })()"""


def center_of(browser, selector, index=0):
    """Scroll the element into view (the page and its table's box) and return its centre in the viewport."""
    return browser.evaluate(f"""(function () {{
      var e = document.querySelectorAll({selector!r})[{index}];
      e.scrollIntoView({{block: "center", inline: "center"}});
      var r = e.getBoundingClientRect(); return [r.left + r.width / 2, r.top + r.height / 2]; }})()""")


@pytest.mark.skipif(BROWSER is None, reason="no Chromium on PATH (chromium, chromium-browser or google-chrome); "
                                             ".ci/run installs Debian's chromium")
def test_every_numeric_header_of_every_table_sorts_in_a_real_browser(tmp_path):
    write_runs(tmp_path)
    runs = tmp_path / "runs"
    # group ids that parseFloat reads as numbers (0, 1e10, 9): the config column must sort them as text
    for group, rate in (("1e10aaaa", 0.01), ("9f00aaaa", 0.02), ("0d21aaaa", 0.05), ("5aaaaaaa", 0.2)):
        save(runs, group, group=group, seed=0, attacked=(0.9 - rate, 4 * rate, 0.1), cfg=config(rate=rate))
    page = write_leaderboard(tmp_path).html
    with Chromium(BROWSER, width=700, height=220) as browser:
        browser.open(page)
        tables = browser.evaluate(PAGE_STATE)
        # the detection board (STRIP's), then cifar10 attacks, mnist5k attacks, defenses
        assert [len(t["rows"]) for t in tables] == [1, 1, 7, 2]
        clicks = 0
        for t, table in enumerate(tables):
            whole_rows = sorted(map(tuple, table["rows"]))
            for c, header in enumerate(table["headers"]):
                if header["type"] != "number":
                    continue
                for ascending in (True, False):
                    browser.click(*center_of(browser, "table.sortable th", sum(len(x["headers"]) for x in tables[:t]) + c))
                    rows = browser.evaluate(PAGE_STATE)[t]["rows"]
                    assert sorted(map(tuple, rows)) == whole_rows  # rows move whole
                    keys = [row[c] for row in rows]
                    present = [float(k) for k in keys if k != ""]
                    assert present == sorted(present, reverse=not ascending), (t, header["text"], keys)
                    assert keys[len(present):] == [""] * (len(keys) - len(present))  # missing values last, both ways
                    clicks += 1
        assert clicks == 2 * sum(h["type"] == "number" for t in tables for h in t["headers"]) >= 2 * 12
        attacks = tables[2]
        hashes = [h["text"] for h in attacks["headers"]].index("config")
        browser.click(*center_of(browser, "table.sortable th", len(tables[0]["headers"]) + len(tables[1]["headers"])
                                 + hashes))
        keys = [row[hashes] for row in browser.evaluate(PAGE_STATE)[2]["rows"]]
        assert keys == sorted(keys) and keys[:4] == ["0d21aaaa", "1e10aaaa", "5aaaaaaa", "9f00aaaa"]
        assert browser.errors == []

        # the canonical rows by default; the sweeps on their own one click away
        assert browser.evaluate(PAGE_STATE)[2]["shown"] == ["canonical"] * 2
        browser.click(*center_of(browser, "input[value=other]"))
        assert browser.evaluate(PAGE_STATE)[2]["shown"] == ["other"] * 5
        browser.click(*center_of(browser, "input[value=all]"))
        assert len(browser.evaluate(PAGE_STATE)[2]["shown"]) == 7

        # too wide for 700 px: the table's box scrolls, not the page; its header stays in sight
        box = "document.querySelectorAll('.scroll')[2]"
        assert browser.evaluate("document.documentElement.scrollWidth") <= 700
        assert browser.evaluate(f"{box}.scrollWidth > {box}.clientWidth && {box}.scrollHeight > {box}.clientHeight")
        top = browser.evaluate(f"{box}.scrollTop = 1e6, {box}.scrollTop")
        gap = browser.evaluate(f"{box}.querySelector('th').getBoundingClientRect().top - {box}.getBoundingClientRect().top")
        assert top > 0 and 0 <= gap <= 2
        # a matrix cell is a link to its row in the tables
        browser.click(*center_of(browser, "table.grid td a"))
        assert browser.evaluate("location.hash") == "#row-gc"
        assert browser.evaluate("document.querySelector('tr:target').id") == "row-gc"
        assert browser.errors == []


def test_an_old_record_of_an_excluded_pair_is_n_a_too(tmp_path):
    # A record made before the pipeline asked the defense (schema 2: no `applicable`, no `report`)
    # is upgraded on load with the judgement frozen for its classes: ABL vs WaNet is n/a, vs BadNets not.
    import json

    runs = tmp_path / "runs"
    for attack, cls in (("wanet", "WaNet"), ("badnets", "BadNets")):
        cfg = config(attack=attack, defense={"_target_": "backdoorbench.defenses.abl.AntiBackdoorLearning"})
        cfg["attack"]["_target_"] = f"backdoorbench.attacks.{attack}.{cls}"
        save(runs, f"o{attack}", group=f"g{attack}", seed=0, attack=attack, defense="abl",
             defended=(0.95, 0.1, 0.8), der=0.95, cfg=cfg)
        path = runs / "mnist5k" / f"{attack}_all2one" / f"o{attack}.json"
        data = json.loads(path.read_text())
        del data["report"]
        path.write_text(json.dumps({**data, "schema_version": 2}))
    rows = {r["group_id"]: r for r in read_csv(write_leaderboard(tmp_path).csv["defenses"])}
    assert rows["gwanet"]["der_mean"] == "n/a" and rows["gwanet"]["asr_after_mean"] == "n/a"
    assert float(rows["gbadnets"]["der_mean"]) == 0.95


def test_the_setting_column_names_only_the_methods_own_values_never_a_schema(tmp_path):
    """Records older than a config key lack it, and a row whose optional stage ran has more eval keys:
    neither is a setting. The label is the record's `report.setting`: the attack's and the defense's
    own values off their protocol's defaults, so an older schema never labels a row."""
    runs = tmp_path / "runs"
    older = config()
    newer = config() | {"eval": {"probe": {"lr": 0.1}, "reactivation": {"enabled": True, "epochs": 5}}}
    save(runs, "o0", group="go", seed=0, cfg=older)
    save(runs, "n0", group="gn", seed=0, cfg=newer)
    save(runs, "r0", group="gr", seed=0, cfg=config(rate=0.05))
    rows = {r["group_id"]: r for r in read_csv(write_leaderboard(tmp_path).csv["attacks"])}
    assert rows["go"]["setting"] == rows["gn"]["setting"] == "" and rows["gr"]["setting"] == "poison_rate=0.05"
    assert "another schema" not in (tmp_path / "leaderboard" / "leaderboard.md").read_text()


def test_the_canonical_attack_row_is_the_one_at_the_attack_defaults():
    from backdoorbench.protocols import attack_at_defaults
    assert attack_at_defaults({"name": "adaptive_blend", "poison_rate": 0.1, "cover_rate": 0.1, "target_mode": "all2all"}, "adaptive_blend")
    assert not attack_at_defaults({"poison_rate": 0.0375, "cover_rate": 0.0375}, "adaptive_blend")
    assert not attack_at_defaults({"poison_rate": 0.1}, "no_such_attack")


def test_a_cost_cell_gives_its_mean_and_std_the_same_decimals():
    passes = next(c for c in DEFENSE_COLUMNS if c.key == "passes_per_img")
    # activation clustering's passes over three seeds: 12.97, 13.05, 13.01 (a std of 0.04)
    values = [12.97, 13.05, 13.01]
    cell = Cell(mean=statistics.mean(values), std=statistics.stdev(values), n=3)
    assert cell_text(cell, passes, row_n=3) == "13.01 ± 0.04"
    assert cell_text(Cell(mean=0.00025, std=0.0, n=3), passes, row_n=3) == "0.00"


def test_the_board_opens_on_the_defense_x_attack_matrix_of_canonical_cells(tmp_path):
    write_runs(tmp_path)
    reason = "wanet controls the victim's training; abl reads the stored training split"
    save(tmp_path / "runs", "x0", group="gx", seed=0, attack="wanet", mode="all2all", defense="abl", defended=(0.9, 0.9, 0.0),
         der=0.5, cfg=config(attack="wanet", mode="all2all", defense={"_target_": "backdoorbench.defenses.abl.X"}))
    path = tmp_path / "runs" / "mnist5k" / "wanet_all2all" / "x0.json"
    path.write_text(path.read_text().replace('"applicable": true', '"applicable": false').replace(
        '"not_applicable": null', f'"not_applicable": "{reason}"'))
    files = write_leaderboard(tmp_path)
    text = files.markdown.read_text()
    grid = text.split("### mnist5k, quick protocol, mnist_cnn")[1].split("\n\n")[1].splitlines()
    # the undefended victim first, then the defenses; the columns are the attacks a defense met
    assert grid[0] == "| defense | badnets all2one(0) | wanet all2all |"
    assert grid[2] == "| none | 96.0 ± 1.0 / 99.0 ± 1.0 (n=3) | 93.0 / 80.0 (n=1 †) |"
    assert grid[3:] == ["| abl | – | n/a |", "| fine_tuning | 95.0 / 20.0 ± 10.0 (n=3) | – |",
                        "| strip | 90.0 / 5.0 (n=1 †) | – |"]
    # a dataset no defense was run on: the victims of every attack
    assert "### cifar10, quick protocol, preact_resnet18\n\n| defense | badnets all2one(0) |" in text
    assert text.index("## Defense x attack") < text.index("## cifar10, quick protocol")
    page = files.html.read_text()
    assert page.index('id="matrix"') < page.index('id="tables"')
    cell = re.search(r'<td style="background: ([^"]+)"[^>]*><a href="#row-gs">', page)
    assert cell and cell.group(1) == "hsl(114, 70%, 82%)"  # 5% ASR after: near green
    assert 'id="row-gs"' in page and f'title="{reason}">n/a<' in page.replace("&#x27;", "'")


SPECTRAL = {"_target_": "backdoorbench.defenses.spectral.SpectralSignatures"}
DETECTION_ONLY = {"eval": {"detection_only": True}}
REASON = "detection only (eval.detection_only=true): nothing was retrained"


def spectral_detection(tpr, fpr=0.1, f1=0.5, auroc=0.9, n_flagged=500):
    return {"tpr": tpr, "fpr": fpr, "f1": f1, "auroc": auroc, "n_flagged": n_flagged}


def write_detection_runs(results_dir):
    """Spectral against BadNets as full runs (2 seeds) and detection-only runs (3 seeds), against
    Blended once of each, detection-only on a clean victim (its benign FP), n/a against LIRA; STRIP
    against BadNets, a record from before F1; fine-tuning, which detects nothing."""
    runs = results_dir / "runs"
    dataset_level = {"stage": "pre_train"}
    for seed, tpr in ((0, 0.2), (1, 0.3)):
        save(runs, f"sf{seed}", group="gsf", seed=seed, defense="spectral", defended=(0.9, 0.5, 0.4), der=0.7,
             detection=spectral_detection(tpr), cfg=config(defense=SPECTRAL), defense_info=dataset_level)
    for seed, (tpr, f1) in enumerate(((0.8, 0.5), (0.9, 0.6), (1.0, 0.7))):
        save(runs, f"sd{seed}", group="gsd", seed=seed, defense="spectral", detection=spectral_detection(tpr, f1=f1),
             cfg=config(defense=SPECTRAL) | DETECTION_ONLY, defense_info={**dataset_level, "detection_only": True})
    # one seed of each on Blended: the full run is taken, although the detection-only one is newer
    save(runs, "bf0", group="gbf", seed=0, attack="blended", defense="spectral", defended=(0.9, 0.5, 0.4), der=0.7,
         detection=spectral_detection(0.4), cfg=config(attack="blended", defense=SPECTRAL), defense_info=dataset_level)
    save(runs, "bd0", group="gbd", seed=0, attack="blended", defense="spectral", detection=spectral_detection(0.5),
         cfg=config(attack="blended", defense=SPECTRAL) | DETECTION_ONLY, defense_info=dataset_level,
         created="2026-12-03T00:00:00+00:00")
    for seed, share in ((0, 0.1), (1, 0.2)):  # the clean victim: every flag is a false positive
        save(runs, f"nd{seed}", group="gnd", seed=seed, attack="none", defense="spectral", attacked=(0.98, 0.0, 0.98),
             detection={"tpr": None, "fpr": share, "f1": 0.0, "auroc": None, "n_flagged": int(share * 4000)},
             benign={"measure": "share of the clean training set removed", "false_positive": share},
             cfg=config(attack="none", defense=SPECTRAL) | DETECTION_ONLY, defense_info=dataset_level)
    save(runs, "l0", group="gl", seed=0, attack="lira", defense="spectral", cfg=config(attack="lira", defense=SPECTRAL),
         defense_info={**dataset_level, "applicable": False, "not_applicable": "lira poisons in its own step"})
    save(runs, "s0", group="gs", seed=0, defense="strip", defended=(0.90, 0.05, 0.0), der=0.95,
         detection={"tpr": 0.9, "fpr": 0.01, "auroc": 0.97, "threshold": -0.2}, defense_info={"stage": "input"},
         cfg=config(defense={"_target_": "backdoorbench.defenses.strip.Strip"}))
    save(runs, "ft0", group="gft", seed=0, defense="fine_tuning", defended=(0.95, 0.1, 0.8), der=0.9,
         defense_info={"stage": "post_train"},
         cfg=config(defense={"_target_": "backdoorbench.defenses.fine_tuning.FineTuning"}))
    for name in ("sd0", "sd1", "sd2", "bd0", "nd0", "nd1"):  # as a detection-only run writes them
        path = next(runs.rglob(f"{name}.json"))
        path.write_text(path.read_text().replace('"der": null,', f'"der": null, "defended_reason": "{REASON}",'))


def test_the_detection_board_has_a_cell_per_detector_and_attack_from_full_and_detection_only_runs(tmp_path):
    write_detection_runs(tmp_path)
    files = write_leaderboard(tmp_path)
    board = {r["group_id"]: r for r in read_csv(files.csv["detection"])}
    # BadNets: the 3 detection-only seeds beat the 2 full ones; Blended: a tie of one seed each, the full run
    assert sorted(board) == ["gbf", "gl", "gs", "gsd"]
    sd = board["gsd"]
    assert (sd["level"], sd["detector"], sd["run"], sd["n"], sd["seeds"]) == ("dataset", "spectral", "detection only",
                                                                              "3", "0 1 2")
    assert float(sd["tpr_mean"]) == pytest.approx(0.9) and float(sd["tpr_std"]) == pytest.approx(0.1)
    assert float(sd["f1_mean"]) == pytest.approx(0.6) and float(sd["fpr_mean"]) == pytest.approx(0.1)
    assert float(sd["benign_fp_mean"]) == pytest.approx(0.15) and sd["benign_fp_n"] == "2"  # the clean victim's
    assert float(sd["benign_fp_std"]) == pytest.approx(statistics.stdev([0.1, 0.2]))
    assert board["gbf"]["run"] == "full" and float(board["gbf"]["tpr_mean"]) == pytest.approx(0.4)
    assert board["gl"]["tpr_mean"] == "n/a" and board["gs"]["level"] == "input" and board["gs"]["f1_mean"] == ""

    text = files.markdown.read_text()
    section = text[text.index("## Detection"):text.index("\n## mnist5k, quick protocol\n")]
    dataset_part = section[section.index("#### Dataset-level"):section.index("#### Input-level")]
    lines = {line.split("`")[-2]: line for line in dataset_part.splitlines() if line.startswith("| ") and "`" in line}
    assert lines["gsd"] == ("| spectral | badnets | – | 3 | detection only | 90.00 ± 10.00 | 10.00 | 0.600 ± 0.100 "
                            "| 0.900 | 15.00 ± 7.07 (n=2) † | `gsd` |")
    assert lines["gbf"].startswith("| spectral | blended | – | 1 | full | 40.00 † |")
    # (a LIRA config without its defaults: a setting label)
    assert lines["gl"].startswith("| spectral | lira | poison_rate=0.1 | 1 | full | n/a | n/a | n/a | n/a | n/a |")
    assert "In every row: mode all2one(0), training 10 ep." in dataset_part
    input_part = section[section.index("#### Input-level"):]
    assert "| strip | badnets | all2one(0) | 10 ep | – | 1 | full | 90.00 † | 1.00 † | 0.970 † | `gs` |" in input_part
    assert "Not shown, no row has a value: F1, benign FP %." in input_part
    assert "fine_tuning" not in section and "`gsf`" not in section
    # detection-only runs are no repair result: not in the defense table, nor in the matrix
    defenses = {r["group_id"] for r in read_csv(files.csv["defenses"])}
    assert defenses == {"gsf", "gbf", "gl", "gs", "gft"}
    grid = text[text.index("## Defense x attack"):text.index("## Detection")]
    assert "| spectral | 90.0 / 50.0 (n=2 †) | 90.0 / 50.0 (n=1 †) | n/a |" in grid
    assert files.n_rows == 8 and files.n_records == 12

    page = files.html.read_text()
    parser = TableParser()
    parser.feed(page)
    boards = [t for t in parser.tables if t["class"] == "sortable detection"]
    assert [len([r for r in t["rows"] if r]) for t in boards] == [3, 1]
    assert page.index('id="matrix"') < page.index('id="detection"') < page.index('id="tables"')
    assert '<a href="#detection">Detection</a>' in page
    header = boards[0]["header"]
    row = dict(zip(header, next(r for r in boards[0]["rows"] if r and r[1][1] == "badnets")))
    assert float(row["TPR %"][0]) == pytest.approx(0.9) and row["TPR %"][1] == "90.00 ± 10.00"  # sorts by the mean
    assert row["run"][1] == "detection only" and row["config"][0] == "gsd"


def test_without_a_detecting_run_there_is_no_detection_board(tmp_path):
    save(tmp_path / "runs", "ft0", group="gft", seed=0, defense="fine_tuning", defended=(0.95, 0.1, 0.8), der=0.9,
         cfg=config(defense={"_target_": "backdoorbench.defenses.fine_tuning.FineTuning"}))
    files = write_leaderboard(tmp_path)
    assert "## Detection" not in files.markdown.read_text() and 'href="#detection"' not in files.html.read_text()
    assert files.csv["detection"].read_text().count("\n") == 1  # the header only


@pytest.mark.skipif(BROWSER is None, reason="no Chromium on PATH (chromium, chromium-browser or google-chrome); "
                                             ".ci/run installs Debian's chromium")
def test_the_detection_board_sorts_and_stays_shown_in_every_view_in_a_real_browser(tmp_path):
    write_detection_runs(tmp_path)
    page = write_leaderboard(tmp_path).html
    board = """(function () { return Array.prototype.map.call(document.querySelectorAll("table.detection"),
      function (table) { return Array.prototype.map.call(table.tBodies[0].rows, function (tr) {
        return [tr.offsetParent !== null].concat(Array.prototype.map.call(tr.cells, function (td) {
          return td.getAttribute("data-sort"); })); }); }); })()"""
    with Chromium(BROWSER, width=900, height=400) as browser:
        browser.open(page)
        headers = browser.evaluate("Array.prototype.map.call(document.querySelectorAll('table.detection')[0]"
                                   ".tHead.rows[0].cells, function (th) { return th.textContent; })")
        tpr = headers.index("TPR %")
        first = browser.evaluate("Array.prototype.indexOf.call(document.querySelectorAll('table.sortable th'), "
                                 "document.querySelectorAll('table.detection th')[0])")
        for ascending in (True, False):
            browser.click(*center_of(browser, "table.sortable th", first + tpr))
            rows = browser.evaluate(board)[0]
            keys = [row[1 + tpr] for row in rows]
            present = [float(k) for k in keys if k not in ("", "n/a")]
            assert present == sorted(present, reverse=not ascending) and len(present) == 2, keys
        for view in ("other", "all", "canonical"):  # each board row is a canonical cell: shown in every view
            browser.click(*center_of(browser, f"input[value={view}]"))
            assert all(row[0] for table in browser.evaluate(board) for row in table)
        assert browser.errors == []
