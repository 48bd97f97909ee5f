"""What the model families share: the pre-norm residual block (checkpointed or not), the
embed -> blocks -> head contract with positions handed in, and seeded construction. Their one
attention function is ``attention.causal_attention``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from distlib.app.model import recompute
from distlib.app.model.strategies import LOCAL, Strategies
from distlib.app.observe import activations
from distlib.parallel.documents import Documents
from distlib.parallel.dropout import Draws, dropout


def positions_or_default(positions: torch.Tensor | None, seq: int, device: torch.device) -> torch.Tensor:
    """The positions of a (seq,)-long slice of the sequences: ``positions`` as given (a rank holding
    tokens [a, b) passes a..b-1; every sequence of the batch shares them), else 0..seq-1."""
    if positions is None:
        return torch.arange(seq, device=device)
    if positions.shape != (seq,):
        raise ValueError(f"positions has shape {tuple(positions.shape)}; expected ({seq},), one per token")
    return positions


def in_documents(positions: torch.Tensor, documents: Documents | None) -> torch.Tensor:
    """The positions a layer embeds or rotates by: ``positions`` (seq,), or with ``documents`` each
    token's within its document, (batch, seq)."""
    return positions if documents is None else documents.within(positions)


class PreNormBlock(nn.Module):
    """x + drop(attn(ln1(x), positions)), then + drop(mlp(ln2(x))): every family's residual block;
    they differ only in the factories they pass, each called with the config (built in this order,
    so construction draws from the RNG as each family's own block did; attention takes the
    positions), and in ``residual_dropout`` (GPT-2's dropout on both branches; Llama has none).
    ``index``: the block's place in the whole model, which keys its dropout masks (``draws``).
    With ``model.activation_checkpointing=blocks`` ``_forward`` is recomputed in backward. With
    ``dist.sp`` (``strategies.sequence``) x, the norms and the adds hold this rank's tokens only, and
    each branch enters its tensor-parallel region through one all-gather along the sequence. The
    attention factory also takes ``strategies.context``."""

    def __init__(
        self,
        cfg,
        norm,
        attention,
        mlp,
        *,
        index: int,
        residual_dropout: bool = False,
        strategies: Strategies = LOCAL,
    ):
        super().__init__()
        self.checkpointing = cfg.activation_checkpointing == "blocks"
        self.index, self.seq_len, self.dim = index, cfg.seq_len, cfg.dim
        self.dropout = cfg.dropout if residual_dropout else 0.0
        self.sequence = strategies.sequence
        self.ln1 = norm(cfg)
        self.attn = attention(cfg, context=strategies.context)
        self.ln2 = norm(cfg)
        self.mlp = mlp(cfg)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None = None,
        draws: Draws | None = None,
        documents: Documents | None = None,
    ) -> torch.Tensor:
        draws = None if draws is None else draws.at_layer(self.index)
        if self.checkpointing and torch.is_grad_enabled() and x.requires_grad:
            # Keep only the input; backward reruns _forward (with the same dropout keys; without
            # keys torch restores the RNG state first): the same masks. _forward is called
            # directly, not through the module: the recomputation must not fire this block's hooks
            # again (ZeRO-3's forward hook frees the parameters; its hook on the block's output has
            # gathered them before this runs).
            activations.keep(x)
            return checkpoint(
                self._forward,
                x,
                positions,
                draws,
                documents,
                use_reentrant=False,
                context_fn=recompute.contexts,
            )
        return self._forward(x, positions, draws, documents)

    def _forward(self, x: torch.Tensor, positions, draws: Draws | None, documents) -> torch.Tensor:
        # transformers adds the branch to the residual as attn_output + residual: the same sum.
        attended = self.attn(self._enter(self.ln1(x)), positions, draws, documents)
        x = x + self._drop(attended, positions, draws, "attn")
        return x + self._drop(self.mlp(self._enter(self.ln2(x))), positions, draws, "mlp")

    def _enter(self, h: torch.Tensor) -> torch.Tensor:
        return self.sequence.enter(h)

    def _drop(self, out: torch.Tensor, positions, draws: Draws | None, site: str) -> torch.Tensor:
        """A branch's residual dropout (none unless training with p > 0), keyed by the positions of
        the tokens this rank holds."""
        if not self.training or self.dropout == 0:
            return out
        held = self.sequence.held(
            positions_or_default(positions, out.shape[1] * self.sequence.parts, out.device)
        )
        full, index = (self.seq_len, self.dim), (held, None)
        return dropout(out, self.dropout, self.training, draws, f"{site}.out", full, index)

    def sequence_sharded_parameters(self) -> list[nn.Parameter]:
        """The norms' parameters: with dist.sp they see this rank's tokens only."""
        return [*self.ln1.parameters(), *self.ln2.parameters()]


