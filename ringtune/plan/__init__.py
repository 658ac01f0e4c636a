"""``ringtune plan``: predicted per-rank memory of a training step for every layout, and the layouts that fit.

- :mod:`ringtune.plan.models`: the model to plan for (an HF config, a checkpoint directory or a known name);
- :mod:`ringtune.plan.activations`: what autograd keeps per token, per layer type and recompute mode;
- :mod:`ringtune.plan.estimate`: one layout's per-rank peak, term by term;
- :mod:`ringtune.plan.search`: every layout of a GPU count, which fit, best first;
- :mod:`ringtune.plan.command`: the command line (table or JSON).

See docs/plan.md for the model and its check against measurement.
"""
