"""specdec's shipped assets for the embedded SmolLM2-135M-Instruct (data only; the ``specdec`` library finds
them with ``importlib.resources`` through ``specdec.speculation.assets.asset_path``).

- ``draft/smollm2-135m-instruct/``: the vanilla draft model's own tensors (``specdec train-draft --ship``);
- ``eagle/smollm2-135m-instruct/``, ``eagle/smollm2-135m-instruct-eagle3/``: the EAGLE-1 and EAGLE-3 heads
  (``specdec train-eagle --ship``);
- ``medusa/smollm2-135m-instruct/``: the Medusa heads and their measured accuracy (``specdec train-medusa``);
- ``train/tokens/smollm2-135m-instruct/``: the token store the shipped strategies were trained on;
- ``train/requests*.jsonl``: the written requests of the ``written`` training mix.
"""
