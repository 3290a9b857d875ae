"""SCAn: decompose learned representations into a class identity and a variation shared by every class,
estimated on clean data; per class, test whether two identities (an untangled subgroup) explain its
training samples better than one, and flag the class whose statistic stands out (pre-training detection)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.linalg
import torch
from torch import Tensor

from backdoorbench import checks
from backdoorbench.defenses.base import Defense, DefenseContext, DefenseResult
from backdoorbench.errors import ConfigError
from backdoorbench.models.taps import penultimate_features

IDENTITIES = ("paper", "official_code")
MAD_NORMAL = 1.4826  # the anomaly index's consistency constant (the official `median(b) * 1.4826`)
SPLIT_STEPS = 100  # the untangling's rounds at most (the official `steps < 100`)


@dataclass
class GlobalModel:
    """The clean decomposition r = identity + variation, in the coordinates of `basis` (d, r): S_u the
    identities' covariance, S_e the variation's, shared by every class."""

    basis: np.ndarray
    su: np.ndarray
    se: np.ndarray
    iterations: int

    def project(self, features: np.ndarray) -> np.ndarray:
        """(n, d) -> (n, r): centred on their own mean (as the official local model), then projected."""
        return (features - features.mean(0, keepdims=True)) @ self.basis


def variation_basis(x: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Orthonormal axes (d, r) of the span of the clean within-class variation, eigenvalues above
    numpy's rank tolerance. The official works in all d dimensions with pinv(S_e); a direction in which
    no clean sample varies within its class gets no weight there, and here it is dropped, so S_e is
    invertible in what is kept (it is singular when the clean set holds fewer samples than dimensions)."""
    residual = x.copy()
    for cls in np.unique(labels):
        residual[labels == cls] -= residual[labels == cls].mean(0)
    vals, vecs = np.linalg.eigh(residual.T @ residual)
    keep = vals > max(float(vals.max()), 0.0) * len(vals) * np.finfo(np.float64).eps
    if not keep.any():
        raise ConfigError("defense=scan: the clean samples show no variation within any class (a class needs 2 "
                          "clean samples or more); raise defense.clean_fraction")
    return vecs[:, keep]


