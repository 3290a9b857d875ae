"""Side by side with BackdoorBench: the same data, the same victim recipe, equal defense budgets.

Both toolkits get the same 4,000 / 1,000 mnist5k images, train a PreActResNet18 BadNets victim
(all-to-one to class 0, 10% poisoned, 7 epochs, SGD lr 0.01, cosine over the 7 epochs, batch 128),
and run fine-tuning, NAD, Neural Cleanse and I-BAU with the same budget and a 5% clean set; every
other value is each side's own default. The script writes one markdown table: CA / ASR after each
defense on either side (and Neural Cleanse's flagged classes), mean ± std over the seeds.

    python benchmarks/peer_compare.py --backdoorbench ~/src/BackdoorBench --bb-python ~/bb-venv/bin/python \\
        --device cuda:0 --seeds 0 1 2 --out peer_compare.md

The user supplies the BackdoorBench checkout (https://github.com/SCLBD/BackdoorBench, written
against f02e3534645f0ee63d6848653062cd6c0d6c400d) and a Python that has its requirements; this
project holds none of its code. What the script does to feed it:

- the split is written where BackdoorBench's `--dataset mnist` reads it: torchvision's MNIST files
  (idx, uncompressed) in `<work>/data/mnist/MNIST/raw/`, which torchvision takes as downloaded;
- the attack's yaml is BackdoorBench's own `config/attack/prototype/cifar10.yaml` (it ships none
  for MNIST) with the recipe above set, `cos_t_max: 7` included (its scheduler's T_max is 100
  unless a yaml sets it), written to `<work>/bb_config/`;
- its PreActResNet18 takes 3 channels and its MNIST path gives 1 (its tracker's open report
  "MNIST dataset not supported correctly", May 2025), so each of its scripts runs under a short launcher
  that converts torchvision's MNIST images to RGB before the script starts (`--no-gray-to-rgb`
  runs the scripts as they are);
- its results are read from the files its trainers write: `record/<name>/attack_df.csv` and
  `record/<name>/defense/<method>/<prefix>_df.csv` (or `_df_summary.csv`), the last row's
  `test_acc` and `test_asr`, and Neural Cleanse's "Flagged label list" from its log.

Ours runs as `python -m backdoorbench` (`--ours-command` replaces it) with the same recipe; each run's
record is the path its last `record:` line names. Any failure is one line on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shlex
import statistics
import struct
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

CHECKOUT_FILES = ("attack/badnet.py", "attack/prototype.py", "config/attack/prototype/cifar10.yaml",
                  "config/attack/badnet/default.yaml", "resource/badnet/trigger_image.png")
VICTIM_EPOCHS, VICTIM_LR, BATCH, POISON_RATE, TARGET, CLEAN_FRACTION = 7, 0.01, 128, 0.1, 0, 0.05
OURS_VICTIM = ("model=preact_resnet18", f"trainer.epochs={VICTIM_EPOCHS}", f"trainer.optimizer.lr={VICTIM_LR}",
               "trainer.schedule=cosine", f"trainer.batch_size={BATCH}", "attack=badnets", "attack.target_mode=all2one",
               f"attack.target={TARGET}", f"attack.poison_rate={POISON_RATE}")
# Run before each BackdoorBench script (argv: the script, then its arguments): torchvision's MNIST
# images become RGB, as its 3-channel PreActResNet18 needs; the script then runs as `__main__`.
TO_RGB = (
    "from torchvision.datasets import MNIST\n"
    "_item = MNIST.__getitem__\n"
    "MNIST.__getitem__ = lambda self, i: (lambda pair: (pair[0].convert('RGB'),) + tuple(pair[1:]))(_item(self, i))\n"
)
PLAIN = "import runpy, sys\nsys.argv = sys.argv[1:]\nrunpy.run_path(sys.argv[0], run_name='__main__')\n"
GRAY_TO_RGB = TO_RGB + PLAIN


class PeerError(Exception):
    """A one-line reason the comparison can't go on."""


@dataclass(frozen=True)
class Row:
    """One defense on both sides: BackdoorBench's script, yaml and budget flags, ours as overrides."""

    label: str
    budget: str
    script: str
    yaml: str
    folder: str  # record/<name>/defense/<folder>/
    prefix: str  # <prefix>_df.csv
    bb_args: tuple[str, ...]
    ours: tuple[str, ...]


