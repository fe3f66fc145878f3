"""What a run shows about itself: per-tag rollout metrics (``metrics``), the collapse watch
(``collapse``), the diversity of reasoning (``diversity``), trajectories as readable records
(``dumps``) and TensorBoard scalars (``tensorboard``)."""
