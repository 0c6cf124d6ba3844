"""Pearson chi-square goodness of fit, p-value from the regularised upper incomplete gamma
(torch.special.gammaincc; no scipy)."""
from __future__ import annotations

import torch


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0
                      ) -> float:
    """counts [V] observed, probs [V] expected distribution. Cells with expected count below
    `min_expected` are pooled into one cell (so the chi-square approximation holds)."""
    counts, probs = counts.double(), probs.double() / probs.sum()
    n = counts.sum()
    expected = probs * n
    small = expected < min_expected
    if small.any():
        counts = torch.cat([counts[~small], counts[small].sum().reshape(1)])
        expected = torch.cat([expected[~small], expected[small].sum().reshape(1)])
        if expected[-1] == 0:
            assert counts[-1] == 0, "a token of probability 0 was sampled"
            counts, expected = counts[:-1], expected[:-1]
    stat = ((counts - expected) ** 2 / expected).sum()
    df = counts.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         stat / 2.0))
