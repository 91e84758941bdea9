"""What an online run needs of the other sections, checked before any rank builds a model."""

from __future__ import annotations

from dpo_megatron.online.layouts import name_sampling_keys, sampling_layout


def validate_online(cfg, world_size: int | None = None) -> None:
    """The rules that span ``online.*`` and the rest of the config (``config.validate`` has
    checked the sections, ``config.validate_online_config`` runs both); with ``world_size``,
    both layouts against it.

    Raises:
        ValueError: naming the fields and what to do.
    """
    o = cfg.online
    if o.rounds < 1:
        raise ValueError("online.rounds=0: an online run needs online.rounds >= 1")
    if not (cfg.model.hf_path or cfg.model.load):
        raise ValueError(
            "an online run samples from its policy: start it from pretrained weights "
            "(model.hf_path or model.load), not a random initialisation"
        )
    if cfg.lora.enabled:
        raise ValueError(
            "lora.enabled=true is not supported by online runs (each round starts from the "
            "previous round's full checkpoint): set lora.enabled=false"
        )
    if cfg.reference.weights():
        raise ValueError(
            f"{cfg.reference.weights_key()}={cfg.reference.weights()}: an online run's "
            "reference is online.reference (round_start or initial); drop "
            f"{cfg.reference.weights_key()}"
        )
    if cfg.checkpoint.resume not in ("none", "auto"):
        raise ValueError(
            f"checkpoint.resume={cfg.checkpoint.resume!r}: an online run resumes with "
            "checkpoint.resume=auto (each round from its own checkpoints) or starts with none"
        )
    if cfg.checkpoint.save:
        raise ValueError(
            "checkpoint.save is set: an online run keeps each round's checkpoints in "
            "<run_dir>/online/round_<r>/checkpoints; leave checkpoint.save empty"
        )
    if cfg.parallel.context_parallel_size > 1 or (
        o.reward_model.path and o.reward_model.parallel.context_parallel_size > 1
    ):
        raise ValueError(
            "context parallelism does not sample: set parallel.context_parallel_size=1 and "
            "online.reward_model.parallel.context_parallel_size=1"
        )
    if o.reward_model.chat_template:
        from dpo_megatron.data.tokenizer import resolve_chat_template

        try:
            resolve_chat_template(o.reward_model.chat_template)
        except ValueError as e:
            raise ValueError(
                str(e).replace("data.chat_template", "online.reward_model.chat_template")
            ) from None
    if world_size is not None:
        _check_world(cfg, world_size)


def _check_world(cfg, world_size: int) -> None:
    """Each phase's layout against the world size: the policy's training and sampling
    layouts, and the reward model's, each error named after its own keys."""
    cfg.parallel.validate(world_size)
    sampling = sampling_layout(cfg)
    if sampling is not cfg.parallel:
        try:
            sampling.validate(world_size)
        except ValueError as e:
            raise ValueError(name_sampling_keys(cfg, str(e))) from None
    rm = cfg.online.reward_model
    if rm.path:
        try:
            rm.parallel.validate(world_size)
        except ValueError as e:
            raise ValueError(str(e).replace("parallel.", "online.reward_model.parallel.")) from None
