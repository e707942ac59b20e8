"""The analyse stage: the facts about one lowered graph that the claimers read, computed once per graph.

:func:`analyse` gives a :class:`GraphAnalysis`: the value properties of every tensor of the graph
(:func:`.values.analyze_values`: constants, index patterns, masks' bands — they do not depend on which nodes a
kernel takes) and the cost model of the device the graph is compiled for. A claimer costs a candidate region with
:meth:`GraphAnalysis.region_cost`, which reuses those values instead of recomputing them for the whole graph per
question (before the stage existed, every stitch group's cost re-ran the value analysis over all of the graph's
nodes).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable, Sequence

from ..capture.ir import Graph, Node, Value
from .cost import Cost, CostModel
from .device import DeviceModel
from .values import ValueProperty, analyze_values

log = logging.getLogger("torch_mirage")


@dataclass
class GraphAnalysis:
    """One graph's value properties (``None`` where the value analysis failed: each question then recomputes
    what it needs, as it would without this stage) and the cost model of its device."""
    graph: Graph
    values: dict[int, ValueProperty] | None
    cost: CostModel

    def region_cost(self, nodes: Iterable[Node], model: CostModel | None = None,
                    outputs: Sequence[Value] | None = None) -> Cost:
        """``nodes`` as one kernel of the graph, on ``model``'s device (default: the graph's)."""
        return (model or self.cost).region_cost(list(nodes), self.graph, values=self.values, outputs=outputs)


def analyse(graph: Graph, device: DeviceModel | None = None) -> GraphAnalysis:
    """The analyse stage for ``graph`` on ``device`` (default: the current device's model)."""
    try:
        values = analyze_values(graph.nodes)
    except Exception as e:   # the value facts are an aid: a claimer that needs them finds out itself
        log.debug("torch_mirage: value analysis failed (%s: %s); claimers recompute what they need",
                  type(e).__name__, e)
        values = None
    return GraphAnalysis(graph, values, CostModel(device))
