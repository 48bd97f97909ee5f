import torch
from multiproc import run_ranks

from distlib.app.config.model_group import ModelConfig
from distlib.app.model.minigpt import MiniGPT
from distlib.parallel.broadcast import broadcast_module_


class WithBuffer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = MiniGPT(ModelConfig(n_layers=1))
        self.register_buffer("counter", torch.zeros(3, dtype=torch.int64))


def _replicas(comm):
    torch.manual_seed(100 + comm.rank)  # every rank starts from different weights
    module = WithBuffer()
    module.counter += comm.rank + 1
    before = torch.cat([p.detach().flatten() for p in module.parameters()]).clone()
    broadcast_module_(module, comm)
    after = torch.cat([p.detach().flatten() for p in module.parameters()])
    return before.numpy(), after.numpy(), module.counter.clone().numpy()


def test_broadcast_module_gives_every_rank_rank0s_parameters_and_buffers():
    for world in (2, 3, 4):
        results = run_ranks(_replicas, world)
        rank0_before = results[0][0]
        for rank, (before, after, counter) in enumerate(results):
            assert after.tobytes() == rank0_before.tobytes(), (
                f"rank {rank} of {world} did not get rank 0's weights"
            )
            assert counter.tolist() == [1, 1, 1], f"rank {rank}'s buffer was not broadcast"
            if rank:
                assert before.tobytes() != rank0_before.tobytes()  # the test would notice a missing broadcast
