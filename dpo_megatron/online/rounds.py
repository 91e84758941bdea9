"""Iterative (online) DPO: rounds of sample -> score -> pair -> train, in one world.

Each round ``r`` (folder ``<run_dir>/online/round_<r>``):

1. **sample**: the round's prompts (``prompts.round_prompts``), K completions each from the
   policy the round starts from, at its sampling layout (``online.sampling.parallel`` over
   ``parallel.*``: ``layouts.sampling_layout``), seed ``online.sampling.seed + r``;
   ``samples.jsonl``.
2. **score**: the judge callable on rank 0, or the reward model at its own layout
   (``online.reward_model.parallel.*``); ``scores.jsonl``.
3. **pairs**: best vs worst per prompt, ties and near-ties dropped and counted
   (``pairs.build_pairs``); ``pairs.jsonl`` and ``summary.json``.
4. **train**: the engine's :class:`~dpo_megatron.training.trainer.Trainer` on those pairs, with
   the round folder as its run folder: the policy from the previous round's checkpoint
   (``model.load``), the reference per ``online.reference``, the run's ``loss.*``, ``train.*``,
   ``parallel.*``; its checkpoints in ``round_<r>/checkpoints``. ``summary.json`` gets the last
   training metrics and the phases' wall times.
5. **eval** (``online.eval_prompts`` > 0): the policy samples the held-out prompts (also once
   before round 0: ``online/eval_start.jsonl``) with a fixed seed, the scorer scores them, and
   the policy and the starting policy give each sample's log-probability; ``eval.jsonl``, and
   in ``summary.json`` ``eval_mean_score`` (with the score before the round) and ``eval``: the
   mean score, its change since the start and the KL from the starting policy, each with its
   bootstrap interval (``online.evaluation``).

At the end rank 0 writes the run's report (``online/summary.json``: every evaluation, each
round's counts and wall times, the final policy; ``online/evaluation.png``: score and KL by
round) and prints the table and the final policy's checkpoint.

Between phases megatron-core's model-parallel groups are torn down and built for the next
phase's layout (``layouts.use_layout``: the default process group stays), and the phase's models
are freed first. Rank 0 writes every file atomically; ``online/state.json`` lists the finished
phases of each round, written after the phase's files. A resumed run (``checkpoint.resume=auto``)
skips finished phases (samples present: no regeneration) and its unfinished training resumes
from the round's last checkpoint through the Trainer's own resume, so it ends with the same
pairs and weights as an uninterrupted run.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from typing import Any

from dpo_megatron.online import adapters
from dpo_megatron.online.checks import validate_online
from dpo_megatron.online.evaluation import (
    evaluation_entry,
    final_policy_line,
    plot_evaluation,
    run_summary,
    summary_lines,
)
from dpo_megatron.online.layouts import free_models, sampling_layout, use_layout
from dpo_megatron.online.pairs import build_pairs, penalize_missing_eos
from dpo_megatron.online.prompts import (
    PromptItem,
    encode_prompts,
    left_out_warning,
    read_prompts,
    round_prompts,
    split_prompts,
)
from dpo_megatron.online.records import (
    EvalSample,
    PairRecord,
    PhaseTimes,
    RecordError,
    RoundState,
    RoundSummary,
    SampleRecord,
    ScoreRecord,
    StateRecord,
    read_record,
    read_records,
    write_record,
    write_records,
)
from dpo_megatron.training import run_models
from dpo_megatron.training.metrics_log import last_record
from dpo_megatron.training.run_data import RunData
from dpo_megatron.training.run_dir import RunFolder
from dpo_megatron.utils import ranks
from dpo_megatron.utils.frozen import freeze
from dpo_megatron.utils.run_layout import RunLayout

PHASES = ("sample", "score", "pairs", "train", "eval")


class StopAfter(Exception):
    """Raised by :func:`run_online` after the phase named in ``stop_after`` (tests: a run
    killed between phases)."""


# ----------------------------------------------------------------------------------------------
# state


class OnlineState:
    """``online/state.json`` (:class:`~dpo_megatron.online.records.StateRecord`): the phases
    each round finished and, after training, the checkpoint folder its policy ended in. Rank 0
    reads and writes it; every rank asks it the same questions.

    Raises:
        RecordError: (on rank 0) the file is not a state record; every rank stops with it.
    """

    def __init__(self, path: str):
        self.path = path
        record, error = None, None
        if ranks.is_rank0():
            try:
                exists = os.path.isfile(path)
                record = read_record(path, StateRecord) if exists else StateRecord()
            except RecordError as e:
                error = e
        self.record, error = ranks.broadcast_from_rank0((record, error))
        if error is not None:
            raise error

    def round(self, r: int) -> RoundState:
        """What the state knows of round ``r`` (nothing finished: an empty one)."""
        return self.record.rounds.get(r, RoundState())

    def done(self, r: int, phase: str) -> bool:
        return phase in self.round(r).done

    def mark(self, r: int, phase: str, **values) -> None:
        """Record ``phase`` of round ``r`` as finished, with ``values`` (fields of
        :class:`~dpo_megatron.online.records.RoundState`), and write the file (collective)."""
        entry = self.round(r)
        done = entry.done if phase in entry.done else (*entry.done, phase)
        self.record.rounds[r] = dataclasses.replace(entry, done=done, **values)
        if ranks.is_rank0():
            write_record(self.path, self.record)
        ranks.barrier()

    def policy_after(self, r: int) -> str | None:
        """The checkpoint folder the policy of round ``r`` ended in (None: the round did not
        train yet)."""
        return self.round(r).policy


# ----------------------------------------------------------------------------------------------
# phases


def _round_config(cfg, round_dir: str, policy: str):
    """The round's training config: a copy of the run's with the round folder as run folder,
    ``model.load`` the policy the round starts from, resume from the round's checkpoints (the
    run's config is not changed)."""
    starts_from_hf = policy == cfg.model.hf_path and not cfg.model.load
    return dataclasses.replace(
        cfg,
        run_dir=round_dir,
        model=dataclasses.replace(cfg.model, load="" if starts_from_hf else policy),
        checkpoint=dataclasses.replace(cfg.checkpoint, resume="auto", overwrite=False, save=""),
        online=dataclasses.replace(cfg.online, rounds=0),
    )


