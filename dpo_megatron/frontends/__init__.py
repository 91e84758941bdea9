"""Front doors for other tools' command lines: the reference DPO repository's
(:mod:`~dpo_megatron.frontends.dpo_repo`, Rafailov et al. 2023) and TRL's ``DPOConfig``
(:mod:`~dpo_megatron.frontends.trl`), translated to this engine's overrides and run."""
