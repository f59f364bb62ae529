"""Adapters between kvtier and model libraries.

Each adapter lives in its own module and imports its library only there, so that
``import kvtier`` never pulls in a model library: ``kvtier.integrations.transformers``
needs the ``hf`` extra (``pip install '.[hf]'`` in kvtier's checkout).
"""
