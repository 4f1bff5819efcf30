"""Tests of examples/sac.py: config loading, the replay buffer, the episode count and short training runs.

Reaching -200 takes about 3 minutes on a 2-core machine with configs/sac_pendulum.yaml and 2 minutes or more with
configs/sac_pendulum_torch.yaml, more than the suite can afford: both are measured by the commands in
docs/off-policy.md; here the torch config runs 2 episodes of 256 envs and must improve.
"""

from __future__ import annotations

import csv
import importlib.util
import math
import re
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import pytest
import torch
from tensordict import TensorDict

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "sac.py"
TORCH_CONFIG = ROOT / "configs" / "sac_pendulum_torch.yaml"


@pytest.fixture(scope="module")
def sac():
    """examples/sac.py imported as a module (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("sac_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolves annotations through sys.modules
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def read_progress(run_dir: Path) -> list[dict[str, float]]:
    with open(run_dir / "progress.csv", newline="") as f:
        return [{key: float(value) for key, value in row.items()} for row in csv.DictReader(f)]


def test_the_shipped_config_loads_with_overrides(sac):
    cfg = sac.load_config(sac.DEFAULT_CONFIG, ["seed=3", "q_lr=3e-4", "backend=process"])
    assert (cfg.env_id, cfg.total_timesteps, cfg.seed, cfg.backend) == ("Pendulum-v1", 30_000, 3, "process")
    assert cfg.q_lr == 3e-4 and isinstance(cfg.q_lr, float)
    assert cfg.prefetch >= 1 and cfg.buffer_size >= cfg.total_timesteps


def test_the_torch_config_is_fasttd3s_shape(sac):
    """Thousands of torch envs stepped once per batch, several gradient steps on large minibatches per batch."""
    cfg = sac.load_config(TORCH_CONFIG)
    assert cfg.env_id == "torch_rollout/Pendulum-v1" and cfg.num_envs >= 1024 and cfg.num_steps == 1
    assert cfg.num_envs * cfg.update_ratio == 4 and cfg.batch_size >= 1024
    assert cfg.buffer_size >= cfg.total_timesteps and cfg.target_return == -200


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("bogus=1", "override 'bogus=1': unknown config key 'bogus'"),
        ("num_envs=2.5", "override 'num_envs=2.5': config key 'num_envs': expected int, got 2.5 (float)"),
        ("backend=ray", "config key 'backend': expected 'thread' or 'process', got 'ray'"),
        ("prefetch=0", "config key 'prefetch': expected >= 1 (collection beside training), got 0"),
    ],
    ids=["unknown", "wrong-type", "backend", "lockstep"],
)
def test_config_errors_name_the_key(sac, override, message):
    with pytest.raises(sac.ConfigError, match=re.escape(message)):
        sac.load_config(None, [override])


def test_help_lists_every_key(sac, capsys):
    with pytest.raises(SystemExit) as exit_info:
        sac.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for key in ("num_steps=2", "update_ratio=1.0", "autotune=true", "target_return=null"):
        assert key in out
    assert "[sac_pendulum.yaml: 30000]" in out  # the shipped config's value beside the default


def test_the_script_shows_sac_in_about_390_lines_with_the_plumbing_in_common(sac):
    """CleanRL-style, top to bottom: config, actor and critics, replay buffer, the loop; the rest is common.py's."""
    assert len(SCRIPT.read_text().splitlines()) <= 390
    assert sac.ConfigError is sac.common.ConfigError
    source = SCRIPT.read_text()
    for shown in ("class Config:", "class Actor(", "class ReplayBuffer:", "Collector(", "def update("):
        assert shown in source, shown


