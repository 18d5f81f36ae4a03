"""Compare one recorded sequence of phase names with the expected one.

Finds missing phases (with multiplicity: ``empty_cache`` twice per step), phases recorded
out of order (those outside a longest common subsequence), duplicates and unexpected names.
A missing phase is a *tail* when it is expected after everything that was recorded: the
sequence stopped before it (a kill, a crash) rather than skipping it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

MISSING, OUT_OF_ORDER, DUPLICATE, UNEXPECTED = "missing", "out_of_order", "duplicate", "unexpected"


@dataclass
class Finding:
    kind: str
    phase: str
    detail: str
    tail: bool = False
    pos: int = -1  # position in the expected sequence (missing only)
    count: int = 1  # how many occurrences are missing (missing only)


def _lcs_pairs(a: list[str], b: list[str]) -> list[tuple[int, int]]:
    """Index pairs ``(i, j)`` of one longest common subsequence of ``a`` and ``b``."""
    n, m = len(a), len(b)
    dp = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(n - 1, -1, -1):
        for j in range(m - 1, -1, -1):
            dp[i][j] = dp[i + 1][j + 1] + 1 if a[i] == b[j] else max(dp[i + 1][j], dp[i][j + 1])
    pairs, i, j = [], 0, 0
    while i < n and j < m:
        if a[i] == b[j]:
            pairs.append((i, j))
            i, j = i + 1, j + 1
        elif dp[i + 1][j] >= dp[i][j + 1]:
            i += 1
        else:
            j += 1
    return pairs


def _short(names: list[str], cap: int = 20) -> str:
    return ", ".join(names[:cap]) + (f", ... ({len(names) - cap} more)" if len(names) > cap else "")


def check_sequence(actual: list[str], expected: list[str]) -> list[Finding]:
    """Every difference between ``actual`` and ``expected``, aligned by a longest common
    subsequence: an unaligned recorded phase matching an unaligned expected one is out of order;
    other expected leftovers are missing, recorded ones duplicates or unexpected."""
    pairs = _lcs_pairs(actual, expected)
    last = max((j for _, j in pairs), default=-1)  # furthest expected position recorded in order
    matched_a, matched_e = {i for i, _ in pairs}, {j for _, j in pairs}
    left_e = [j for j in range(len(expected)) if j not in matched_e]
    out: list[Finding] = []
    extra: Counter[str] = Counter()
    for i in (i for i in range(len(actual)) if i not in matched_a):
        j = next((j for j in left_e if expected[j] == actual[i]), None)
        if j is None:
            extra[actual[i]] += 1
            continue
        left_e.remove(j)
        out.append(
            Finding(OUT_OF_ORDER, actual[i], f"recorded [{_short(actual)}], expected [{_short(expected)}]")
        )
    ce, ca = Counter(expected), Counter(actual)
    missing: dict[str, list[int]] = {}
    for j in left_e:
        missing.setdefault(expected[j], []).append(j)
    for name, pos in missing.items():  # one finding per name; its first missing occurrence decides "tail"
        detail = f"{len(pos)} of {ce[name]} missing" if ce[name] > 1 else ""
        out.append(Finding(MISSING, name, detail, tail=pos[0] > last, pos=pos[0], count=len(pos)))
    for name, n in extra.items():
        if name in ce:
            out.append(Finding(DUPLICATE, name, f"recorded {ca[name]} times, expected {ce[name]}"))
        else:
            out.append(Finding(UNEXPECTED, name, f"recorded {n} time(s)"))
    order = {MISSING: 0, OUT_OF_ORDER: 1, DUPLICATE: 2, UNEXPECTED: 3}
    out.sort(key=lambda f: (order[f.kind], f.pos))
    return out
