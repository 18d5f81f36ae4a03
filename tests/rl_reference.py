"""Float64 numpy references of the RL quantities as verl and TRL define them, written from their
sources, for the tests of docs/RL.md's table (every row is checked against these):

- verl ``verl/trainer/ppo/core_algos.py``: ``compute_grpo_outcome_advantage`` (``torch.std``,
  unbiased; eps 1e-6), ``compute_policy_loss_vanilla`` (log-ratio clamped to [-20, 20], PPO clip,
  ``pg_clipfrac``, dual-clip ``clip_ratio_c`` and ``pg_clipfrac_lower``), ``agg_loss``
  (``token-mean``, ``seq-mean-token-sum``, ``seq-mean-token-mean`` -- both leave fully masked
  sequences out of the mean -- and ``seq-mean-token-sum-norm``, a token sum over the batch /
  ``loss_scale_factor`` with no mean over sequences), ``kl_penalty_forward`` ``low_var_kl`` (k3 of
  the log-ratio clamped to [-20, 20], clamped to [-10, 10]); the truncated importance weights of
  ``verl/trainer/ppo/rollout_corr_helper.py`` (``rollout_is="token"``, ``rollout_is_threshold``).
- TRL ``trl/trainer/grpo_trainer.py``: ``_compute_loss`` (``coef_1``/``coef_2``, the k3 KL
  unclamped, ``loss_type`` ``grpo``/``bnpo``/``dr_grpo``/``dapo``: ``grpo`` and ``dr_grpo``
  count every sequence, fully masked ones included), the logged ``clip_ratio/region_mean``
  (low|high region clipped), advantages ``(r - mean) / (std + 1e-4)``.

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
    """verl's ``agg_loss`` of one whole batch (``dp_size`` 1, ``global_batch_size`` and
    ``batch_num_tokens`` unset). A batch without a valid token is NaN there (0 / 0)."""
    loss_mat, mask = _f64(loss_mat, mask)
    if mode == "token-mean":
        return float((loss_mat * mask).sum() / mask.sum())
    seq_sum = (loss_mat * mask).sum(-1)
    seq_mask = (mask.sum(-1) > 0).astype(np.float64)  # verl: "exclude fully masked sequences"
    if mode == "seq-mean-token-sum":
        return float((seq_sum * seq_mask).sum() / seq_mask.sum())
    if mode == "seq-mean-token-mean":
        return float((seq_sum / (mask.sum(-1) + 1e-8) * seq_mask).sum() / seq_mask.sum())
    if mode == "seq-mean-token-sum-norm":  # no mean over sequences, despite the name
        return float(seq_sum.sum() / loss_scale_factor)
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
    """``kl_penalty_forward(..., "low_var_kl")``: k3 of the clamped log-ratio, clamped to [-10, 10]."""
    kl = np.clip(np.asarray(ref, np.float64) - np.asarray(logp, np.float64), -20, 20)
    return np.clip(np.exp(kl) - kl - 1, -10, 10)


def verl_actor_loss(d: dict[str, np.ndarray], mode: str, kl_coef: float, loss_scale_factor: float) -> float:
    """``dp_actor.update_policy`` of one micro-batch with ``use_kl_loss``: ``pg_loss`` (dual-clip 3)
    + ``kl_loss_coef`` * ``agg_loss(low_var_kl)`` with the same ``loss_agg_mode``."""
    pg = verl_policy_loss(d["old"], d["logp"], d["adv"], d["mask"], EPS_LOW, EPS_HIGH, 3.0, mode,
                          loss_scale_factor)["pg_loss"]  # fmt: skip
    kl = verl_agg_loss(verl_low_var_kl(d["logp"], d["ref"]), d["mask"], mode, loss_scale_factor)
    return pg + kl_coef * kl


# -- TRL ---------------------------------------------------------------------------------
def trl_advantages(rewards: np.ndarray, group_size: int) -> np.ndarray:
    g = np.asarray(rewards, np.float64).reshape(-1, group_size)
    std = g.std(axis=1, ddof=1, keepdims=True)
    return ((g - g.mean(axis=1, keepdims=True)) / (std + 1e-4)).reshape(-1)


def trl_k3(logp: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """TRL's ``per_token_kl``: ``exp(ref - logp) - (ref - logp) - 1``, no clamp."""
    d = np.asarray(ref, np.float64) - np.asarray(logp, np.float64)
    return np.exp(d) - d - 1


