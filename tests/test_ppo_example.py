"""Tests of examples/ppo.py: config loading, the command line, short training runs with --eval, TensorBoard; and
the size of every PPO script (the variants' own tests are in tests/test_ppo_variants.py)."""

from __future__ import annotations

import csv
import dataclasses
import re
import sys

import pytest
import torch
from example_scripts import CONFIGS, EXAMPLES, import_script

SCRIPT = EXAMPLES / "ppo.py"


@pytest.fixture(scope="module")
def ppo():
    yield from import_script("ppo")


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """train() and evaluate() set the process's torch threads (cfg.torch_threads): the next test gets them back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("script", "name"),
    [
        ("ppo", "ppo_cartpole.yaml"),
        ("ppo", "ppo_cartpole_torch.yaml"),
        ("ppo_continuous", "ppo_halfcheetah.yaml"),
        ("ppo_continuous", "ppo_isaac_cartpole.yaml"),
        ("ppo_lstm", "ppo_cartpole_novel_lstm.yaml"),
        ("ppo_resume", "ppo_cartpole.yaml"),
        ("ppo_ranks", "ppo_cartpole.yaml"),
    ],
)
def test_shipped_configs_load(script, name):
    for module in import_script(script):
        cfg = module.load_config(CONFIGS / name)
        assert isinstance(cfg.learning_rate, float)
        assert cfg.total_timesteps >= cfg.num_envs * cfg.num_steps


def test_default_config_is_cartpole(ppo):
    cfg = ppo.load_config(ppo.DEFAULT_CONFIG)
    assert (cfg.env_id, cfg.total_timesteps) == ("CartPole-v1", 200_000)


def test_overrides_apply_after_the_file(ppo):
    cfg = ppo.load_config(
        CONFIGS / "ppo_cartpole.yaml",
        ["seed=3", "learning_rate=3e-4", "anneal_lr=false", "target_kl=0.02", "exp_name=123", "hidden_size=32"],
    )
    assert cfg.seed == 3
    assert cfg.learning_rate == 3e-4 and isinstance(cfg.learning_rate, float)
    assert cfg.anneal_lr is False
    assert cfg.target_kl == 0.02
    assert cfg.exp_name == "123"  # string fields keep the text
    assert cfg.hidden_size == 32
    assert ppo.load_config(None, ["target_kl=0.1", "target_kl=null"]).target_kl is None  # the last one wins


def test_yaml_float_without_dot_is_accepted(ppo, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("learning_rate: 3e-4\nstop_return: 5\n")  # YAML 1.1 reads 3e-4 as the string "3e-4"
    assert ppo.load_config(path).learning_rate == 3e-4
    assert ppo.load_config(path).stop_return == 5.0 and isinstance(
        ppo.load_config(path).stop_return, float
    )  # ints widen


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
    for heading in ("the run:", "environments:", "collection and PPO:", "the agent:", "logging and evaluation:"):
        assert heading in text
    for option in ("--config CONFIG", "--eval CHECKPOINT", "KEY=VALUE"):
        assert option in text


@pytest.mark.parametrize(
    ("script", "lines", "shown"),
    [
        ("ppo", 370, ("class Config:", "class Agent(", "Collector(", "def update(", "def evaluate(")),
        ("ppo_continuous", 430, ("normalize_obs", "NormalizeReward", "Normal(", "desired_kl")),
        ("ppo_lstm", 400, ("class RecurrentAgent(", "initial_state=", "def to_sequences(")),
        ("ppo_resume", 460, ("def save_checkpoint(", "def load_resume(", "KeyboardInterrupt", "capture_video")),
        ("ppo_ranks", 400, ("init_process_group", "def average_gradients(", "gather_object")),
    ],
)
def test_each_ppo_script_reads_alone_top_to_bottom_and_shares_only_common_py(script, lines, shown):
    """CleanRL's manner: ppo.py whole in one file, each further capability a script of its own that imports no other
    script, all of them sharing only the plumbing of common.py (config files, the log, the run folder)."""
    source = (EXAMPLES / f"{script}.py").read_text()
    assert len(source.splitlines()) <= lines
    for part in shown:
        assert part in source, part
    assert not re.findall(r"^import (ppo\w*|sac)\b|^from (ppo\w*|sac) import", source, re.MULTILINE)
    assert len((EXAMPLES / "common.py").read_text().splitlines()) <= 300
    (module,) = import_script(script)
    assert module.ConfigError is module.common.ConfigError


# ---------------------------------------------------------------------------- runs
# The runs call the script's main() in the test's process (a fresh interpreter importing torch costs seconds).


@pytest.fixture
def run_script(ppo, capsys):
    """Runs the script's command line, ``main(args)``; returns what it printed."""

    def run(*args: str) -> str:
        capsys.readouterr()
        ppo.main(list(args))
        return capsys.readouterr().out

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
    assert checkpoint["config"]["env_id"] == "CartPole-v1" and checkpoint["iteration"] == 3

    assert EVAL_LINE.search(run_script("--eval", str(run_dir / "checkpoint.pt"), "eval_episodes=2"))


def test_torch_cartpole_config_trains_and_evaluates_on_the_torch_env(tmp_path, run_script):
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
