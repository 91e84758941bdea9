"""Iterative (online) DPO on the parallel engine: rounds of sample -> score -> pair -> train
(``rounds.run_online``; the command is ``scripts/iterative_dpo.sh``). The top floor, beside
``dpo_megatron.train``."""
