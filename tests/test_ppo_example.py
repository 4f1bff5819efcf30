"""Tests of examples/ppo.py: config loading, and short training runs with --eval."""

from __future__ import annotations

import csv
import dataclasses
import importlib.util
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

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "ppo.py"
CONFIGS = ROOT / "configs"


@pytest.fixture(scope="module")
def ppo():
    """examples/ppo.py imported as a module (it is a script, not part of the package), by the name that worker
    processes import it by: the script puts examples/ on sys.path, which they start with."""
    spec = importlib.util.spec_from_file_location("ppo", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolves annotations through sys.modules
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """train() and evaluate() set the process's torch threads (cfg.torch_threads): the next test gets them back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------------------- config


@pytest.mark.parametrize("name", ["ppo_cartpole.yaml", "ppo_halfcheetah.yaml", "ppo_cartpole_novel_lstm.yaml"])
def test_shipped_configs_load(ppo, name):
    cfg = ppo.load_config(CONFIGS / name)
    assert isinstance(cfg.learning_rate, float)
    assert cfg.total_timesteps >= cfg.num_envs * cfg.num_steps


def test_default_config_is_cartpole(ppo):
    cfg = ppo.load_config(ppo.DEFAULT_CONFIG)
    assert (cfg.env_id, cfg.total_timesteps) == ("CartPole-v1", 200_000)


def test_overrides_apply_after_the_file(ppo):
    cfg = ppo.load_config(
        CONFIGS / "ppo_cartpole.yaml",
        ["seed=3", "learning_rate=3e-4", "anneal_lr=false", "target_kl=0.02", "exp_name=123", "clip_obs=5"],
    )
    assert cfg.seed == 3
    assert cfg.learning_rate == 3e-4 and isinstance(cfg.learning_rate, float)
    assert cfg.anneal_lr is False
    assert cfg.target_kl == 0.02
    assert cfg.exp_name == "123"  # string fields keep the text
    assert cfg.clip_obs == 5.0 and isinstance(cfg.clip_obs, float)  # ints widen to float
    assert ppo.load_config(None, ["target_kl=0.1", "target_kl=null"]).target_kl is None  # the last one wins


def test_yaml_float_without_dot_is_accepted(ppo, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("learning_rate: 3e-4\n")  # YAML 1.1 reads this as the string "3e-4"
    assert ppo.load_config(path).learning_rate == 3e-4


def test_unknown_key_in_override(ppo):
    with pytest.raises(ppo.ConfigError, match=re.escape("override 'bogus=1': unknown config key 'bogus'")):
        ppo.load_config(None, ["bogus=1"])


def test_unknown_key_in_file(ppo, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("num_envs: 2\nlearning_rat: 0.1\n")
    with pytest.raises(ppo.ConfigError, match=re.escape(f"{path}: unknown config key 'learning_rat'")):
        ppo.load_config(path)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("num_envs=eight", "config key 'num_envs': expected int, got 'eight' (str)"),
        ("num_envs=2.5", "config key 'num_envs': expected int, got 2.5 (float)"),
        ("num_envs=true", "config key 'num_envs': expected int, got True (bool)"),
        ("anneal_lr=1", "config key 'anneal_lr': expected bool, got 1 (int)"),
        ("learning_rate=fast", "config key 'learning_rate': expected float, got 'fast' (str)"),
        ("target_kl=high", "config key 'target_kl': expected float or None, got 'high' (str)"),
        ("seed=null", "config key 'seed': expected int, got None (NoneType)"),
    ],
    ids=["str-for-int", "float-for-int", "bool-for-int", "int-for-bool", "str-for-float", "str-for-optional", "none"],
)
def test_wrong_type_names_key_value_and_type(ppo, override, message):
    with pytest.raises(ppo.ConfigError, match=re.escape(f"override {override!r}: {message}")):
        ppo.load_config(None, [override])


def test_keys_that_would_both_set_the_learning_rate_are_refused(ppo):
    with pytest.raises(ppo.ConfigError, match=re.escape("desired_kl adapts the learning rate, which anneal_lr=true")):
        ppo.load_config(None, ["desired_kl=0.01"])
    assert ppo.load_config(None, ["desired_kl=0.01", "anneal_lr=false"]).desired_kl == 0.01


def test_an_env_recipe_that_cannot_be_imported_names_the_key(ppo):
    cfg = ppo.load_config(None, ["env_recipe=no_such_module:make"])
    with pytest.raises(ppo.ConfigError, match=re.escape("config key 'env_recipe': 'no_such_module:make' names no")):
        ppo.make_envs(cfg, 2)


def test_wrong_type_in_file(ppo, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("update_epochs: many\n")
    with pytest.raises(ppo.ConfigError, match=re.escape(f"{path}: config key 'update_epochs': expected int")):
        ppo.load_config(path)


def test_malformed_override(ppo):
    with pytest.raises(ppo.ConfigError, match=re.escape("override 'seed': expected KEY=VALUE")):
        ppo.load_config(None, ["seed"])


def test_command_line_reports_config_errors(ppo, capsys):
    with pytest.raises(SystemExit) as exit_info:
        ppo.main(["--config", str(CONFIGS / "ppo_cartpole.yaml"), "bogus=1"])
    assert exit_info.value.code == 2
    assert "unknown config key 'bogus'" in capsys.readouterr().err


def test_help_lists_every_config_key_with_its_default_and_description(ppo, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")  # argparse wraps to the terminal's width
    with pytest.raises(SystemExit) as exit_info:
        ppo.main(["--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # descriptions are wrapped to the terminal's width
    source = SCRIPT.read_text()
    for field in dataclasses.fields(ppo.Config):
        default = field.default
        shown = "null" if default is None else str(default).lower() if isinstance(default, bool) else str(default)
        (description,) = re.findall(rf"^    {field.name}: [^#\n]+  # (.+)$", source, re.MULTILINE)
        assert f" {field.name}={shown} {description}" in text, field.name
    assert "total_timesteps=500000 env transitions to collect (all envs together) [ppo_cartpole.yaml: 200000]" in text
    for heading in ("the run:", "environments:", "collection and PPO:", "the agent:", "logging, checkpoints"):
        assert heading in text
    for option in ("--config CONFIG", "--eval CHECKPOINT", "--resume CHECKPOINT", "KEY=VALUE"):
        assert option in text


def test_the_script_shows_ppo_whole_and_shares_only_the_plumbing_with_sac(ppo):
    """CleanRL-style, top to bottom: config, env, agent, collector, update; config files and the log in common.py."""
    assert len(SCRIPT.read_text().splitlines()) <= 980
    assert ppo.ConfigError is ppo.common.ConfigError
    source = SCRIPT.read_text()
    for shown in ("class Config:", "class Agent(", "class RecurrentAgent(", "Collector(", "def update("):
        assert shown in source, shown


# ---------------------------------------------------------------------------- runs
# The runs call the script's main() in the test's process (a fresh interpreter importing torch costs seconds);
# the tests that need one, Ctrl-C and torchrun, start the script as a command.


@pytest.fixture
def run_script(ppo, capsys):
    """Runs the script's command line, ``main(args)``; returns what it printed."""

    def run(*args: str) -> str:
        capsys.readouterr()
        ppo.main(list(args))
        return capsys.readouterr().out

    return run


@pytest.fixture
def run_script_failing(ppo, capsys):
    """Runs the script's command line expecting it to fail as a command (an exit code of 2); returns its stderr."""

    def run(*args: str) -> str:
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info:
            ppo.main(list(args))
        assert exit_info.value.code == 2
        return capsys.readouterr().err

    return run


EVAL_LINE = re.compile(r"eval over 2 episodes: mean return (-?\d+\.\d) \+- (\d+\.\d)")


def test_smoke_cartpole_train_then_eval(tmp_path, run_script):
    run_dir = tmp_path / "run"
    # 3 iterations of 4 envs x 32 steps
    out = run_script("total_timesteps=384", "num_envs=4", "num_steps=32", f"run_dir={run_dir}")
    # first: the placement that backend=auto chose for the CPU agent, in the config's keys
    assert out.splitlines()[0] == "collector: backend=process num_workers=1 prefetch=1 device=cpu"
    assert re.search(r"final mean return \(last \d+ episodes\): ", out)

    with open(run_dir / "progress.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [128, 256, 384]
    for key in ("charts/mean_return", "charts/policy_lag", "losses/approx_kl", "losses/explained_variance"):
        assert key in rows[0]
    assert (run_dir / "learning_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the collector's account of each interval (docs/bottleneck.md): the loops' shares sum to 1; the whole run's line
    for row in rows:
        shares = [float(row[f"time/{key}_share"]) for key in ("env", "policy", "collector", "idle")]
        assert all(0 <= share <= 1 for share in shares) and sum(shares) == pytest.approx(1)
        assert 0 <= float(row["time/wait_share"]) <= 1
    assert re.search(r"collector over the run: [\d,]+ frames/s over .* \| collection: env \d+%", out)
    assert (run_dir / "time_shares.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(run_dir.glob("events.out.tfevents.*"))  # TensorBoard only with track_tensorboard=true
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert checkpoint["config"]["env_id"] == "CartPole-v1" and checkpoint["obs_rms"] is None

    assert EVAL_LINE.search(run_script("--eval", str(run_dir / "checkpoint.pt"), "eval_episodes=2"))


def test_torch_cartpole_config_trains_and_evaluates_on_the_torch_env(tmp_path, run_script, run_script_failing):
    """configs/ppo_cartpole_torch.yaml: one vector env of torch tensors, thousands of envs on the agent's device."""
    run_dir = tmp_path / "run"
    config = str(CONFIGS / "ppo_cartpole_torch.yaml")
    out = run_script("--config", config, "total_timesteps=32768", "num_envs=256", f"run_dir={run_dir}")
    assert re.search(r"final mean return \(last \d+ episodes\): ", out)
    with open(run_dir / "progress.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [4096 * (i + 1) for i in range(8)]
    assert float(rows[-1]["charts/episodes"]) > 0
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert checkpoint["config"]["env_id"] == "torch_rollout/CartPole-v1"
    assert EVAL_LINE.search(run_script("--eval", str(run_dir / "checkpoint.pt"), "eval_episodes=2"))
    refused = run_script_failing("--config", config, "normalize_obs=true", f"run_dir={tmp_path / 'refused'}")
    assert "torch_rollout/CartPole-v1 is a vector env of torch tensors" in refused


def test_continuous_actions_save_obs_normalisation(ppo, tmp_path, capsys):
    """Pendulum (Box actions, no MuJoCo needed) with the HalfCheetah config's wrappers."""
    cfg = ppo.load_config(
        CONFIGS / "ppo_halfcheetah.yaml",
        ["env_id=Pendulum-v1", "num_envs=2", "num_steps=64", "total_timesteps=256", f"run_dir={tmp_path}"],
    )
    ppo.train(cfg)
    checkpoint = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert checkpoint["obs_rms"]["mean"].shape == (3,)
    assert checkpoint["obs_rms"]["count"] > 256  # updated on every step
    mean, std = ppo.evaluate(tmp_path / "checkpoint.pt", ["eval_episodes=2"])
    assert -2000 < mean < 0 and std >= 0  # Pendulum's returns are negative
    assert EVAL_LINE.search(capsys.readouterr().out)


TENSORBOARD_TAGS = [
    "charts/episodic_return",
    "charts/SPS",
    "charts/learning_rate",
    "losses/value_loss",
    "losses/policy_loss",
    "losses/entropy",
    "losses/approx_kl",
]


def test_track_tensorboard_writes_grouped_scalars_into_the_run_folder(ppo, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # 4 iterations of 2 envs x 32 steps
    args = ["total_timesteps=256", "num_envs=2", "num_steps=32", "backend=thread", "track_tensorboard=true"]
    ppo.train(ppo.load_config(CONFIGS / "ppo_cartpole.yaml", [*args, f"run_dir={tmp_path}"]))
    (events,) = tmp_path.glob("events.out.tfevents.*")
    accumulator = EventAccumulator(str(events))
    accumulator.Reload()
    assert set(TENSORBOARD_TAGS) <= set(accumulator.Tags()["scalars"])
    for tag in TENSORBOARD_TAGS[1:]:
        assert [event.step for event in accumulator.Scalars(tag)] == [64, 128, 192, 256], tag
    # one point per episode, at the env step where it ended
    episodes = accumulator.Scalars("charts/episodic_return")
    assert len(episodes) == torch.load(tmp_path / "checkpoint.pt", weights_only=True)["episodes"] > 0
    assert all(0 < event.step <= 256 and event.value >= 8 for event in episodes)  # CartPole lasts >= 8 steps


def test_track_tensorboard_without_tensorboard_fails_at_start_naming_the_fix(ppo, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard raises ImportError
    monkeypatch.delitem(sys.modules, "torch.utils.tensorboard", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        ppo.main(["track_tensorboard=true", f"run_dir={tmp_path / 'run'}"])
    assert exit_info.value.code == 2
    message = (
        "track_tensorboard=true needs tensorboard, which is not installed: pip install -e '.[examples]' in the "
        "torch_rollout clone"
    )
    assert f"{message} (or pip install tensorboard)" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # nothing built, nothing written


def test_capture_video_records_an_evaluation_episode_after_training_and_with_eval(ppo, tmp_path, capsys, monkeypatch):
    pytest.importorskip("moviepy")
    pytest.importorskip("pygame")  # CartPole renders with pygame: gymnasium[classic-control]
    monkeypatch.setenv("SDL_VIDEODRIVER", "dummy")  # as the example sets it, but undone after the test
    # 1 iteration of 2 envs x 32 steps, then one recorded episode of the final weights
    args = ["total_timesteps=64", "num_envs=2", "num_steps=32", "backend=thread", "capture_video=true"]
    ppo.train(ppo.load_config(CONFIGS / "ppo_cartpole.yaml", [*args, f"run_dir={tmp_path}"]))
    video = tmp_path / "videos" / "eval-step64-episode-0.mp4"
    assert video.read_bytes()[4:8] == b"ftyp"  # an MP4 container
    assert "eval over 1 episode: " in capsys.readouterr().out

    video.unlink()  # --eval records anew into the folder that exists (no warning, an error in the tests)
    ppo.main(["--eval", str(tmp_path / "checkpoint.pt"), "eval_episodes=2"])
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
    ppo, tmp_path, monkeypatch, capsys, missing, message
):
    if missing != "moviepy":
        pytest.importorskip("moviepy")  # checked first
    monkeypatch.setitem(sys.modules, missing, None)  # importing it raises ImportError
    monkeypatch.setenv("SDL_VIDEODRIVER", "dummy")
    with pytest.raises(SystemExit) as exit_info:
        ppo.main(["capture_video=true", f"run_dir={tmp_path / 'run'}"])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # nothing built, nothing written


def read_steps(run_dir: Path) -> list[int]:
    with open(run_dir / "progress.csv", newline="") as f:
        return [int(row["step"]) for row in csv.DictReader(f)]


@pytest.mark.parametrize("backend", ["thread", "process"])
def test_a_run_stopped_by_ctrl_c_resumes_to_the_same_final_step_with_a_continuous_curve(tmp_path, backend):
    run_dir = tmp_path / "run"
    batch, iterations = 4 * 32, 12
    # Started from tmp_path with a relative run folder: the printed command must work from any other folder.
    args = [f"total_timesteps={batch * iterations}", "num_envs=4", "num_steps=32", "run_dir=run"]
    args += [f"backend={backend}", "checkpoint_every=2", "prefetch=1"]
    proc = subprocess.Popen(
        [sys.executable, "-W", "error", str(SCRIPT), *args],
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
    assert command[1:] == [str(SCRIPT.resolve()), "--resume", str((run_dir / "checkpoint.pt").resolve())]
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


def test_resume_carries_the_optimizer_and_schedule_on_and_refuses_a_finished_run(ppo, tmp_path, capsys):
    args = ["total_timesteps=256", "num_envs=2", "num_steps=32", f"run_dir={tmp_path}", "backend=thread"]
    ppo.train(ppo.load_config(CONFIGS / "ppo_cartpole.yaml", args))
    first = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    with pytest.raises(SystemExit) as exit_info:
        ppo.main(["--resume", str(tmp_path / "checkpoint.pt")])
    assert exit_info.value.code == 2
    assert "the run is complete (256 steps of total_timesteps=256)" in capsys.readouterr().err

    ppo.main(["--resume", str(tmp_path / "checkpoint.pt"), "total_timesteps=512"])
    second = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert read_steps(tmp_path) == [64 * i for i in range(1, 9)]
    adam_steps = lambda ckpt: int(next(iter(ckpt["optimizer"]["state"].values()))["step"])  # noqa: E731
    assert adam_steps(second) == 2 * adam_steps(first) > 0, "the optimizer's state was carried on"
    assert second["collector"]["policy_version"] > first["collector"]["policy_version"]
    with open(tmp_path / "progress.csv", newline="") as f:
        lrs = [float(row["charts/learning_rate"]) for row in csv.DictReader(f)]
    assert lrs[4:] == sorted(lrs[4:], reverse=True) and lrs[4] < lrs[0], "the schedule goes on from iteration 5"


def test_normalize_reward_in_worker_processes_logs_the_envs_own_returns(tmp_path, run_script):
    run_dir = tmp_path / "run"
    run_script(
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
        # CartPole's returns are whole numbers (a reward of 1 per step), the normalised rewards' sums are not:
        # the logged mean of the last episodes times their count is a whole number.
        total = float(row["charts/mean_return"]) * min(int(row["charts/episodes"]), 20)
        assert total >= 8 and abs(total - round(total)) < 1e-6, row


def test_normalize_obs_with_worker_processes_is_refused(ppo, tmp_path):
    cfg = ppo.load_config(None, ["normalize_obs=true", "backend=process", f"run_dir={tmp_path}"])
    with pytest.raises(ppo.ConfigError, match=re.escape("normalize_obs needs backend=thread, got backend=process")):
        ppo.train(cfg)


def test_smoke_recurrent_config_train_then_eval(tmp_path, run_script):
    run_dir = tmp_path / "run"
    # 2 iterations of 2 envs x 16 steps, in a worker process, then --eval with the LSTM's state
    out = run_script(
        "--config",
        str(CONFIGS / "ppo_cartpole_novel_lstm.yaml"),
        "total_timesteps=64",
        "num_envs=2",
        "num_steps=16",
        "backend=process",
        f"run_dir={run_dir}",
    )
    assert re.search(r"final mean return \(last \d+ episodes\): ", out)
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert checkpoint["model"]["lstm.weight_ih"].shape == (4 * 64, 2)  # position and angle only
    assert EVAL_LINE.search(run_script("--eval", str(run_dir / "checkpoint.pt"), "eval_episodes=2"))


def test_recurrent_agent_replays_the_batch_it_collected(ppo):
    """End to end: sequences cut from a batch at any row and replayed from their stored state give the stored
    log_prob and value (same weights), across episode starts (is_init) and NEXT_STEP reset rows."""
    from torch_rollout import Collector

    cfg = ppo.load_config(CONFIGS / "ppo_cartpole_novel_lstm.yaml", ["num_envs=3", "num_steps=48", "lstm_size=8"])
    torch.manual_seed(0)
    envs = ppo.make_envs(cfg, cfg.num_envs)
    agent = ppo.make_agent(envs.single_observation_space, envs.single_action_space, cfg)
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
            sequences = ppo.to_sequences(batch, length)
            with torch.no_grad():
                log_prob, _, value = agent.evaluate(sequences)
            assert torch.allclose(log_prob, sequences["log_prob"], atol=1e-5)
            assert torch.allclose(value, sequences["value"], atol=1e-5)


@pytest.mark.parametrize("backend", ["thread", "process"])
def test_torchrun_ranks_collect_different_episodes_and_keep_equal_weights(ppo, tmp_path, capsys, backend):
    """Two gloo ranks on the CPU: each its own collector, seeded by its rank; gradients averaged across them."""
    run_dir = tmp_path / "run"
    args = ["total_timesteps=768", "num_envs=2", "num_steps=64", f"backend={backend}", f"run_dir={run_dir}"]
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
        + [str(ROOT / "tests" / "ppo_ranks.py"), str(tmp_path), *args],
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
        ppo.main(["--resume", str(run_dir / "checkpoint.pt"), "total_timesteps=1536"])
    assert "the checkpoint's run had 2 ranks, this one has 1; resume it with as many" in capsys.readouterr().err
