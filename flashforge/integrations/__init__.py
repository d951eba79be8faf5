"""Integrations of flashforge into other libraries.

Each submodule imports its library only when it is itself imported, so that the library stays
an optional dependency:

* `flashforge.integrations.transformers`: ``attn_implementation="forge"`` for Hugging Face
  transformers models (``pip install "flashforge[transformers]"``).
"""