def trl_grpo_loss(
    logp: np.ndarray, old: np.ndarray, adv: np.ndarray, mask: np.ndarray, eps_low: float, eps_high: float,
    loss_type: str, max_completion_length: int = 1, beta: float = 0.0, ref: np.ndarray | None = None,
) -> dict[str, float]:  # fmt: skip
    """TRL's GRPO loss (one iteration, no vLLM correction, one process): ``loss`` and
    ``clip_ratio/region_mean``."""
    logp, old, adv, mask = _f64(logp, old, adv, mask)
    a = adv[:, None]
    coef_1 = np.exp(logp - old)
    coef_2 = np.clip(coef_1, 1 - eps_low, 1 + eps_high)
    per_token = -np.minimum(coef_1 * a, coef_2 * a)
    if beta > 0:
        per_token = per_token + beta * trl_k3(logp, ref)
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
    return {"loss": loss, "clip_ratio/region_mean": masked_mean((low | high).astype(np.float64), mask)}


def loss_batch(seed: int = 0, b: int = 8, t: int = 7) -> dict[str, np.ndarray]:
    """A float32 batch whose ratios fall on every side of the clip range and past the dual-clip
    bound, with tokens whose k3 to the reference is past verl's clamp of 10 and one sequence
    without a valid token (row 5): ``logp``, ``old``, ``ref``, ``rollout`` [B, T], ``adv`` [B],
    ``mask`` [B, T]."""
    rng = np.random.default_rng(seed)
    logp = rng.normal(-2, 0.3, (b, t))
    old = logp + rng.normal(0, 0.4, (b, t))
    old[0, :3] = logp[0, :3] - 1.5  # ratio e^1.5 = 4.5 > clip_ratio_c (with a negative advantage below)
    old[1, :3] = logp[1, :3] + 1.0  # ratio e^-1 < 1 - eps_low
    ref = logp + rng.normal(0, 0.2, (b, t))
    ref[2, :2] = logp[2, :2] + 3.0  # k3 = e^3 - 4 = 16.1 > 10
    ref[3, 0] = logp[3, 0] - 12.0  # k3 = e^-12 + 11 > 10
    adv = rng.normal(0, 1, b)
    adv[0], adv[1] = -1.3, 0.7
    mask = (np.arange(t)[None, :] < rng.integers(2, t + 1, (b, 1))).astype(np.float64)
    mask[0, :3] = mask[1, :3] = mask[2, :2] = 1.0
    mask[5] = 0.0  # an aborted completion: no valid token
    out = {"logp": logp, "old": old, "ref": ref, "rollout": old + rng.normal(0, 0.3, (b, t)), "adv": adv,
           "mask": mask}  # fmt: skip
    return {k: v.astype(np.float32) for k, v in out.items()}


# -- the table of docs/RL.md, row by row ---------------------------------------------------
# ``ours(cfg, arrays, is_weight)`` runs a backend's ``policy_loss`` with ``LossConfig(**cfg)`` on
# ``arrays`` (``loss_batch``) and returns float ``loss``, ``clip_frac``, ``clip_frac_dual``,
# ``ratio_mean``, ``kl``. Each row: (name, our config, our metric, the reference's value).
EPS_LOW, EPS_HIGH, MAX_LEN, BETA = 0.2, 0.28, 7, 0.1
VERL_MODES = {"token_mean": "token-mean", "seq_mean_token_mean": "seq-mean-token-mean",
              "seq_mean_token_sum": "seq-mean-token-sum", "token_sum_norm": "seq-mean-token-sum-norm"}  # fmt: skip
# TRL's loss types, with the settings that make ours equal them: no dual-clip, no k3 clamp, and
# sequences without a valid token counted in the mean (TRL's ``grpo``)
TRL_TYPES = {"token_mean": "dapo", "seq_mean_token_mean": "grpo", "dr_grpo": "dr_grpo"}
TRL_SETTINGS = {"clip_ratio_c": 0.0, "kl_clamp": 0.0, "empty_seqs": "count"}


