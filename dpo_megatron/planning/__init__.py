"""The layout planner: which TP x PP x VPP x DP x CP x EP layout, micro-batch size, recompute
setting and reference mode fit a model on a cluster, what each rank holds and how long a step
takes, and the report of them (``report``; the command is ``python -m dpo_megatron.plan``)."""