class CausalLM(nn.Module):
    """forward = embed -> blocks -> head, the contract the pipeline stages rely on. Subclasses hold
    their parameters only in top-level children, in forward order: the modules ``EMBEDDINGS`` names
    (the first pipeline stage keeps them), ``blocks``, then those ``HEAD`` names (the last stage's);
    they define ``_embed``, which receives the positions (learned embeddings read them; Llama's
    rotary angles are taken from them in each attention, so the blocks receive them too) and the
    dropout draws."""

    EMBEDDINGS: tuple[str, ...] = ("tok_emb",)
    HEAD: tuple[str, ...] = ("ln_f", "lm_head")

    def __init__(self, cfg, strategies: Strategies = LOCAL):
        super().__init__()
        self.cfg = cfg
        # dist.sp: the embedding's output is cut to this rank's tokens for the blocks, and gathered
        # again for the head, which (like the embedding) runs replicated on the whole sequence.
        self.sequence = strategies.sequence
        self.loads = strategies.loads  # the experts' loads and the values the routing count reads

    def embed(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        draws: Draws | None = None,
        documents: Documents | None = None,
    ) -> torch.Tensor:
        seq = tokens.shape[1]
        if seq > self.cfg.seq_len:
            raise ValueError(f"sequence length {seq} exceeds model.seq_len={self.cfg.seq_len}")
        return self._embed(tokens, positions_or_default(positions, seq, tokens.device), draws, documents)

    def _embed(
        self, tokens: torch.Tensor, positions: torch.Tensor, draws: Draws | None, documents
    ) -> torch.Tensor:
        raise NotImplementedError

    def step_fields(self, micro_batches: int) -> dict:
        """What the model adds to a step's metrics record from its last ``micro_batches`` training
        forwards (mixtral: its routing); nothing here."""
        return {}

    def train_loss(self, ce: torch.Tensor) -> torch.Tensor:
        """A training micro-batch's loss from its cross-entropy (the pipeline's last stage computes the
        cross-entropy itself); mixtral may add its load-balancing loss; here ``ce`` itself."""
        return ce

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(hidden))

    def forward(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        draws: Draws | None = None,
        documents: Documents | None = None,
    ):
        """Logits for ``tokens`` (batch, seq); with ``targets``, the mean cross-entropy loss.
        ``positions`` (seq,): where these tokens sit in their sequences (``positions_or_default``).
        ``draws``: the keys of the batch's dropout masks (``distlib.parallel.dropout``; the trainer
        passes them); None: dropout draws from torch's RNG. ``documents``: the sequences are packed
        documents (``distlib.parallel.documents``, of the whole sequences): attention stays inside
        each, and the positions the model sees restart at each; None: one text each."""
        x = self.embed(tokens, positions, draws, documents)
        x = self.sequence.scatter(x)
        for block in self.blocks:
            x = block(x, positions, draws, documents)
        logits = self.head(self.sequence.gather(x))
        if targets is None:
            return logits
        return lm_loss(logits, targets)

    def _init_and_tie(self) -> None:
        """normal(0, 0.02) Linear/Embedding weights, zero biases (norms keep their ones/zeros); then
        the tie, so the shared weight holds the embedding's draw (drawn once)."""
        self.apply(init_weights)
        if self.cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy over every position, in float32 (transformers' ForCausalLMLoss upcasts
    the logits too)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def init_weights(module: nn.Module) -> None:
    if not isinstance(module, (nn.Linear, nn.Embedding)):
        return
    if module.weight.is_meta:
        return  # shapes only (the planner's model): nothing to draw, and drawing costs 2 ms a weight
    nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def seeded(make, cfg, seed: int) -> nn.Module:
    """``make(cfg)`` with weights depending only on ``seed`` (global RNG untouched), drawn on the CPU
    whatever the default device, so every device starts from the same bytes."""
    fork = torch.random.fork_rng(devices=[])
    with fork, torch.device("cpu"):
        torch.manual_seed(seed)
        return make(cfg)
