"""Configuration of the preference-data path (an OmegaConf structured config: plain types only)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from dpo_megatron.data.sources import parse_split
from dpo_megatron.utils.config_checks import check_choice, check_range

TRUNCATION_MODES = ("keep_end", "keep_start")
ON_ERROR_MODES = ("raise", "skip")


@dataclass
class DataConfig:
    """Where the preference data comes from and how it becomes token ids.

    Length rules, in order: (1) a prompt longer than ``max_prompt_length`` tokens is cut per
    ``truncation_mode`` (with ``keep_end``, a conversation first loses whole oldest turns, its
    system message kept; a cut never removes the BOS a tokenizer puts first); (2) a pair whose
    prompt leaves fewer than ``min_completion_tokens`` tokens of ``max_length`` is dropped
    (reason ``prompt_too_long``); (3) each completion is cut to ``max_length - len(prompt)``
    tokens (keeping its start; a cut completion loses its EOS). A text far longer than these
    limits is cut before it is tokenized (see ``data.encode.bound_text``).
    """

    path: str = ""
    """One dataset: a local file (.json, .jsonl, .parquet, .arrow, .csv), a folder (saved with
    ``datasets.save_to_disk`` or holding data files), or a hub name passed to
    ``datasets.load_dataset`` (needs internet). Empty: use ``datasets``."""

    datasets: list[str] = field(default_factory=list)
    """Several datasets mixed into one training set (same forms as ``path``)."""

    weights: list[float] = field(default_factory=list)
    """Mixing proportions for ``datasets`` (same length; relative, need not sum to 1). Source i
    then makes ``round(total * w_i / sum(w))`` of the training pairs, ``total`` being the number
    of kept training pairs of all sources, drawn by ``seed`` (repeating a source when it is
    short). Empty: every kept pair once."""

    format: str = "auto"
    """Row format: a registered format's name (``data.format_registry``; the table of
    docs/DATA.md: ``standard``, ``conversational``, ``sharegpt``, ``hh``, ``kto_messages``, ...;
    an unknown name lists them all), or ``auto`` (detected from the columns; an ambiguous case
    is an error that lists the candidates)."""

    formats: list[str] = field(default_factory=list)
    """Per-dataset formats for ``datasets`` (same length); empty: ``format`` for all."""

    split: str = "train"
    """Split to read from a hub dataset or a folder with several splits (a file is its
    ``train`` split). A row range in ``datasets``' notation keeps those rows only, of any
    source: ``train[:200]``, ``train[200:300]`` (e.g. a reward model on rows a later online
    run's prompts never come from)."""

    eval_datasets: list[str] = field(default_factory=list)
    """Datasets whose pairs are the evaluation set (same forms as ``path``; a hub name or a
    folder is read at ``eval_split``, a file whole), converted, tokenized, checked and cached as
    the training data are, every kept pair evaluated once in file order. The training sources
    may be named again here: a folder holding ``train.jsonl`` and ``test.jsonl`` (split names
    as ``datasets.load_dataset`` infers them from file names) trains on the one and evaluates
    on the other. Excludes ``eval_fraction``. Empty: the eval set is ``eval_fraction`` of the
    training sources (or none)."""

    eval_formats: list[str] = field(default_factory=list)
    """Per-dataset formats for ``eval_datasets`` (same length); empty: ``format``."""

    eval_split: str = "test"
    """Split of ``eval_datasets`` read from a hub dataset or a folder with several splits (a
    row range as for ``split``)."""

    tokenizer: str = ""
    """HF tokenizer folder / hub name, or a SentencePiece ``.model`` file. Empty: the engine
    passes the model folder."""

    chat_template: str = ""
    """Chat template for conversational data: empty = the tokenizer's own; ``chatml`` or
    ``mistral`` = a built-in one; anything else = a path to a Jinja file."""

    max_length: int = 512
    """Most tokens in prompt + completion (each of chosen and rejected); >= 2."""

    max_prompt_length: int = 256
    """Most prompt tokens kept (cut per ``truncation_mode``); 0 = no prompt cut, so a prompt
    that leaves no room for a completion drops the pair. Otherwise >= 2 (room for the BOS and
    one token) and max_prompt_length + min_completion_tokens <= max_length."""

    truncation_mode: str = "keep_end"
    """How a long prompt is cut: ``keep_end`` keeps the latest turns (a conversation drops its
    oldest user/assistant exchanges first, keeping the system message; a prompt still too long,
    or a text prompt, keeps its BOS and its last ``max_prompt_length - 1`` tokens),
    ``keep_start`` its first tokens."""

    min_completion_tokens: int = 1
    """Fewest completion tokens a pair must keep on each side after cutting (>= 1); below that
    the pair is dropped as ``prompt_too_long``."""

    eval_fraction: float = 0.0
    """Fraction of each source's kept pairs held out for evaluation (chosen by ``seed``), in
    [0, 1); 0 with ``eval_datasets`` (one eval set or the other)."""

    seed: int = 1234
    """Seed for the eval split and the mixing draws (>= 0)."""

    shuffle: bool = True
    """Visit the training pairs in a new seeded order each epoch (``train.seed``); false: in
    file order (e.g. to compare step by step with another trainer)."""

    num_proc: int = 1
    """Processes for tokenization (``datasets.map``); >= 1."""

    on_error: str = "raise"
    """Malformed row (bad JSON, non-UTF-8 bytes, a missing or mistyped field): ``raise`` stops
    with file, row / line and field; ``skip`` drops and counts it."""

    drop_duplicates: bool = False
    """Drop a pair whose prompt, chosen and rejected tokens equal an earlier pair's of the same
    source (counted as ``duplicate``). False: keep them; they are counted and reported in the
    summary either way."""

    cache_dir: str = ""
    """Where tokenized data is cached, keyed by data, tokenizer and settings. Empty:
    ``$DPO_MEGATRON_CACHE/data``; ``none``: no cache."""

    shp_min_score_ratio: float = 2.0
    """SHP: keep a pair only if the preferred comment's score is at least this multiple of the
    other's (the SteamSHP paper's filter); >= 0 (0 or 1: no filter)."""

    shp_max_pairs_per_post: int = 5
    """SHP: most pairs kept per post (rows sharing ``post_id``, else the same ``history``): the
    first ones in file order that pass ``shp_min_score_ratio``, counted before the length
    limits; the rest are dropped as ``shp_pairs_per_post``. 5 as in the SHP dataset card's
    recipe ("no more than 5 preferences from each post to prevent overfitting"); >= 0, 0: no
    cap (the reference DPO repo's ``get_shp`` keeps every pair)."""

    se_max_pairs_per_question: int = 1
    """StackExchange: pairs made per question, best-scored answer vs the next lower scores (>=
    1)."""

    reference_preprocessing: bool = False
    """``hh`` / ``shp`` / ``se`` rows as the reference DPO repo (Rafailov et al. 2023,
    ``preference_datasets.py``) preprocesses them: plain-text prompts ``"\n\nHuman: <text>
    \n\nAssistant:"`` (HH: the dialogue up to the last common Assistant turn) and completions
    ``" <answer>"`` with no chat template; SE HTML stripped as there (top-level ``<p>`` text and
    ``<code>`` blocks, kept as ``<code>...</code>``) and every pair of a question's answers made
    (higher ``pm_score`` chosen; on a tie the later answer, as there). False: conversations
    (message lists through the chat template) and this engine's SE rule
    (``se_max_pairs_per_question``)."""

    verbose: bool = True
    """Print the start-up summary (rows read, pairs kept, drops by reason, length percentiles),
    on global rank 0 only when torch.distributed is initialized; also shows progress bars."""

    def sources(self) -> list[tuple[str, str]]:
        """[(dataset, format)] for every dataset this config names; ValueError on conflicts."""
        if self.path and self.datasets:
            raise ValueError(
                "data.path and data.datasets are both set: use one (data.datasets for a mix)"
            )
        names = [self.path] if self.path else list(self.datasets)
        if not names:
            raise ValueError("no data: set data.path (one dataset) or data.datasets (a mix)")
        if self.formats and len(self.formats) != len(names):
            raise ValueError(
                f"data.formats has {len(self.formats)} entries for {len(names)} datasets"
            )
        if self.weights and len(self.weights) != len(names):
            raise ValueError(
                f"data.weights has {len(self.weights)} entries for {len(names)} datasets"
            )
        if self.weights and (min(self.weights) < 0 or sum(self.weights) <= 0):
            raise ValueError(f"data.weights must be >= 0 with a positive sum, got {self.weights}")
        formats = list(self.formats) if self.formats else [self.format] * len(names)
        return list(zip(names, formats))

    def eval_sources(self) -> list[tuple[str, str]]:
        """[(dataset, format)] of ``eval_datasets`` (empty when none); ValueError when
        ``eval_formats`` does not match it in length."""
        if self.eval_formats and len(self.eval_formats) != len(self.eval_datasets):
            raise ValueError(
                f"data.eval_formats has {len(self.eval_formats)} entries for "
                f"{len(self.eval_datasets)} data.eval_datasets"
            )
        formats = list(self.eval_formats) or [self.format] * len(self.eval_datasets)
        return list(zip(self.eval_datasets, formats))

    def validate(self) -> None:
        """Raise ValueError naming the field for any invalid setting (the ranges in the field
        docs)."""
        check_choice("data", self, "truncation_mode", TRUNCATION_MODES)
        check_choice("data", self, "on_error", ON_ERROR_MODES)
        for key in ("split", "eval_split"):
            try:
                parse_split(getattr(self, key))
            except ValueError as e:
                raise ValueError(f"data.{key}: {e}") from None
        check_range("data", self, "max_length", 2)
        if self.max_prompt_length != 0:
            check_range(
                "data",
                self,
                "max_prompt_length",
                2,
                why="room for the BOS and one token (0: no prompt cut)",
            )
        check_range("data", self, "seed", 0)
        check_range("data", self, "shp_min_score_ratio", 0)
        check_range("data", self, "shp_max_pairs_per_post", 0, why="0: no cap")
        check_range("data", self, "se_max_pairs_per_question", 1)
        if (
            self.max_prompt_length
            and self.max_prompt_length + self.min_completion_tokens > self.max_length
        ):
            raise ValueError(
                f"data.max_prompt_length={self.max_prompt_length} leaves fewer than "
                "data.min_completion_tokens="
                f"{self.min_completion_tokens} of data.max_length={self.max_length}: lower "
                "max_prompt_length "
                "(or set it to 0 to drop over-long prompts instead of cutting them)"
            )
        if self.min_completion_tokens < 1:
            raise ValueError(
                "data.min_completion_tokens must be >= 1: a pair needs completion tokens on both "
                "sides"
            )
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"data.eval_fraction={self.eval_fraction} must be in [0, 1)")
        if self.eval_datasets and self.eval_fraction:
            raise ValueError(
                f"data.eval_datasets and data.eval_fraction={self.eval_fraction} are "
                f"both set: the eval set is one or the other (set "
                f"data.eval_fraction=0 to evaluate on data.eval_datasets)"
            )
        if self.num_proc < 1:
            raise ValueError(f"data.num_proc={self.num_proc} must be >= 1")
        from dpo_megatron.data.formats import get_format  # the registry: converters, no torch

        for _, fmt in self.sources() + self.eval_sources():  # before any reading: a typo fails
            if fmt != "auto":
                get_format(fmt)