def test_the_replay_buffer_wraps_around_and_keeps_the_newest(sac):
    def rows(start, n):
        k = torch.arange(start, start + n, dtype=torch.float32)
        return TensorDict(
            {
                "obs": k[:, None],
                "action": k[:, None],
                "reward": k,
                "next_obs": k[:, None] + 1,
                "terminated": k % 2 == 0,
                "mask": k % 3 != 0,
                "episode_return": k,  # not kept
            },
            [n],
        )

    buffer = sac.ReplayBuffer(5, rows(0, 1))
    buffer.extend(rows(0, 3))
    assert buffer.size == 3 and sorted(buffer.data["reward"][:3].tolist()) == [0, 1, 2]
    buffer.extend(rows(3, 4))  # 7 in all: 0 and 1 are overwritten
    assert buffer.size == 5 and sorted(buffer.data["reward"].tolist()) == [2, 3, 4, 5, 6]
    buffer.extend(rows(10, 8))  # more than it holds at once: the last 5
    assert sorted(buffer.data["reward"].tolist()) == [13, 14, 15, 16, 17]
    # written from position 2 on, wrapping around: 13, 14, 15 at 2, 3, 4, then 16, 17 at 0, 1
    assert buffer.data["reward"].tolist() == [16, 17, 13, 14, 15] and buffer.pos == 2
    assert buffer.data["mask"].tolist() == [True, True, True, True, False]  # kept with its row (15 % 3 == 0)
    sample = buffer.sample(64, torch.Generator().manual_seed(0))
    assert set(sample.keys()) == set(sac.ReplayBuffer.KEYS)
    assert torch.equal(sample["next_obs"], sample["obs"] + 1) and set(sample["reward"].tolist()) <= {13, 14, 15, 16, 17}


def test_the_critics_loss_ignores_masked_rows(sac):
    """A masked row (NEXT_STEP's reset row) is in the buffer but is no transition: its reward must not count."""
    cfg = sac.load_config(None, ["hidden_size=8", "autotune=false"])
    space = gym.spaces.Box(-2.0, 2.0, (1,))
    torch.manual_seed(0)
    learner = sac.SAC(3, space, cfg, torch.device("cpu"))
    data = TensorDict(
        {
            "obs": torch.randn(6, 3),
            "action": torch.rand(6, 1) * 4 - 2,
            "reward": torch.randn(6),
            "next_obs": torch.randn(6, 3),
            "terminated": torch.zeros(6, dtype=torch.bool),
            "mask": torch.tensor([True, True, False, True, False, True]),
        },
        [6],
    )
    losses = []
    for masked_reward in (-1e6, 1e6):
        data["reward"][~data["mask"]] = masked_reward
        copy = sac.SAC(3, space, cfg, torch.device("cpu"))
        copy.critic.load_state_dict(learner.critic.state_dict())
        copy.critic_target.load_state_dict(learner.critic_target.state_dict())
        copy.actor.load_state_dict(learner.actor.state_dict())
        torch.manual_seed(1)  # the same action samples
        copy.update(data)
        losses.append(copy.stats["losses/qf_loss"])
    torch.testing.assert_close(losses[0], losses[1])
    assert losses[0] < 1e3  # neither masked reward reached it


def test_ended_returns_are_counted_at_flush_in_order_and_reached_where_the_window_first_passes(sac):
    recent = sac.common.RecentReturns(2)
    ended = sac.EndedReturns(recent, target=-10.0)

    def batch(returns, done, mask=(True, True)):
        return TensorDict(
            {
                "episode_return": torch.tensor([returns]),  # [T=1, N=2]
                "done": torch.tensor([done]),
                "mask": torch.tensor([mask]),
            },
            [1, 2],
        )

    ended.add(2, batch([-50.0, -30.0], [True, False]))
    ended.add(4, batch([-20.0, -5.0], [False, True], mask=(True, False)))  # a masked row ends nothing
    ended.add(6, batch([-8.0, -12.0], [True, True]))
    ended.add(8, batch([-1.0, -1.0], [True, True]))
    assert recent.episodes == 0 and len(ended.pending) == 4  # nothing counted before the flush
    ended.flush()
    assert recent.episodes == 5 and list(recent.returns) == [-1.0, -1.0] and not ended.pending
    assert ended.reached == 6  # the window [-8, -12] first: mean -10
    ended.flush()  # nothing pending: no change
    assert recent.episodes == 5 and ended.reached == 6