def _policy_chunks(cfg, model_cfg, policy: str) -> list:
    """The policy of a round at its sampling layout (made the current one: nothing happens
    when it already is), weights from ``policy`` (collective)."""
    from dpo_megatron.models import build_model_chunks

    parallel = sampling_layout(cfg)
    use_layout(parallel)
    chunks = build_model_chunks(model_cfg, parallel)
    run_models.load_weights(chunks, model_cfg, policy)
    for chunk in chunks:
        chunk.eval()  # sampling: no dropout
    return chunks


EVAL_SEED_OFFSET = 1_000_003
"""The held-out evaluation samples with ``online.sampling.seed + EVAL_SEED_OFFSET`` every time:
its scores then differ between evaluations by the policy alone."""


def _sample(cfg, model_cfg, tokenizer, pad_id, items: list[PromptItem], policy: str, r, seed: int):
    chunks = _policy_chunks(cfg, model_cfg, policy)
    records = _sample_with(chunks, cfg, tokenizer, pad_id, items, r, seed)
    del chunks
    free_models()
    return records


def _sampling_note(cfg) -> str:
    """The start-up line's note of a sampling layout of its own (``online.sampling.parallel``),
    named as a run's layout line names it, its data parallelism what the world leaves."""
    s = sampling_layout(cfg)
    if s is cfg.parallel:
        return ""
    return f" | sampling at {s.describe(ranks.world_size() // s.model_parallel_size())}"


def _stop_ids(tokenizer, pad_id: int) -> list[int]:
    """The ids a sample stops at: the tokenizer's EOS and the pad id."""
    return sorted({i for i in (tokenizer.eos_token_id, pad_id) if i is not None})


