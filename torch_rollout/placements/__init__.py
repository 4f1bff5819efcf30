"""Where the loop runs: the placement protocol, the thread, worker processes and Ray; imports loop/, envs/ and util/."""