def table_rows(d: dict[str, np.ndarray]) -> list[tuple[str, dict, str, float]]:
    """The rows whose reference needs no importance weight (``check_tis`` has the other)."""
    base = {"eps_low": EPS_LOW, "eps_high": EPS_HIGH, "max_len": MAX_LEN}
    args = (d["old"], d["logp"], d["adv"], d["mask"], EPS_LOW, EPS_HIGH)
    rows = []
    for agg, mode in VERL_MODES.items():
        v = verl_policy_loss(*args, 3.0, mode, loss_scale_factor=MAX_LEN)
        ours = {**base, "aggregation": agg}
        rows += [
            (f"loss {agg} = verl {mode} (dual-clip 3)", ours, "loss", v["pg_loss"]),
            (f"loss {agg} + KL = verl {mode} + kl_loss_coef low_var_kl", {**ours, "beta": BETA}, "loss",
             verl_actor_loss(d, mode, BETA, MAX_LEN)),
        ]  # fmt: skip
    for agg, loss_type in TRL_TYPES.items():
        ours = {**base, "aggregation": agg, **TRL_SETTINGS}
        for beta in (0.0, BETA):
            t = trl_grpo_loss(d["logp"], d["old"], d["adv"], d["mask"], EPS_LOW, EPS_HIGH, loss_type, MAX_LEN,
                              beta=beta, ref=d["ref"])  # fmt: skip
            name = f"loss {agg} = TRL {loss_type} (beta {beta})"
            rows.append((name, {**ours, "beta": beta}, "loss", t["loss"]))
    v = verl_policy_loss(*args, 3.0)
    t = trl_grpo_loss(d["logp"], d["old"], d["adv"], d["mask"], EPS_LOW, EPS_HIGH, "grpo")
    mask = np.asarray(d["mask"], np.float64)
    rows += [
        ("clip_frac = verl pg_clipfrac", base, "clip_frac", v["pg_clipfrac"]),
        ("clip_frac = TRL clip_ratio/region_mean", base, "clip_frac", t["clip_ratio/region_mean"]),
        ("clip_frac_dual = verl pg_clipfrac_lower", base, "clip_frac_dual", v["pg_clipfrac_lower"]),
        ("ratio_mean (log-ratio clamped to +-20)", base, "ratio_mean", v["ratio_mean"]),
        ("kl = verl low_var_kl (k3 clamped to 10)", {**base, "beta": BETA}, "kl",
         masked_mean(verl_low_var_kl(d["logp"], d["ref"]), mask)),
        ("kl (--kl-clamp 0) = TRL k3", {**base, "beta": BETA, "kl_clamp": 0.0}, "kl",
         masked_mean(trl_k3(d["logp"], d["ref"]), mask)),
    ]  # fmt: skip
    return rows


def check_choices(ours) -> None:
    """Where verl and TRL differ, the batch of ``loss_batch`` tells their definitions apart, so a
    row of the table fails if a definition changes: the k3 clamp changes the loss and the ``kl``
    metric, a sequence without a valid token changes the sequence means, and verl's
    ``seq-mean-token-sum-norm`` is TRL's ``dr_grpo`` times the number of sequences."""
    d = loss_batch()
    base = {"eps_low": EPS_LOW, "eps_high": EPS_HIGH, "max_len": MAX_LEN, "beta": BETA}
    for key in ("loss", "kl"):
        clamped, raw = ours(base, d, None)[key], ours({**base, "kl_clamp": 0.0}, d, None)[key]
        assert raw > clamped + 0.01, (key, raw, clamped)
    for agg in ("seq_mean_token_mean", "seq_mean_token_sum"):
        excl = ours({**base, "aggregation": agg}, d, None)["loss"]
        count = ours({**base, "aggregation": agg, "empty_seqs": "count"}, d, None)["loss"]
        n = d["mask"].shape[0]
        assert abs(count - excl * (n - 1) / n) <= 1e-5 * max(1.0, abs(excl)), (agg, excl, count)
        assert abs(count - excl) > 1e-4, (agg, excl, count)
    per_batch = ours({**base, "aggregation": "token_sum_norm"}, d, None)["loss"]
    per_seq = ours({**base, "aggregation": "dr_grpo"}, d, None)["loss"]
    assert abs(per_batch - d["mask"].shape[0] * per_seq) <= 1e-5 * abs(per_batch), (per_batch, per_seq)


def check_all_empty(ours) -> None:
    """A batch whose every completion was aborted (no valid token) has loss 0 and every metric 0
    under every aggregation (verl's ``agg_loss`` would divide 0 by 0 in the sequence means)."""
    d = {**loss_batch(), "mask": np.zeros((8, 7), np.float32)}
    for agg in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "dr_grpo", "token_sum_norm"):
        for empty in ("exclude", "count"):
            cfg = {"eps_low": EPS_LOW, "eps_high": EPS_HIGH, "max_len": MAX_LEN, "beta": BETA,
                   "aggregation": agg, "empty_seqs": empty}  # fmt: skip
            got = ours(cfg, d, None)
            assert all(v == 0.0 for v in got.values()), (agg, empty, got)


def check_tis(ours, cap: float = 1.5) -> None:
    """A backend's loss with truncated importance weights ``min(exp(old - rollout), cap)`` (``old``
    the trainer's old log-probs, ``rollout`` the engine's) equals verl's token-mean loss with token
    rollout-correction weights (``rollout_is="token"``, ``rollout_is_threshold``), and differs from
    the unweighted loss."""
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
