"""House utilities: the bottom floor of the package.

Every layer may import these modules; they import nothing else from ``dpo_megatron`` (checked by
the import contract in ``.importlinter``). Each concern lives here once:

* :mod:`~dpo_megatron.utils.files`: atomic file and folder writes.
* :mod:`~dpo_megatron.utils.cache`: the cache root, content keys and the one cache version.
* :mod:`~dpo_megatron.utils.ranks`: "is rank 0" and the few collectives checkpoint code needs.
* :mod:`~dpo_megatron.utils.modules`: ``unwrap`` (DDP / Float16Module wrappers).
* :mod:`~dpo_megatron.utils.collector`: the garbage collector paused through start-up.
* :mod:`~dpo_megatron.utils.processes`: a process that dies with its parent (``prctl``).
* :mod:`~dpo_megatron.utils.exits`: how a rank ends at a reported stop (the launchers' exits).
* :mod:`~dpo_megatron.utils.exceptions`: the exceptions a failure wraps (cause chains, DCP's).
* :mod:`~dpo_megatron.utils.config_checks`: the config sections' range and choice checks.
* :mod:`~dpo_megatron.utils.loss_names`: a loss's other names (``dpo``) and its registered one.
* :mod:`~dpo_megatron.utils.saved_activations`: activations backward makes again instead of
  keeping (saved-tensor hooks).

Nothing is imported here, so importing one helper does not pull in torch.
"""