def _sample_with(chunks, cfg, tokenizer, pad_id, items: list[PromptItem], r, seed: int):
    """The samples records of ``items`` from the policy ``chunks`` (collective)."""
    stop = _stop_ids(tokenizer, pad_id)
    completions = adapters.sample_completions(
        chunks,
        [it.prompt_ids for it in items],
        cfg.online.sampling,
        seed=seed,
        num_samples=cfg.online.samples_per_prompt,
        stop_ids=stop,
        pad_id=pad_id,
        vocab_size=len(tokenizer),
    )
    records = []
    for i, (item, outs) in enumerate(zip(items, completions)):
        prompt_text = tokenizer.decode(list(item.prompt_ids))
        for k, ids in enumerate(outs):
            records.append(
                SampleRecord(
                    round=r,
                    prompt=i,
                    sample=k,
                    row=item.row,
                    prompt_text=prompt_text,
                    completion_text=tokenizer.decode(list(ids), skip_special_tokens=True),
                    prompt_ids=tuple(item.prompt_ids),
                    completion_ids=tuple(int(t) for t in ids),
                )
            )
    return records


def _score(cfg, reader, samples: list[SampleRecord], forms: list, label: str) -> list[float]:
    """The scores of ``samples`` (their prompts' forms: ``forms``): the judge's, or the reward
    model's, read with ``reader`` (``adapters.reward_reader``; None with a judge)."""
    o = cfg.online
    if o.judge:
        return adapters.judge_scores(
            o.judge, [s.prompt_text for s in samples], [s.completion_text for s in samples]
        )
    encoded = adapters.reward_model_sequences(reader, forms, samples, label)
    use_layout(o.reward_model.parallel)
    chunks = adapters.build_reward_model(cfg, o.reward_model.path)
    scores = adapters.score_with_reward_model(
        chunks,
        encoded.sequences,
        encoded.starts,
        micro_batch_size=o.reward_model.micro_batch_size,
        pad_id=reader.pad_id,
    )
    del chunks
    free_models()
    return [float(x) for x in scores]


def _pairs(
    cfg,
    samples: list[SampleRecord],
    scores: list[float],
    r: int,
    seed: int,
    items: list,
    policy,
    stop_ids: list[int],
) -> tuple[list[PairRecord], RoundSummary]:
    """The round's pairs and its summary as the pairs phase writes it (``policy``: the one the
    round started from; ``stop_ids``: the ids a completion ends with, for
    ``online.missing_eos_penalty``)."""
    candidates = [s.pair_candidate() for s in samples]
    ranked, without_eos = penalize_missing_eos(
        candidates, scores, stop_ids, cfg.online.missing_eos_penalty
    )
    pairs, counts = build_pairs(candidates, ranked, cfg.online.min_margin)
    by_key = {(s.prompt, s.sample): s for s in samples}
    records = []
    for p in pairs:
        chosen, rejected = (
            by_key[(p.prompt, p.chosen_sample)],
            by_key[(p.prompt, p.rejected_sample)],
        )
        records.append(
            PairRecord(
                round=r,
                prompt=p.prompt,
                row=chosen.row,
                chosen_sample=p.chosen_sample,
                rejected_sample=p.rejected_sample,
                chosen_score=p.chosen_score,
                rejected_score=p.rejected_score,
                prompt_text=chosen.prompt_text,
                chosen_text=chosen.completion_text,
                rejected_text=rejected.completion_text,
                prompt_ids=chosen.prompt_ids,
                chosen_ids=chosen.completion_ids,
                rejected_ids=rejected.completion_ids,
            )
        )
    summary = RoundSummary(
        round=r,
        prompts=counts.prompts,
        samples=counts.samples,
        pairs_kept=counts.pairs,
        ties_dropped=counts.ties,
        near_ties_dropped=counts.near_ties,
        empty_samples=counts.empty,
        prompts_with_too_few_samples=counts.too_few,
        samples_without_eos=without_eos,
        mean_score=sum(scores) / len(scores) if scores else None,
        mean_chosen_score=sum(p.chosen_score for p in pairs) / len(pairs) if pairs else None,
        mean_rejected_score=sum(p.rejected_score for p in pairs) / len(pairs) if pairs else None,
        sampling_seed=seed,
        prompt_rows=tuple(it.row for it in items),
        policy_start=policy,
        reference=cfg.online.reference,
    )
    return records, summary


