"""Choosing the next token from full-vocabulary logits: greedy, temperature, top-p, with a
random stream per completion that no layout or batching changes.

Every completion (prompt i, sample j) draws its randomness from its own generator, seeded from
``(seed, i, j)`` (:func:`completion_generator`), one uniform number per generated token, on the
host, after the logits are reduced over the tensor-parallel group. Which rank, micro-batch or
row computes a completion therefore changes no draw: a completion's tokens depend on its
logits and its own stream only.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How completions are sampled (:func:`dpo_megatron.generation.generate`).

    Attributes:
        temperature: logits are divided by it before the softmax; 0 is greedy (the argmax,
            ties to the lowest id). >= 0.
        top_p: nucleus sampling: only the most likely tokens whose probabilities, taken in
            decreasing order, reach ``top_p`` (the token that crosses it included) are kept and
            renormalised (Holtzman et al. 2020); 1 keeps all. In (0, 1].
        max_new_tokens: most tokens generated per completion (the stop token counted). >= 1.
        seed: seeds every completion's stream with the prompt and sample indices.
        stop_ids: a generated id in this set ends its completion (and is kept in it).

    Raises:
        ValueError: a value out of its range (the message names the field).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int
    seed: int = 0
    stop_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0: greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if int(self.max_new_tokens) != self.max_new_tokens or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens}")
        object.__setattr__(self, "stop_ids", tuple(int(i) for i in self.stop_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def completion_generator(seed: int, prompt_index: int, sample_index: int) -> torch.Generator:
    """The host generator of completion (prompt ``prompt_index``, sample ``sample_index``):
    seeded from a hash of the three integers, so neighbouring seeds give unrelated streams."""
    digest = hashlib.blake2b(f"{seed}:{prompt_index}:{sample_index}".encode(), digest_size=8)
    generator = torch.Generator(device="cpu")
    generator.manual_seed(int.from_bytes(digest.digest(), "little") & (2**63 - 1))
    return generator


def nucleus_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The distribution sampled from: softmax(logits / temperature) restricted to the top-p
    nucleus and renormalised, in float64.

    Args:
        logits: [R, V] (any float dtype; -inf for ids never chosen).
        temperature: > 0.
        top_p: in (0, 1]: a token is kept iff the probability of the tokens before it, in
            decreasing order (ties: lower id first), is below ``top_p``; the most likely token
            is always kept.

    Returns:
        [R, V] float64 probabilities, each row summing to 1.
    """
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    if top_p >= 1:
        return probs
    nucleus = torch.zeros_like(probs)
    for r in range(probs.shape[0]):
        ordered, order = _descending_head(probs[r], top_p)
        before = torch.cumsum(ordered, dim=-1) - ordered
        kept = torch.where(before < top_p, ordered, torch.zeros_like(ordered))
        nucleus[r].scatter_(-1, order, kept)
    return nucleus / nucleus.sum(dim=-1, keepdim=True)


HEAD = 256
"""Most likely tokens :func:`_descending_head` orders first (a nucleus of top-p 0.95 over a
49k vocabulary is usually far smaller)."""


def _descending_head(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The first tokens of ``probs`` [V] in decreasing order (ties: lower id first), enough of
    them to hold the whole top-p nucleus, with their ids: the head of the stable full sort,
    value for value (so its cumulative sums are the full sort's too). A full sort of V float64
    took 5 ms a row; the head comes from ``topk`` of 256, 1024, ... tokens, taken when the
    nucleus ends before the smallest of them, so no token outside can tie with one inside."""
    k = HEAD
    while k < probs.shape[0]:
        values, ids = torch.topk(probs, k)
        ids, by_id = torch.sort(ids)  # ascending ids, then a stable sort by value: ties by id
        ordered, position = torch.sort(values[by_id], descending=True, stable=True)
        order = ids[position]
        mass = torch.cumsum(ordered, dim=-1)
        inside = int((mass - ordered < top_p).sum())
        if inside < k and ordered[inside - 1] > ordered[-1]:
            return ordered, order
        k *= 4
    return torch.sort(probs, dim=-1, descending=True, stable=True)


def choose_tokens(
    logits: torch.Tensor, params: SamplingParams, generators: list[torch.Generator]
) -> list[int]:
    """The next token of each row.

    Args:
        logits: [R, V] full-vocabulary logits of each row's last position (host).
        params: greedy when ``params.temperature`` is 0, else sampled from
            :func:`nucleus_probs`.
        generators: one per row (:func:`completion_generator`); each sampled row draws one
            uniform number u from its own and takes the first id whose cumulative probability
            exceeds u (inverse transform; ids in vocabulary order). Unused when greedy.

    Returns:
        R token ids.
    """
    if logits.shape[0] == 0:
        return []
    if params.greedy:
        return logits.float().argmax(dim=-1).tolist()
    probs = nucleus_probs(logits, params.temperature, params.top_p)
    uniforms = torch.cat(
        [torch.rand(1, generator=g, dtype=torch.float64) for g in generators]
    ).unsqueeze(-1)
    cumulative = torch.cumsum(probs, dim=-1)
    picked = torch.searchsorted(cumulative, uniforms * cumulative[:, -1:], right=True)
    # u * total can equal the total in floating point: the last id with mass, not past the end.
    last = (probs > 0).cumsum(dim=-1).argmax(dim=-1, keepdim=True)
    return torch.minimum(picked, last).squeeze(-1).tolist()