def shrinkage(su: np.ndarray, se: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """W, lam with W' S_e W = I and W' S_u W = diag(lam), so (n S_u + S_e)^-1 = W diag(1 / (n lam + 1)) W'."""
    lam, w = scipy.linalg.eigh(su, se)
    return w, np.clip(lam, 0.0, None)


def identities(sums: np.ndarray, counts: np.ndarray, su: np.ndarray, se: np.ndarray,
               mode: str = "paper") -> np.ndarray:
    """Per group k of counts[k] samples summing to sums[k]: the identity estimate S_u (n S_u + S_e)^-1 s,
    the posterior mean of the identity given the samples (the paper's G = -(n S_u + S_e)^-1 S_u S_e^-1 in
    -S_e G s, the same matrix; the official EM's). `official_code`: S_e (n S_u + S_e)^-1 s, the official
    `calc_test` (Matlab and Python, copied by BackdoorBench and backdoor-toolbox), which leaves out S_u S_e^-1."""
    w, lam = shrinkage(su, se)
    scaled = (sums @ w) / (np.asarray(counts, dtype=np.float64)[:, None] * lam + 1.0)
    return scaled @ w.T @ (su if mode == "paper" else se)


def fit_global(features: np.ndarray, labels: np.ndarray, *, tol: float = 1e-5, max_iters: int = 100) -> GlobalModel:
    """The official `build_global_model`: EM on the clean samples. Start from the class means (S_u the
    covariance of each sample's class mean, S_e of its residual); then each identity is re-estimated as
    its posterior mean and S_u, S_e as the (unbiased) covariances of the samples' identities and
    residuals, until ||dS_u|| + ||dS_e|| (Frobenius) <= tol or max_iters rounds. Computed from sums per
    class, so a round costs O(L r^2 + r^3), not O(N r^2) as the official loop over samples."""
    basis = variation_basis(features - features.mean(0), labels)
    x = (features - features.mean(0)) @ basis
    classes, index, counts = np.unique(labels, return_inverse=True, return_counts=True)
    n = len(x)
    sums = np.zeros((len(classes), x.shape[1]))
    np.add.at(sums, index, x)
    gram, total = x.T @ x, sums.sum(0)

    def covariances(u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # rows u[index] (each sample's identity) and x - u[index] (its variation), np.cov's n - 1
        weighted = u.T * counts
        mean_u = weighted.sum(1) / n
        su = (weighted @ u - n * np.outer(mean_u, mean_u)) / (n - 1)
        cross = sums.T @ u
        mean_e = (total - counts @ u) / n
        se = (gram - cross - cross.T + weighted @ u - n * np.outer(mean_e, mean_e)) / (n - 1)
        return su, se

    su, se = covariances(sums / counts[:, None])
    iterations = 0
    for iterations in range(1, max_iters + 1):
        new_su, new_se = covariances(identities(sums, counts, su, se))
        step = np.linalg.norm(new_su - su) + np.linalg.norm(new_se - se)
        su, se = new_su, new_se
        if step <= tol:
            break
    return GlobalModel(basis, su, se, iterations)


def whitener(se: np.ndarray):
    """z(x) with ||z(a) - z(b)||^2 = (a - b)' S_e^-1 (a - b): the Mahalanobis metric of the variation."""
    chol = np.linalg.cholesky(se)
    return lambda v: scipy.linalg.solve_triangular(chol, np.atleast_2d(v).T, lower=True).T


def untangle(z: np.ndarray, start: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The official `find_split` on whitened rows z: two identities sharing the variation, i.e. two
    means under the S_e metric. `start` (uniform [0, 1) per sample) puts >= 0.5 in subgroup 1; each
    round takes the two subgroups' means and reassigns every sample to the nearer (a tie goes to
    subgroup 2), until nothing moves, everything swaps, or 100 rounds. Returns (in subgroup 1, u1, u2)."""
    n = len(z)
    first = start >= 0.5
    if n == 1:
        return np.zeros(1, dtype=bool), z[0].copy(), z[0].copy()
    if not first.any():
        first[0] = True
    if first.all():
        first[0] = False
    u1, u2 = z[first].mean(0), z[~first].mean(0)
    for _ in range(SPLIT_STEPS):
        if first.all() or not first.any():
            break
        u1, u2 = z[first].mean(0), z[~first].mean(0)
        moved = ((z - u1) ** 2).sum(1) < ((z - u2) ** 2).sum(1)
        if (moved == first).all() or (moved != first).all():
            first = moved
            break
        first = moved
    return first, u1, u2


def j_statistic(z: np.ndarray, mu: np.ndarray, first: np.ndarray, u1: np.ndarray, u2: np.ndarray) -> float:
    """The official `calc_test` on whitened rows: the mean over the class of ||z - mu||^2 - ||z - u_g||^2,
    mu the class's one identity, u_g its sample's subgroup identity: twice the log-likelihood ratio of
    the two-identity model over the one-identity model, per sample."""
    own = np.where(first[:, None], u1, u2)
    return float((((z - mu) ** 2).sum(1) - ((z - own) ** 2).sum(1)).mean())


def anomaly_index(values: np.ndarray) -> np.ndarray:
    """The official `calc_anomaly_index`: |J - median| / (1.4826 MAD) (numpy's median; its division by
    max(J) first cancels). A zero MAD is floored at 1e-12 so the index stays finite."""
    spread = np.abs(values - np.median(values))
    return spread / max(MAD_NORMAL * float(np.median(spread)), 1e-12)


@dataclass
class ClassSplit:
    members: np.ndarray  # training indices of the class
    suspicious: np.ndarray  # bool per member: in the subgroup holding fewer of the defender's clean samples
    log_ratio: np.ndarray  # per member: log-likelihood of the suspicious subgroup minus the other's
    j: float


def detect(train: np.ndarray, train_labels: np.ndarray, clean: np.ndarray, clean_labels: np.ndarray,
           num_classes: int, generator: torch.Generator, *, threshold: float = math.exp(2), identity: str = "paper",
           tol: float = 1e-5, max_iters: int = 100) -> tuple[Tensor, Tensor, dict[str, Any]]:
    """Scores, flags and statistics of the training features (N, d) with their labels, the global model
    fitted on the clean features. The local model sees the training set (centred on its own mean, as
    the official); the defender's clean samples, already in it, tell which subgroup is the clean one."""
    model = fit_global(clean.astype(np.float64), clean_labels, tol=tol, max_iters=max_iters)
    whiten = whitener(model.se)
    both = np.concatenate([train, clean]).astype(np.float64)
    projected = model.project(both)  # one centring for both: the clean samples sit among the training ones
    x, x_clean = projected[: len(train)], projected[len(train):]
    splits: dict[int, ClassSplit] = {}
    for cls in range(num_classes):
        members = np.nonzero(train_labels == cls)[0]
        if len(members) < 2:  # one sample cannot hold two subgroups: left out of the index, score 0
            continue
        z = whiten(x[members])
        start = torch.rand(len(members), generator=generator, dtype=torch.float64).numpy()
        first, u1, u2 = untangle(z, start)
        mu = identities(x[members].sum(0, keepdims=True), [len(members)], model.su, model.se, identity)
        j = j_statistic(z, whiten(mu)[0], first, u1, u2)
        own_clean = whiten(x_clean[clean_labels == cls])
        clean_first = int((((own_clean - u1) ** 2).sum(1) < ((own_clean - u2) ** 2).sum(1)).sum())
        clean_second = len(own_clean) - clean_first
        # the subgroup with fewer clean samples is the suspicious one (BackdoorBench's and backdoor-toolbox's
        # rule); on a tie, the smaller subgroup, as poison is a minority of its class
        if clean_first != clean_second:
            suspicious_is_first = clean_first < clean_second
        else:
            suspicious_is_first = int(first.sum()) < len(first) - int(first.sum())
        far, near = (u1, u2) if suspicious_is_first else (u2, u1)
        log_ratio = (((z - near) ** 2).sum(1) - ((z - far) ** 2).sum(1)) / 2
        splits[cls] = ClassSplit(members, first if suspicious_is_first else ~first, log_ratio, j)

    scores = torch.zeros(len(train))
    flagged = torch.zeros(len(train), dtype=torch.bool)
    tested = sorted(splits)
    j_values = np.array([splits[c].j for c in tested])
    index = anomaly_index(j_values) if len(tested) else j_values
    median = float(np.median(j_values)) if len(tested) else 0.0
    suspected = [c for c, ai, j in zip(tested, index, j_values) if ai > threshold and j > median]
    for cls in tested:
        split = splits[cls]
        # the sample's log-likelihood ratio (suspicious subgroup over the other) weighed by its class's J,
        # so a sample of a class whose two subgroups stand apart ranks above any of a class that is one
        scores[split.members] = torch.from_numpy(split.log_ratio * max(split.j, 0.0)).float()
        if cls in suspected:
            flagged[split.members[split.suspicious]] = True
    stats = {"j": {str(c): float(j) for c, j in zip(tested, j_values)},
             "anomaly_index": {str(c): float(a) for c, a in zip(tested, index)},
             "suspected_classes": suspected, "em_iterations": model.iterations, "variation_rank": int(model.basis.shape[1])}
    return scores, flagged, stats


class Scan(Defense):
    """SCAn (Tang, Wang, Tang, Zhang, "Demon in the Variant: Statistical Analysis of DNNs for Robust
    Backdoor Contamination Detection", USENIX Security 2021).

    A sample's representation (the penultimate features) is modelled as r = u + e, the identity u of its
    class (covariance S_u) plus a variation e shared by every class (covariance S_e), both estimated by
    EM on the defender's clean samples. Per class of the training set, an untangling model splits the
    class into two subgroups with their own identities and the shared variation (two-means under the
    S_e^-1 metric), and J, the per-sample log-likelihood ratio of the two-identity model over one
    identity, measures how much better two explain it. A class whose J stands out from the others'
    (anomaly index |J - median| / (1.4826 MAD) > e^2, J above the median) is flagged as contaminated, and
    its subgroup holding fewer of the defender's clean samples is flagged. Ledger: docs/fidelity.md#scan.

    Sample score: half the difference of the sample's squared S_e-Mahalanobis distances to its class's
    clean and suspicious subgroup identities (its log-likelihood ratio, suspicious over clean) times
    max(J, 0) of its class: positive in the suspicious subgroup, and large only where the class's two
    subgroups stand apart, so one AUROC ranks across classes.

    Departures: the class's one identity in J is the paper's, its posterior mean S_u (n S_u + S_e)^-1 sum r
    (as the official EM's); the official `calc_test` (Matlab and Python, copied by BackdoorBench and
    backdoor-toolbox) leaves out S_u S_e^-1 there (an open pull request of the authors' repository
    restores it); `identity=official_code` reproduces the code. The
    anomaly index is the official two-sided one, but a class is flagged only with J above the median
    (an unusually small J is no mixture). The clean samples come from the clean subset (part of the
    training set), so the local model runs on the training set alone and the clean samples of the
    class are assigned to the nearer subgroup to pick the clean one. Directions with no clean within-
    class variation are dropped (pinv(S_e) gives them no weight). A class with fewer than 2 training
    samples is not tested (score 0).
    """

    name = "scan"
    family = "latent_separation"
    sensitivity = ("threshold",)  # swept by conf/experiment/sensitivity_scan.yaml
    stage = "pre_train"
    needs_clean_data = True
    meets_training_controlled_attacks = False

    def __init__(self, *, threshold: float = math.exp(2), identity: str = "paper", em_tol: float = 1e-5,
                 max_iters: int = 100, clean_fraction: float = 0.05) -> None:
        super().__init__(clean_fraction=clean_fraction)
        if identity not in IDENTITIES:
            raise ConfigError(f"defense.identity={identity!r} is unknown; choose one of: {', '.join(IDENTITIES)}")
        self.threshold = checks.number("defense", "threshold", threshold, 0, low_open=True, high_open=True,
                                       hint="the anomaly index above which a class is flagged; the paper: e^2 = 7.389")
        self.em_tol = checks.number("defense", "em_tol", em_tol, 0, low_open=True, high_open=True,
                                    hint="BackdoorBench's EM tolerance: 1e-5")
        self.max_iters = checks.integer("defense", "max_iters", max_iters, 1, hint="the official EM rounds: 100")
        self.identity = identity

    def check_model(self, model) -> None:
        if not callable(getattr(model, "features", None)):
            raise ConfigError(f"defense=scan reads penultimate features, but {type(model).__name__} has no "
                              ".features(x); choose another model")

    def apply(self, ctx: DefenseContext) -> DefenseResult:
        train, clean = ctx.poisoned_train, ctx.clean_subset
        device, batch = ctx.trainer.device, ctx.trainer.eval_batch_size
        train_features = penultimate_features(ctx.model, train.images, device, batch)
        clean_features = penultimate_features(ctx.model, clean.images, device, batch)
        scores, flagged, stats = detect(train_features.double().numpy(), train.labels.numpy(),
                                        clean_features.double().numpy(), clean.labels.numpy(), ctx.num_classes,
                                        ctx.generator, threshold=self.threshold, identity=self.identity,
                                        tol=self.em_tol, max_iters=self.max_iters)
        return DefenseResult(sample_scores=scores, flagged=flagged,
                             extras={**stats, "feature_dim": int(train_features.shape[1])})

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "threshold": self.threshold, "identity": self.identity, "em_tol": self.em_tol,
                "max_iters": self.max_iters}
