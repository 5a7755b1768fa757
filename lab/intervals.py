"""Intervals for comparing runs: the mean of a few seeds with its Student-t interval, and the difference
of two arms, paired by seed (a paired t-test) or not (Welch's). tools/report.py, recall.py, needle.py,
eval_lengths.py and lab/lr_view.py use them."""
import math
import statistics

LEVEL = 0.95


def t_quantile(df: float) -> float:
    """The two-sided 95% quantile of Student's t with df degrees of freedom (df may be fractional)."""
    from scipy import stats
    return float(stats.t.ppf(0.5 + LEVEL / 2, df))


def describe(values: list) -> dict:
    """n, mean, sd (n - 1 in the denominator) and the half width of the 95% t-interval of the mean;
    sd and the interval are None for one value."""
    n = len(values)
    if n == 0:
        return {"n": 0, "mean": None, "sd": None, "half": None}
    mean = statistics.fmean(values)
    if n == 1:
        return {"n": 1, "mean": mean, "sd": None, "half": None}
    sd = statistics.stdev(values)
    return {"n": n, "mean": mean, "sd": sd, "half": t_quantile(n - 1) * sd / math.sqrt(n)}


def paired_interval(a: list, b: list) -> dict:
    """b - a for values paired by position: the mean difference, the half width of its 95%
    t-interval and the p-value of the paired t-test (Student 1908)."""
    from scipy import stats

    d = [y - x for x, y in zip(a, b)]
    half = t_quantile(len(d) - 1) * statistics.stdev(d) / math.sqrt(len(d))
    p = float(stats.ttest_rel(b, a).pvalue) if any(d) else 1.0
    return {"diff": statistics.fmean(d), "half": half, "p": p, "df": len(d) - 1, "test": "paired t", "n": len(d)}


def welch_interval(a: list, b: list) -> dict:
    """mean(b) - mean(a) for independent samples: Welch's t-test, its Welch-Satterthwaite degrees
    of freedom and the half width of the 95% interval of the difference (Welch 1947)."""
    from scipy import stats

    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1)) if va + vb > 0 else math.inf
    half = t_quantile(df) * math.sqrt(va + vb) if va + vb > 0 else 0.0
    p = float(stats.ttest_ind(b, a, equal_var=False).pvalue) if va + vb > 0 else 1.0
    return {"diff": statistics.fmean(b) - statistics.fmean(a), "half": half, "p": p, "df": df, "test": "Welch t",
            "n": min(len(a), len(b))}


def replicate_interval(a: dict, b: dict) -> dict:
    """b minus a for values keyed by replicate (seed, data seed): paired where both ran the same
    replicates (two or more), else Welch's with two or more in each; {} where no interval can be given."""
    if set(a) == set(b) and len(a) >= 2:
        keys = sorted(a, key=str)
        return paired_interval([a[k] for k in keys], [b[k] for k in keys])
    if len(a) >= 2 and len(b) >= 2:
        return welch_interval(list(a.values()), list(b.values()))
    return {}


# ----------------------------------------------------------------------------- the Wilson interval

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile: a two-sided 95% interval


def wilson(right: int, n: int, z: float = Z95) -> tuple:
    """The Wilson score interval of a proportion right/n (Wilson 1927, JASA 22:209): the p whose
    normal test at p does not reject right/n; unlike p ± z·se it stays inside [0, 1] and is not zero
    wide at 0 or n right."""
    p, z2 = right / n, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return (0.0 if right == 0 else centre - half), (1.0 if right == n else centre + half)  # exact there
