"""Method modules: importing this package registers every method."""

from . import h2o, kivi, snapkv, streaming_llm, tova  # noqa: F401