@dataclass
class PackingConfig:
    """Padding-free packing of each micro-batch's sequences (``packing.*``; used by
    ``data.packing``, defined here so that the config tree imports no torch)."""

    enabled: bool | None = None
    """Pack the 2B sequences of each micro-batch into rows, each sequence attending only to
    itself. Log-probs equal the padded path's (fp32, 1e-6 relative). null (auto): on, except for
    SFT losses and MoE models (``training.auto_settings``)."""
    row_length: int = 0
    """Tokens per packed row (>= 0). 0: one row per micro-batch holding all its units (the
    step's longest micro-batch, rounded up to the padding granule): nothing is padding but the
    rounding, and the attention runs per sequence. > 0: rows of this many tokens filled
    first-fit decreasing (must be >= the longest unit); meant for the dense-mask kernel
    (``model.local_attention=megatron``), whose cost grows with the row length squared."""
    bucket_by_length: bool = False
    """Within each data-parallel rank's share of a step, regroup pairs into micro-batches of
    similar length (longest first). The step's pair set, hence its loss and gradient, is
    unchanged; only which pairs share a micro-batch (and the per-pair report order) changes."""
    share_prompt: bool | None = None
    """null (auto): on for paired losses wherever packing is on (``training.auto_settings``).
    With ``enabled``: each pair is one unit ``[prompt | chosen | rejected]``: the prompt runs
    once through the model (policy and reference), each completion attends to the prompt and to
    itself only, rejected positions continue from the end of the prompt. Log-probs equal the
    unshared path's (fp32). Needs a kernel that takes two branches per unit: every local
    ``model.local_attention`` and transformer-engine (THD, one row per micro-batch)."""

    def may_pack(self) -> bool:
        """Whether the run may pack its rows: unless packing is set off (auto packs the rows of
        every preference loss, ``training.auto_settings``), so a rule on packed rows holds."""
        return self.enabled is not False

    def validate(self) -> None:
        """Rules of this section alone (the transformer-engine rule on ``row_length`` spans
        sections: ``config.validate``).

        Raises:
            ValueError: a negative ``row_length``; ``share_prompt`` without ``enabled``.
        """
        check_range(
            "packing",
            self,
            "row_length",
            0,
            why="0: one row per micro-batch, or the tokens per packed row",
        )
        if self.share_prompt and self.enabled is False:
            raise ValueError(
                "packing.share_prompt=true lays pairs out in packed rows: set "
                "packing.enabled=true too"
            )


def as_data_config(cfg: Any) -> DataConfig:
    """A DataConfig from a DataConfig, an OmegaConf DictConfig of one, or a plain dict.

    Raises ValueError naming unknown keys.
    """
    if isinstance(cfg, DataConfig):
        return cfg
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(cfg, DictConfig):
            obj = OmegaConf.to_object(cfg)
            if isinstance(obj, DataConfig):
                return obj
            cfg = obj
    except ImportError:  # omegaconf is optional for the data path
        pass
    if isinstance(cfg, dict):
        known = {f.name for f in fields(DataConfig)}
        unknown = sorted(set(cfg) - known)
        if unknown:
            raise ValueError(f"unknown data config key(s) {unknown}; known: {sorted(known)}")
        return DataConfig(**cfg)
    raise TypeError(
        f"expected a DataConfig (or a DictConfig / dict of one), got {type(cfg).__name__}"
    )
