"""The same code on a GPU (skipped without one; scripts/gpu_check.sh runs these on a GPU machine).

Two gloo ranks share GPU 0, as the capstone's ranks do there (``train.device=cuda``): their CUDA
tensors are staged through pinned host memory. The collectives give the bytes the CPU gives; a
training run keeps every buffer on the GPU, follows the CPU run's losses, and its checkpoints
load on the CPU and the other way round.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from multiproc import run_ranks

from distlib.app.config.run import RunConfig
from distlib.app.trainer import Trainer
from distlib.comm import agree, local
from distlib.comm import collectives as C
from distlib.launch.torchrun import use_deterministic_kernels

# device_count (NVML), not is_available: the test process must not initialise CUDA before it forks
pytestmark = pytest.mark.skipif(
    torch.cuda.device_count() == 0, reason="needs a CUDA GPU (run scripts/gpu_check.sh on a GPU machine)"
)
GPU = "cuda:0"
MODEL = {"vocab_size": 30, "seq_len": 8, "dim": 16, "n_heads": 4, "n_layers": 2, "mlp_ratio": 2}


def _collectives(comm, board: bool):
    torch.cuda.set_device(0)
    if board:  # the shared-memory board, as training on one host uses: parts staged through it
        comm = local.attach(comm, None, 60.0)
        assert comm.transport.board is not None
    C.SEGMENT_BYTES = 64
    out = []
    for numel in (1, 7, 1000):
        g = torch.Generator().manual_seed(comm.rank * 100 + numel)
        x = torch.randn(numel, generator=g)
        for algo in ("exchange", "direct", "ring", "rabenseifner"):
            cpu, gpu = x.clone(), x.to(GPU)
            C.all_reduce(cpu, comm, "avg", algo=algo)
            C.all_reduce(gpu, comm, "avg", algo=algo)
            out.append(("all_reduce", algo, numel, torch.equal(gpu.cpu(), cpu), gpu.device.type))
        for algo in ("direct", "ring"):
            cpu, gpu = C.reduce_scatter(x, comm, algo=algo), C.reduce_scatter(x.to(GPU), comm, algo=algo)
            out.append(("reduce_scatter", algo, numel, torch.equal(gpu.cpu(), cpu), gpu.device.type))
            full = torch.empty(numel, device=GPU)
            lo, hi = C.chunk_bounds(numel, comm.size)[comm.rank]
            C.all_gather(full, x.to(GPU)[lo:hi], comm, algo=algo)
            ref = C.all_gather(torch.empty(numel), x[lo:hi], comm, algo=algo)
            out.append(("all_gather", algo, numel, torch.equal(full.cpu(), ref), full.device.type))
        for algo in ("flat", "tree", "chain", "scatter"):
            gpu = C.broadcast(x.to(GPU), 1, comm, algo=algo)
            out.append(
                (
                    "broadcast",
                    algo,
                    numel,
                    torch.equal(gpu.cpu(), C.broadcast(x.clone(), 1, comm, algo=algo)),
                    gpu.device.type,
                )
            )
    return out


@pytest.mark.parametrize("board", [False, True])
def test_collectives_on_cuda_tensors_over_gloo_match_the_cpu(board):
    for rank_out in run_ranks(_collectives, 2, board):
        bad = [case for case in rank_out if not case[3] or case[4] != "cuda"]
        assert not bad, bad


def _cfg(resume: str | None = None, steps: int = 4) -> RunConfig:
    return RunConfig.from_dict(
        {
            "model": MODEL,
            "data": {"total_tokens": 4096},
            "train": {"steps": steps, "global_batch": 8, "device": "cuda"},
            "dist": {"world_size": 2},
            "checkpoint": {"every_steps": 2, "resume": resume},
        }
    )


def _train(comm, run_dir: Path, device: str, resume: str | None = None, steps: int = 4):
    use_deterministic_kernels()  # the product's switch: the same ATen flag, without torch._inductor
    if device != "cpu":
        torch.cuda.set_device(0)
    if comm.rank == 0:
        run_dir.mkdir(parents=True)
    agree.all_true(True, comm)
    trainer = Trainer(_cfg(resume, steps), comm, run_dir, device=device)
    result = trainer.run()
    (opt,) = trainer.optimizer.groups.values()  # a dense model: one parameter group
    devices = {
        str(t.device) for t in (opt.flat_params, opt.flat_grads, opt.master, opt.exp_avg, opt.exp_avg_sq)
    }
    return [s.loss for s in result.steps], devices, result.resume_check and result.resume_check.ok


def _across(comm, root: str):
    root = Path(root)
    gpu = _train(comm, root / "gpu", GPU)
    cpu = _train(comm, root / "cpu", "cpu")
    gpu_to_cpu = _train(comm, root / "g2c", "cpu", str(root / "gpu" / "checkpoints" / "step_00000002"))
    cpu_to_gpu = _train(comm, root / "c2g", GPU, str(root / "cpu" / "checkpoints" / "step_00000002"))
    return gpu, cpu, gpu_to_cpu, cpu_to_gpu


def test_training_on_the_gpu_matches_the_cpu_and_checkpoints_cross_devices(tmp_path):
    gpu, cpu, gpu_to_cpu, cpu_to_gpu = run_ranks(_across, 2, str(tmp_path))[0]
    assert gpu[1] == {GPU} and cpu[1] == {"cpu"} and gpu[2] and cpu[2]
    for a, b in zip(gpu[0], cpu[0]):
        assert abs(a - b) <= 1e-5 * abs(b), (gpu[0], cpu[0])
    assert gpu_to_cpu[1] == {"cpu"} and cpu_to_gpu[1] == {GPU}
    for resumed, reference in ((gpu_to_cpu[0], cpu[0][2:]), (cpu_to_gpu[0], gpu[0][2:])):
        assert len(resumed) == 2
        for a, b in zip(resumed, reference):
            assert abs(a - b) <= 1e-5 * abs(b), (resumed, reference)
