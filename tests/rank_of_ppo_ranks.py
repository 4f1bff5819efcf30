"""One rank of examples/ppo_ranks.py under torchrun, recording what the test of data-parallel training compares.

``torchrun --standalone --nproc_per_node K tests/rank_of_ppo_ranks.py OUT KEY=VALUE ...`` trains as
``examples/ppo_ranks.py KEY=VALUE ...`` would, and each rank writes ``OUT/rank<r>.pt``: the first
row of observations of each of its batches, its agent's weights before training and after.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main(out: Path, overrides: list[str]) -> None:
    # by its module name, which worker processes import again to build the envs from its recipe
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    import ppo_ranks

    first_rows, agents = [], []

    class RecordingCollector(ppo_ranks.Collector):
        def __init__(self, envs, policy, **options):  # built right after the agent: its initial weights
            agents.append((policy, {k: v.clone() for k, v in policy.state_dict().items()}))
            super().__init__(envs, policy, **options)

        def __next__(self):
            batch = super().__next__()
            first_rows.append(batch["obs"][0].clone())
            return batch

    ppo_ranks.Collector = RecordingCollector
    ppo_ranks.main(overrides)  # joins torchrun's process group, and leaves it at the end
    ((agent, initial),) = agents
    assert not dist.is_initialized()
    torch.save(
        {"first_rows": torch.stack(first_rows), "initial": initial, "final": agent.state_dict()},
        out / f"rank{os.environ['RANK']}.pt",
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
