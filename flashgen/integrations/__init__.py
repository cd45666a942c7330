"""Adapters that plug flashgen's kernels into other libraries' model code.

- ``flashgen.integrations.transformers``: an attention implementation for Hugging Face transformers
  (``register()`` returns the name to pass as ``attn_implementation``).

Each adapter imports its library inside its functions, so importing this package costs nothing, and
nothing registers itself on ``import flashgen``: a model opts in with one explicit call.
"""
