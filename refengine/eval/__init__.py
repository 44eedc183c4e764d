"""``refengine eval``: how good a model's predictions are, measured through the engine itself.

- ``perplexity.py``: perplexity over a text (llama.cpp's ``perplexity`` method), and the
  comparison of a model against a baseline (ΔPPL, KL divergence, top-1 agreement);
- ``cli.py``: the ``eval`` click group (``refengine eval perplexity``).

See ``docs/evaluation.md``.
"""
