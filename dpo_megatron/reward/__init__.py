"""Reward models on the engine: scoring sequences with one (:mod:`dpo_megatron.reward.scoring`),
and a JSONL file's rows scored (:mod:`dpo_megatron.reward.rows`, ``python -m dpo_megatron.score``).

Training one is a loss (``loss.name=bradley_terry``, ``losses.reward``); its head is
``models.reward_head``; conversion to and from HF ``*ForSequenceClassification`` folders is the
conversion package's (``models.conversion``).
"""
