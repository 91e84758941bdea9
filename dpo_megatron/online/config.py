"""The ``online:`` config section: iterative (online) DPO rounds (``dpo_megatron/online``).

Each round samples ``samples_per_prompt`` completions for ``prompts_per_round`` prompts from the
current policy, scores them (a reward model or a judge callable), keeps best vs worst per prompt
and trains DPO on those pairs through the run's own ``loss.*``, ``train.*`` and ``parallel.*``
sections. ``rounds: 0`` (the default) means no online run. Imports nothing heavy.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from dpo_megatron.generation.config import SamplingConfig
from dpo_megatron.parallel.config import ParallelConfig
from dpo_megatron.utils.config_checks import check_choice, check_range

REFERENCES = ("round_start", "initial")


@dataclass
class SamplingLayoutConfig:
    """The policy's layout while it samples (a round's samples and the held-out evaluation's),
    as rollout engines give generation a tensor parallelism of its own: the same world, this
    TP x PP, DP whatever the world leaves. A sampling rank builds the policy at this layout from
    the round's checkpoint (checkpoints reshard), so training keeps ``parallel.*``. A policy
    that fits one rank samples fastest at TP 1 x PP 1: every rank decodes its share of the
    completions alone, without the pipeline's hand-offs or TP's all-reduces per token."""

    tensor_model_parallel_size: int = 0
    """Ranks that split each weight while sampling (>= 0; 0:
    ``parallel.tensor_model_parallel_size``)."""
    pipeline_model_parallel_size: int = 0
    """Pipeline stages while sampling (>= 0; 0: ``parallel.pipeline_model_parallel_size``)."""

    def resolve(self, policy: ParallelConfig) -> ParallelConfig:
        """The sampling layout: ``policy`` (``parallel.*``) with the sizes set here. A pipeline
        size set here drops ``policy``'s interleaving (its chunks would not fit the new stages),
        a tensor size of 1 its sequence parallelism; data parallelism takes the rest. Sizes
        equal to ``policy``'s return ``policy`` itself (callers test ``is``)."""
        tp = self.tensor_model_parallel_size or policy.tensor_model_parallel_size
        pp = self.pipeline_model_parallel_size or policy.pipeline_model_parallel_size
        if (tp, pp) == (policy.tensor_model_parallel_size, policy.pipeline_model_parallel_size):
            return policy
        return replace(
            policy,
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            data_parallel_size=None,
            virtual_pipeline_model_parallel_size=(
                policy.virtual_pipeline_model_parallel_size
                if pp == policy.pipeline_model_parallel_size
                else None
            ),
            sequence_parallel=policy.sequence_parallel and tp > 1,
        )


@dataclass
class OnlineSamplingConfig(SamplingConfig):
    """How each round samples completions from the policy (the fields of ``generation.*``,
    with smaller defaults; temperature must be > 0), and at which layout. Round r samples with
    seed ``seed + r``, so a resumed round draws the same completions."""

    max_new_tokens: int = 128
    micro_batch_size: int = 4
    parallel: SamplingLayoutConfig = field(default_factory=SamplingLayoutConfig)
    """The policy's TP x PP while it samples (0: as ``parallel.*``)."""


