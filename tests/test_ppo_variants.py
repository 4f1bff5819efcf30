"""Tests of the PPO scripts beside examples/ppo.py, each of which adds one capability: continuous control with
normalisation (ppo_continuous.py), a recurrent agent (ppo_lstm.py), checkpoints, Ctrl-C, --resume and videos
(ppo_resume.py), and data-parallel ranks under torchrun (ppo_ranks.py)."""

from __future__ import annotations

import csv
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from example_scripts import CONFIGS, EXAMPLES, ROOT, import_script


@pytest.fixture(scope="module")
def ppo_continuous():
    yield from import_script("ppo_continuous")


@pytest.fixture(scope="module")
def ppo_lstm():
    yield from import_script("ppo_lstm")


@pytest.fixture(scope="module")
def ppo_resume():
    yield from import_script("ppo_resume")


@pytest.fixture(scope="module")
def ppo_ranks():
    yield from import_script("ppo_ranks")


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """train() and evaluate() set the process's torch threads (cfg.torch_threads): the next test gets them back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def run_main(module, capsys, *args: str) -> str:
    """Runs a script's command line, ``main(args)``; returns what it printed."""
    capsys.readouterr()
    module.main(list(args))
    return capsys.readouterr().out


def run_failing(module, capsys, *args: str) -> str:
    """Runs a script's command line expecting it to fail as a command (an exit code of 2); returns its stderr."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        module.main(list(args))
    assert exit_info.value.code == 2
    return capsys.readouterr().err


EVAL_LINE = re.compile(r"eval over 2 episodes: mean return (-?\d+\.\d) \+- (\d+\.\d)")


def read_steps(run_dir: Path) -> list[int]:
    with open(run_dir / "progress.csv", newline="") as f:
        return [int(row["step"]) for row in csv.DictReader(f)]


# ---------------------------------------------------------------------------- ppo_continuous.py


def test_an_env_recipe_that_cannot_be_imported_names_the_key(ppo_continuous):
    cfg = ppo_continuous.load_config(None, ["env_recipe=no_such_module:make"])
    with pytest.raises(
        ppo_continuous.ConfigError, match=re.escape("config key 'env_recipe': 'no_such_module:make' names no")
    ):
        ppo_continuous.make_envs(cfg, 2)


def test_keys_that_would_both_set_the_learning_rate_are_refused(ppo_continuous):
    load, error = ppo_continuous.load_config, ppo_continuous.ConfigError
    with pytest.raises(error, match=re.escape("desired_kl adapts the learning rate, which anneal_lr=true")):
        load(None, ["desired_kl=0.01"])
    assert load(None, ["desired_kl=0.01", "anneal_lr=false"]).desired_kl == 0.01


def test_continuous_actions_save_obs_normalisation(ppo_continuous, tmp_path, capsys):
    """Pendulum (Box actions, no MuJoCo needed) with the HalfCheetah config's wrappers."""
    cfg = ppo_continuous.load_config(
        CONFIGS / "ppo_halfcheetah.yaml",
        ["env_id=Pendulum-v1", "num_envs=2", "num_steps=64", "total_timesteps=256", f"run_dir={tmp_path}"],
    )
    ppo_continuous.train(cfg)
    checkpoint = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert checkpoint["obs_rms"]["mean"].shape == (3,)
    assert checkpoint["obs_rms"]["count"] > 256  # updated on every step
    mean, std = ppo_continuous.evaluate(tmp_path / "checkpoint.pt", ["eval_episodes=2"])
    assert -2000 < mean < 0 and std >= 0  # Pendulum's returns are negative
    assert EVAL_LINE.search(capsys.readouterr().out)


def test_the_wrappers_are_refused_for_a_vector_env_of_torch_tensors(ppo_continuous, tmp_path, capsys):
    config = str(CONFIGS / "ppo_isaac_cartpole.yaml")  # an env recipe: Isaac Lab's envs, tensors on their device
    refused = run_failing(ppo_continuous, capsys, "--config", config, "normalize_obs=true", "backend=thread")
    assert "Isaac-Cartpole-Direct: normalize_obs, normalize_reward and clip_action are for NumPy envs" in refused


