"""The config groups of a training run: the model, the optimizer, ZeRO and the loop (the data's:
``data_group``).

Each key is declared once, here (``schema.key``): default, meaning, allowed values. Rules between
the keys of one group are the group's ``check``; rules across groups are in ``run.py``.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from distlib.app.config.schema import ConfigError, Group, key, specs
from distlib.parallel.adamw import AdamWConfig
from distlib.parallel.zero.buckets import BUCKET_NUMEL

DTYPES = ("fp32", "bf16")  # train.dtype; distlib.app.config.run maps them to torch dtypes
DEVICES = ("auto", "cpu", "cuda")
SCHEDULES = ("constant", "cosine", "wsd")


# model.family; app/model/families.py builds each
FAMILIES = ("minigpt", "gpt2", "llama", "qwen3", "mixtral", "qwen3_moe")
# mixtral's sparse MoE (model/moe.py)
MOE_KEYS = ("n_experts", "top_k", "router_aux_loss_coef", "capacity_factor", "norm_topk_prob", "balance")
MOE_KEYS += ("bias_update_speed",)
# The keys a family does not use, each with what it is to stay at (the default); docs/models.md.
NOT_USED_BY = {
    "minigpt": ("mlp_hidden", "n_kv_heads", "head_dim", "tie_embeddings", "norm_eps", "rope_theta")
    + ("init_from", *MOE_KEYS),
    "gpt2": ("n_kv_heads", "head_dim", "rope_theta", *MOE_KEYS),
    "llama": MOE_KEYS,
    "qwen3": MOE_KEYS,
    "mixtral": ("head_dim", "norm_topk_prob"),
    "qwen3_moe": (),
}
# Llama's attention: rotary positions, grouped-query key/value heads
ROTARY = ("llama", "qwen3", "mixtral", "qwen3_moe")
HEAD_NORMS = ("qwen3", "qwen3_moe")  # Qwen3's attention: an RMSNorm on every query and key head
EXPERT_FAMILIES = ("mixtral", "qwen3_moe")  # a sparse mixture of experts for the MLP (model.n_experts, top_k)


@dataclass(frozen=True)
class ModelConfig(Group):
    """The model: its family and shape (conf/model/; docs/models.md).

    family: minigpt (the project's own model), gpt2 (computes what transformers' GPT2LMHeadModel computes),
        llama (LlamaForCausalLM's arithmetic), qwen3 (Qwen3ForCausalLM's: Llama with an RMSNorm on each
        query and key head), mixtral (MixtralForCausalLM's: Llama's attention, a sparse mixture of
        experts for the MLP) or qwen3_moe (Qwen3MoeForCausalLM's: Qwen3's attention, Mixtral's
        experts); docs/models.md
    vocab_size: tokens in the vocabulary (the synthetic corpus uses the same); left unset, data=text's
        tokenizer's (256 bytes, or data.vocab_size) or model.init_from's
    seq_len: context length: tokens per training sequence (gpt2/llama: the largest position)
    dim: embedding / residual width; must be divisible by n_heads unless head_dim is set
    n_heads: attention heads per block
    n_layers: transformer blocks
    mlp_ratio: MLP hidden width = mlp_ratio x dim (unless mlp_hidden is set)
    mlp_hidden: every family but minigpt: the MLP (mixtral, qwen3_moe: each expert's) hidden width
        itself (intermediate_size, moe_intermediate_size); null = mlp_ratio x dim
    n_kv_heads: llama/qwen3/mixtral/qwen3_moe: key/value heads (grouped-query attention; divides
        n_heads); null = n_heads
    head_dim: llama/qwen3/qwen3_moe: the width of one attention head (q/k/v project to n_heads x
        head_dim, o_proj back to dim); null = dim / n_heads
    tie_embeddings: every family but minigpt: the LM head is the token embedding (one parameter)
    norm_eps: every family but minigpt: the LayerNorm / RMSNorm epsilon
    rope_theta: llama/qwen3/mixtral/qwen3_moe: the rotary position embedding's base
    n_experts: mixtral/qwen3_moe: experts per block (num_local_experts, num_experts)
    top_k: mixtral/qwen3_moe: experts each token is sent to (num_experts_per_tok), their outputs
        weighted by the router probabilities (renormalised: norm_topk_prob); at most n_experts
    router_aux_loss_coef: mixtral/qwen3_moe: weight of the load-balancing loss added to the training
        loss (transformers' default)
    capacity_factor: mixtral/qwen3_moe: null = dropless (every token reaches its top_k experts, as
        transformers); a number: each expert takes at most ceil(capacity_factor x seq_len x top_k /
        n_experts) of one sequence's assignments (first choices first, in token order) and drops the
        rest (GShard); the dropped count per block is logged as dropped_tokens
    balance: mixtral/qwen3_moe: how the experts' load is balanced: aux (the load-balancing loss of the
        whole step, model.router_aux_loss_coef) or bias (DeepSeek-V3's auxiliary-loss-free rule: a
        per-expert bias added to the router probabilities to choose the experts, not to weigh them,
        moved after each step by model.bias_update_speed towards the mean load, from the step's counts
        over the whole batch; no loss term, no counting forward; the biases are checkpointed state)
    bias_update_speed: mixtral/qwen3_moe with model.balance=bias: how far each step moves an expert's
        bias (up if it got fewer tokens than the mean, down if more; DeepSeek-V3's gamma)
    norm_topk_prob: qwen3_moe: renormalise a token's top_k router probabilities to sum to 1
        (transformers' norm_topk_prob; mixtral always does); false: the probabilities themselves
    dropout: dropout probability; every mask is a function of (seed, global sample, block, site), so
        every layout and a resumed run draw the same ones (distlib/parallel/dropout.py); llama, qwen3,
        mixtral, qwen3_moe: on the attention weights only, as transformers' attention_dropout
    activation_checkpointing: blocks: keep only each block's input in forward and recompute the block in
        backward (same losses, bit for bit; fewer activation bytes: the memory profile's `activation bytes`
        line)
    init_from: a Hugging Face GPT-2 or Llama directory (config.json, model.safetensors) whose weights a
        fresh run starts from; its config.json gives the family and shape keys left unset (one set to another
        value is refused); a resume ignores it
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

    def check(self) -> None:
        if self.head_dim is None and self.dim % self.n_heads:
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
        if self.top_k > self.n_experts:
            raise ConfigError(
                f"model.top_k={self.top_k} exceeds model.n_experts={self.n_experts} (each token goes to "
                f"top_k distinct experts)"
            )

    @property
    def mlp_width(self) -> int:
        """The MLP's hidden width (MiniGPT: always mlp_ratio x dim)."""
        return self.mlp_hidden if self.mlp_hidden is not None else self.mlp_ratio * self.dim

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


@dataclass(frozen=True)
class OptimizerConfig(Group):
    """AdamW (bitwise torch.optim.AdamW's update), gradient clipping and the learning rate schedule.

    lr: peak learning rate (constant by default; see schedule)
    beta1: AdamW's first-moment decay
    beta2: AdamW's second-moment decay
    eps: added to AdamW's denominator
    weight_decay: decoupled weight decay, applied as p *= 1 - lr x weight_decay
    grad_clip: clip the global gradient norm to this value; 0 disables
    schedule: the learning rate per step, a function of the step alone (a resume continues it bit for bit):
        constant, cosine (to min_lr_ratio x lr at train.steps) or wsd (warmup, stable, then a linear decay
        over the last decay_steps)
    warmup_steps: linear warmup: step t <= W runs at lr x t / W (any schedule)
    decay_steps: wsd only: the final decay phase, in steps (>= 1 for wsd)
    min_lr_ratio: cosine / wsd: the rate at the end of the decay, as a fraction of lr
    """

    GROUP = "optimizer"
    lr: float = key(0.01, gt=0)
    beta1: float = key(0.9, ge=0, lt=1)
    beta2: float = key(0.999, ge=0, lt=1)
    eps: float = key(1e-8, gt=0)
    weight_decay: float = key(0.01, ge=0)
    grad_clip: float = key(0.0, ge=0)
    schedule: str = key("constant", choices=SCHEDULES)
    warmup_steps: int = key(0, ge=0)
    decay_steps: int = key(0, ge=0)
    min_lr_ratio: float = key(0.0, ge=0, le=1)

    def check(self) -> None:
        if self.schedule == "wsd" and self.decay_steps < 1:
            raise ConfigError(
                "optimizer.schedule=wsd needs optimizer.decay_steps >= 1 (its final decay phase)"
            )
        if self.schedule != "wsd" and self.decay_steps:
            raise ConfigError(
                f"optimizer.decay_steps is used by schedule=wsd only (schedule={self.schedule}; "
                f"cosine decays from the end of warmup to train.steps)"
            )

    @property
    def adamw(self) -> AdamWConfig:
        return AdamWConfig(
            lr=self.lr, beta1=self.beta1, beta2=self.beta2, eps=self.eps, weight_decay=self.weight_decay
        )


@dataclass(frozen=True)
class ZeroConfig(Group):
    """How the optimizer state, gradients and parameters are sharded over the data-parallel ranks.

    stage: 0: plain data parallelism (all-reduce, full AdamW state everywhere); 1: optimizer state sharded
        (12P/N); 2: gradients sharded too; 3: parameters sharded too
    bucket_numel: gradient bucket size in elements at stage 2 (and stages 0/1 with overlap); whole modules
        per bucket
    overlap: start the gradient sync from backward hooks on a communication thread (stage 3: also prefetch
        the next block's parameters); not bitwise equal to false at stages 0/1
    """

    GROUP = "zero"
    stage: int = key(1, choices=(0, 1, 2, 3))
    bucket_numel: int = key(BUCKET_NUMEL, ge=1)
    overlap: bool = key(False)


@dataclass(frozen=True)
class TrainConfig(Group):
    """The loop: steps, batch, accumulation, the invariants' reach, evaluation, precision, device.

    steps: optimizer steps; the run ends by itself after the last one
    global_batch: sequences per optimizer step over all data-parallel ranks; fixed, so every world size sees
        the same data and the same losses
    batch_size: sequences per data-parallel rank per micro-batch; null = derived from global_batch (to size
        per rank, set global_batch=null and batch_size=K)
    grad_accum: micro-batches per rank per optimizer step
    loss_tolerance: invariant 1: loss[t+1] <= loss[t] x (1 + loss_tolerance)
    monotone_until_step: invariant 1 covers steps up to this one (near convergence the per-step loss is
        noisy); 0 disables it
    eval_every: validation loss on the held-out split every K steps (needs data.val_fraction > 0); 0 = off
    eval_windows: held-out windows scored per evaluation (the first ones; the same every time)
    profile_steps: [a, b]: a torch.profiler Chrome trace of steps a..b per rank in <run
        dir>/traces/rank<R>.json, every collective a named range; scripts/report.py splits each rank's time
        with it
    dtype: bf16: bf16 parameters and activations, fp32 gradients, master weights and Adam state
    device: cpu, cuda (rank r on GPU LOCAL_RANK % GPUs; with gloo several ranks share a GPU), or auto (cuda
        with nccl, else cpu); docs/gpu.md
    """

    GROUP = "train"
    steps: int = key(20, ge=1)
    global_batch: int | None = key(16, ge=1)
    batch_size: int | None = key(None, ge=1)
    grad_accum: int = key(1, ge=1)
    loss_tolerance: float = key(1e-6, ge=0)
    monotone_until_step: int = key(20, ge=0)
    eval_every: int = key(0, ge=0)
    eval_windows: int = key(128, ge=1)
    profile_steps: tuple[int, int] | None = key(None)
    dtype: str = key("fp32", choices=DTYPES)
    device: str = key("auto", choices=DEVICES)

    def check(self) -> None:
        if self.profile_steps is not None:
            a, b = self.profile_steps
            if not 1 <= a <= b <= self.steps:
                raise ConfigError(
                    f"train.profile_steps must be [a, b] with 1 <= a <= b <= train.steps={self.steps}, "
                    f"got {list(self.profile_steps)}"
                )
        if self.batch_size is None and self.global_batch is None:
            raise ConfigError("set train.global_batch or train.batch_size (both are null)")


@dataclass(frozen=True)
class MetricsConfig(Group):
    """What rank 0 logs (metrics.jsonl, schema in docs/unattended.md) and prints.

    file: rank 0's JSONL log in the run directory: a record per step plus events
    per_rank: also write metrics.rank<R>.jsonl with each rank's own values
    progress_every: rank 0 prints a one-line progress report every K steps; 0 disables
    tensorboard: also write rank 0's step records as TensorBoard event files in <run dir>/tensorboard/
        (loss, grad norm, lr, step time, tokens/s, MFU, memory, validation loss); needs the optional
        `tensorboard` extra
    peak_flops: MFU's peak per rank in FLOP/s; null = the GPU's data-sheet figure for train.dtype
        (A100, H100, H200) or, on any other device, measured (a few 256x256 fp32 matmuls); the run prints
        which
    """

    GROUP = "metrics"
    file: str = key("metrics.jsonl")
    per_rank: bool = key(False)
    progress_every: int = key(1, ge=0)
    tensorboard: bool = key(False)
    peak_flops: float | None = key(None, gt=0)

    def check(self) -> None:
        if not self.file or "/" in self.file:
            raise ConfigError(
                f"metrics.file must be a plain file name in the run directory, got {self.file!r}"
            )
        # Looked up, not imported: the writer is imported by the run that uses it (observe.tensorboard).
        if self.tensorboard and importlib.util.find_spec("tensorboard") is None:
            raise ConfigError(
                "metrics.tensorboard=true needs the optional `tensorboard` extra "
                "(pip install tensorboard==2.21.0), which is not installed"
            )
