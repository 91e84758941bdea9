"""A micro-batch's prompts as one packed row with their common prefixes computed once.

Rows of one generation micro-batch often begin alike: every sample of a prompt
(``num_samples`` > 1; the online loop's ``samples_per_prompt``) is the same prompt, and prompts
rendered with a chat template share its system turn. The prefill computes each distinct prefix
once (the idea of vLLM's prefix caching and SGLang's RadixAttention, here within one micro-batch:
nothing is shared across micro-batches or calls): the prompts form a tree whose nodes are runs
of tokens that the same rows share, laid out one node after another in depth-first order, each
node one attention span whose keys are its ancestors' tokens then its own
(``data.batch.AttentionSpan``, the rule a shared-prompt DPO pair already uses). Every row's cache
slots are then filled from the packed tokens on its path (``KVCache.append_packed``'s
``token_index``). Under sequence parallelism the engine prefills the left-padded rows instead.

What is computed once is a shared token's projections and MLP, most of a prefill. Attention on
the rows route (``data.batch.span_rows``: the CPU, CUDA in fp32) still runs each node's span over
its whole path, its ancestors' slots as filler queries whose outputs nothing reads, as a
shared-prompt DPO pair's rejected row does; varlen flash-attention (CUDA in fp16 / bf16)
computes only a node's own queries.

Example: prompts [1, 2, 3], [1, 2, 4, 5] and [1, 2, 3] -> nodes [1, 2] (rows 0, 1, 2), [3]
(rows 0, 2), [4, 5] (row 1); packed tokens [1, 2, 3, 4, 5] at positions [0, 1, 2, 2, 3];
spans [0, 2) on keys [0, 2), [2, 3) on [0, 2) ++ [2, 3), [3, 5) on [0, 2) ++ [3, 5); token index
(row after row) [0, 1, 2, 0, 1, 3, 4, 0, 1, 2]; each row's last token at [2, 4, 2].

The packed forward differs from one computing every row in full only in fp32 rounding: a shared
token's keys and values are the same for each row, but the matmuls run over other token counts
and a branch's queries meet their ancestors' keys in another attention call. So which rows share
a micro-batch can move a logit in its last bits (about 5e-5 of SmolLM2-135M's; a decode step's
batch already did), and so change a token sampled at a near tie.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from dpo_megatron.data.batch import AttentionSpan


class PrefixNode(NamedTuple):
    """Tokens ``start .. end - 1`` (depths in each prompt) shared by ``rows``; ``parent`` the
    index of the node before ``start`` (None at a root); ``offset`` its first packed position."""

    start: int
    end: int
    rows: tuple[int, ...]
    parent: int | None
    offset: int


class PackedPrompts(NamedTuple):
    """The prefill of a micro-batch's prompts with their common prefixes once.

    Attributes:
        tokens: [T] int64 packed token ids, node after node (T: distinct prefix tokens).
        positions: [T] int64, each token's position in its prompts (its depth).
        spans: one causal span per node, keys its ancestors' tokens then its own.
        unit_ids: [T] int32, the tree (prompts with a common first token) each token belongs to.
        token_index: [N] int64, for each real (row, depth), row after row, its packed position.
        last: [R] int64, each row's last prompt token's packed position (an idle row's 0).
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    spans: list[AttentionSpan]
    unit_ids: torch.Tensor
    token_index: torch.Tensor
    last: torch.Tensor


def prefix_tree(prompts: Sequence[Sequence[int] | None]) -> list[PrefixNode]:
    """The prompts' tree of shared runs (module docstring), nodes in depth-first order.

    Args:
        prompts: each row's token ids; None or empty: an idle row (in no node).

    Returns:
        The nodes: a node ends where its rows branch or one of them ends, so each row's path
        covers its prompt exactly once.
    """
    nodes: list[PrefixNode] = []

    def children(rows: list[int], depth: int, parent: int | None) -> list[tuple]:
        """The (rows, depth, parent) of each node starting at ``depth``, last first (a stack's
        order: an explicit stack, as a chain of nested prompts can outgrow Python's recursion)."""
        by_token: dict[int, list[int]] = {}
        for r in rows:
            if len(prompts[r]) > depth:
                by_token.setdefault(prompts[r][depth], []).append(r)
        return [(group, depth, parent) for group in reversed(by_token.values())]

    stack = children([r for r, p in enumerate(prompts) if p], 0, None)
    while stack:
        group, depth, parent = stack.pop()
        end = depth + 1
        while all(len(prompts[r]) > end for r in group) and (
            len({prompts[r][end] for r in group}) == 1
        ):
            end += 1
        offset = nodes[-1].offset + nodes[-1].end - nodes[-1].start if nodes else 0
        nodes.append(PrefixNode(depth, end, tuple(group), parent, offset))
        stack += children(group, end, len(nodes) - 1)
    return nodes


def pack_prompts(prompts: Sequence[Sequence[int] | None]) -> PackedPrompts:
    """The packed prefill of ``prompts`` (module docstring; idle rows: None or empty).

    Raises:
        ValueError: every row idle (nothing to pack).
    """
    nodes = prefix_tree(prompts)
    if not nodes:
        raise ValueError("pack_prompts needs at least one non-empty prompt")
    tokens, positions, unit_ids, spans = [], [], [], []
    unit_of: list[int] = []  # per node: its tree's number
    roots = 0
    for i, node in enumerate(nodes):
        first = node.rows[0]
        tokens += prompts[first][node.start : node.end]
        positions += range(node.start, node.end)
        unit_of.append(roots if node.parent is None else unit_of[node.parent])
        roots += node.parent is None
        unit_ids += [unit_of[i]] * (node.end - node.start)
        keys, up = [], node.parent
        while up is not None:
            keys.append((nodes[up].offset, nodes[up].offset + nodes[up].end - nodes[up].start))
            up = nodes[up].parent
        own = (node.offset, node.offset + node.end - node.start)
        spans.append(AttentionSpan(own[0], own[1], (*reversed(keys), own)))
    # each row's packed position at each depth: the nodes on its path, in depth order
    where: list[list[int]] = [[] for _ in prompts]
    for node in nodes:
        for r in node.rows:
            where[r] += range(node.offset, node.offset + node.end - node.start)
    last = [w[-1] if w else 0 for w in where]
    return PackedPrompts(
        torch.tensor(tokens, dtype=torch.int64),
        torch.tensor(positions, dtype=torch.int64),
        spans,
        torch.tensor(unit_ids, dtype=torch.int32),
        torch.tensor([t for w in where for t in w], dtype=torch.int64),
        torch.tensor(last, dtype=torch.int64),
    )
