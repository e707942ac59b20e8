"""A graph's partition, kept on disk: what each claimer claimed and declined, so that a warm compile of the same
graph replays it instead of exploring again.

A claimer explores: the weight-streaming claimer grows and lowers two or three cuts around every matmul before
one streams, the seeded search passes lower a hundred cuts a graph to find the few a library seed fits, the
stitch claimer grows every fusion group. In a warm process every answer they get is already on disk (the
verifier's verdicts, the searches), but the exploration itself is redone: 0.4-0.6 s of the partition stage of
each of an HF llama's graphs on the 2-core CPU, 1.0 s on the H200's host (12-03). A :class:`PartitionRecord`
keeps, per claimer, its outcomes in order — a decline as its nodes (graph positions), reason and detail; a claim
as its nodes and the claimer's ``Claim.hint`` — under a key made of the graph as the claimers read it (its text:
every node's op, ATen overload, arguments and wiring, every value's meta), the claimers and their settings, the
configuration's output fields, the device model and a digest of the claimers' code.

Replaying, a claimer that can plan a given cut (``replan(graph, nodes, hint, free, ctx)``) plans exactly its
recorded claims — lowered, seeded and verified as in the first compile, from the same caches — and its declines
are restored as recorded; a claimer without ``replan`` runs as usual. Every replayed claimer's outcomes must
take the recorded nodes, or the record is dropped and the graph partitioned afresh (and recorded again): a
record only ever saves work, a claim is never taken from it without its plan being made anew.
"""
from __future__ import annotations

import hashlib
import logging
from typing import Any, Sequence

from ..cache import cache_key, source_digest
from ..capture.ir import Graph, Node
from ..context import CompileContext
from ..report import Reason
from .region import Claim, Claimer, Decline, Outcome

log = logging.getLogger("torch_mirage")
# where each graph's record key comes from, part by part (DEBUG): two processes' lines show which part differs
# where a warm compile finds no record
key_log = logging.getLogger("torch_mirage.partition.record")

__all__ = ["PartitionRecord"]

# the code whose answers a record holds: the claimers, the lowering and the verifier they call, the IR
CODE = ("superopt", "analysis", "capture", "partition", "ugraph.py", "numerics.py", "pipeline.py")


