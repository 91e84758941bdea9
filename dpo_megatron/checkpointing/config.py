"""The ``checkpoint`` config section: where and when a run's checkpoints are written, what a
start resumes, and the Hugging Face export at the end (the run's checkpoint policy is
``run_checkpoint.Checkpointer``). Imports nothing heavy (the config tree loads it)."""

from __future__ import annotations

from dataclasses import dataclass

from dpo_megatron.models.lora_config import EXPORT_MODES, export_mode
from dpo_megatron.utils.config_checks import check_choice, check_range

EXPORT_DTYPES = ("bfloat16", "float32")


@dataclass
class CheckpointConfig:
    """Where and when checkpoints are written."""

    save: str = ""
    """Checkpoint directory (empty: <run_dir>/checkpoints)."""
    save_interval: int = 0
    """Steps between checkpoints (>= 0; 0: only at the end)."""
    keep_last_n: int = 2
    """Checkpoints kept (>= 0); older ones are deleted after a newer one is complete (0: keep
    all)."""
    resume: str = "none"
    """Continue a run: ``none`` (start fresh), ``auto`` (the latest complete checkpoint in the
    save directory, else start fresh), or a checkpoint folder (or a folder of them: its latest).
    Restores model, optimizer, LR scheduler, RNG, data position, loss state and step."""
    overwrite: bool = False
    """Start afresh (``resume=none``) in a run_dir that holds an earlier run's checkpoints or
    metrics by moving that run, untouched, to ``<run_dir>.replaced-<time>``; without it such a
    start is refused (``dpo_megatron/training/run_dir.py``)."""
    export_hf: str = "none"
    """At the end of training write the final policy for Hugging Face: ``false``/``none`` (no
    export), ``true``/``merged`` (an HF folder <save>/hf; LoRA adapters merged into the weights)
    or ``adapter`` (LoRA only: the adapters in PEFT's layout, <save>/hf_adapter)."""
    export_dtype: str = "bfloat16"
    """dtype of the exported HF weights: bfloat16 or float32."""

    def __post_init__(self) -> None:
        """``export_hf`` as its canonical name (``none``, ``merged`` or ``adapter``: a YAML
        ``false`` arrives as the string ``'False'``), so that the run and its config.yaml read
        one spelling; a yes/no ``resume`` refused here, before the run folder's checks read it
        as a path.

        Raises:
            ValueError: an unknown ``export_hf`` value (``models.lora_config.export_mode``), or
                a boolean ``resume`` (a YAML ``true`` / ``yes`` / ``on`` arrives as ``'True'``).
        """
        self.export_hf = export_mode(self.export_hf)
        if self.resume in ("True", "False"):
            raise ValueError(
                f"checkpoint.resume={self.resume.lower()} is a yes/no; it takes none (start "
                "fresh), auto (the latest complete checkpoint in the save folder, else start "
                "fresh) or a checkpoint path"
            )

    def validate(self) -> None:
        """Raises ValueError for a negative interval or count, an unknown export dtype or
        ``export_hf`` value."""
        check_range("checkpoint", self, "save_interval", 0, why="0: only at the end")
        check_range("checkpoint", self, "keep_last_n", 0, why="0: keep all")
        check_choice("checkpoint", self, "export_dtype", EXPORT_DTYPES)
        check_choice("checkpoint", self, "export_hf", EXPORT_MODES)
