"""Which autoreset mode a vector env runs in: the one its metadata declares, or the one its steps show.

gymnasium's vector envs name their mode in ``metadata["autoreset_mode"]``. An env
that names none (gymnax through ``JaxToTorch``, many envs of one's own) is
NEXT_STEP by gymnasium's default, but an env that puts the observations that ended
its episodes in its step infos (``final_obs``, gymnasium's name, or
``final_observation``, ManiSkill3's and gymnax's) resets within the step
(SAME_STEP): read as NEXT_STEP, the real transition after each episode end would
be masked out and each end would bootstrap from the next episode's reset
observation. :class:`AutoresetReading` decides an undeclared mode from the step
infos, and refuses a step whose infos contradict the mode read.

Until an episode ends, NEXT_STEP and SAME_STEP give the same rows (no env is in
a reset step, and none ends), so the mode can be taken from the first infos
that carry final observations, as long as no episode has ended before them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gymnasium.vector import AutoresetMode, VectorEnv

from torch_rollout.util._warnings import warn

__all__ = ["FINAL_OBS_KEYS", "AutoresetReading", "final_obs_key"]

# Where SAME_STEP envs put the observation that ended an episode: gymnasium's name, then ManiSkill3's.
FINAL_OBS_KEYS = ("final_obs", "final_observation")

_DECLARE = "metadata['autoreset_mode']"


def final_obs_key(info: Mapping[str, Any]) -> str | None:
    """The infos' key of final observations (or of their ``_`` mask alone), None where they carry none."""
    for key in FINAL_OBS_KEYS:
        if key in info or "_" + key in info:
            return key if key in info else "_" + key
    return None


class AutoresetReading:
    """The autoreset mode a driver reads an env in, and the checks of each step's infos against it.

    Args:
        envs: the vector env (its ``metadata``, and its name for messages).

    Attributes:
        mode: the mode the driver reads the env in now: the declared one, or for an
            undeclared env NEXT_STEP until its infos carry final observations.
        declared: whether ``metadata`` names the mode.
        undecided: an undeclared env whose infos have carried no final observation yet.
    """

    mode: AutoresetMode
    declared: bool
    undecided: bool

    def __init__(self, envs: VectorEnv) -> None:
        self.name = type(envs).__name__
        declared = (envs.metadata or {}).get("autoreset_mode")
        self.declared = declared is not None
        self.mode = AutoresetMode(declared) if self.declared else AutoresetMode.NEXT_STEP
        self.undecided = not self.declared

    def read(self, info: Mapping[str, Any]) -> bool:
        """Checks a step's infos; returns True where they switch an undeclared env to SAME_STEP (with a warning).

        The caller must then be sure that no episode ended before this step (its rows were read as NEXT_STEP).

        Raises:
            ValueError: the env runs, as declared (or as read from earlier steps), in NEXT_STEP or
                DISABLED mode, and its infos carry final observations.
        """
        if self.mode == AutoresetMode.SAME_STEP:  # final observations are what it gives: nothing to check
            return False
        key = final_obs_key(info)
        if key is None:
            return False
        if self.undecided:
            self.mode, self.undecided = AutoresetMode.SAME_STEP, False
            warn(
                f"Collector: the metadata of the vector env {self.name} names no autoreset mode, but its step infos "
                f"carry final observations (infos[{key!r}]): it resets ended envs within the step, and the "
                f"collector reads it in SAME_STEP mode (not gymnasium's default, NEXT_STEP). Declare the mode to "
                f"silence this warning: {_DECLARE} = gymnasium.vector.AutoresetMode.SAME_STEP on the env (or on a "
                "wrapper of it)"
            )
            return True
        if self.declared:
            said = f"its {_DECLARE} is {self.mode.name}"
        else:
            said = (
                f"its metadata names no autoreset mode and an episode ended at an earlier step without final "
                f"observations in the infos, so the collector reads it in {self.mode.name} mode (gymnasium's default)"
            )
        raise ValueError(
            f"Collector: the step infos of the vector env {self.name} carry final observations (infos[{key!r}]), "
            f"which only an env that resets ended envs within the step (SAME_STEP) gives, but {said}; the batch is "
            f"not delivered, as its rows would be read wrongly. If the env resets within the step, set {_DECLARE} "
            "= gymnasium.vector.AutoresetMode.SAME_STEP and give the final observations at every episode end; "
            f"if it does not, leave {key!r} out of its step infos (a wrapper can drop it)"
        )

    def ended_without_final(self) -> None:
        """An episode ended with no final observation in the step's infos: an undeclared env is NEXT_STEP."""
        self.undecided = False

    def ended_before(self) -> ValueError:
        """The error for an undeclared env whose final observations first came after episodes had ended without."""
        return ValueError(
            f"Collector: the metadata of the vector env {self.name} names no autoreset mode, and its step infos "
            "carried final observations only after episodes had ended without them, which the collector had read "
            "in NEXT_STEP mode (gymnasium's default); the batch is not delivered, as its rows would be read "
            f"wrongly. Declare the mode: {_DECLARE} = gymnasium.vector.AutoresetMode.SAME_STEP if the env resets "
            "ended envs within the step (and give the final observations at every episode end), else NEXT_STEP "
            "(and leave final observations out of its step infos)"
        )