class PartitionRecord:
    """One graph's partition outcomes per claimer: looked up (:meth:`load`), replayed (:meth:`replay`) and kept
    (:meth:`save`) in the compile's disk cache; inert (no key) without one, or where a claimer's settings have no
    stable description."""

    def __init__(self, graph: Graph, claimers: Sequence[Claimer], ctx: CompileContext):
        self.graph = graph
        self.ctx = ctx
        self.position = {id(n): i for i, n in enumerate(graph.nodes)}
        self.key = None
        if ctx.cache is not None and (parts := _key_parts(graph, claimers, ctx)) is not None:
            self.key = cache_key(**parts)
            if key_log.isEnabledFor(logging.DEBUG):
                key_log.debug("torch_mirage: partition record %s of a graph of %d nodes, from parts %s",
                              self.key[:16], len(graph.nodes),
                              {k: hashlib.sha256(repr(v).encode()).hexdigest()[:12] for k, v in parts.items()})

    def load(self) -> list[list[dict]] | None:
        """The recorded outcomes, one list per claimer; None where none is kept (or it is not of this form)."""
        if self.key is None:
            return None
        entries = self.ctx.cache.get_json(self.key)
        if isinstance(entries, list):
            key_log.debug("torch_mirage: partition record %s found", self.key[:16])
        else:
            key_log.debug("torch_mirage: partition record %s not found; the graph:\n%s", self.key[:16], self.graph)
        return entries if isinstance(entries, list) else None

    def save(self, outcomes: Sequence[Sequence[Outcome]]) -> None:
        if self.key is None:
            return
        try:
            self.ctx.cache.put_json(self.key, [[self._entry(o) for o in per] for per in outcomes])
        except (TypeError, ValueError) as e:   # a hint that is not JSON: this graph is not recorded
            log.debug("torch_mirage: partition not recorded (%s)", e)

    def replay(self, claimer: Claimer, entries: list[dict], free: Sequence[Node]) -> list[Outcome] | None:
        """``claimer``'s outcomes from its recorded ``entries``, given the nodes still ``free``; None where they do
        not take the recorded nodes (the caller then partitions afresh; an INFO line says which claimer and why)."""
        nodes_of = self.graph.nodes
        try:
            if not all(isinstance(i, int) and 0 <= i < len(nodes_of) for e in entries for i in e["nodes"]):
                raise IndexError
            recorded = [[nodes_of[i] for i in e["nodes"]] for e in entries]
        except (IndexError, KeyError, TypeError):
            return _differs(claimer, "an entry names no node of this graph")
        replan = getattr(claimer, "replan", None)
        if replan is None:      # runs as usual; it must come to the same outcomes
            outcomes = list(claimer.claim(self.graph, free, self.ctx))
            if [_taking(self._entry(o)) for o in outcomes] != [_taking(e) for e in entries]:
                return _differs(claimer, "its outcomes differ from the recorded ones")
            return outcomes
        outcomes: list[Outcome] = []
        free = list(free)
        free_ids = {id(n) for n in free}
        for entry, nodes in zip(entries, recorded):
            if entry.get("kind") == "decline":
                try:
                    reason = Reason[entry["reason"]]
                except KeyError:
                    return _differs(claimer, f"no reason {entry.get('reason')!r}")
                outcomes.append(Decline(nodes, reason, entry.get("detail", ""), entry.get("claimer", "")))
                continue
            if not all(id(n) in free_ids for n in nodes):
                return _differs(claimer, f"{[n.name for n in nodes]} are no longer free")
            outcome = replan(self.graph, nodes, entry.get("hint"), free, self.ctx)
            if not isinstance(outcome, Claim) or [self.position.get(id(n)) for n in outcome.nodes] != entry["nodes"]:
                why = f": {outcome.reason.name}, {outcome.detail}" if isinstance(outcome, Decline) else ""
                return _differs(claimer, f"it did not claim {[n.name for n in nodes]} again{why}")
            outcomes.append(outcome)
            free_ids -= {id(n) for n in nodes}
            free = [n for n in free if id(n) in free_ids]
        return outcomes

    def _entry(self, outcome: Outcome) -> dict[str, Any]:
        nodes = [self.position[id(n)] for n in outcome.nodes]
        if isinstance(outcome, Claim):
            return {"kind": "claim", "nodes": nodes, "hint": outcome.hint}
        return {"kind": "decline", "nodes": nodes, "reason": outcome.reason.name, "detail": outcome.detail,
                "claimer": outcome.claimer}


def _taking(entry: dict) -> tuple:
    """What an entry takes or passes over: its kind and nodes (a claimer that runs as usual is held to these)."""
    return entry.get("kind"), entry.get("nodes")


def _differs(claimer: Claimer, why: str) -> None:
    log.info("torch_mirage: the graph's partition record does not replay (%s: %s): partitioned afresh",
             claimer.name, why)
    return None


def _key_parts(graph: Graph, claimers: Sequence[Claimer], ctx: CompileContext) -> dict[str, Any] | None:
    """What a record's key is made of; None where a claimer's settings have no stable description."""
    described = [_describe(c) for c in claimers]
    if any(d is None for d in described):
        return None
    cost = ctx.analysis_of(graph).cost
    # the graph's text (every value's meta, every node's op and arguments) and each node's ATen overload
    return dict(kind="partition-record", graph=str(graph), targets=[n.target_name for n in graph.nodes],
                claimers=described, config=ctx.config.output_key(), target=ctx.target.name,
                device=repr(getattr(cost, "device", None)), cuda_graph=getattr(cost, "cuda_graph", None),
                code=source_digest(*CODE))


def _describe(claimer: Claimer) -> str | None:
    """The claimer's class and settings (its public attributes; a private one is state, e.g. a device model read
    once) in words that are the same in every process; None where a setting prints as an object's address."""
    settings = sorted((k, v) for k, v in vars(claimer).items() if not k.startswith("_"))
    text = f"{type(claimer).__module__}.{type(claimer).__qualname__}{settings!r}"
    return None if " at 0x" in text else text