def _completion_logps(cfg, chunks, samples: list[SampleRecord], pad_id: int) -> list[float]:
    return adapters.completion_logps(
        chunks,
        [s.sequence for s in samples],
        [len(s.prompt_ids) for s in samples],
        micro_batch_size=cfg.online.sampling.micro_batch_size,
        pad_id=pad_id,
    )


def _evaluate(
    cfg, model_cfg, tokenizer, pad_id, reader, held: list, policy: str, initial: str, path: str
) -> list[EvalSample]:
    """Sample the held-out prompts from ``policy``; unless it is the ``initial`` policy, read
    the log-probability of each sample under both (``logp``, ``logp_initial``: the KL's
    terms, ``online.evaluation``); score them; write ``path`` (the samples with their values)
    and return its rows (collective)."""
    seed = cfg.online.sampling.seed + EVAL_SEED_OFFSET
    chunks = _policy_chunks(cfg, model_cfg, policy)
    samples = _sample_with(chunks, cfg, tokenizer, pad_id, held, "eval", seed)
    logps = logps_initial = [None] * len(samples)
    if policy != initial:
        logps = _completion_logps(cfg, chunks, samples, pad_id)
        del chunks
        free_models()
        chunks = _policy_chunks(cfg, model_cfg, initial)
        logps_initial = _completion_logps(cfg, chunks, samples, pad_id)
    del chunks
    free_models()
    scores = _score(cfg, reader, samples, [held[s.prompt].prompt for s in samples], path)
    rows = [
        EvalSample.of(s, v, logp=a, logp_initial=b)
        for s, a, b, v in zip(samples, logps, logps_initial, scores)
    ]
    if ranks.is_rank0():
        write_records(path, rows)
    return rows


def _train(
    cfg, round_dir: str, policy: str, reference: str, tokenizer, pad_id, pairs: list[PairRecord]
):
    from dpo_megatron.training.trainer import Trainer

    use_layout(cfg.parallel)
    trainer = Trainer(
        _round_config(cfg, round_dir, policy),
        data=RunData([p.preference_pair() for p in pairs], [], pad_id, tokenizer),
        reference_weights=reference,
    )
    trainer.train()
    del trainer
    free_models()
    return RunLayout(round_dir).checkpoints


# ----------------------------------------------------------------------------------------------
# the run


def _prompts(cfg, tokenizer) -> tuple[list[PromptItem], int]:
    """Every rank's prompt list (rank 0 reads and tokenizes; a failure reaches every rank)."""
    out, error = None, None
    if ranks.is_rank0():
        try:
            o = cfg.online
            rows = read_prompts(o.prompts, o.prompts_offset, o.prompts_limit, cfg.data)
            out = encode_prompts(
                rows, tokenizer, cfg.data.chat_template, cfg.data.max_prompt_length
            )
            if not out[0]:
                raise ValueError(
                    f"online.prompts={o.prompts}: no prompt of {len(rows)} fits "
                    f"data.max_prompt_length={cfg.data.max_prompt_length}"
                )
        except ValueError as e:  # DataError is a ValueError
            error = str(e)
    out, error = ranks.broadcast_from_rank0((out, error))
    if error:
        from dpo_megatron.data.sources import DataError

        raise DataError(error)
    return out


