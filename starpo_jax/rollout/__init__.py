"""The rollout, inside one compiled program: prompts assembled from token pieces (``prompts``,
``tokens``), KV-cached generation (``sampling``), the reply parsed into actions (``parsing``), the
envs stepped (``env_turn``), and the multi-turn loop that ties them together and returns
``Trajectories`` (``multi_turn``)."""