ROWS = {
    "fine_tuning": Row("fine-tuning", "20 epochs", "defense/ft.py", "config/defense/ft/config.yaml", "ft", "ft",
                       ("--epochs", "20"), ("defense=fine_tuning", "defense.epochs=20")),
    "nad": Row("NAD", "10 + 10 epochs", "defense/nad.py", "config/defense/nad/config.yaml", "nad", "nad",
               ("--te_epochs", "10", "--epochs", "10"), ("defense=nad", "defense.teacher_epochs=10", "defense.epochs=10")),
    "neural_cleanse": Row("Neural Cleanse", "15 search epochs, 5 unlearning", "defense/nc.py",
                          "config/defense/nc/config.yaml", "nc", "nc", ("--nc_epoch", "15", "--epochs", "5"),
                          ("defense=neural_cleanse", "defense.epochs=15", "defense.unlearn_epochs=5")),
    "i_bau": Row("I-BAU", "5 rounds, K = 5", "defense/i-bau.py", "config/defense/i-bau/config.yaml", "i-bau", "i-bau",
                 ("--n_rounds", "5", "--K", "5"), ("defense=i_bau", "defense.rounds=5", "defense.hypergrad_iterations=5")),
}


def check_checkout(path: Path, rows: list[str]) -> Path:
    """The checkout's root, or a one-line PeerError saying what is missing."""
    path = path.expanduser()
    if not path.exists():
        raise PeerError(f"--backdoorbench {path}: no such folder; clone https://github.com/SCLBD/BackdoorBench there")
    if not path.is_dir():
        raise PeerError(f"--backdoorbench {path} is a file; give the folder of a BackdoorBench checkout")
    needed = list(CHECKOUT_FILES) + [p for name in rows for p in (ROWS[name].script, ROWS[name].yaml)]
    missing = [p for p in needed if not (path / p).is_file()]
    if missing:
        raise PeerError(f"--backdoorbench {path} is not a BackdoorBench checkout: {missing[0]} is missing"
                        f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}; "
                        "clone https://github.com/SCLBD/BackdoorBench (f02e353 or later)")
    return path.resolve()


def write_idx(path: Path, array) -> None:
    """One torchvision MNIST file: uint8 images (N, 28, 28) as idx3, or labels (N,) as idx1."""
    header = struct.pack(">II", 2049, len(array)) if array.ndim == 1 else struct.pack(">IIII", 2051, *array.shape)
    path.write_bytes(header + array.astype("uint8").tobytes())


def prepare_data(work: Path, data=None) -> Path:
    """mnist5k's split (`data`, loaded when None) as torchvision MNIST files under
    `<work>/data/mnist/MNIST/raw/`; returns `<work>/data`, BackdoorBench's `--dataset_path` (it
    appends `/mnist`)."""
    if data is None:
        from backdoorbench.datasets.mnist5k import load_mnist5k

        data = load_mnist5k()
    raw = work / "data" / "mnist" / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for stem, split in (("train", data.train), ("t10k", data.test)):
        write_idx(raw / f"{stem}-images-idx3-ubyte", split.images[:, 0].numpy())
        write_idx(raw / f"{stem}-labels-idx1-ubyte", split.labels.numpy())
    return work / "data"


def attack_yaml(bb: Path, work: Path, data_path: Path, device: str) -> Path:
    """BackdoorBench's CIFAR-10 prototype yaml with the shared victim recipe, for `--dataset mnist`."""
    import yaml

    values = yaml.safe_load((bb / "config/attack/prototype/cifar10.yaml").read_text())
    values.update(dataset="mnist", dataset_path=str(data_path), epochs=VICTIM_EPOCHS, lr=VICTIM_LR,
                  lr_scheduler="CosineAnnealingLR", cos_t_max=VICTIM_EPOCHS, model="preactresnet18",
                  batch_size=BATCH, device=device, amp=False)
    path = work / "bb_config" / "mnist5k_prototype.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(values, sort_keys=True))
    return path


def run_logged(cmd: list[str], cwd: Path, log: Path, what: str) -> str:
    """Run `cmd`, its output to `log`; its stdout, or a PeerError with its last line."""
    log.parent.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    except OSError as exc:
        raise PeerError(f"{what} could not start ({cmd[0]}): {exc.strerror or exc}") from exc
    log.write_text(f"$ {shlex.join(cmd)}\n{done.stdout}\n{done.stderr}")
    if done.returncode != 0:
        tail = next((line for line in reversed((done.stderr + done.stdout).splitlines()) if line.strip()), "no output")
        raise PeerError(f"{what} failed (exit {done.returncode}): {tail.strip()[:300]}; full log: {log}")
    return done.stdout


