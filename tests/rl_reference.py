"""Float64 numpy references of the RL quantities as verl and TRL define them, written from their
sources, for the tests of docs/RL.md's table (every row is checked against these):

- verl ``verl/trainer/ppo/core_algos.py``: ``compute_grpo_outcome_advantage`` (``torch.std``,
  unbiased; eps 1e-6), ``compute_policy_loss_vanilla`` (log-ratio clamped to [-20, 20], PPO clip,
  ``pg_clipfrac``, dual-clip ``clip_ratio_c`` and ``pg_clipfrac_lower``, truncated importance
  sampling ``tis_imp_ratio_cap``), ``agg_loss`` (``token-mean``, ``seq-mean-token-sum``,
  ``seq-mean-token-mean``, ``seq-mean-token-sum-norm``), ``kl_penalty`` ``low_var_kl`` (k3).
- TRL ``trl/trainer/grpo_trainer.py``: ``_compute_loss`` (``coef_1``/``coef_2``,
  ``loss_type`` ``grpo``/``bnpo``/``dr_grpo``/``dapo``, ``clip_ratio`` as low|high region
  clipped), advantages ``(r - mean) / (std + 1e-4)``.

Shapes: B sequences, T tokens; ``mask`` [B, T] (1 = completion token), ``adv`` [B].
Imports numpy only: the JAX and the torch tests share it.
"""

from __future__ import annotations

import numpy as np


def _f64(*xs: np.ndarray) -> list[np.ndarray]:
    return [np.asarray(x, np.float64) for x in xs]


def masked_mean(x: np.ndarray, mask: np.ndarray) -> float:
    return float((x * mask).sum() / mask.sum())


# -- verl --------------------------------------------------------------------------------
def verl_grpo_advantages(scores: np.ndarray, group_size: int, eps: float = 1e-6) -> np.ndarray:
    """(score - group mean) / (group std, unbiased + eps), prompt-major groups."""
    out = np.empty(len(scores))
    for s in range(0, len(scores), group_size):
        g = np.asarray(scores[s : s + group_size], np.float64)
        mean = g.sum() / len(g)
        std = np.sqrt(((g - mean) ** 2).sum() / (len(g) - 1))
        out[s : s + group_size] = (g - mean) / (std + eps)
    return out


def verl_agg_loss(loss_mat: np.ndarray, mask: np.ndarray, mode: str, loss_scale_factor: float) -> float:
    if mode == "token-mean":
        return masked_mean(loss_mat, mask)
    seq_sum = (loss_mat * mask).sum(-1)
    if mode == "seq-mean-token-sum":
        return float(seq_sum.mean())
    if mode == "seq-mean-token-mean":
        return float((seq_sum / mask.sum(-1)).mean())
    if mode == "seq-mean-token-sum-norm":  # current verl: per sequence / loss_scale_factor, then the mean
        return float((seq_sum / loss_scale_factor).mean())
    raise ValueError(mode)


def verl_policy_loss(
    old: np.ndarray, logp: np.ndarray, adv: np.ndarray, mask: np.ndarray, clip_low: float, clip_high: float,
    clip_ratio_c: float, mode: str = "token-mean", loss_scale_factor: float = 1.0,
    rollout_logp: np.ndarray | None = None, tis_cap: float = 0.0,
) -> dict[str, float]:  # fmt: skip
    """verl's vanilla policy loss: ``pg_loss``, ``pg_clipfrac``, ``pg_clipfrac_lower``, and the
    ratio mean. ``clip_ratio_c <= 0`` here means no dual-clip (verl always applies it)."""
    old, logp, adv, mask = _f64(old, logp, adv, mask)
    a = adv[:, None]
    ratio = np.exp(np.clip(logp - old, -20.0, 20.0))
    pg1 = -a * ratio
    pg2 = -a * np.clip(ratio, 1 - clip_low, 1 + clip_high)
    clip1 = np.maximum(pg1, pg2)
    out = {"pg_clipfrac": masked_mean((pg2 > pg1).astype(np.float64), mask), "pg_clipfrac_lower": 0.0}
    pg = clip1
    if clip_ratio_c > 0:
        pg3 = -a * clip_ratio_c
        out["pg_clipfrac_lower"] = masked_mean(((clip1 > pg3) & (a < 0)).astype(np.float64), mask)
        pg = np.where(a < 0, np.minimum(pg3, clip1), clip1)
    if tis_cap > 0 and rollout_logp is not None:
        pg = pg * np.minimum(np.exp(old - np.asarray(rollout_logp, np.float64)), tis_cap)
    out["pg_loss"] = verl_agg_loss(pg, mask, mode, loss_scale_factor)
    out["ratio_mean"] = masked_mean(ratio, mask)
    return out


