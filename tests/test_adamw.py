import torch

from distlib.app.config.groups import OptimizerConfig
from distlib.parallel.adamw import AdamWConfig, adamw_step_


def test_flat_adamw_is_bitwise_torch_adamw():
    torch.manual_seed(0)
    shapes = [(7, 5), (5,), (3, 11), (1,), (13,)]
    params = [torch.randn(s) for s in shapes]
    cfg = AdamWConfig(lr=3e-3, beta1=0.85, beta2=0.97, eps=1e-7, weight_decay=0.05)

    reference = [torch.nn.Parameter(p.clone()) for p in params]
    opt = torch.optim.AdamW(reference, **cfg.torch_kwargs(), foreach=False)

    flat = torch.cat([p.flatten() for p in params])
    exp_avg, exp_avg_sq = torch.zeros_like(flat), torch.zeros_like(flat)
    for step in range(1, 8):
        grads = [torch.randn(s) for s in shapes]
        for p, g in zip(reference, grads):
            p.grad = g.clone()
        opt.step()
        adamw_step_(flat, torch.cat([g.flatten() for g in grads]), exp_avg, exp_avg_sq, step, cfg)
        expected = torch.cat([p.detach().flatten() for p in reference])
        assert torch.equal(flat, expected), f"diverged from torch.optim.AdamW at step {step}"
    expected_m = torch.cat([opt.state[p]["exp_avg"].flatten() for p in reference])
    assert torch.equal(exp_avg, expected_m)


def test_bad_hyperparameters_are_refused():
    import pytest

    good = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    with pytest.raises(ValueError, match="lr must be > 0"):
        AdamWConfig(**{**good, "lr": 0.0})
    with pytest.raises(ValueError, match="beta2 must be in"):
        AdamWConfig(**{**good, "beta2": 1.0})
    with pytest.raises(ValueError, match="optimizer.beta2 must be a number >= 0 and < 1, got 1.0"):
        OptimizerConfig(beta2=1.0)