def last_row(folder: Path, prefix: str, what: str) -> dict[str, float]:
    """CA and ASR (percent) of the last row of `<prefix>_df.csv`, else of `<prefix>_df_summary.csv`."""
    for name in (f"{prefix}_df.csv", f"{prefix}_df_summary.csv"):
        path = folder / name
        if path.is_file():
            with path.open(newline="") as handle:
                rows = [r for r in csv.DictReader(handle) if r.get("test_acc") not in (None, "")]
            if not rows or "test_asr" not in rows[-1]:
                raise PeerError(f"{what}: {path} has no row with test_acc and test_asr")
            try:
                return {"ca": 100 * float(rows[-1]["test_acc"]), "asr": 100 * float(rows[-1]["test_asr"])}
            except ValueError as exc:
                raise PeerError(f"{what}: {path}'s last row is not numeric: {exc}") from exc
    raise PeerError(f"{what} wrote no {folder / f'{prefix}_df.csv'} (nor {prefix}_df_summary.csv)")


def bb_flags(folder: Path) -> list[int] | None:
    """The classes BackdoorBench's Neural Cleanse flagged (its log's last "Flagged label list"), [] for
    none, None when it left no log."""
    logs = sorted((folder / "log").glob("*.log")) if (folder / "log").is_dir() else []
    if not logs:
        return None
    flagged: list[int] = []
    for line in "\n".join(p.read_text(errors="replace") for p in logs).splitlines():
        if "Flagged label list:" in line:
            flagged = [int(m) for m in re.findall(r"(\d+)\s*:\s*[-+.\deE]+", line.split("Flagged label list:", 1)[1])]
    return flagged


def run_backdoorbench(bb: Path, python: str, work: Path, seed: int, names: list[str], device: str,
                      rgb: bool, data_path: Path) -> dict[str, dict]:
    """The attack, then each defense, for one seed; {"victim"/name: {"ca", "asr", ("flags")}}."""
    launcher = GRAY_TO_RGB if rgb else PLAIN
    # a fresh folder per run (two runs in one second must not read each other's results)
    name = f"peer_badnet_s{seed}_{int(time.time())}_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    logs = work / "logs" / name
    common = ["--dataset", "mnist", "--dataset_path", str(data_path), "--device", device, "--random_seed", str(seed)]
    yaml_path = attack_yaml(bb, work, data_path, device)
    run_logged([python, "-c", launcher, "attack/badnet.py", "--yaml_path", str(yaml_path),
                "--bd_yaml_path", "config/attack/badnet/default.yaml", "--patch_mask_path",
                "resource/badnet/trigger_image.png", "--save_folder_name", name, "--attack_target", str(TARGET),
                "--pratio", str(POISON_RATE), *common], bb, logs / "attack.log", "BackdoorBench's attack/badnet.py")
    record = bb / "record" / name
    out = {"victim": last_row(record, "attack", "BackdoorBench's attack/badnet.py")}
    for key in names:
        row = ROWS[key]
        run_logged([python, "-c", launcher, row.script, "--result_file", name, "--yaml_path", row.yaml,
                    "--ratio", str(CLEAN_FRACTION), *row.bb_args, *common], bb, logs / f"{key}.log",
                   f"BackdoorBench's {row.script}")
        folder = record / "defense" / row.folder
        out[key] = last_row(folder, row.prefix, f"BackdoorBench's {row.script}")
        if key == "neural_cleanse":
            out[key]["flags"] = bb_flags(folder)
    return out


def read_record(stdout: str, what: str) -> dict:
    """The record a run of ours names on its last `record:` line."""
    paths = [line.split("record:", 1)[1].strip() for line in stdout.splitlines() if line.startswith("record:")]
    if not paths:
        raise PeerError(f"{what} printed no 'record: <path>' line")
    try:
        return json.loads(Path(paths[-1]).read_text())
    except (OSError, ValueError) as exc:
        raise PeerError(f"{what}: its record {paths[-1]} can't be read: {exc}") from exc