def run_script(*args: str, timeout: float = 120) -> str:
    result = subprocess.run(
        [sys.executable, "-W", "error", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.parametrize("backend", ["thread", "process"])
def test_a_short_run_logs_finite_losses(tmp_path, backend):
    # 800 steps: one episode of each of the 4 envs, updates from step 200 on; run as a script, as a user runs
    # it (a worker process imports the actor's class from the script).
    overrides = ["total_timesteps=800", "learning_starts=200", "log_every=200", "batch_size=64"]
    out = run_script(*overrides, f"backend={backend}", f"run_dir={tmp_path}")
    assert out.splitlines()[0] == f"collector: backend={backend} num_workers=1 prefetch=1 device=cpu"
    mean_return = float(re.search(r"final mean return \(last 4 episodes\): (-?\d+\.\d)", out)[1])
    rows = read_progress(tmp_path)
    assert [row["step"] for row in rows] == [200, 400, 600, 800]
    last = rows[-1]
    assert last["charts/episodes"] == 4 and round(last["charts/mean_return"], 1) == mean_return
    # Pendulum's returns lie in [-16.3 * 200, 0]; the untrained actor's are far below the -200 of a trained one.
    assert -3300 < mean_return < -200
    for key in ("losses/qf_loss", "losses/qf_value", "losses/actor_loss", "losses/alpha"):
        assert all(math.isfinite(row[key]) for row in rows), key
    assert 0 < last["losses/alpha"] < 0.2  # autotuned down from 0.2 as the entropy is above its target
    assert last["charts/policy_lag"] == 1  # prefetch=1: acting one refresh behind
    assert (tmp_path / "config.yaml").exists()
    # the collector's account of each interval and of the run (docs/bottleneck.md)
    assert all(0 <= row["time/env_share"] <= 1 and 0 <= row["time/wait_share"] <= 1 for row in rows)
    assert re.search(r"step +800 .* env \d+% pol \d+% col \d+% idle \d+% wait \d+%", out)
    assert "collector over the run: " in out and (tmp_path / "time_shares.png").exists()


def test_the_torch_config_fills_the_buffer_from_every_batch_and_improves(sac, tmp_path, monkeypatch):
    """configs/sac_pendulum_torch.yaml, shortened to 256 envs and 2 episodes: the buffer holds every row of every
    batch, in order and wrapped around; 256 episodes end at each time limit; the second episodes score better."""
    written = []

    class Recording(sac.ReplayBuffer):
        def extend(self, rows):
            written.append(rows.select(*self.KEYS).clone())
            super().extend(rows)
            Recording.buffer = self  # the one the run made, for the checks below

    monkeypatch.setattr(sac, "ReplayBuffer", Recording)
    overrides = [
        "num_envs=256",
        "total_timesteps=102400",  # 400 steps of each env: 2 episodes
        "learning_starts=2560",
        "update_ratio=0.015625",  # 4 gradient steps per batch, as the config with 1,024 envs
        "buffer_size=80000",  # wraps around after 312.5 batches
        "log_every=25600",
        f"run_dir={tmp_path}",
    ]
    final = sac.train(sac.load_config(TORCH_CONFIG, overrides))

    assert len(written) == 400 and all(rows.shape == (256,) for rows in written)
    assert all(rows["mask"].all() for rows in written)  # SAME_STEP resets: every row is a transition
    buffer = Recording.buffer
    newest = torch.cat(written)[-80000:]
    assert buffer.size == 80000 and buffer.pos == 102400 % 80000
    assert (buffer.data.apply(lambda x: x.roll(-buffer.pos, 0)) == newest).all()

    rows = read_progress(tmp_path)
    assert [row["step"] for row in rows] == [25600 * k for k in range(1, 5)]
    assert [row["charts/episodes"] for row in rows] == [0, 256, 256, 512]
    first, second = rows[1]["charts/mean_return"], rows[3]["charts/mean_return"]
    assert second == pytest.approx(final) and -3300 < first < -900  # the untrained actor's episodes
    assert second > first + 300, (first, second)
    assert all(math.isfinite(row["losses/qf_loss"]) for row in rows[1:])