@dataclass
class _OnlineRun:
    """What every phase of one online run reads, built once by :func:`run_online`; one method per
    phase, each skipping a phase ``state`` records as finished and returning its result."""

    cfg: Any
    model_cfg: Any
    tokenizer: Any
    pad_id: int
    state: OnlineState
    layout: RunLayout
    initial: str
    """The starting policy (``model.load`` or ``model.hf_path``)."""
    held: list
    """The held-out prompts (``online.eval_prompts``)."""
    reader: adapters.RewardReader | None
    """How the reward model reads samples (None: a judge scores)."""
    stop_after: tuple[int, str] | None = None

    def finished(self, r: int, phase: str, **values) -> None:
        """Record the phase (after its files); raise :class:`StopAfter` where a test stops."""
        self.state.mark(r, phase, **values)
        if self.stop_after == (r, phase):
            raise StopAfter(f"stopped after round {r} phase {phase}")

    def held_out(self, policy: str, path: str) -> tuple[list[EvalSample], float]:
        """The held-out evaluation of ``policy`` (``_evaluate``, rows written to ``path``):
        its rows and mean score."""
        rows = _evaluate(
            self.cfg,
            self.model_cfg,
            self.tokenizer,
            self.pad_id,
            self.reader,
            self.held,
            policy,
            self.initial,
            path,
        )
        return rows, sum(x.score for x in rows) / len(rows)

    def evaluate_start(self, policy: str) -> None:
        """The starting policy's held-out evaluation, once (round -1)."""
        if self.held and not self.state.done(-1, "eval"):
            t0 = time.time()
            _, mean = self.held_out(policy, self.layout.online_eval_start)
            self.state.mark(-1, "eval", eval_mean_score=mean, eval_s=time.time() - t0)

    def round(self, r: int, items: list[PromptItem], policy: str) -> tuple[str, RoundSummary]:
        """Round ``r``'s unfinished phases on ``items`` from ``policy``; returns the policy after
        the round and its summary (every rank)."""
        seed = self.cfg.online.sampling.seed + r
        samples = self.sample(r, items, policy, seed)
        scores = self.score(r, samples, items)
        pairs = self.pair(r, samples, scores, items, seed, policy)
        self.train(r, policy, pairs)
        policy = self.state.policy_after(r) or policy
        self.evaluate(r, policy)
        summary = self.summary(r) if ranks.is_rank0() else None
        return policy, ranks.broadcast_from_rank0(summary)

    def summary(self, r: int) -> RoundSummary:
        """Round ``r``'s ``summary.json`` (rank 0)."""
        return read_record(self.layout.round_summary(r), RoundSummary)

    def sample(self, r, items, policy, seed) -> list[SampleRecord]:
        path = self.layout.round_samples(r)
        if not self.state.done(r, "sample"):
            t0 = time.time()
            records = _sample(
                self.cfg, self.model_cfg, self.tokenizer, self.pad_id, items, policy, r, seed
            )
            if ranks.is_rank0():
                write_records(path, records)
            self.finished(r, "sample", sample_s=time.time() - t0)
        return read_records(path, SampleRecord)

    def score(self, r, samples: list[SampleRecord], items: list[PromptItem]) -> list[float]:
        path = self.layout.round_scores(r)
        if not self.state.done(r, "score"):
            t0 = time.time()
            forms = [items[s.prompt].prompt for s in samples]
            samples_path = self.layout.round_samples(r)
            scores = _score(self.cfg, self.reader, samples, forms, samples_path)
            if ranks.is_rank0():
                write_records(
                    path, [ScoreRecord(s.prompt, s.sample, v) for s, v in zip(samples, scores)]
                )
            self.finished(r, "score", score_s=time.time() - t0)
        return [float(x.score) for x in read_records(path, ScoreRecord)]

    def pair(self, r, samples, scores, items, seed, policy) -> list[PairRecord]:
        path = self.layout.round_pairs(r)
        if not self.state.done(r, "pairs"):
            stop = _stop_ids(self.tokenizer, self.pad_id)
            records, summary = _pairs(self.cfg, samples, scores, r, seed, items, policy, stop)
            if ranks.is_rank0():
                write_records(path, records)
                write_record(self.layout.round_summary(r), summary)
            self.finished(r, "pairs")
        return read_records(path, PairRecord)

    def train(self, r, policy: str, pairs: list[PairRecord]) -> None:
        """DPO on the round's pairs (fewer than one global batch: the policy stays); the summary
        gets the last training metrics, the policy after the round and the phases' wall
        times."""
        if self.state.done(r, "train"):
            return
        t0 = time.time()
        folder = self.layout.online_round(r)
        initial = self.initial
        reference = initial if self.cfg.online.reference == "initial" and policy != initial else ""
        end = None
        # Fewer pairs than one global batch cannot make a step: the policy stays this round.
        if len(pairs) >= self.cfg.train.global_batch_size:
            end = _train(self.cfg, folder, policy, reference, self.tokenizer, self.pad_id, pairs)
        elif ranks.is_rank0():
            print(
                f"online: round {r}: {len(pairs)} pair(s), fewer than train.global_batch_size="
                f"{self.cfg.train.global_batch_size}: the policy does not train this round",
                flush=True,
            )
        if ranks.is_rank0():
            entry = self.state.round(r)
            summary = dataclasses.replace(
                self.summary(r),
                train=last_record(RunLayout(folder).metrics, "train") if end else {},
                policy_end=end or policy,
                wall_s=PhaseTimes(entry.sample_s, entry.score_s, time.time() - t0),
            )
            write_record(self.layout.round_summary(r), summary)
            print(
                f"online: round {r}: {summary.pairs_kept} pairs of {summary.prompts} prompts "
                f"({summary.ties_dropped} ties, {summary.near_ties_dropped} near-ties dropped; "
                f"{summary.samples_without_eos} of {summary.samples} samples cut at "
                f"max_new_tokens), mean score {summary.mean_score:.4f} -> {folder}",
                flush=True,
            )
        self.finished(r, "train", policy=end or policy)

    def evaluate(self, r, policy: str) -> None:
        """The held-out evaluation after round ``r``: its mean score beside the one before the
        round, the change since the start and the KL from the starting policy with their
        intervals (``summary.json``'s ``eval``)."""
        if not self.held or self.state.done(r, "eval"):
            return
        t0 = time.time()
        rows, mean = self.held_out(policy, self.layout.round_eval(r))
        if ranks.is_rank0():
            entry = evaluation_entry(
                rows,
                read_records(self.layout.online_eval_start, EvalSample),
                round_index=r,
                seed=self.cfg.online.seed,
            )
            summary = self.summary(r)
            # round -1: the evaluation before round 0
            before = self.state.round(r - 1).eval_mean_score
            wall_s = summary.wall_s or PhaseTimes(None, None, None)
            summary = dataclasses.replace(
                summary,
                wall_s=dataclasses.replace(wall_s, eval=time.time() - t0),
                eval_prompts=len(self.held),
                eval_mean_score_before=before,
                eval_mean_score=mean,
                eval=entry,
            )
            write_record(self.layout.round_summary(r), summary)
            change, kl = entry.score_change, entry.kl_from_initial
            print(
                f"online: round {r}: mean score of the policy's samples on {len(self.held)} "
                f"held-out prompts {before:.4f} -> {mean:.4f}; since the start "
                f"{change.mean:+.4f} [{change.low:+.4f}, {change.high:+.4f}], "
                f"KL from the start {kl.mean:.3f} nats",
                flush=True,
            )
        self.finished(r, "eval", eval_mean_score=mean)

    def report(self, policy: str, summaries: list[RoundSummary]) -> None:
        """The closing summary (rank 0): ``online/summary.json``, the evaluation plot, the
        table of held-out scores and the line naming the final policy."""
        if not ranks.is_rank0():
            return
        final = run_models.resolve_model_load(policy)  # a checkpoints folder: its latest
        entries, plot = [], None
        if self.held:
            start_rows = read_records(self.layout.online_eval_start, EvalSample)
            start = evaluation_entry(
                start_rows, start_rows, round_index=-1, seed=self.cfg.online.seed
            )
            entries = [start] + [s.eval for s in summaries if s.eval is not None]
            plot = self.layout.online_plot
            plot_evaluation(entries, plot, self.scorer)
        write_record(
            self.layout.online_summary,
            run_summary(
                entries,
                summaries,
                scorer=self.scorer,
                final_policy=final,
                plot=plot,
                start_eval_s=self.state.round(-1).eval_s,
            ),
        )
        for line in summary_lines(entries, self.scorer):
            print(line, flush=True)
        print(final_policy_line(final, self.layout.online_summary, plot), flush=True)

    @property
    def scorer(self) -> str:
        o = self.cfg.online
        return o.judge or o.reward_model.path


