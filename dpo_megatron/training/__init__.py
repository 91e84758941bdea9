"""The DPO engine: TP-reduced log-probs, the pipeline step, optimizer set-up and the loop."""