def verl_low_var_kl(logp: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """k3: ``exp(ref - logp) - (ref - logp) - 1`` (verl clamps it to [-10, 10])."""
    kl = np.asarray(ref, np.float64) - np.asarray(logp, np.float64)
    return np.clip(np.exp(kl) - kl - 1, -10, 10)


# -- TRL ---------------------------------------------------------------------------------
def trl_advantages(rewards: np.ndarray, group_size: int) -> np.ndarray:
    g = np.asarray(rewards, np.float64).reshape(-1, group_size)
    std = g.std(axis=1, ddof=1, keepdims=True)
    return ((g - g.mean(axis=1, keepdims=True)) / (std + 1e-4)).reshape(-1)


def trl_grpo_loss(
    logp: np.ndarray, old: np.ndarray, adv: np.ndarray, mask: np.ndarray, eps_low: float, eps_high: float,
    loss_type: str, max_completion_length: int = 1, beta: float = 0.0, ref: np.ndarray | None = None,
) -> dict[str, float]:  # fmt: skip
    """TRL's GRPO loss (one iteration, no vLLM correction): ``loss`` and ``clip_ratio``."""
    logp, old, adv, mask = _f64(logp, old, adv, mask)
    a = adv[:, None]
    coef_1 = np.exp(logp - old)
    coef_2 = np.clip(coef_1, 1 - eps_low, 1 + eps_high)
    per_token = -np.minimum(coef_1 * a, coef_2 * a)
    if beta > 0:
        per_token = per_token + beta * verl_low_var_kl(logp, ref)
    if loss_type == "grpo":
        loss = float(((per_token * mask).sum(-1) / np.maximum(mask.sum(-1), 1)).mean())
    elif loss_type in ("bnpo", "dapo"):
        loss = float((per_token * mask).sum() / max(mask.sum(), 1))
    elif loss_type == "dr_grpo":
        loss = float((per_token * mask).sum() / (per_token.shape[0] * max_completion_length))
    else:
        raise ValueError(loss_type)
    low = (coef_1 < 1 - eps_low) & (a < 0)
    high = (coef_1 > 1 + eps_high) & (a > 0)
    return {"loss": loss, "clip_ratio": masked_mean((low | high).astype(np.float64), mask)}


def loss_batch(seed: int = 0, b: int = 8, t: int = 7) -> dict[str, np.ndarray]:
    """A float32 batch whose ratios fall on every side of the clip range and past the dual-clip
    bound: ``logp``, ``old``, ``ref``, ``rollout`` [B, T], ``adv`` [B], ``mask`` [B, T]."""
    rng = np.random.default_rng(seed)
    logp = rng.normal(-2, 0.3, (b, t))
    old = logp + rng.normal(0, 0.4, (b, t))
    old[0, :3] = logp[0, :3] - 1.5  # ratio e^1.5 = 4.5 > clip_ratio_c (with a negative advantage below)
    old[1, :3] = logp[1, :3] + 1.0  # ratio e^-1 < 1 - eps_low
    adv = rng.normal(0, 1, b)
    adv[0], adv[1] = -1.3, 0.7
    mask = (np.arange(t)[None, :] < rng.integers(2, t + 1, (b, 1))).astype(np.float64)
    mask[0, :3] = mask[1, :3] = 1.0
    out = {"logp": logp, "old": old, "ref": logp + rng.normal(0, 0.2, (b, t)),
           "rollout": old + rng.normal(0, 0.3, (b, t)), "adv": adv, "mask": mask}  # fmt: skip
    return {k: v.astype(np.float32) for k, v in out.items()}


# -- the table of docs/RL.md, row by row ---------------------------------------------------
# ``ours(cfg, arrays, is_weight)`` runs a backend's ``policy_loss`` with ``LossConfig(**cfg)`` on
# ``arrays`` (``loss_batch``) and returns float ``loss``, ``clip_frac``, ``clip_frac_dual``,
# ``ratio_mean``, ``kl``. Each row: (name, our config, our metric, the reference's value).
EPS_LOW, EPS_HIGH, MAX_LEN = 0.2, 0.28, 7
VERL_MODES = {"token_mean": "token-mean", "seq_mean_token_mean": "seq-mean-token-mean",
              "seq_mean_token_sum": "seq-mean-token-sum", "dr_grpo": "seq-mean-token-sum-norm"}  # fmt: skip
TRL_TYPES = {"token_mean": "dapo", "seq_mean_token_mean": "grpo", "dr_grpo": "dr_grpo"}


def table_rows(d: dict[str, np.ndarray]) -> list[tuple[str, dict, str, float]]:
    """The rows whose reference needs no importance weight (``tis_row`` has the other)."""
    base = {"eps_low": EPS_LOW, "eps_high": EPS_HIGH, "max_len": MAX_LEN}
    args = (d["old"], d["logp"], d["adv"], d["mask"], EPS_LOW, EPS_HIGH)
    rows = []
    for agg, mode in VERL_MODES.items():
        v = verl_policy_loss(*args, 3.0, mode, loss_scale_factor=MAX_LEN)
        rows.append(
            (f"loss {agg} = verl {mode} (dual-clip 3)", {**base, "aggregation": agg}, "loss", v["pg_loss"])
        )
        if agg in TRL_TYPES:
            t = trl_grpo_loss(
                d["logp"], d["old"], d["adv"], d["mask"], EPS_LOW, EPS_HIGH, TRL_TYPES[agg], MAX_LEN
            )
            rows.append((f"loss {agg} = TRL {TRL_TYPES[agg]} (no dual-clip)",
                         {**base, "aggregation": agg, "clip_ratio_c": 0.0}, "loss", t["loss"]))  # fmt: skip
    v = verl_policy_loss(*args, 3.0)
    t = trl_grpo_loss(d["logp"], d["old"], d["adv"], d["mask"], EPS_LOW, EPS_HIGH, "grpo")
    rows += [
        ("clip_frac = verl pg_clipfrac", base, "clip_frac", v["pg_clipfrac"]),
        ("clip_frac = TRL clip_ratio", base, "clip_frac", t["clip_ratio"]),
        ("clip_frac_dual = verl pg_clipfrac_lower", base, "clip_frac_dual", v["pg_clipfrac_lower"]),
        ("ratio_mean (log-ratio clamped to +-20)", base, "ratio_mean", v["ratio_mean"]),
        ("kl = verl low_var_kl (k3)", {**base, "beta": 0.1}, "kl",
         masked_mean(verl_low_var_kl(d["logp"], d["ref"]), np.asarray(d["mask"], np.float64))),
    ]  # fmt: skip
    return rows


def check_tis(ours, cap: float = 1.5) -> None:
    """A backend's loss with truncated importance weights ``min(exp(old - rollout), cap)`` (``old``
    the trainer's old log-probs, ``rollout`` the engine's) equals verl's token-mean loss with
    ``tis_imp_ratio_cap``, and differs from the unweighted loss."""
    d = loss_batch(3)
    w = np.minimum(np.exp(d["old"].astype(np.float64) - d["rollout"]), cap).astype(np.float32)
    cfg = {"eps_low": EPS_LOW, "eps_high": EPS_HIGH}
    got = ours(cfg, d, w)["loss"]
    want = verl_policy_loss(d["old"], d["logp"], d["adv"], d["mask"], EPS_LOW, EPS_HIGH, 3.0,
                            rollout_logp=d["rollout"], tis_cap=cap)["pg_loss"]  # fmt: skip
    assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), (got, want)
    assert abs(got - ours(cfg, d, None)["loss"]) > 1e-4  # the weight changes the loss


