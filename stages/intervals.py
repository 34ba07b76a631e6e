"""Error bars for evaluations: how sure a score, and a difference of scores, is. Design: docs/algorithms.md."""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

Z_95 = NormalDist().inv_cdf(0.975)
Z_80_POWER = NormalDist().inv_cdf(0.80)


@dataclass(frozen=True)
class Estimate:
    """A mean with its standard error over ``n`` units (prompts or seeds) and its 95% interval."""

    mean: float
    se: float
    n: int
    low: float
    high: float
    method: str  # how the interval was made, for people ("paired z over 200 prompts")

    def holds(self, value: float) -> bool:
        return self.low <= value <= self.high

    @property
    def within_noise(self) -> bool:
        """For a difference: its interval holds 0."""
        return self.holds(0.0)

    def text(self, digits: int = 3) -> str:
        return f"{self.mean:+.{digits}f} [{self.low:+.{digits}f}, {self.high:+.{digits}f}]"


def mean_and_se(values: list[float]) -> tuple[float, float]:
    """Mean and standard error of the mean (sample standard deviation over sqrt(n); SE 0 for n < 2)."""
    n = len(values)
    if n == 0:
        raise ValueError("no values to average")
    mean = math.fsum(values) / n
    if n < 2:
        return mean, 0.0
    variance = math.fsum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(variance / n)


def clustered_mean_and_se(values: list[float], clusters: list | None = None) -> tuple[float, float]:
    """Mean and its cluster-robust SE (e.g. by question): Var = C/(C-1) * sum_c (sum_i in c r_i)^2 / n^2, residuals
    r summed within each cluster c; with every value its own cluster, the plain SE of ``mean_and_se``."""
    if clusters is None:
        return mean_and_se(values)
    if len(clusters) != len(values):
        raise ValueError(f"{len(values)} values but {len(clusters)} cluster labels")
    mean = math.fsum(values) / len(values)
    sums: dict = {}
    for value, cluster in zip(values, clusters):
        sums[cluster] = sums.get(cluster, 0.0) + value - mean
    c = len(sums)
    if c < 2:
        return mean, 0.0
    return mean, math.sqrt(c / (c - 1) * math.fsum(r * r for r in sums.values())) / len(values)


def _prompts(n: int, clusters: list | None) -> str:
    distinct = len(set(clusters)) if clusters is not None else n
    return f"{n} prompts" + (f" ({distinct} distinct)" if distinct != n else "")


def prompt_estimate(per_prompt: list[float], clusters: list | None = None) -> Estimate:
    """A score's mean over prompts, its SE clustered by prompt (or ``clusters``, a label a prompt), 95% z interval."""
    mean, se = clustered_mean_and_se(per_prompt, clusters)
    return Estimate(mean, se, len(per_prompt), mean - Z_95 * se, mean + Z_95 * se,
                    f"z over {_prompts(len(per_prompt), clusters)}")


def paired_difference(a: list[float], b: list[float], clusters: list | None = None) -> Estimate:
    """b - a on the same prompts, in order: the mean per-prompt difference, 95% z interval as ``prompt_estimate``."""
    if len(a) != len(b):
        raise ValueError(f"a paired difference needs the same prompts: {len(a)} against {len(b)}")
    mean, se = clustered_mean_and_se([y - x for x, y in zip(a, b)], clusters)
    return Estimate(mean, se, len(a), mean - Z_95 * se, mean + Z_95 * se,
                    f"paired z over {_prompts(len(a), clusters)}")


def t_quantile_975(df: int) -> float:
    """The 97.5% quantile of Student's t with ``df`` degrees of freedom (bisection on the CDF)."""
    if df < 1:
        raise ValueError("a t interval needs at least 2 observations")

    def cdf(t: float) -> float:  # through the regularised incomplete beta, by Simpson's rule on the density
        steps = 2000
        h = t / steps
        c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
        density = [c * (1 + (i * h) ** 2 / df) ** (-(df + 1) / 2) for i in range(steps + 1)]
        area = h / 3 * (density[0] + density[-1] + 4 * sum(density[1:-1:2]) + 2 * sum(density[2:-1:2]))
        return 0.5 + area

    low, high = 0.0, 100.0
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if cdf(middle) < 0.975 else (low, middle)
    return (low + high) / 2


def seed_estimate(per_seed: list[float]) -> Estimate:
    """A mean over seeds (of scores, or paired differences) with a 95% t interval (seeds - 1 df); one seed has no
    spread: SE 0 and an infinite interval, not a false certainty."""
    mean, se = mean_and_se(per_seed)
    n = len(per_seed)
    if n < 2:
        return Estimate(mean, 0.0, n, -math.inf, math.inf, "1 seed: no spread over seeds")
    half = t_quantile_975(n - 1) * se
    return Estimate(mean, se, n, mean - half, mean + half, f"t over {n} seeds")


def minimum_detectable_difference(se_difference: float) -> float:
    """The smallest true difference a two-sided 5% test detects with 80% power, given the difference's SE."""
    return (Z_95 + Z_80_POWER) * se_difference


def unpaired_se(se_a: float, se_b: float) -> float:
    """SE of a difference of two independent means: what a paired SE is bounded by when the prompts'
    scores are positively correlated (the usual case), so it stands in where per-prompt scores are missing."""
    return math.sqrt(se_a**2 + se_b**2)
