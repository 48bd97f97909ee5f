"""Training throughput on one GPU: our ZeRO optimizer vs torch DDP + fused AdamW, same run.

    python3 benchmarks/gpu_throughput.py                       # MiniGPT dim 1024, 8 blocks, seq 512
    python3 benchmarks/gpu_throughput.py --model gpt2_124m     # a conf/model preset: GPT-2 small
    python3 benchmarks/gpu_throughput.py --steps 5 --json out.json

One process, one GPU, a process group of one (NCCL). Every variant trains its own copy of the
same model (same seed) on the same batches: a MiniGPT of --dim/--layers/--heads/--seq/--vocab, or
with --model the conf/model/ preset of that name (any family, composed as train.py composes
model=<preset>; its own shape). Warm-up steps, then ``--steps`` timed steps between
two ``torch.cuda.synchronize()``. Variants, in fp32 and in bf16:

  ours   distlib's ZeRO-1 optimizer (a world of one: no collective has anything to send), the
         step our trainer runs: forward, backward, sync_grads (grad norm: one host read), AdamW
         on the flat fp32 master. bf16: bf16 parameters and activations, fp32 master and Adam.
  torch  DistributedDataParallel + torch.optim.AdamW(fused=True). bf16: fp32 parameters under
         torch.autocast(bfloat16), torch's usual mixed precision.

Model FLOPs utilisation (MFU) = 6 * parameters * tokens / seconds / peak, where peak is the
dense bf16 matmul rate measured here first (an 8192^3 matmul, best of several), so fp32 rows
are shown against the bf16 peak too. ``vs torch`` = our tokens/s / torch's (> 1: faster).
Prints a table; writes JSON (--json, default benchmarks/results/gpu_throughput.json).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch
import torch.distributed as dist

from distlib.app.config.groups import OptimizerConfig
from distlib.app.config.model_group import ModelConfig
from distlib.app.config.run import RunConfig
from distlib.app.model.families import build
from distlib.comm.group import Comm
from distlib.parallel.zero import make_optimizer

ADAMW = OptimizerConfig(lr=1e-4).adamw


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bf16_peak(device: torch.device, n: int = 8192, reps: int = 10) -> float:
    """Measured dense bf16 matmul FLOP/s (best of 3 timings of ``reps`` matmuls)."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(3):
        sync(device)
        began = time.perf_counter()
        for _ in range(reps):
            a @ b
        sync(device)
        best = min(best, time.perf_counter() - began)
    return 2 * n**3 * reps / best


def batches(
    cfg: ModelConfig, batch: int, count: int, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        w = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=g, device="cpu").to(device)
        out.append((w[:, :-1], w[:, 1:]))
    return out


def ours(cfg, dtype, device, data):
    model = build(cfg, seed=1234).to(device)
    transport = str(device) if device.type == "cuda" else "cpu"  # NCCL on the GPU, gloo on the CPU
    opt = make_optimizer(model, Comm.world(device=transport), 1, ADAMW, param_dtype=dtype)

    def step(x, y):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return step, sum(p.numel() for p in model.parameters())


def torch_ddp(cfg, dtype, device, data):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = build(cfg, seed=1234).to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.AdamW(ddp.parameters(), **ADAMW.torch_kwargs(), fused=True)

    def step(x, y):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            loss = ddp(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step, sum(p.numel() for p in model.parameters())


def measure(make, cfg, dtype, device, data, warmup: int, steps: int) -> dict:
    step, params = make(cfg, dtype, device, data)
    for i in range(warmup):
        step(*data[i % len(data)])
    sync(device)
    began = time.perf_counter()
    losses = [step(*data[(warmup + i) % len(data)]) for i in range(steps)]
    sync(device)
    seconds = (time.perf_counter() - began) / steps
    return {
        "params": params,
        "step_s": seconds,
        "last_loss": float(losses[-1]),
        "peak_mem_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0,
    }


def model_config(args: argparse.Namespace) -> ModelConfig:
    """The --model preset (conf/model/<name>.yaml over the defaults), or MiniGPT of the shape flags."""
    if args.model:
        from distlib.launch.hydra_config import compose_tree

        return RunConfig.from_dict(compose_tree([f"model={args.model}"])).model
    return ModelConfig(
        vocab_size=args.vocab, seq_len=args.seq, dim=args.dim, n_heads=args.heads, n_layers=args.layers
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a conf/model/ preset (e.g. gpt2_124m); its shape wins")
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a quick smoke run of this script")
    ap.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "results", "gpu_throughput.json"))
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("error: benchmarks/gpu_throughput.py needs a CUDA GPU (or --device cpu for a smoke run)")
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        cfg = model_config(args)
        data = batches(cfg, args.batch, 4, device)
        peak = bf16_peak(device, n=8192 if device.type == "cuda" else 256)
        tokens = args.batch * cfg.seq_len
        rows = []
        for name in args.dtypes.split(","):
            dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[name]
            for variant, make in (("ours ZeRO-1", ours), ("torch DDP + AdamW(fused)", torch_ddp)):
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                r = measure(make, cfg, dtype, device, data, args.warmup, args.steps)
                r.update(
                    variant=variant,
                    dtype=name,
                    tokens_per_s=tokens / r["step_s"],
                    mfu=6 * r["params"] * tokens / r["step_s"] / peak,
                )
                rows.append(r)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"{name}, torch {torch.__version__}: measured bf16 matmul peak {peak / 1e12:.0f} TFLOP/s; "
        f"model {cfg.family} {rows[0]['params'] / 1e6:.1f}M params, {tokens} tokens/step, "
        f"{args.steps} timed steps"
    )
    print(
        f"{'variant':<26} {'dtype':>5} {'ms/step':>8} {'tokens/s':>10} {'MFU':>6} {'vs torch':>8} "
        f"{'peak GiB':>8} {'last loss':>9}"
    )
    for r in rows:
        ref = next(x for x in rows if x["dtype"] == r["dtype"] and x["variant"].startswith("torch"))
        r["vs_torch"] = r["tokens_per_s"] / ref["tokens_per_s"]
        print(
            f"{r['variant']:<26} {r['dtype']:>5} {r['step_s'] * 1e3:8.2f} {r['tokens_per_s']:10.0f} "
            f"{r['mfu']:6.1%} {r['vs_torch']:8.2f} {r['peak_mem_bytes'] / 2**30:8.2f} {r['last_loss']:9.4f}"
        )
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(
            {
                "device": name,
                "torch": torch.__version__,
                "bf16_peak_flops": peak,
                "tokens_per_step": tokens,
                "config": vars(args),
                "model": cfg.to_dict(),
                "rows": rows,
            },
            f,
            indent=2,
        )
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
