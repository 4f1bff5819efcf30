"""Genesis 1.4.5 on its CPU backend: a batched cartpole env written the way Genesis's own locomotion example
(``examples/locomotion/go2_env.py``, not in the wheel) writes its Go2 env, as the integration tests and the
benchmarks build it.

Run in Genesis's venv (sims/build.sh), with the checkout on PYTHONPATH. The robot is a cart on a slider with a
hinged pole, from an MJCF file written here (no download). Like the example, the env steps the rsl_rl 1.x way,
``step(actions) -> (obs, privileged_obs or None, rewards, dones, extras)``, resets ended envs inside ``step``, puts
the time-outs in ``extras["time_outs"]`` as floats and keeps no final observation; ``layout="rsl_rl 3.x"`` steps
the same env the later way, ``(TensorDict of groups, rewards, dones, extras)``. ``genesis_cartpole`` is the env
through ``FromRslRl``, as examples/ppo_continuous.py's env_recipe builds it (``env_recipe:
sims.genesis_setup:genesis_cartpole``).
"""

from __future__ import annotations

import math
import pathlib
import tempfile

import genesis as gs
import torch
from tensordict import TensorDict

from torch_rollout.envs import FromRslRl

__all__ = ["CARTPOLE_MJCF", "GenesisCartPole", "cartpole_mjcf", "genesis_cartpole", "init"]

# A cart of 1 kg on a slider along x, a pole of 0.1 kg and 1 m on a hinge about y; no ground, nothing to collide.
CARTPOLE_MJCF = """\
<mujoco model="cartpole">
  <worldbody>
    <body name="cart" pos="0 0 0">
      <joint name="slider" type="slide" axis="1 0 0"/>
      <geom name="cart" type="box" size="0.2 0.1 0.05" mass="1"/>
      <body name="pole" pos="0 0 0">
        <joint name="hinge" type="hinge" axis="0 1 0"/>
        <geom name="pole" type="capsule" fromto="0 0 0 0 0 1" size="0.02" mass="0.1"/>
      </body>
    </body>
  </worldbody>
</mujoco>
"""
FORCE = 10.0  # N on the cart at action 1
X_LIMIT, THETA_LIMIT = 2.4, 12 * math.pi / 180  # the episode terminates beyond these, as gymnasium's CartPole
LAYOUTS = ("rsl_rl 1.x", "rsl_rl 3.x")


def init() -> None:
    """``gs.init`` on the CPU backend in float32, once per process (Genesis refuses a second one)."""
    if not gs._initialized:
        gs.init(backend=gs.cpu, precision="32", logging_level="warning")


def cartpole_mjcf(folder: str | pathlib.Path | None = None) -> str:
    """``CARTPOLE_MJCF`` written into ``folder`` (a new temporary folder if None); the file's path."""
    path = pathlib.Path(folder if folder is not None else tempfile.mkdtemp(prefix="cartpole-mjcf-")) / "cartpole.xml"
    path.write_text(CARTPOLE_MJCF)
    return str(path)


