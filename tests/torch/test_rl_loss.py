"""The torch policy loss: the JAX loss's tests (``tests/jax/test_rl_loss.py``) in torch, plus a
cross-backend check against the JAX implementation run in ``.venv-jax``."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from mllm_rl.backends.torch.rl_loss import AGGREGATIONS, LossConfig, policy_loss
from mllm_rl.rl.loss_config import EMPTY_SEQS, seq_count
from tests import rl_reference as ref_defs
from tests.conftest import ROOT

JAX_PYTHON = ROOT / ".venv-jax" / "bin" / "python"
AGGS = list(AGGREGATIONS)


def batch_np(seed: int = 0, b: int = 4, t: int = 6) -> tuple[np.ndarray, ...]:
    """(logp, old, ref, adv, mask) float32 numpy: [B, T] x 3, [B], [B, T] (mask has 2..T tokens per row)."""
    rng = np.random.default_rng(seed)
    logp = rng.normal(-2, 0.3, (b, t)).astype(np.float32)
    old = (logp + rng.normal(0, 0.3, (b, t))).astype(np.float32)
    ref = (logp + rng.normal(0, 0.2, (b, t))).astype(np.float32)
    adv = rng.normal(0, 1, (b,)).astype(np.float32)
    mask = (np.arange(t)[None, :] < rng.integers(2, t + 1, (b, 1))).astype(np.float32)
    return logp, old, ref, adv, mask


def batch(seed: int = 0, b: int = 4, t: int = 6) -> tuple[torch.Tensor, ...]:
    return tuple(torch.from_numpy(x) for x in batch_np(seed, b, t))


def loss_and_grad(logp: torch.Tensor, *args, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    lp = logp.clone().requires_grad_(True)
    loss, _ = policy_loss(lp, *args, **kw)
    loss.backward()
    return loss.detach(), lp.grad


def test_on_policy_unclipped_loss_is_minus_mean_advantage():
    logp, _, _, adv, mask = batch()
    loss, m = policy_loss(logp, logp, adv, mask, LossConfig())
    want = -(adv[:, None] * mask).sum() / mask.sum()
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=0)
    assert m["clip_frac"] == 0 and float(m["ratio_mean"]) == pytest.approx(1.0)


def test_asymmetric_clipping():
    adv, mask, old = torch.ones(1), torch.ones(1, 1), torch.zeros(1, 1)
    high = torch.log(torch.full((1, 1), 1.5))  # ratio 1.5 > 1 + eps_high
    loss, m = policy_loss(high, old, adv, mask, LossConfig(eps_low=0.2, eps_high=0.28))
    assert float(loss) == pytest.approx(-1.28, rel=1e-6) and float(m["clip_frac"]) == 1.0
    loss, _ = policy_loss(high, old, -adv, mask, LossConfig(eps_low=0.2, eps_high=0.28))
    assert float(loss) == pytest.approx(1.5, rel=1e-6)  # negative advantage: unclipped side is the min
    low = torch.log(torch.full((1, 1), 0.5))  # ratio 0.5 < 1 - eps_low, negative advantage: clipped at 0.8
    loss, _ = policy_loss(low, old, -adv, mask, LossConfig(eps_low=0.2, eps_high=0.28))
    assert float(loss) == pytest.approx(0.8, rel=1e-6)


def test_kl_is_in_the_loss_and_its_gradient():
    logp, old, ref, adv, mask = batch(1)
    l0, g0 = loss_and_grad(logp, old, adv, mask, LossConfig(beta=0.0), ref_logp=ref)
    l1, g1 = loss_and_grad(logp, old, adv, mask, LossConfig(beta=0.1), ref_logp=ref)
    assert l1 > l0
    assert not torch.allclose(g0, g1)  # the KL term changes the update, not only a logged metric
    _, m = policy_loss(logp, old, adv, mask, LossConfig(beta=0.1), ref_logp=ref)
    d = ref - logp
    want = ((torch.exp(d) - d - 1) * mask).sum() / mask.sum()
    torch.testing.assert_close(m["kl"], want)
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(logp, old, adv, mask, LossConfig(beta=0.1))


def test_padding_does_not_change_the_loss_or_the_gradient_of_valid_tokens():
    logp, old, ref, adv, mask = batch(3)
    cfg = LossConfig(beta=0.05, aggregation="seq_mean_token_mean")
    la, ga = loss_and_grad(logp, old, adv, mask, cfg, ref_logp=ref)
    noise = torch.randn(logp.shape, generator=torch.Generator().manual_seed(0)) * (1 - mask)
    lb, gb = loss_and_grad(logp + noise, old - noise, adv, mask, cfg, ref_logp=ref + 3 * noise)
    torch.testing.assert_close(la, lb)
    torch.testing.assert_close(ga, gb)
    assert float(ga[mask == 0].abs().max()) == 0.0


@pytest.mark.parametrize("empty", EMPTY_SEQS)
@pytest.mark.parametrize("agg", AGGS)
def test_micro_batch_accumulation_equals_full_batch(agg, empty):
    logp, old, ref, adv, mask = batch(2, b=6)
    mask[1] = 0.0  # an aborted completion in the first micro-batch
    cfg = LossConfig(aggregation=agg, beta=0.05, max_len=6, empty_seqs=empty)
    full_loss, full_grad = loss_and_grad(logp, old, adv, mask, cfg, ref_logp=ref)
    totals = {"total_tokens": mask.sum(), "total_seqs": seq_count(mask.numpy(), cfg)}
    acc_loss, acc_grad = 0.0, []
    for s in (slice(0, 2), slice(2, 6)):
        lv, g = loss_and_grad(logp[s], old[s], adv[s], mask[s], cfg, ref_logp=ref[s], **totals)
        acc_loss += lv
        acc_grad.append(g)
    torch.testing.assert_close(acc_loss, full_loss, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(torch.cat(acc_grad), full_grad, rtol=1e-5, atol=1e-7)
    # without the batch totals, a micro-batch normalises by its own counts: not the same loss
    # (token_sum_norm has no count to normalise by)
    part, _ = loss_and_grad(logp[:2], old[:2], adv[:2], mask[:2], cfg, ref_logp=ref[:2])
    with_totals, _ = loss_and_grad(logp[:2], old[:2], adv[:2], mask[:2], cfg, ref_logp=ref[:2], **totals)
    assert torch.allclose(part, with_totals) == (agg == "token_sum_norm")


def test_a_token_past_the_kl_clamp_gets_no_kl_gradient():
    """verl's ``low_var_kl`` clamps k3 at 10: the loss of a token past it is beta * 10 and its KL
    gradient is 0; ``kl_clamp=0`` keeps TRL's unclamped k3 and its gradient."""
    logp, old, mask, adv = torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.zeros(1)
    ref = torch.full((1, 1), 3.0)  # k3 = e^3 - 3 - 1 = 16.1
    loss, grad = loss_and_grad(logp, old, adv, mask, LossConfig(beta=0.5, kl_clamp=10.0), ref_logp=ref)
    assert float(loss) == pytest.approx(0.5 * 10.0, rel=1e-6) and float(grad[0, 0]) == 0.0
    loss, grad = loss_and_grad(logp, old, adv, mask, LossConfig(beta=0.5, kl_clamp=0.0), ref_logp=ref)
    assert float(loss) == pytest.approx(0.5 * (np.exp(3.0) - 4.0), rel=1e-6)
    assert float(grad[0, 0]) == pytest.approx(0.5 * (1.0 - np.exp(3.0)), rel=1e-6)


