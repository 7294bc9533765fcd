"""The construction handshake of a whole world, computed in one process (the scale benchmark and
the tests).

:func:`simulate` runs the same decoding steps as :func:`gradwatch.reduce.handshake.exchange` on
every rank's description and record, with no collective; :func:`bytes_per_rank` counts what one
rank sends and receives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gradwatch.reduce.handshake import (
    AGREE_WORDS,
    HOST_BYTES,
    PHASE0_BYTES,
    RECORD_BYTES,
    Description,
    Gathered,
    RankRecord,
    agreed,
    agreed_records,
    agreement_words,
    coordinate_table,
    digest,
    group_records,
    phase2_layout,
    split_descriptions,
)


def simulate(per_rank: Sequence[tuple[Description, RankRecord]],
             meshes: Sequence[Any] | None = None) -> Gathered:
    """What :func:`exchange` returns on every rank, computed in one process from every rank's
    description and record (the same decoding steps, no
    collective). ``meshes``: the mesh slots every rank holds (one shared list: ranks of one
    structure hold copies of the same meshes, whose grids are equal); None: no rank can derive
    the coordinate table (the records path). Equal descriptions may be shared objects: each
    distinct one is encoded once."""
    world = len(per_rank)
    table = coordinate_table(meshes, world) if meshes is not None else None
    shared = digest(table.numpy().tobytes()) if table is not None else None
    top = [-(2**62)] * AGREE_WORDS
    low = [2**62] * AGREE_WORDS
    for r, (desc, record) in enumerate(per_rank):
        words = agreement_words(record, desc.stage, table, r, shared)
        top = [max(a, b) for a, b in zip(top, words, strict=True)]
        low = [min(a, b) for a, b in zip(low, words, strict=True)]
    if agreed([*top, *(-x for x in low)]) and table is not None:
        desc, record = per_rank[0]
        hosts = [rec.host for _d, rec in per_rank] if desc.rank_view else None
        return Gathered((desc,), (0,) * world, agreed_records(record, table, hosts), True)
    raw = b"".join(record.pack() for _desc, record in per_rank)
    records, digests, rank_group = group_records(raw, world)
    if len(digests) == 1:
        return Gathered((per_rank[0][0],), rank_group, records)
    spans = phase2_layout(records, digests, rank_group)
    buffer = b"".join(per_rank[writer][0].encode() for _offset, _length, writer in spans)
    return Gathered(split_descriptions(buffer, digests, spans), rank_group, records)


def bytes_per_rank(gathered: Gathered) -> tuple[int, int]:
    """(sent, received) bytes of one rank's handshake collectives, as the tensors passed to
    them (an all-reduced buffer counts as sent and as received): phase 0's vote; on the agreed
    path the host names when the per-rank view is on (one all-gather: ``HOST_BYTES`` sent,
    ``W x HOST_BYTES`` received); otherwise the records' all-gather and, when the descriptions
    differ, the phase-2 buffer."""
    world = len(gathered.rank_group)
    if gathered.agreed:
        hosts = gathered.descriptions[0].rank_view > 0
        return PHASE0_BYTES + HOST_BYTES * hosts, PHASE0_BYTES + world * HOST_BYTES * hosts
    phase2 = 0
    if len(gathered.descriptions) > 1:
        leaders = {}
        for r, g in enumerate(gathered.rank_group):
            leaders.setdefault(g, r)
        phase2 = sum(gathered.records[r].length for r in leaders.values())
    return (PHASE0_BYTES + RECORD_BYTES + phase2,
            PHASE0_BYTES + world * RECORD_BYTES + phase2)


