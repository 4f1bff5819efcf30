"""A batch's plain steps in one function: acting, the envs' step and the rows, without a record per step.

The loop's general step (``RolloutLoop._interact``) serves every driver, recurrent
policies, infos and finite checks, through a :class:`~torch_rollout.envs._seam.StepRecord`
of each step and a dozen calls between the loop, the acting side, the driver and the
rows. For the common case, a driver that steps every env at once on the host (NumPy
envs, in any autoreset mode) and a policy on the CPU without state, infos or finite
checks, :func:`run_steps` does the same steps in one loop: the observations into
their row, the policy's checked outputs and version into theirs, and the driver's
:meth:`~torch_rollout.envs._numpy.NumpyEnvs.step_into_rows` for the actions' check,
the envs' step, its checks, the episode totals and the results' rows. The rows it
writes are those the general step writes, value for value; only the calls between
them are fewer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from torch_rollout.envs._seam import StepRecord
from torch_rollout.loop._acting import PolicyCall
from torch_rollout.loop._rows import HostRows

if TYPE_CHECKING:
    from torch_rollout.envs._numpy import NumpyEnvs
    from torch_rollout.loop._rollout import RolloutLoop

__all__ = ["run_steps"]


def run_steps(loop: RolloutLoop, head: HostRows | Any) -> None:
    """Steps ``loop``'s envs into ``head`` until its batch is complete or the loop's ``stop`` says so; returns at
    once where the loop's next step needs the general path (see the module's docstring), which then goes on.

    Called with the policy's outputs known (its first call made), so the checks of its first call are done.
    """
    driver, waiting = loop.driver, loop.waiting
    plain = (
        driver.steps_into_rows
        and waiting is not None
        and loop.recurrent is None
        and loop.infos is None
        and not loop.check_finite
        and loop.device.type == "cpu"
        and isinstance(head, HostRows)
        and head.on_host
        and head.flat_obs is not None  # observations in one array (not a Dict space)
    )
    if not plain:
        return
    assert waiting is not None  # checked above
    full, n = loop.num_steps * loop.num_envs, loop.num_envs
    stop, act, step_into_rows = loop.stop, loop.acting.act, cast("NumpyEnvs", driver).step_into_rows
    arrays, rows, host, finals = head.obs.arrays, head.obs_rows, head.host, head.finals
    assert rows is not None  # the rows of one array of observations
    obs = waiting.obs
    try:
        while head.filled < full and not stop():
            t = loop.step - loop.first_row
            loop.step += 1
            loop.row = t
            arrays[t] = obs
            out_t, version, _ = act(PolicyCall(rows[t]), n)
            obs, final = step_into_rows(out_t["action"], host, t, head.put_plain(t, out_t, version))
            head.filled += n
            if final is not None:  # (envs, their final observations)
                finals.append((t, final[0], final[1], None))
    finally:
        loop.waiting = StepRecord(obs=obs)  # what the next step acts on, as a step's record holds it
        cast("NumpyEnvs", driver).own_totals()