# -- docs/RL.md's table: each quantity against verl's and TRL's definitions (tests/rl_reference.py)
def ours(cfg: dict, d: dict, is_weight=None) -> dict[str, float]:
    t = {k: torch.from_numpy(v) for k, v in d.items()}
    w = None if is_weight is None else torch.from_numpy(is_weight)
    loss, m = policy_loss(t["logp"], t["old"], t["adv"], t["mask"], LossConfig(**cfg), ref_logp=t["ref"],
                          is_weight=w)  # fmt: skip
    return {"loss": float(loss), **{k: float(v) for k, v in m.items()}}


def test_every_row_of_the_rl_table_matches_verl_and_trl():
    assert ref_defs.check_table(ours) >= 20


def test_where_verl_and_trl_differ_the_table_tells_them_apart():
    ref_defs.check_choices(ours)


def test_a_batch_of_aborted_completions_has_loss_zero():
    ref_defs.check_all_empty(ours)


def test_clip_frac_counts_tokens_whose_gradient_the_clip_cuts():
    ref_defs.check_clip_frac_is_not_the_out_of_range_share(ours)


def test_truncated_importance_sampling_matches_verl():
    ref_defs.check_tis(ours)


def test_dual_clip_bounds_the_loss_of_a_huge_ratio_with_negative_advantage():
    old, mask, adv = torch.zeros(1, 1), torch.ones(1, 1), -torch.ones(1)
    huge = torch.full((1, 1), 5.0)  # ratio e^5 = 148
    loss, m = policy_loss(huge, old, adv, mask, LossConfig(clip_ratio_c=3.0))
    assert float(loss) == pytest.approx(3.0, rel=1e-6) and float(m["clip_frac_dual"]) == 1.0
    loss, _ = policy_loss(huge, old, adv, mask, LossConfig(clip_ratio_c=0.0))
    assert float(loss) == pytest.approx(np.exp(5.0), rel=1e-5)


