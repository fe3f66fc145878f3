"""``ModelLoadError``, which every model source raises when it cannot be read: the loader
(``models.loading``) and the format readers below it (``models.gguf_reader``) share it, so it lives
apart from both."""


class ModelLoadError(ValueError):
    """A checkpoint source that cannot be loaded; the message names the file and what to do."""
