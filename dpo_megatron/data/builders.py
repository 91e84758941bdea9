"""The batch builder of a run: the item kind's padded builder, packed or shared-prompt pairs, cut
per context-parallel rank. Above ``batch``, ``collate``, ``packing`` and ``context_split`` (which
import ``batch`` only), so that the builders' module graph has no circle."""

from __future__ import annotations

from dpo_megatron.data import collate
from dpo_megatron.data.batch import BatchBuilder
from dpo_megatron.data.context_split import ContextParallelSplit
from dpo_megatron.data.kinds import PAIRS_KIND, ItemKind
from dpo_megatron.data.packing import PackedPairs, SharedPromptPairs


def make_batch_builder(
    packing=None,
    *,
    pad_token_id: int,
    multiple: int,
    kind: ItemKind = PAIRS_KIND,
    context_parallel: tuple[int, int] = (0, 1),
) -> BatchBuilder:
    """The builder for a run: the ``kind``'s padded builder (SFT examples: chosen only; pairs
    and unpaired examples: two rows per item), shared-prompt pairs (``packing.share_prompt``)
    or packed pairs (``packing.enabled``); ``packing``: the ``packing`` config section (None:
    padded rows). Rows are padded with ``pad_token_id`` to a multiple of ``multiple`` tokens.
    With ``context_parallel`` = (CP rank, CP size),
    size > 1: packed units are padded to a multiple of 2 x CP and every micro-batch is cut for
    that rank (``data.context_split``); ``multiple`` must then be a multiple of 2 x CP.

    Raises:
        ValueError: packing asked for SFT examples (packing packs preference pairs), or
            ``packing.share_prompt`` without ``packing.enabled``.
    """
    packed = packing is not None and packing.enabled
    if packing is not None:
        packing.validate()
    kind.check_packing(packing)
    if packed:
        pack = SharedPromptPairs if packing.share_prompt else PackedPairs
        builder = pack(
            pad_token_id,
            multiple,
            packing,
            unit_multiple=2 * context_parallel[1] if context_parallel[1] > 1 else 1,
            kind=kind.name,
        )
    else:
        builder = getattr(collate, kind.builder)(pad_token_id, multiple, kind.name)
    rank, size = context_parallel
    return ContextParallelSplit(builder, rank, size) if size > 1 else builder
