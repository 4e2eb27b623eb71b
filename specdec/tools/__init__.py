"""Tools around the library, never imported by the runtime, the speculation layer, the strategies or the
API: training (``train``), benchmarks (``bench``), acceptance experiments (``experiments``), the capacity
planner (``plan``) and the command-line flag groups (``arguments``). The ``specdec`` command
(``specdec.cli``) and the server (``specdec.serving``) are in the same layer; ``tests/test_layering.py``
checks the direction of every import and that no import cycle runs among these modules."""
