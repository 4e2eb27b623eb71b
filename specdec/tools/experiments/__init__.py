"""Acceptance-rate experiments: sweeps over strategies × k × temperature × prompts as pandas DataFrames,
and their plots (``specdec.tools.experiments.plots``). Needs ``pip install 'specdec[experiments]'`` (pandas,
matplotlib).

    from specdec import DecoderModel
    from specdec.tools.experiments import grid, mt_bench_prompts, summarize, sweep
    from specdec.tools.experiments import plots

    target = DecoderModel.from_pretrained(None, n_positions=512, backend="eager")
    df = sweep(target, grid(["none", "eagle", "lookup"], ks=[2, 4], temperatures=[0, 0.7]),
               mt_bench_prompts(8), max_new_tokens=64, output="sweep.jsonl")   # resumable
    summarize(df)                        # one row per configuration
    plots.tau_and_speed(df).savefig("tau.png")
"""
from .sweep import (
                    COLUMNS,
                    STRATEGIES,
                    Config,
                    Prompt,
                    Strategy,
                    frame,
                    grid,
                    load_results,
                    mt_bench_prompts,
                    row_seed,
                    stats_of,
                    summarize,
                    sweep,
)

__all__ = ["COLUMNS", "STRATEGIES", "Config", "Prompt", "Strategy", "frame", "grid", "load_results",
           "mt_bench_prompts", "row_seed", "stats_of", "summarize", "sweep"]