# -- cross-backend: the same numbers from the JAX implementation -------------------------
_JAX_SCRIPT = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np
from mllm_rl.backends.jax.rl_loss import LossConfig, policy_loss
d = np.load(sys.argv[1])
out = {}
for spec in json.loads(sys.argv[2]):
    cfg = LossConfig(**spec["cfg"])
    s = slice(*spec["rows"])
    kw = {k: jnp.float32(v) for k, v in spec["totals"].items()}
    f = lambda lp: policy_loss(lp, jnp.asarray(d["old"][s]), jnp.asarray(d["adv"][s]), jnp.asarray(d["mask"][s]),
                               cfg, ref_logp=jnp.asarray(d["ref"][s]), **kw)
    (loss, m), g = jax.value_and_grad(f, has_aux=True)(jnp.asarray(d["logp"][s]))
    out[spec["name"]] = {"loss": float(loss), "grad": np.asarray(g).tolist(), **{k: float(v) for k, v in m.items()}}
print(json.dumps(out))
"""


def _cases(mask: np.ndarray) -> list[dict]:
    cases = []
    for agg in AGGS:
        for beta, clamp, empty in ((0.0, 10.0, "exclude"), (0.1, 10.0, "exclude"), (0.1, 0.0, "count")):
            cfg = {"aggregation": agg, "beta": beta, "eps_low": 0.2, "eps_high": 0.28, "max_len": 7,
                   "kl_clamp": clamp, "empty_seqs": empty}  # fmt: skip
            name = f"{agg}-{beta}-{clamp}-{empty}"
            cases.append({"name": name, "cfg": cfg, "rows": [0, 8], "totals": {}})
            totals = {"total_tokens": float(mask.sum()), "total_seqs": seq_count(mask, LossConfig(**cfg))}
            cases.append({"name": f"{name}-micro", "cfg": cfg, "rows": [3, 8], "totals": totals})
    return cases


@pytest.mark.slow
@pytest.mark.skipif(
    not JAX_PYTHON.exists(), reason=f"{JAX_PYTHON} absent (the JAX venv computes the reference)"
)
def test_matches_the_jax_loss_and_gradient(tmp_path: Path):
    logp, old, ref, adv, mask = batch_np(7, b=8, t=7)
    old[0, :3] = logp[0, :3] - 1.0  # ratios far outside the clip range on both sides
    old[1, :3] = logp[1, :3] + 1.0
    ref[2, :2] = logp[2, :2] + 3.0  # k3 past the clamp
    mask[2, :2], mask[4] = 1.0, 0.0  # and an aborted completion in the micro-batch
    data = tmp_path / "loss_inputs.npz"
    np.savez(data, logp=logp, old=old, ref=ref, adv=adv, mask=mask)
    cases = _cases(mask)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    r = subprocess.run([str(JAX_PYTHON), "-c", _JAX_SCRIPT, str(data), json.dumps(cases)], capture_output=True,
                       text=True, timeout=180, env={**env, "JAX_PLATFORMS": "cpu"}, cwd=ROOT)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    want = json.loads(r.stdout.strip().splitlines()[-1])
    clipped = 0.0
    for case in cases:
        s = slice(*case["rows"])
        t = [torch.from_numpy(x[s]) for x in (logp, old, ref, adv, mask)]
        cfg = LossConfig(**case["cfg"])
        lp = t[0].clone().requires_grad_(True)
        loss, m = policy_loss(lp, t[1], t[3], t[4], cfg, ref_logp=t[2], **case["totals"])
        loss.backward()
        w = want[case["name"]]
        assert float(loss.detach()) == pytest.approx(w["loss"], rel=1e-5, abs=1e-7), case["name"]
        np.testing.assert_allclose(
            lp.grad.numpy(), np.asarray(w["grad"]), rtol=1e-5, atol=1e-7, err_msg=case["name"]
        )
        for k in ("clip_frac", "clip_frac_dual", "kl", "ratio_mean"):
            assert float(m[k]) == pytest.approx(w[k], rel=1e-5, abs=1e-7), (case["name"], k)
        clipped = max(clipped, float(m["clip_frac"]))
    assert clipped > 0  # the input exercises the clipped branch
