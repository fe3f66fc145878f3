"""What runs the iteration on real machines: the settings table (``settings``), a config turned into
a model, tokenizer and plans (``experiment``), the memory planner (``planning``), meshes and many
hosts (``sharding``, ``distributed``), checkpoints (``checkpoint``), on-disk caches (``caches``), the
process's allocator (``allocator``), the environment variables that switch parts off (``switches``), the
env contract's check at start-up (``contract``) and the one filter on errors Python can only report
(``unraisable``)."""