def test_normalize_reward_in_worker_processes_logs_the_envs_own_returns(ppo_continuous, tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_main(
        ppo_continuous,
        capsys,
        "--config",
        str(CONFIGS / "ppo_cartpole.yaml"),
        "env_id=Pendulum-v1",
        "normalize_reward=true",
        "backend=process",
        "num_envs=2",
        "num_steps=64",
        "total_timesteps=512",
        f"run_dir={run_dir}",
    )
    with open(run_dir / "progress.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if int(r["charts/episodes"]) > 0]
    assert rows
    for row in rows:
        # Pendulum's own returns are below -300 for an untrained agent (200 steps of rewards in [-16.3, 0]); the
        # normalised rewards' sums are within a few tens of 0
        assert float(row["charts/mean_return"]) < -300, row


def test_normalize_obs_with_worker_processes_is_refused(ppo_continuous, tmp_path):
    with pytest.raises(
        ppo_continuous.ConfigError, match=re.escape("normalize_obs needs backend=thread, got backend=process")
    ):
        ppo_continuous.load_config(None, ["normalize_obs=true", "backend=process", f"run_dir={tmp_path}"])


# ---------------------------------------------------------------------------- ppo_lstm.py


def test_smoke_recurrent_config_train_then_eval(ppo_lstm, tmp_path, capsys):
    run_dir = tmp_path / "run"
    # 2 iterations of 2 envs x 16 steps, in a worker process, then --eval with the LSTM's state
    out = run_main(
        ppo_lstm,
        capsys,
        "total_timesteps=64",
        "num_envs=2",
        "num_steps=16",
        "backend=process",
        f"run_dir={run_dir}",
    )
    assert re.search(r"final mean return \(last \d+ episodes\): ", out)
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert checkpoint["model"]["lstm.weight_ih"].shape == (4 * 64, 2)  # position and angle only
    assert EVAL_LINE.search(run_main(ppo_lstm, capsys, "--eval", str(run_dir / "checkpoint.pt"), "eval_episodes=2"))


def test_recurrent_agent_replays_the_batch_it_collected(ppo_lstm):
    """End to end: sequences cut from a batch at any row and replayed from their stored state give the stored
    log_prob and value (same weights), across episode starts (is_init) and NEXT_STEP reset rows."""
    from torch_rollout import Collector

    cfg = ppo_lstm.load_config(CONFIGS / "ppo_cartpole_novel_lstm.yaml", ["num_envs=3", "num_steps=48", "lstm_size=8"])
    torch.manual_seed(0)
    envs = ppo_lstm.make_envs(cfg, cfg.num_envs)
    agent = ppo_lstm.make_agent(envs.single_observation_space, envs.single_action_space, cfg)
    with Collector(
        envs,
        agent,
        num_steps=cfg.num_steps,
        total_timesteps=3 * 48 * 2,
        device="cpu",
        seed=0,
        backend="thread",
        prefetch=1,
        initial_state=agent.initial_state,
    ) as collector:
        batches = list(collector)
    envs.close()
    assert batches[0]["obs"].shape == (48, 3, 2) and batches[0]["h"].shape == (48, 3, 8)
    assert bool(batches[0]["is_init"][0].all()) and not batches[1]["is_init"][0].all()
    assert sum(int(batch["is_init"].sum()) for batch in batches) > 3  # episodes restarted inside the batches
    for batch in batches:
        for length in (8, 48):
            sequences = ppo_lstm.to_sequences(batch, length)
            with torch.no_grad():
                log_prob, _, value = agent.evaluate(sequences)
            assert torch.allclose(log_prob, sequences["log_prob"], atol=1e-5)
            assert torch.allclose(value, sequences["value"], atol=1e-5)


# ---------------------------------------------------------------------------- ppo_resume.py


def test_help_lists_the_checkpoint_keys_and_options(ppo_resume, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit) as exit_info:
        ppo_resume.main(["--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "logging, checkpoints and evaluation:" in text and " checkpoint_every=10 iterations between" in text
    for option in ("--config CONFIG", "--eval CHECKPOINT", "--resume CHECKPOINT", "KEY=VALUE"):
        assert option in text


def test_capture_video_records_an_evaluation_episode_after_training_and_with_eval(
    ppo_resume, tmp_path, capsys, monkeypatch
):
    pytest.importorskip("moviepy")
    pytest.importorskip("pygame")  # CartPole renders with pygame: gymnasium[classic-control]
    monkeypatch.setenv("SDL_VIDEODRIVER", "dummy")  # as the example sets it, but undone after the test
    # 1 iteration of 2 envs x 32 steps, then one recorded episode of the final weights
    args = ["total_timesteps=64", "num_envs=2", "num_steps=32", "backend=thread", "capture_video=true"]
    ppo_resume.train(ppo_resume.load_config(CONFIGS / "ppo_cartpole.yaml", [*args, f"run_dir={tmp_path}"]))
    video = tmp_path / "videos" / "eval-step64-episode-0.mp4"
    assert video.read_bytes()[4:8] == b"ftyp"  # an MP4 container
    assert "eval over 1 episode: " in capsys.readouterr().out

    video.unlink()  # --eval records anew into the folder that exists (no warning, an error in the tests)
    ppo_resume.main(["--eval", str(tmp_path / "checkpoint.pt"), "eval_episodes=2"])
    assert [path.name for path in (tmp_path / "videos").iterdir()] == [video.name]  # sub-env 0 only
    assert video.read_bytes()[4:8] == b"ftyp"
    assert f"video of the first episode: {video}" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("missing", "message"),
    [
        (
            "moviepy",
            "capture_video=true needs moviepy, which is not installed: pip install -e '.[examples]' in the "
            "torch_rollout clone (or pip install moviepy)",
        ),
        (
            "pygame",
            "capture_video=true: CartPole-v1 cannot render the frames to record: pygame is not installed, run "
            '`pip install "gymnasium[classic-control]"`',
        ),
    ],
    ids=["moviepy", "pygame"],
)
def test_capture_video_without_a_dependency_fails_at_start_naming_the_fix(
    ppo_resume, tmp_path, monkeypatch, capsys, missing, message
):
    if missing != "moviepy":
        pytest.importorskip("moviepy")  # checked first
    monkeypatch.setitem(sys.modules, missing, None)  # importing it raises ImportError
    monkeypatch.setenv("SDL_VIDEODRIVER", "dummy")
    with pytest.raises(SystemExit) as exit_info:
        ppo_resume.main(["capture_video=true", f"run_dir={tmp_path / 'run'}"])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # nothing built, nothing written


@pytest.mark.parametrize("backend", ["thread", "process"])
def test_a_run_stopped_by_ctrl_c_resumes_to_the_same_final_step_with_a_continuous_curve(tmp_path, backend):
    run_dir = tmp_path / "run"
    batch, iterations = 4 * 32, 12
    # Started from tmp_path with a relative run folder: the printed command must work from any other folder.
    args = [f"total_timesteps={batch * iterations}", "num_envs=4", "num_steps=32", "run_dir=run"]
    args += [f"backend={backend}", "checkpoint_every=2", "prefetch=1"]
    proc = subprocess.Popen(
        [sys.executable, "-W", "error", str(EXAMPLES / "ppo_resume.py"), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if (run_dir / "progress.csv").exists() and len(read_steps(run_dir)) >= 5:
                break
            time.sleep(0.05)
        assert proc.poll() is None, f"the run ended before it could be interrupted: {proc.communicate()}"
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C reaches the whole process group
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 130, err
    command = shlex.split(err.split("carry on from the last checkpoint with:\n")[1].splitlines()[0])
    assert os.path.samefile(command[0], sys.executable)
    assert command[1:] == [
        str((EXAMPLES / "ppo_resume.py").resolve()),
        "--resume",
        str((run_dir / "checkpoint.pt").resolve()),
    ]
    stopped_at = torch.load(run_dir / "checkpoint.pt", weights_only=True)["iteration"]
    assert 2 <= stopped_at < iterations and stopped_at % 2 == 0

    resumed = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)  # another folder
    assert resumed.returncode == 0, resumed.stderr
    # rows logged after the last checkpoint were logged again by the resumed run, not twice
    assert read_steps(run_dir) == [batch * i for i in range(1, iterations + 1)]
    final = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert final["iteration"] == iterations
    assert final["collector"]["batches"] == iterations and final["collector"]["starts"] == 2
    # the policy versions went on counting: one refresh per batch in each part of the run
    assert final["collector"]["policy_version"] >= iterations


def test_resume_carries_the_optimizer_and_schedule_on_and_refuses_a_finished_run(ppo_resume, tmp_path, capsys):
    args = ["total_timesteps=256", "num_envs=2", "num_steps=32", f"run_dir={tmp_path}", "backend=thread"]
    ppo_resume.train(ppo_resume.load_config(CONFIGS / "ppo_cartpole.yaml", args))
    first = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    with pytest.raises(SystemExit) as exit_info:
        ppo_resume.main(["--resume", str(tmp_path / "checkpoint.pt")])
    assert exit_info.value.code == 2
    assert "the run is complete (256 steps of total_timesteps=256)" in capsys.readouterr().err

    ppo_resume.main(["--resume", str(tmp_path / "checkpoint.pt"), "total_timesteps=512"])
    second = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert read_steps(tmp_path) == [64 * i for i in range(1, 9)]
    adam_steps = lambda ckpt: int(next(iter(ckpt["optimizer"]["state"].values()))["step"])  # noqa: E731
    assert adam_steps(second) == 2 * adam_steps(first) > 0, "the optimizer's state was carried on"
    assert second["collector"]["policy_version"] > first["collector"]["policy_version"]
    with open(tmp_path / "progress.csv", newline="") as f:
        lrs = [float(row["charts/learning_rate"]) for row in csv.DictReader(f)]
    assert lrs[4:] == sorted(lrs[4:], reverse=True) and lrs[4] < lrs[0], "the schedule goes on from iteration 5"


# ---------------------------------------------------------------------------- ppo_ranks.py


@pytest.mark.parametrize("backend", ["thread", "process"])
def test_torchrun_ranks_collect_different_episodes_and_keep_equal_weights(ppo_ranks, tmp_path, capsys, backend):
    """Two gloo ranks on the CPU: each its own collector, seeded by its rank; gradients averaged across them."""
    run_dir = tmp_path / "run"
    args = ["total_timesteps=768", "num_envs=2", "num_steps=64", f"backend={backend}", f"run_dir={run_dir}"]
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
        + [str(ROOT / "tests" / "rank_of_ppo_ranks.py"), str(tmp_path), *args],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        env={**os.environ, "PYTHONWARNINGS": "error"},
    )
    assert result.returncode == 0, result.stderr
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    assert len(rank0["first_rows"]) == len(rank1["first_rows"]) == 3  # 768 steps = 3 batches of 2 ranks x 2 x 64
    # Env j of rank 1 starts from seed 1 + 2 + j, rank 0's from 1 + j: other episodes from the first reset on.
    assert not torch.isclose(rank0["first_rows"], rank1["first_rows"]).all(dim=-1).any()
    for name, initial in rank0["initial"].items():
        assert torch.equal(initial, rank1["initial"][name]), name  # the same init on every rank
        assert torch.equal(rank0["final"][name], rank1["final"][name]), name  # and the same updates
    assert any(not torch.equal(rank0["initial"][k], rank0["final"][k]) for k in rank0["initial"]), "it trained"
    # rank 0 alone logged: one row per iteration, steps of both ranks together
    assert read_steps(run_dir) == [256, 512, 768]
    assert re.search(r"final mean return \(last \d+ episodes of each of 2 ranks\): ", result.stdout)
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert checkpoint["world_size"] == 2 and [r["collector"]["rank"] for r in checkpoint["ranks"]] == [0, 1]
    with pytest.raises(SystemExit):  # each rank carries on its own streams: as many ranks again
        ppo_ranks.main(["--resume", str(run_dir / "checkpoint.pt"), "total_timesteps=1536"])
    assert "the checkpoint's run had 2 ranks, this one has 1; resume it with as many" in capsys.readouterr().err