class GenesisCartPole:
    """``num_envs`` cartpoles in one Genesis scene, stepped as Genesis's ``Go2Env`` steps its robots.

    Actions ``[num_envs, 1]`` are clipped to [-1, 1] and push the cart with ``FORCE`` N; each step is 0.02 s (two
    substeps). Observations ``[num_envs, 4]``: cart position and velocity, pole angle and angular velocity. An
    episode terminates where the cart passes ``X_LIMIT`` or the pole ``THETA_LIMIT``, and times out where
    ``episode_length_buf > max_episode_length`` (after ``episode_steps + 1`` steps, as in the example); a step can
    do both. Rewards: ``1 - (theta / THETA_LIMIT) ** 2`` of the state the step reached. Episodes start at a state
    drawn uniformly in [-0.05, 0.05]^4 from a generator seeded with ``seed``.

    With ``privileged=True`` the privileged observations ``[num_envs, 5]`` (the observation and the action, clipped)
    are the critic's, from ``get_privileged_observations()`` and as ``step``'s second value; otherwise these are
    None, as in the example.
    """

    def __init__(
        self,
        num_envs: int,
        *,
        episode_steps: int = 20,
        privileged: bool = False,
        seed: int = 0,
        layout: str = "rsl_rl 1.x",
        mjcf: str | None = None,
    ) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"GenesisCartPole(layout={layout!r}): expected one of {LAYOUTS}")
        init()
        self.num_envs, self.num_obs, self.num_actions = num_envs, 4, 1
        self.num_privileged_obs = 5 if privileged else None
        self.layout = layout
        self.device = gs.device
        self.dt = 0.02
        self.max_episode_length = episode_steps
        self.scene = gs.Scene(
            sim_options=gs.options.SimOptions(dt=self.dt, substeps=2),
            rigid_options=gs.options.RigidOptions(enable_collision=False, enable_joint_limit=False),
            show_viewer=False,
        )
        self.robot = self.scene.add_entity(gs.morphs.MJCF(file=mjcf if mjcf is not None else cartpole_mjcf()))
        self.scene.build(n_envs=num_envs)
        self.dofs = [self.robot.get_joint(name).dofs_idx_local[0] for name in ("slider", "hinge")]
        self.generator = torch.Generator(device=self.device).manual_seed(seed)

        float_ = gs.tc_float
        self.obs_buf = torch.zeros((num_envs, self.num_obs), device=self.device, dtype=float_)
        self.privileged_obs_buf = torch.zeros((num_envs, 5), device=self.device, dtype=float_) if privileged else None
        self.rew_buf = torch.zeros((num_envs,), device=self.device, dtype=float_)
        self.reset_buf = torch.ones((num_envs,), device=self.device, dtype=torch.bool)
        self.episode_length_buf = torch.zeros((num_envs,), device=self.device, dtype=gs.tc_int)
        self.actions = torch.zeros((num_envs, self.num_actions), device=self.device, dtype=float_)
        self.dof_pos = torch.zeros((num_envs, 2), device=self.device, dtype=float_)
        self.dof_vel = torch.zeros((num_envs, 2), device=self.device, dtype=float_)
        self.extras: dict = {}

    def step(self, actions: torch.Tensor) -> tuple:
        self.actions = torch.clip(actions, -1.0, 1.0)
        self.robot.control_dofs_force(self.actions * FORCE, self.dofs[:1])
        self.scene.step()
        self.episode_length_buf += 1
        self.dof_pos[:] = self.robot.get_dofs_position(self.dofs)
        self.dof_vel[:] = self.robot.get_dofs_velocity(self.dofs)

        # The example computes its rewards after the resets; here they are those of the state the step reached
        self.rew_buf[:] = 1.0 - (self.dof_pos[:, 1] / THETA_LIMIT) ** 2

        # check termination and reset, as the example does
        self.reset_buf = self.episode_length_buf > self.max_episode_length
        self.reset_buf |= torch.abs(self.dof_pos[:, 0]) > X_LIMIT
        self.reset_buf |= torch.abs(self.dof_pos[:, 1]) > THETA_LIMIT
        time_out_idx = (self.episode_length_buf > self.max_episode_length).nonzero(as_tuple=False).flatten()
        self.extras["time_outs"] = torch.zeros_like(self.reset_buf, device=self.device, dtype=gs.tc_float)
        self.extras["time_outs"][time_out_idx] = 1.0
        self.reset_idx(self.reset_buf.nonzero(as_tuple=False).flatten())

        self._observe()
        return self._returned(self.rew_buf, self.reset_buf, self.extras)

    def _observe(self) -> None:
        self.obs_buf = torch.cat(
            [self.dof_pos[:, :1], self.dof_vel[:, :1], self.dof_pos[:, 1:], self.dof_vel[:, 1:]], -1
        )
        if self.privileged_obs_buf is not None:
            self.privileged_obs_buf = torch.cat([self.obs_buf, self.actions], -1)

    def _returned(self, *rest) -> tuple:
        if self.layout == "rsl_rl 1.x":
            return self.obs_buf, self.privileged_obs_buf, *rest
        return self.get_observations(), *rest

    def get_observations(self):
        if self.layout == "rsl_rl 1.x":
            return self.obs_buf
        critic = self.obs_buf if self.privileged_obs_buf is None else self.privileged_obs_buf
        return TensorDict({"policy": self.obs_buf, "critic": critic}, batch_size=[self.num_envs])

    def get_privileged_observations(self) -> torch.Tensor | None:
        return self.privileged_obs_buf

    def reset_idx(self, envs_idx: torch.Tensor) -> None:
        if len(envs_idx) == 0:
            return
        state = torch.rand((len(envs_idx), 4), generator=self.generator, device=self.device) * 0.1 - 0.05
        self.dof_pos[envs_idx] = state[:, :2]
        self.dof_vel[envs_idx] = state[:, 2:]
        self.robot.set_dofs_position(self.dof_pos[envs_idx], self.dofs, envs_idx, zero_velocity=False)
        self.robot.set_dofs_velocity(self.dof_vel[envs_idx], self.dofs, envs_idx)
        self.episode_length_buf[envs_idx] = 0
        self.reset_buf[envs_idx] = True

    def reset(self) -> tuple:
        self.reset_buf[:] = True
        self.reset_idx(torch.arange(self.num_envs, device=self.device))
        self.actions.zero_()
        self._observe()
        if self.layout == "rsl_rl 1.x":
            return self.obs_buf, self.privileged_obs_buf
        return self.get_observations(), self.extras


def genesis_cartpole(num_envs: int, *, episode_steps: int = 200, seed: int = 0) -> FromRslRl:
    """``GenesisCartPole`` through ``FromRslRl``, time-outs bootstrapped from V(s_t) (the env keeps no final
    observation): a module-level recipe, for worker processes and examples/ppo_continuous.py too."""
    return FromRslRl(GenesisCartPole(num_envs, episode_steps=episode_steps, seed=seed), bootstrap="last_obs")
