"""torch_rollout: a PyTorch-native rollout collector with exact GAE, yielding TensorDict batches."""

from torch_rollout._double_buffer import DoubleBufferedVectorEnv
from torch_rollout._envpool import envpool_envs
from torch_rollout.collector import Collector
from torch_rollout.gae import compute_gae

__all__ = ["Collector", "DoubleBufferedVectorEnv", "compute_gae", "envpool_envs"]
__version__ = "0.1.0"
