"""Iterative (online) DPO on the parallel engine: rounds of sample -> score -> pair -> train
(``rounds.run_online``), and the ``online:`` config section (``config``). The command is
``scripts/iterative_dpo.sh`` (:mod:`dpo_megatron.cli.online`); this package sits below the
config tree, which imports its section."""