def run_ours(command: list[str], work: Path, seed: int, names: list[str], device: str) -> dict[str, dict]:
    """Each defense of ours (the victim trained by the first run, then taken from the cache)."""
    out: dict[str, dict] = {}
    base = [*command, f"results_dir={work / 'ours'}", f"seed={seed}", f"device={device.split(':')[0]}",
            "eval.stealth_images=0", *OURS_VICTIM]
    for key in names:
        what = f"ours ({ROWS[key].label}, seed {seed})"
        record = read_record(run_logged([*base, *ROWS[key].ours, f"defense.clean_fraction={CLEAN_FRACTION}"],
                                        Path.cwd(), work / "logs" / f"ours_{key}_s{seed}.log", what), what)
        try:
            attacked, defended = record["metrics"]["attacked"], record["metrics"]["defended"]
            out.setdefault("victim", {"ca": 100 * attacked["clean_acc"], "asr": 100 * attacked["asr"]})
            out[key] = {"ca": 100 * defended["clean_acc"], "asr": 100 * defended["asr"]}
        except (KeyError, TypeError) as exc:
            raise PeerError(f"{what}: its record has no metrics.attacked/defended ({exc})") from exc
        if key == "neural_cleanse":
            extras = (record.get("defense") or {}).get("extras") or {}
            out[key]["flags"] = extras.get("flagged")
    return out


def cell(runs: list[dict], key: str) -> str:
    """`CA / ASR` (mean ± std over the runs where there are several), and NC's flags per run."""
    values = [r[key] for r in runs if key in r]
    if not values:
        return "–"
    parts = []
    for metric in ("ca", "asr"):
        xs = [v[metric] for v in values]
        parts.append(f"{xs[0]:.1f}" if len(xs) == 1 else f"{statistics.mean(xs):.1f} ± {statistics.stdev(xs):.1f}")
    text = " / ".join(parts)
    flags = [v["flags"] for v in values if "flags" in v]
    if flags:
        text += ", flags " + "; ".join("–" if f is None else f"[{', '.join(str(c) for c in f)}]" for f in flags)
    return text


def table(bb_runs: list[dict], our_runs: list[dict], names: list[str], seeds: list[int]) -> str:
    """The markdown table: one row for the victim, one per defense."""
    lines = [f"mnist5k, PreActResNet18, BadNets all2one (target {TARGET}, {POISON_RATE:.0%} poisoned), "
             f"victim {VICTIM_EPOCHS} epochs SGD {VICTIM_LR} cosine; {CLEAN_FRACTION:.0%} clean set; "
             f"seeds {', '.join(map(str, seeds))}; CA / ASR in %",
             "", "| defense | budget | BackdoorBench CA / ASR after | ours CA / ASR after |", "|---|---|---|---|",
             f"| none (victim) | {VICTIM_EPOCHS} epochs | {cell(bb_runs, 'victim')} | {cell(our_runs, 'victim')} |"]
    lines += [f"| {ROWS[k].label} | {ROWS[k].budget} | {cell(bb_runs, k)} | {cell(our_runs, k)} |" for k in names]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backdoorbench", required=True, type=Path, help="a BackdoorBench checkout (its root folder)")
    parser.add_argument("--bb-python", default=sys.executable, help="a Python with BackdoorBench's requirements")
    parser.add_argument("--ours-command", default=f"{shlex.quote(sys.executable)} -m backdoorbench",
                        help="how ours is run (split like a shell line)")
    parser.add_argument("--defenses", nargs="+", default=list(ROWS), help=f"a subset of: {', '.join(ROWS)}")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda:0 (ours gets cpu or cuda)")
    parser.add_argument("--work", type=Path, default=Path("peer_compare_work"), help="data, configs, logs, our records")
    parser.add_argument("--out", type=Path, help="also write the table to this file")
    parser.add_argument("--no-gray-to-rgb", dest="rgb", action="store_false",
                        help="run BackdoorBench's scripts without converting MNIST to RGB")
    args = parser.parse_args(argv)
    unknown = [d for d in args.defenses if d not in ROWS]
    if unknown:
        parser.error(f"--defenses {unknown[0]!r} is unknown; choose from: {', '.join(ROWS)}")
    if not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
        parser.error(f"--device {args.device!r}: use cpu, cuda or cuda:<index>")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        bb = check_checkout(args.backdoorbench, args.defenses)
        work = args.work.expanduser().resolve()
        work.mkdir(parents=True, exist_ok=True)
        data_path = prepare_data(work)
        command = shlex.split(args.ours_command)
        bb_runs, our_runs = [], []
        for seed in args.seeds:
            bb_runs.append(run_backdoorbench(bb, args.bb_python, work, seed, args.defenses, args.device, args.rgb,
                                             data_path))
            our_runs.append(run_ours(command, work, seed, args.defenses, args.device))
        text = table(bb_runs, our_runs, args.defenses, args.seeds)
        if args.out is not None:
            args.out.write_text(text)
    except PeerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
