"""One training step of a mixture-of-experts family (mixtral, qwen3_moe) against transformers'
class for it: the helpers tests/test_mixtral.py and tests/test_qwen3_moe.py share."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from family_models import built, max_diff, tokens

from distlib.app.config.model_group import ModelConfig
from distlib.app.model import hf_config as hfc
from distlib.app.model import hf_weights as hfw

TOL = 1e-5


def exported_pair(cfg: ModelConfig, out_dir: Path, transformers):
    """(ours in training mode, transformers' eager model loaded from our exported directory)."""
    ours = built(cfg, seed=3).train()
    hfw.save_hf_dir(cfg, ours.state_dict(), out_dir)
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(
        out_dir, output_loading_info=True, attn_implementation="eager"
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"))
    assert type(theirs).__name__ == hfc.ARCHITECTURES[cfg.family]
    return ours, theirs.train()


def file_grads(theirs, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """transformers' gradients under the names its files use (in memory it fuses each block's
    experts into gate_up_proj (E, 2 x width, dim) and down_proj (E, dim, width) tensors)."""
    where, called = hfw.EXPERT_FILES[cfg.family]
    out = {}
    for name, p in theirs.named_parameters():
        base = name.rpartition(".mlp.")[0] + f".{where}.experts."
        if name.endswith("mlp.experts.gate_up_proj"):
            gate, up = p.grad.chunk(2, dim=1)
            for e in range(cfg.n_experts):
                out[f"{base}{e}.{called['w1']}.weight"] = gate[e]
                out[f"{base}{e}.{called['w3']}.weight"] = up[e]
        elif name.endswith("mlp.experts.down_proj"):
            out |= {f"{base}{e}.{called['w2']}.weight": p.grad[e] for e in range(cfg.n_experts)}
        else:
            out[name.replace(".mlp.gate.", f".{where}.gate.")] = p.grad
    return out


def check_one_step(cfg: ModelConfig, out_dir: Path, transformers) -> None:
    """One training step's loss (cross-entropy + coef x load-balancing loss), the aux loss itself,
    every gradient and the logits, within 1e-5 of transformers' (output_router_logits=True)."""
    ours, theirs = exported_pair(cfg, out_dir, transformers)
    window = tokens(cfg, 3, cfg.seq_len + 1, 21)
    x, y = window[:, :-1], window[:, 1:].contiguous()
    loss = ours(x, y)
    out = theirs(input_ids=x, labels=y, shift_labels=y, output_router_logits=True)
    aux = ours.step_fields(1)["aux_loss"]
    assert abs(loss.item() - out.loss.item()) <= TOL
    assert abs(aux - out.aux_loss.item()) <= TOL
    with torch.no_grad():
        ce = F.cross_entropy(ours(x).reshape(-1, cfg.vocab_size), y.reshape(-1)).item()
    assert cfg.router_aux_loss_coef * aux > 100 * TOL  # the term is really there
    assert abs(loss.item() - ce - cfg.router_aux_loss_coef * aux) <= 1e-6
    loss.backward()
    out.loss.backward()
    grads = hfw.to_hf_state_dict(cfg, {n: p.grad for n, p in ours.named_parameters()})
    theirs_grads = file_grads(theirs, cfg)
    assert grads.keys() == theirs_grads.keys()
    assert max(max_diff(grads[n], theirs_grads[n]) for n in grads) <= TOL
    with torch.no_grad():
        for seq in (cfg.seq_len, 5):
            assert max_diff(ours(x[:, :seq]), theirs(x[:, :seq]).logits) <= TOL
