"""The model's config group: its family and shape (conf/model/; docs/models.md).

Each key is declared once, here (``schema.key``): default, meaning, allowed values. A key a family
does not use must stay at its default (``NOT_USED_BY``); the rules between the keys are ``check``'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from distlib.app.config.schema import ConfigError, Group, key, specs

# model.family; app/model/families.py builds each
FAMILIES = ("minigpt", "gpt2", "llama", "qwen3", "mixtral", "qwen3_moe", "deepseek_v3")
# the sparse MoE (model/moe.py)
MOE_KEYS = ("n_experts", "top_k", "router_aux_loss_coef", "capacity_factor", "norm_topk_prob", "balance")
MOE_KEYS += ("bias_update_speed",)
# DeepSeek-V3's multi-head latent attention (model/mla.py) and its MoE's schedule and router
LATENT_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
DEEPSEEK_KEYS = LATENT_KEYS + ("first_k_dense_replace", "dense_mlp_hidden", "n_shared_experts")
DEEPSEEK_KEYS += ("n_group", "topk_group", "routed_scaling_factor")
# The keys a family does not use, each with what it is to stay at (the default); docs/models.md.
NOT_USED_BY = {
    "minigpt": ("mlp_hidden", "n_kv_heads", "head_dim", "tie_embeddings", "norm_eps", "rope_theta")
    + ("init_from", *MOE_KEYS, *DEEPSEEK_KEYS),
    "gpt2": ("n_kv_heads", "head_dim", "rope_theta", *MOE_KEYS, *DEEPSEEK_KEYS),
    "llama": MOE_KEYS + DEEPSEEK_KEYS,
    "qwen3": MOE_KEYS + DEEPSEEK_KEYS,
    "mixtral": ("head_dim", "norm_topk_prob", *DEEPSEEK_KEYS),
    "qwen3_moe": DEEPSEEK_KEYS,
    "deepseek_v3": ("n_kv_heads", "head_dim"),
}
# Llama's attention: rotary positions, grouped-query key/value heads
ROTARY = ("llama", "qwen3", "mixtral", "qwen3_moe")
ROPE = ROTARY + ("deepseek_v3",)  # rotary positions (model.rope_theta), in any attention
HEAD_NORMS = ("qwen3", "qwen3_moe")  # Qwen3's attention: an RMSNorm on every query and key head
# a sparse mixture of experts for the MLP (model.n_experts, top_k)
EXPERT_FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3")


@dataclass(frozen=True)
class ModelConfig(Group):
    """The model: its family and shape (conf/model/; docs/models.md).

    family: minigpt (the project's own model), gpt2 (computes what transformers' GPT2LMHeadModel computes),
        llama (LlamaForCausalLM's arithmetic), qwen3 (Qwen3ForCausalLM's: Llama with an RMSNorm on each
        query and key head), mixtral (MixtralForCausalLM's: Llama's attention, a sparse mixture of
        experts for the MLP), qwen3_moe (Qwen3MoeForCausalLM's: Qwen3's attention, Mixtral's
        experts) or deepseek_v3 (DeepseekV3ForCausalLM's: multi-head latent attention, dense first
        blocks, then shared and routed experts chosen by sigmoid scores in groups); docs/models.md
    vocab_size: tokens in the vocabulary (the synthetic corpus uses the same); left unset, data=text's
        tokenizer's (256 bytes, or data.vocab_size) or model.init_from's
    seq_len: context length: tokens per training sequence (gpt2/llama: the largest position)
    dim: embedding / residual width; must be divisible by n_heads unless head_dim is set
    n_heads: attention heads per block
    n_layers: transformer blocks
    mlp_ratio: MLP hidden width = mlp_ratio x dim (unless mlp_hidden is set)
    mlp_hidden: every family but minigpt: the MLP (mixtral, qwen3_moe, deepseek_v3: each expert's)
        hidden width itself (intermediate_size, moe_intermediate_size); null = mlp_ratio x dim
    n_kv_heads: llama/qwen3/mixtral/qwen3_moe: key/value heads (grouped-query attention; divides
        n_heads); null = n_heads
    head_dim: llama/qwen3/qwen3_moe: the width of one attention head (q/k/v project to n_heads x
        head_dim, o_proj back to dim); null = dim / n_heads
    tie_embeddings: every family but minigpt: the LM head is the token embedding (one parameter)
    norm_eps: every family but minigpt: the LayerNorm / RMSNorm epsilon
    rope_theta: llama/qwen3/mixtral/qwen3_moe/deepseek_v3: the rotary position embedding's base
    n_experts: mixtral/qwen3_moe/deepseek_v3: experts per MoE block (num_local_experts, num_experts,
        n_routed_experts)
    top_k: mixtral/qwen3_moe/deepseek_v3: experts each token is sent to (num_experts_per_tok), their
        outputs weighted by the router's scores (renormalised: norm_topk_prob); at most n_experts
    router_aux_loss_coef: mixtral/qwen3_moe/deepseek_v3: weight of the load-balancing loss added to
        the training loss with model.balance=aux (transformers' default)
    capacity_factor: mixtral/qwen3_moe/deepseek_v3: null = dropless (every token reaches its top_k
        experts, as transformers); a number: each expert takes at most ceil(capacity_factor x seq_len x
        top_k / n_experts) of one sequence's assignments (first choices first, in token order) and drops
        the rest (GShard); the dropped count per block is logged as dropped_tokens
    balance: mixtral/qwen3_moe/deepseek_v3: how the experts' load is balanced: aux (the load-balancing
        loss of the whole step, model.router_aux_loss_coef) or bias (DeepSeek-V3's auxiliary-loss-free
        rule: a per-expert bias added to the router scores to choose the experts, not to weigh them,
        moved after each step by model.bias_update_speed towards the mean load, from the step's counts
        over the whole batch; no loss term, no counting forward; the biases are checkpointed state)
    bias_update_speed: mixtral/qwen3_moe/deepseek_v3 with model.balance=bias: how far each step moves
        an expert's bias (up if it got fewer tokens than the mean, down if more; DeepSeek-V3's gamma)
    norm_topk_prob: qwen3_moe/deepseek_v3: renormalise a token's top_k router scores to sum to 1
        (transformers' norm_topk_prob; mixtral always does); false: the scores themselves
    q_lora_rank: deepseek_v3: the queries' low-rank width (q_a_proj to it, an RMSNorm, q_b_proj to the
        heads); null = one q_proj from dim to the heads
    kv_lora_rank: deepseek_v3: the width of the compressed key/value latent every head's keys and values
        are projected from (kv_a_proj_with_mqa, an RMSNorm, kv_b_proj)
    qk_nope_head_dim: deepseek_v3: each query/key head's width without rotary positions
    qk_rope_head_dim: deepseek_v3: each query head's rotary part, and the one rotary key part every head
        shares (even: rotated in interleaved pairs, as transformers' rope_interleave)
    v_head_dim: deepseek_v3: each value head's width (o_proj maps n_heads x v_head_dim back to dim)
    first_k_dense_replace: deepseek_v3: the first blocks with a dense MLP (of dense_mlp_hidden); the rest
        are MoE blocks (at least one)
    dense_mlp_hidden: deepseek_v3: the dense blocks' MLP width (intermediate_size); null = mlp_ratio x dim
    n_shared_experts: deepseek_v3: experts every token goes through beside its routed ones (one SwiGLU MLP
        of n_shared_experts x the experts' width, unweighted)
    n_group: deepseek_v3: the routed experts form n_group equal groups; a token chooses its top_k among the
        topk_group groups with the highest sums of their two best scores
    topk_group: deepseek_v3: the groups a token's experts may come from (at most n_group)
    routed_scaling_factor: deepseek_v3: the routed experts' weights are multiplied by it (after
        norm_topk_prob)
    dropout: dropout probability; every mask is a function of (seed, global sample, block, site), so
        every layout and a resumed run draw the same ones (distlib/parallel/dropout.py); llama, qwen3,
        mixtral, qwen3_moe, deepseek_v3: on the attention weights only, as transformers'
        attention_dropout
    activation_checkpointing: blocks: keep only each block's input in forward and recompute the block in
        backward (same losses, bit for bit; fewer activation bytes: the memory profile's `activation bytes`
        line)
    init_from: a Hugging Face directory (config.json, model.safetensors) of any family but minigpt whose
        weights a fresh run starts from; its config.json gives the family and shape keys left unset (one
        set to another value is refused); a resume ignores it
    """

    GROUP = "model"
    family: str = key("minigpt", choices=FAMILIES)
    vocab_size: int = key(64, ge=2)
    seq_len: int = key(16, ge=1)
    dim: int = key(32, ge=1)
    n_heads: int = key(4, ge=1)
    n_layers: int = key(2, ge=1)
    mlp_ratio: int = key(4, ge=1)
    mlp_hidden: int | None = key(None, ge=1)
    n_kv_heads: int | None = key(None, ge=1)
    head_dim: int | None = key(None, ge=1)
    tie_embeddings: bool = key(False)
    norm_eps: float = key(1e-5, gt=0)
    rope_theta: float = key(10000.0, gt=0)
    norm_topk_prob: bool = key(True)
    dropout: float = key(0.0, ge=0, lt=1)
    activation_checkpointing: str = key("none", choices=("none", "blocks"))
    init_from: str | None = key(None)
    n_experts: int = key(8, ge=1)
    top_k: int = key(2, ge=1)
    router_aux_loss_coef: float = key(0.001, ge=0)
    capacity_factor: float | None = key(None, gt=0)
    balance: str = key("aux", choices=("aux", "bias"))
    bias_update_speed: float = key(0.001, gt=0)
    q_lora_rank: int | None = key(None, ge=1)
    kv_lora_rank: int = key(16, ge=1)
    qk_nope_head_dim: int = key(8, ge=1)
    qk_rope_head_dim: int = key(8, ge=2)
    v_head_dim: int = key(8, ge=1)
    first_k_dense_replace: int = key(1, ge=0)
    dense_mlp_hidden: int | None = key(None, ge=1)
    n_shared_experts: int = key(1, ge=1)
    n_group: int = key(1, ge=1)
    topk_group: int = key(1, ge=1)
    routed_scaling_factor: float = key(1.0, gt=0)

    def check(self) -> None:
        if self.head_dim is None and self.dim % self.n_heads and self.family != "deepseek_v3":
            raise ConfigError(
                f"model.dim ({self.dim}) must be divisible by model.n_heads ({self.n_heads}), or "
                f"model.head_dim set"
            )
        defaults = {s.name: s.default for s in specs(type(self))}
        for name in NOT_USED_BY[self.family]:
            if getattr(self, name) != defaults[name]:
                raise ConfigError(
                    f"model.{name}={getattr(self, name)!r} does not apply to model.family={self.family} "
                    f"(used by {', '.join(f for f in FAMILIES if name not in NOT_USED_BY[f])}); "
                    f"leave it at {defaults[name]!r}"
                )
        if self.mlp_hidden is not None and self.mlp_ratio != defaults["mlp_ratio"]:
            raise ConfigError(
                f"model.mlp_hidden={self.mlp_hidden} and model.mlp_ratio={self.mlp_ratio} both set the MLP "
                f"width; set only one of them"
            )
        if self.family in ROTARY and self.n_heads % self.kv_heads:
            raise ConfigError(
                f"model.n_heads={self.n_heads} must be a multiple of model.n_kv_heads={self.kv_heads} "
                f"(each key/value head serves n_heads / n_kv_heads query heads)"
            )
        self._check_balance(defaults)
        if self.top_k > self.n_experts:
            raise ConfigError(
                f"model.top_k={self.top_k} exceeds model.n_experts={self.n_experts} (each token goes to "
                f"top_k distinct experts)"
            )
        if self.family == "deepseek_v3":
            self._check_deepseek()

    def _check_balance(self, defaults: dict) -> None:
        if self.balance == "aux" and self.bias_update_speed != defaults["bias_update_speed"]:
            raise ConfigError(
                f"model.bias_update_speed={self.bias_update_speed} moves the biases of model.balance=bias; "
                f"set model.balance=bias or leave it out"
            )
        if self.balance == "bias" and self.capacity_factor is not None:
            raise ConfigError(
                f"model.capacity_factor={self.capacity_factor} with model.balance=bias: the bias rule "
                f"balances a dropless router (DeepSeek-V3's); leave model.capacity_factor null"
            )

    def _check_deepseek(self) -> None:
        """DeepSeek-V3's shapes, as transformers' DeepseekV3 model would run them."""
        if self.qk_rope_head_dim % 2:
            raise ConfigError(
                f"model.qk_rope_head_dim={self.qk_rope_head_dim} must be even (rotated in pairs)"
            )
        if self.first_k_dense_replace >= self.n_layers:
            raise ConfigError(
                f"model.first_k_dense_replace={self.first_k_dense_replace} leaves no MoE block in "
                f"model.n_layers={self.n_layers}; use fewer dense blocks (or model.family=llama)"
            )
        groups, chosen = self.n_group, self.topk_group
        if self.n_experts % groups or self.n_experts // groups < 2:
            raise ConfigError(
                f"model.n_group={groups} must divide model.n_experts={self.n_experts} into groups of at "
                f"least 2 experts (a group's score is the sum of its two best)"
            )
        if chosen > groups:
            raise ConfigError(f"model.topk_group={chosen} exceeds model.n_group={groups}")
        reachable = chosen * (self.n_experts // groups)
        if self.top_k > reachable:
            raise ConfigError(
                f"model.top_k={self.top_k} exceeds the {reachable} experts of model.topk_group={chosen} "
                f"groups of {self.n_experts // groups}"
            )

    @property
    def mlp_width(self) -> int:
        """The MLP's hidden width (MiniGPT: always mlp_ratio x dim; the MoE families: each expert's)."""
        return self.mlp_hidden if self.mlp_hidden is not None else self.mlp_ratio * self.dim

    @property
    def dense_width(self) -> int:
        """deepseek_v3's dense blocks' MLP width."""
        return self.dense_mlp_hidden if self.dense_mlp_hidden is not None else self.mlp_ratio * self.dim

    @property
    def kv_heads(self) -> int:
        """Key/value heads (the families without rotary attention: one per query head)."""
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def head_width(self) -> int:
        """The width of one attention head: model.head_dim, or dim / n_heads."""
        return self.head_dim if self.head_dim is not None else self.dim // self.n_heads

    @property
    def has_experts(self) -> bool:
        """Whether the MLPs are mixtures of experts: the one way the code asks it."""
        return self.family in EXPERT_FAMILIES

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The blocks whose MLP is a mixture of experts, in order (deepseek_v3: after the dense ones)."""
        if not self.has_experts:
            return ()
        first = self.first_k_dense_replace if self.family == "deepseek_v3" else 0
        return tuple(range(first, self.n_layers))

    def moe_row(self, block: int) -> int:
        """Block ``block``'s row among the MoE blocks (the step's routing counts are kept so)."""
        return self.moe_layers.index(block)
