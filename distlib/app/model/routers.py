"""How an MoE layer chooses each token's experts and weighs them: the router of its family, chosen
when the layer is built (``for_model``).

Both take the gate's logits and the layer's selection biases (``model.balance=bias``; None
otherwise) and return ``Routed``: each token's top_k expert ids, their weights (float32), and the
scores the load-balancing loss reads (``moe.balance``: a distribution over the experts per token).

    SoftmaxTopK        Mixtral's and Qwen3-MoE's: probabilities = softmax(logits) in float32; the
                       top_k by probability (plus the bias, with one), weighed by the probabilities
                       themselves, renormalised to sum to 1 if ``norm_topk_prob``
    SigmoidGroupTopK   DeepSeek-V3's (transformers' DeepseekV3TopkRouter): scores = sigmoid(logits)
                       in float32; the choice scores (scores + bias) form n_group groups, each
                       scored by the sum of its two best; a token's top_k come from its topk_group
                       best groups; weighed by the scores (renormalised with norm_topk_prob, a
                       denominator + 1e-20 as transformers'), times routed_scaling_factor. The
                       balance loss reads each token's scores divided by their sum (DeepSeek-V3's
                       normalised affinities).

``margin``: the smallest gap a choice rests on (the k-th against the (k+1)-th choice score; with
groups, also the last chosen group against the next), over some tokens: a gap within rounding can
choose another expert under another layout's rounding, so an equivalence test measures it first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

NO_GAP = float("inf")  # the margin of a choice with nothing to choose against


@dataclass(frozen=True)
class Routed:
    ids: torch.Tensor  # (tokens, k) int64
    weights: torch.Tensor  # (tokens, k) float32
    probs: torch.Tensor  # (tokens, n_experts) float32: what the load-balancing loss reads


def _gap(values: torch.Tensor, k: int) -> float:
    """The smallest gap between the k-th and (k+1)-th largest of each row (NO_GAP if k is all)."""
    if k >= values.shape[-1] or values.numel() == 0:
        return NO_GAP
    top = torch.topk(values, k + 1, dim=-1).values
    return float((top[:, -2] - top[:, -1]).min())


@dataclass(frozen=True)
class SoftmaxTopK:
    top_k: int
    normalise: bool

    def logits(self, gate, x: torch.Tensor) -> torch.Tensor:
        return gate(x).float()  # float32 whatever the dtype, as transformers

    def route(self, logits: torch.Tensor, bias: torch.Tensor | None) -> Routed:
        probs = F.softmax(logits, dim=-1)
        if bias is None:
            top, ids = torch.topk(probs, self.top_k, dim=-1)
        else:  # the bias chooses the experts; the probabilities alone weigh them (DeepSeek-V3's rule)
            ids = torch.topk(probs + bias, self.top_k, dim=-1).indices
            top = probs.gather(-1, ids)
        weights = top / top.sum(dim=-1, keepdim=True) if self.normalise else top
        return Routed(ids, weights, probs)

    def margin(self, logits: torch.Tensor, bias: torch.Tensor | None) -> float:
        choice = F.softmax(logits, dim=-1)
        return _gap(choice if bias is None else choice + bias, self.top_k)


@dataclass(frozen=True)
class SigmoidGroupTopK:
    top_k: int
    n_group: int
    topk_group: int
    normalise: bool
    scale: float

    def logits(self, gate, x: torch.Tensor) -> torch.Tensor:
        # transformers keeps the router's weight in float32 and multiplies in float32
        return F.linear(x.float(), gate.weight.float())

    def _choice(self, scores: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the choice scores, masked to -inf outside each token's topk_group groups; the groups'
        scores)."""
        choice = scores if bias is None else scores + bias
        tokens, experts = choice.shape
        grouped = choice.view(tokens, self.n_group, experts // self.n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        chosen = torch.topk(group_scores, self.topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)
        masked = grouped.masked_fill(~keep[:, :, None], float("-inf")).view(tokens, experts)
        return masked, group_scores

    def route(self, logits: torch.Tensor, bias: torch.Tensor | None) -> Routed:
        scores = logits.sigmoid()
        masked, _ = self._choice(scores, bias)
        ids = torch.topk(masked, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if self.normalise:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * self.scale
        return Routed(ids, weights, scores / scores.sum(dim=-1, keepdim=True))

    def margin(self, logits: torch.Tensor, bias: torch.Tensor | None) -> float:
        masked, group_scores = self._choice(logits.sigmoid(), bias)
        return min(_gap(group_scores, self.topk_group), _gap(masked, self.top_k))


Router = SoftmaxTopK | SigmoidGroupTopK


def for_model(cfg) -> Router:
    """The router of ``cfg``'s family (a ``ModelConfig``)."""
    if cfg.family == "deepseek_v3":
        return SigmoidGroupTopK(
            cfg.top_k, cfg.n_group, cfg.topk_group, cfg.norm_topk_prob, cfg.routed_scaling_factor
        )
    return SoftmaxTopK(cfg.top_k, cfg.norm_topk_prob)
