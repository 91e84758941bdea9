"""The commands, one module each, on one layer (:mod:`~dpo_megatron.cli.command`): the
bootstrap, the command line, the config, the ranks' first checks and the exit statuses.

``train`` (a training run), ``check`` (the launchers' pre-check), ``online`` (iterative DPO),
``generate`` (a JSONL of prompts -> completions), ``score`` (a JSONL of rows -> scores),
``plan`` (the layouts that fit), ``launch`` (torchrun with a one-line ending; its lines:
``launch_lines``), ``dpo_repo`` and
``trl`` (other tools' command lines, translated). Run one as ``python -m dpo_megatron.cli.NAME``;
the older names (``python -m dpo_megatron.train``, ``dpo_megatron.config``, ...) run the same
command.
"""