@dataclass
class RewardModelConfig:
    """The reward model that scores the samples, on its own layout of the same world."""

    path: str = ""
    """A reward-model checkpoint folder (or a run's ``checkpoints`` folder: its latest) or a
    Hugging Face ``*ForSequenceClassification`` folder. Empty: ``online.judge`` scores."""
    tokenizer: str = ""
    """The tokenizer the reward model reads samples with. Empty: the one in ``path`` when it is
    a folder holding one, else (a checkpoint) the one of the folder it was built from when its
    vocabulary is not the policy's, else the policy's (``data.tokenizer``). Samples are scored
    on the policy's ids when this tokenizer and chat template read their prompt as the policy
    did, else on their text re-encoded (a reward model of another family)."""
    chat_template: str = ""
    """The reward model's chat template (``chatml``, ``mistral`` or a Jinja file). Empty: its
    tokenizer's own, or ``data.chat_template`` when it reads with the policy's tokenizer."""
    micro_batch_size: int = 4
    """Sequences per scoring forward (>= 1)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """The reward model's TP x PP layout (DP: whatever the world leaves); the policy keeps
    ``parallel.*``. Both must fit the launched world size."""


@dataclass
class OnlineConfig:
    """Iterative DPO: rounds of sample -> score -> pair -> train (``scripts/iterative_dpo.sh``)."""

    rounds: int = 0
    """Rounds to run (>= 0; 0: not an online run)."""
    prompts: str = ""
    """JSON / JSONL file of prompts: rows with a ``prompt`` (string, or chat messages) or
    ``messages`` (chat; trailing assistant turns are dropped), or rows of any preference format
    the data path reads (their prompt is used, e.g. ``${asset:dpo_en_demo}``)."""
    prompts_offset: int = 0
    """Rows of the prompts file skipped before the first prompt (>= 0): e.g. the rows a reward
    model was trained on."""
    prompts_limit: int = 0
    """Rows used after the offset (>= 0; 0: all the rest)."""
    prompts_per_round: int = 8
    """Prompts sampled per round (>= 1): round r takes the next ``prompts_per_round`` of the
    (seeded, shuffled) prompt order, wrapping around at its end."""
    shuffle_prompts: bool = True
    """Shuffle the prompt order once with ``online.seed`` (false: file order)."""
    seed: int = 1234
    """Seed of the prompt order (>= 0)."""
    eval_prompts: int = 0
    """Prompts held out of every round (>= 0; the first ones of the prompt order): before round
    0 and after each round the policy samples ``samples_per_prompt`` completions of each, the
    scorer scores them, and their mean score is the round's ``eval_mean_score`` (0: no
    evaluation)."""
    samples_per_prompt: int = 4
    """Completions sampled per prompt, K (>= 2: a pair needs a best and a worst)."""
    sampling: OnlineSamplingConfig = field(default_factory=OnlineSamplingConfig)
    """Temperature, top-p, length and seed of the round's sampling."""
    judge: str = ""
    """A Python callable ``package.module:function`` taking (prompt texts, completion texts),
    two lists of equal length, and returning one float score per completion; called on rank 0.
    Set exactly one of ``judge`` and ``reward_model.path``."""
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    """The reward model that scores samples (instead of a judge)."""
    min_margin: float = 0.0
    """A prompt's pair (best vs worst score) is kept when best - worst >= min_margin and > 0
    (>= 0): exact ties are always dropped, near-ties below min_margin too; both are counted."""
    missing_eos_penalty: float = 0.0
    """Subtracted from the score of a sample that ends without a stop token (cut at
    ``online.sampling.max_new_tokens``) when the pairs are chosen (>= 0; 0: none), as TRL's
    ``OnlineDPOConfig.missing_eos_penalty``: a cut-off completion is then less often chosen. The
    scores files keep the scorer's scores; the pairs and their scores carry the penalty."""
    reference: str = "round_start"
    """The DPO reference of each round: ``round_start`` (the policy the round starts from) or
    ``initial`` (the run's starting weights, every round)."""

    def validate(self) -> None:
        """Ranges and choices of the section (only when ``rounds`` > 0: the section is unused
        otherwise).

        Raises:
            ValueError: naming the ``online.*`` field and its valid range or what to do.
        """
        check_range("online", self, "rounds", 0, why="0: not an online run")
        if not self.rounds:
            return
        if not self.prompts:
            raise ValueError(
                "online.prompts is empty: give a JSON / JSONL file of prompts (rows with "
                "'prompt' or 'messages', or preference rows)"
            )
        check_range("online", self, "prompts_offset", 0)
        check_range("online", self, "prompts_limit", 0, why="0: all rows after the offset")
        check_range("online", self, "prompts_per_round", 1)
        check_range("online", self, "eval_prompts", 0, why="0: no evaluation")
        check_range("online", self, "seed", 0)
        check_range(
            "online",
            self,
            "samples_per_prompt",
            2,
            why="a pair needs a best and a worst completion",
        )
        self.sampling.validate_sampling("online.sampling", greedy=False)
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
            check_range(
                "online.sampling.parallel", self.sampling.parallel, name, 0, why="0: parallel.*"
            )
        check_range("online", self, "min_margin", 0)
        check_range("online", self, "missing_eos_penalty", 0, why="0: no penalty")
        check_choice("online", self, "reference", REFERENCES)
        rm = self.reward_model
        if bool(self.judge) == bool(rm.path):
            raise ValueError(
                "set exactly one scorer: online.judge=package.module:function or "
                f"online.reward_model.path=<checkpoint or HF folder> (got judge={self.judge!r}, "
                f"reward_model.path={rm.path!r})"
            )
        if self.judge:
            module, _, function = self.judge.partition(":")
            if (
                not module
                or not function
                or not all(part.isidentifier() for part in [*module.split("."), function])
            ):
                raise ValueError(
                    f"online.judge={self.judge!r} must name a callable as package.module:function"
                )
        check_range("online.reward_model", rm, "micro_batch_size", 1)
        try:
            rm.parallel.validate()
        except ValueError as e:
            raise ValueError(str(e).replace("parallel.", "online.reward_model.parallel.")) from None