def run_online(cfg, *, stop_after: tuple[int, str] | None = None) -> list[RoundSummary]:
    """Run (or continue, ``checkpoint.resume=auto``) the configured online rounds
    (collective: every rank calls it). Returns each round's summary.

    Args:
        stop_after: (round, phase): raise :class:`StopAfter` once that phase is finished and
            recorded, as a run killed there would stop (tests).

    Raises:
        ValueError: the config does not fit an online run (``checks.validate_online``), a judge
            fails.
        DataError: the prompts cannot be read.
        RunDirError: the run folder is in use or holds another run.
    """
    from dpo_megatron.data import load_tokenizer
    from dpo_megatron.parallel.shutdown import die_with_launcher

    die_with_launcher()
    cfg = freeze(cfg)  # each round's training config is a replaced copy of it
    use_layout(cfg.parallel)  # starts the world the first time
    validate_online(cfg, ranks.world_size())
    folder = RunFolder.open(cfg)
    try:
        folder.record_config(cfg)
        model_cfg = run_models.resolve_model_config(cfg)
        tokenizer = load_tokenizer(cfg.data.tokenizer or model_cfg.hf_path)
        run_models.check_vocab_fits(tokenizer, model_cfg)
        pad_id = tokenizer.pad_token_id
        pad_id = tokenizer.eos_token_id if pad_id is None else pad_id
        all_prompts, too_long = _prompts(cfg, tokenizer)
        o = cfg.online
        reader = None if o.judge else adapters.reward_reader(cfg, tokenizer)
        if reader:
            adapters.check_reward_reader(reader, [it.prompt for it in all_prompts])
        if ranks.is_rank0():
            print(
                f"online: {o.rounds} round(s) x {o.prompts_per_round} prompts x "
                f"{o.samples_per_prompt} samples from {len(all_prompts)} prompts"
                + (f" ({too_long} longer than data.max_prompt_length left out)" if too_long else "")
                + f" | scorer: {o.judge or o.reward_model.path}"
                + (f" (its tokenizer: {reader.source})" if reader and reader.source else "")
                + f" | reference: {o.reference}"
                + _sampling_note(cfg),
                flush=True,
            )
            warning = left_out_warning(
                too_long, len(all_prompts) + too_long, cfg.data.max_prompt_length
            )
            if warning:
                print(warning, flush=True)
            if o.eval_prompts and (o.sampling.temperature != 1 or o.sampling.top_p != 1):
                print(
                    f"note: online.sampling.temperature={o.sampling.temperature}, top_p="
                    f"{o.sampling.top_p}: the evaluation's KL is the mean log-ratio on samples "
                    "that do not come from the policy itself, not an unbiased KL (1 and 1 make "
                    "it one)",
                    flush=True,
                )
        pool, held = split_prompts(all_prompts, o.eval_prompts, o.shuffle_prompts, o.seed)
        run = _OnlineRun(
            cfg,
            model_cfg,
            tokenizer,
            pad_id,
            OnlineState(folder.layout.online_state),
            folder.layout,
            initial=cfg.model.load or model_cfg.hf_path,
            held=held,
            reader=reader,
            stop_after=stop_after,
        )
        policy = run.initial
        run.evaluate_start(policy)
        summaries = []
        for r in range(o.rounds):
            items = round_prompts(pool, r, o.prompts_per_round, False, o.seed)
            policy, summary = run.round(r, items, policy)
            summaries.append(summary)
        run.report(policy, summaries)
        return summaries
    finally:
        folder.close()
