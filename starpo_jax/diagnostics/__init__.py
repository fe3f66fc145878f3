"""What a run shows about itself: per-tag rollout metrics (``metrics``), play on fixed levels for
validation and ``experiments.evaluate`` (``fixed_levels``), RAGEN-2's template-collapse figures
(``template_collapse``), the collapse watch (``collapse``), the diversity of reasoning
(``diversity``), trajectories as readable records (``dumps``) and TensorBoard scalars
(``tensorboard``)."""
