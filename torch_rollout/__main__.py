"""The command line: ``python -m torch_rollout tune ENV_ID --num-envs N --num-steps T`` (see torch_rollout.tune)."""

import sys

from torch_rollout.tuning import main

if __name__ == "__main__":  # worker processes import this module again by its name
    sys.exit(main())