def check_clip_frac_is_not_the_out_of_range_share(ours) -> None:
    """``clip_frac`` counts tokens whose gradient the clip cuts: fewer than the tokens whose ratio
    is outside the range (one outside with the advantage of the "wrong" sign is not cut)."""
    d = loss_batch()
    got = ours({"eps_low": EPS_LOW, "eps_high": EPS_HIGH}, d, None)["clip_frac"]
    assert 0 < got < outside_range_frac(d), (got, outside_range_frac(d))


def check_table(ours, d: dict[str, np.ndarray] | None = None) -> int:
    """Every row of ``table_rows`` against a backend's ``ours``; returns the rows checked."""
    d = loss_batch() if d is None else d
    rows = table_rows(d)
    for name, cfg, key, want in rows:
        got = ours(cfg, d, None)[key]
        assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), f"{name}: ours {got!r}, reference {want!r}"
    return len(rows)


def outside_range_frac(d: dict[str, np.ndarray]) -> float:
    """The share of tokens whose ratio is outside [1 - eps_low, 1 + eps_high] (what ``clip_frac``
    is *not*: it counts tokens whose gradient the clip cuts, which depends on the advantage's sign)."""
    r = np.exp(np.asarray(d["logp"], np.float64) - d["old"])
    return masked_mean(
        ((r < 1 - EPS_LOW) | (r > 1 + EPS_HIGH)).astype(np.float64), np.asarray(d["mask"], np.float64)
    )
