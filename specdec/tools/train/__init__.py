"""Draft-model training: synthetic data from the target (``data``), distillation (``distill``),
export of a shippable draft (``export``) and the ``specdec train-draft`` command (``cli``)."""
