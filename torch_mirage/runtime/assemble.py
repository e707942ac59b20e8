"""Assembly: one ATen graph + its regions → one boxed callable.

Mirage regions become single ``call_function`` nodes that run the region's
kernel; the remaining nodes are annotated for ``regional_inductor`` (fallback
``"inductor"``) or left as ATen calls (fallback ``"eager"``). Regions are
placed by a topological order of the condensed graph (each region one node),
which exists because every region is convex.
"""
from __future__ import annotations

import contextlib
import heapq
import operator
from typing import Any, Sequence

import torch
import torch.fx as fx
from .inductor_quiet import without_artifact_warning
from functorch.compile import make_boxed_func

from ..capture.ir import Graph, Value
from ..partition.region import Region
from . import region_op

_INDUCTOR_MODE_CONFIGS = {
    "default": {},
    "max-autotune-no-cudagraphs": {"max_autotune": True},
    # the matmuls' templates and configs autotuned, nothing else: max-autotune's prefill GEMM wins (H100: llama
    # prefill 2048, max-autotune 6.98 ms against default 7.53) without autotuning every pointwise kernel
    "max-autotune-gemm": {"max_autotune_gemm": True},
}


def inductor_configs(mode: str) -> dict:
    """Inductor's config patches for an ``inductor_mode`` (the knob): its every use (the fallback's partitions,
    Inductor's versions of regions the measure stage times, a whole graph handed to Inductor) compiles alike."""
    return dict(_INDUCTOR_MODE_CONFIGS[mode])


def _fx_of_values(gm: fx.GraphModule, graph: Graph) -> dict[int, fx.Node]:
    """IR value id → the FX node that holds it (getitem nodes for multi-output ops)."""
    by_name = {n.name: n for n in gm.graph.nodes}
    out: dict[int, fx.Node] = {}
    for v in graph.inputs:
        out[id(v)] = by_name[v.name]
    for node in graph.nodes:
        fxn = by_name[node.name]
        if len(node.outputs) == 1 and isinstance(graph.result(node), Value):
            out[id(node.outputs[0])] = fxn
        else:
            for user in fxn.users:
                if user.target is operator.getitem:
                    out[id(node.outputs[user.args[1]])] = user
    return out


def _region_of_fx(gm: fx.GraphModule, graph: Graph, regions: Sequence[Region]) -> dict[fx.Node, int]:
    by_name = {n.name: n for n in gm.graph.nodes}
    owner: dict[fx.Node, int] = {}
    for ri, region in enumerate(regions):
        for node in region.nodes:
            fxn = by_name[node.name]
            owner[fxn] = ri
            for user in fxn.users:
                if user.target is operator.getitem:
                    owner[user] = ri
    return owner


def _condensed_order(gm: fx.GraphModule, owner: dict[fx.Node, int], first: set[fx.Node] = frozenset()) -> list[Any]:
    """Topological order of FX nodes with each region contracted to one item ('region', i); the nodes of ``first``
    (the prelude: they read only the graph's inputs) ahead of all else."""
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    pos = {n: i for i, n in enumerate(nodes)}
    item = lambda n: ("region", owner[n]) if n in owner else n
    preds: dict[Any, set] = {}
    first_pos: dict[Any, int] = {}
    for n in nodes:
        it = item(n)
        first_pos[it] = min(first_pos.get(it, pos[n]), pos[n])
        preds.setdefault(it, set())
        for a in n.all_input_nodes:
            if a in pos and item(a) != it:
                preds[it].add(item(a))
    succs: dict[Any, list] = {it: [] for it in preds}
    for it, ps in preds.items():
        for p in ps:
            succs[p].append(it)
    indeg = {it: len(ps) for it, ps in preds.items()}
    rank = lambda it: (0 if it in first else 1, first_pos[it])     # noqa: E731
    ready = [(rank(it), i, it) for i, it in enumerate(preds) if indeg[it] == 0]
    heapq.heapify(ready)
    order, counter = [], len(preds)
    while ready:
        _, _, it = heapq.heappop(ready)
        order.append(it)
        for s in succs[it]:
            indeg[s] -= 1
            if indeg[s] == 0:
                counter += 1
                heapq.heappush(ready, (rank(s), counter, s))
    if len(order) != len(preds):
        raise RuntimeError("torch_mirage: claimed regions form a cycle (a region is not convex)")
    return order


PRELUDE_MAX_ELEMENTS = 1 << 16     # the most elements a prelude op's output may hold
# ops whose work grows with their output, not their inputs: a prelude op may read a large tensor through one of these
_GATHERS = {torch.ops.aten.embedding.default, torch.ops.aten.index_select.default, torch.ops.aten.index.Tensor}
PRELUDE_COMBO_NODES = 64           # sub-kernels one combo launch of the prelude may hold (Inductor's default: 8)


def prelude_mode(knob: str, example_inputs: Sequence[Any]) -> str:
    """What the ``prelude`` knob means for a graph of ``example_inputs``: "auto" is "combo" where a tensor input is on
    CUDA (the prelude's kernels in few launches) and "inline" elsewhere; any other value as given."""
    if knob != "auto":
        return knob
    on_cuda = any(isinstance(x, torch.Tensor) and x.device.type == "cuda" for x in example_inputs)
    return "combo" if on_cuda else "inline"


def prelude_nodes(gm: fx.GraphModule, fb_owner: dict[fx.Node, int]) -> set[fx.Node]:
    """The fallback's ops that read only the graph's inputs (placeholders, attributes and each other) and make
    small tensors from small ones (each input and output at most ``PRELUDE_MAX_ELEMENTS``; a gather such as the
    embedding may read a large table): in a decode step, each layer's cache positions
    (``arange + counter``) and counter update, the mask, RoPE's cos / sin, the embedding's rows. Interleaved with
    mirage's kernels each is a launch of its own, as Inductor fuses only ops that share data; together they make
    one graph that runs before everything else. An op that writes an input in place (a counter's ``copy_``) joins
    only where every other reader of that input is a prelude op before it (it must not move ahead of one that reads
    the old value). Empty where no prelude op feeds anything outside the prelude (a graph of its own would have no
    outputs)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    prelude: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if n not in fb_owner or n.op != "call_function" or _write_back_only(n, fb_owner):
            continue
        if any(a.op not in ("placeholder", "get_attr") and a not in prelude for a in n.all_input_nodes):
            continue
        if not _small(n):
            continue
        if n.target not in _GATHERS and not all(_small(a) for a in n.all_input_nodes):
            continue            # its work grows with a large input (a matmul, a reduction): it stays with its users
        if any(u is not n and (u not in prelude or order[u] > order[n]) for w in _written(n) for u in w.users):
            continue
        prelude.add(n)
    feeds = any(u not in prelude and u.op != "output" for n in prelude for u in n.users)
    return prelude if feeds else set()


def _small(node: fx.Node) -> bool:
    """Whether each tensor ``node`` makes holds at most ``PRELUDE_MAX_ELEMENTS`` elements, a static count (a
    symbolic size is not taken: comparing it would add a guard)."""
    vals = node.meta.get("val")
    vals = vals if isinstance(vals, (tuple, list)) else [vals]
    return all(isinstance(v, torch.Tensor) and type(v.numel()) is int and v.numel() <= PRELUDE_MAX_ELEMENTS
               for v in vals)


def _combo_configs() -> dict[str, Any]:
    """Inductor's combo-kernel settings for the prelude graph, those this torch has (none: a plain graph)."""
    from torch._inductor import config as inductor_config

    wanted = {"combo_kernels": True, "combo_kernel_max_num_nodes": PRELUDE_COMBO_NODES}
    return {k: v for k, v in wanted.items() if hasattr(inductor_config, k)}


def _written(node: fx.Node) -> list[fx.Node]:
    """The arguments ``node`` writes in place (its schema's mutable arguments)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return []
    return [a for arg, a in zip(schema.arguments, node.args)
            if isinstance(a, fx.Node) and arg.alias_info is not None and arg.alias_info.is_write]


def _write_back_only(node: fx.Node, fb_owner: dict[fx.Node, int]) -> bool:
    """A ``copy_`` of a mirage result (or an input) back into an input: it stays a plain ATen call. Alone it would
    form an Inductor partition without outputs, which regional_inductor rejects (torch 2.11)."""
    return (node.target is torch.ops.aten.copy_.default
            and not any(a in fb_owner for a in node.all_input_nodes))


# functional ATen update ops whose result may overwrite their first argument instead of a copy of it
_IN_PLACE = {
    torch.ops.aten.index_put.default: torch.ops.aten.index_put_.default,
    torch.ops.aten.index_copy.default: torch.ops.aten.index_copy_.default,
    torch.ops.aten.scatter.src: torch.ops.aten.scatter_.src,
    torch.ops.aten.scatter.value: torch.ops.aten.scatter_.value,
}


def reinplace_write_backs(graph: fx.Graph) -> int:
    """``copy_(x, index_put(x, ...))`` of a graph input ``x`` → ``index_put_(x, ...)`` (likewise ``index_copy``
    and ``scatter``), where nothing else reads ``x`` and nothing reads the ``copy_``. A static KV cache's update
    is this pattern; split across partitions (the update with the attention that reads it, the write-back with
    the other input mutations) Inductor cannot make it in place, and each step copied the whole cache twice.
    Returns how many were rewritten."""
    done = 0
    for copy in list(graph.nodes):
        if copy.op != "call_function" or copy.target is not torch.ops.aten.copy_.default or copy.users:
            continue
        dst, src = copy.args[0], copy.args[1]
        if not (isinstance(dst, fx.Node) and dst.op == "placeholder" and isinstance(src, fx.Node)
                and src.op == "call_function" and src.target in _IN_PLACE and src.args and src.args[0] is dst
                and set(dst.users) == {src, copy} and not _returned_as_view(src)):
            continue
        src.target = _IN_PLACE[src.target]
        graph.erase_node(copy)
        done += 1
    return done


# size arithmetic a partition may compute again from its leaves (host-side integer ops, no side effects)
_SIZE_OPS = {operator.add, operator.sub, operator.mul, operator.floordiv, operator.mod, operator.neg,
             torch.sym_sum, torch.sym_max, torch.sym_min, torch.ops.aten.sym_size.int,
             torch.ops.aten.sym_numel.default, torch.ops.aten.sym_stride.int}


def _compound_size(node: Any) -> bool:
    """Whether ``node`` holds a SymInt whose expression is more than one symbol (``s47 + 1``)."""
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    if not isinstance(v, torch.SymInt):
        return False
    expr = v.node.expr
    return not expr.is_Symbol and bool(expr.free_symbols)


def rematerialize_sizes(graph: fx.Graph) -> int:
    """Each Inductor-annotated node's arguments that are compound sizes (``s47 + 1``) made by size arithmetic:
    that arithmetic computed again right before the node (annotated alike, so it joins the node's partition) from
    its leaves — tensors, plain-symbol SymInts and constants. A partition then takes no compound SymInt input.

    Why: AOTAutograd's cache saves a partition's guards over its SymInt inputs, and writes the guard of a compound
    input in terms of the outer graph's sources (``L['kwargs'][...]``); every later load fails evaluating it
    ("AOTAutograd cache unable to load compiled graph: 'kwargs'", torch 2.11), so each process compiled those
    partitions again — the symbolic decode graph's three attention partitions of an HF llama, about 4 s of a warm
    compile on the H200 (12-03). Returns how many arguments were rewritten; originals left unused are erased."""
    done = 0

    def leaf(n: Any) -> bool:
        return not isinstance(n, fx.Node) or not _compound_size(n) or n.op == "placeholder"

    def pure(n: fx.Node) -> bool:   # the arithmetic between ``n`` and its leaves is size ops only
        return leaf(n) or (n.op == "call_function" and n.target in _SIZE_OPS
                           and all(pure(a) for a in n.all_input_nodes))

    def copy_before(n: Any, user: fx.Node, memo: dict) -> Any:
        if leaf(n):
            return n
        if n not in memo:
            with graph.inserting_before(user):
                c = graph.node_copy(n, lambda a: copy_before(a, user, memo))
            c.meta = dict(n.meta, custom=user.meta["custom"])
            memo[n] = c
        return memo[n]

    for user in list(graph.nodes):
        custom = user.meta.get("custom") if user.op == "call_function" else None
        if not (isinstance(custom, dict) and "compile_with_inductor" in custom):
            continue
        memo: dict = {}
        for a in user.all_input_nodes:   # annotated ones too: a cycle or the prelude may put them elsewhere
            if leaf(a) or not pure(a):
                continue
            user.replace_input_with(a, copy_before(a, user, memo))
            done += 1
    for n in reversed(list(graph.nodes)):   # the originals (and their size-op inputs) nothing reads any more
        if n.op == "call_function" and n.target in _SIZE_OPS and not n.users and _compound_size(n):
            graph.erase_node(n)
    return done


def _returned_as_view(node: fx.Node) -> bool:
    """Whether the graph returns ``node`` or a view of it (made in place, the caller would get the input)."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        for user in n.users:
            if user.op == "output":
                return True
            schema = getattr(user.target, "_schema", None) if user.op == "call_function" else None
            aliases = schema is not None and schema.arguments and user.args and user.args[0] is n and \
                schema.arguments[0].alias_info is not None and not schema.arguments[0].alias_info.is_write
            if aliases or user.target in (operator.getitem, torch.ops.aten._unsafe_view.default):
                todo.append(user)
    return False


def _region_runner(kernel, n_out: int):
    def run_region(*args):
        outs = kernel(*args)
        if len(outs) != n_out:
            raise RuntimeError(f"torch_mirage: region kernel returned {len(outs)} outputs, expected {n_out}")
        return tuple(outs)
    run_region.__name__ = getattr(kernel, "__name__", "mirage_region")
    return run_region


@contextlib.contextmanager
def cacheable_context():
    """A tracing context whose fake mode has a ShapeEnv for Inductor's compiles of the fallback partitions, where
    the ambient one has none (a static-size compile of a symbolic graph runs in a context of its own, whose fake
    mode must stay without one: AOTAutograd would make the sizes it passes as ints symbolic again).
    AOTAutograd's cache bypasses every compile without a ShapeEnv ("No shape env"), so each process lowered and
    generated those partitions again. Static shapes: the partitions' inputs keep their sizes."""
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    ctx = TracingContext.try_get()
    if ctx is not None and ctx.fake_mode is not None and ctx.fake_mode.shape_env is not None:
        yield
        return
    with tracing(TracingContext(FakeTensorMode(shape_env=ShapeEnv(), static_shapes=True))):
        yield


def assemble(gm: fx.GraphModule, graph: Graph, regions: Sequence[Region], fallback: str,
             inductor_mode: str = "default", prelude: str = "inline", taken: list[str] | None = None,
             regions_in_inductor: bool = False) -> Any:
    """A boxed callable running ``gm`` with mirage regions replaced by their kernels. ``prelude`` (the knob):
    where the fallback's input-only ops (:func:`prelude_nodes`) go — "inline" among the others; "hoist" one Inductor
    graph of their own, run first; "combo" that graph with Inductor's combo kernels (independent kernels in one
    launch); ``taken`` (where given) receives the prelude's ops (their names, e.g. ``copy_``), in graph order.
    ``regions_in_inductor`` (the knob; Inductor fallback only): each region :func:`.region_op.eligible` runs as the
    ``mirage::region`` op inside the Inductor partition around it, so that the stretches of fallback ops between
    regions make one partition, not one each."""
    mirage = [r for r in regions if r.compiled_by == "mirage"]
    fallback_regions = [r for r in regions if r.compiled_by != "mirage"]
    values = _fx_of_values(gm, graph)
    owner = _region_of_fx(gm, graph, mirage)
    fb_owner = _region_of_fx(gm, graph, fallback_regions)
    first = prelude_nodes(gm, fb_owner) if fallback == "inductor" and prelude != "inline" else set()
    if taken is not None:
        taken[:] = [getattr(n.target, "_opname", str(n.target)) for n in gm.graph.nodes if n in first]
    order = _condensed_order(gm, owner, first)

    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    graph_key = ""      # the graph's digest, made for the first region that runs inside Inductor
    main_partition = {"inductor_configs": inductor_configs(inductor_mode), "inductor_region": 0}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            env[n] = new.node_copy(n, lambda a: env[a])
    for it in order:
        if isinstance(it, fx.Node):
            copied = new.node_copy(it, lambda a: env[a])
            if fallback == "inductor" and it in fb_owner and not _write_back_only(it, fb_owner):
                copied.meta.setdefault("custom", {})
                configs = inductor_configs(inductor_mode)
                if it in first and prelude == "combo":
                    # Inductor's 8 sub-kernels per combo launch split a 4-layer decode prelude's dozen kernels
                    # into 2 combo launches and 3 lone ones (H100, 11-27 tenth); a prelude is small ops only
                    configs.update(_combo_configs())
                copied.meta["custom"] = dict(copied.meta["custom"], compile_with_inductor={
                    "inductor_configs": configs,
                    # one annotation for every fallback node (and one for the prelude's): regional_inductor then
                    # forms the largest cycle-free partitions itself, so Inductor fuses across our report's
                    # region borders
                    "inductor_region": 1 if it in first else 0})
            env[it] = copied
            continue
        region = mirage[it[1]]
        outs = region.outputs(graph)
        args = tuple(env[values[id(v)]] for v in region.inputs)
        in_inductor = regions_in_inductor and fallback == "inductor" and region_op.eligible(region, outs)
        if in_inductor:
            graph_key = graph_key or region_op.graph_digest(graph)
            key = region_op.region_key(graph_key, it[1], region, graph, outs)
            region_op.register(key, region.kernel, outs)
            call = new.call_function(region_op.region_op(), (key, list(args)))
            call.meta["val"] = [v.example for v in outs]
        else:
            call = new.call_function(_region_runner(region.kernel, len(outs)), args)
            call.meta["val"] = tuple(v.example for v in outs)
        for i, v in enumerate(outs):
            item = new.call_function(operator.getitem, (call, i))
            item.meta["val"] = v.example
            env[values[id(v)]] = item
            if in_inductor:
                item.meta["custom"] = dict(compile_with_inductor=main_partition)
        if in_inductor:
            call.meta["custom"] = dict(compile_with_inductor=main_partition)
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    new.output(fx.node.map_arg(out_node.args[0], lambda a: env[a]))
    reinplace_write_backs(new)
    if fallback == "inductor":
        rematerialize_sizes(new)
    new_gm = fx.GraphModule(gm, new)
    if fallback == "inductor" and fb_owner:
        from torch.fx.passes.regional_inductor import regional_inductor


        example = [n.meta.get("val") for n in new_gm.graph.nodes if n.op == "placeholder"]
        with without_artifact_warning(), cacheable_context():
            compiled = regional_inductor(new_gm, *example)
        return compiled  # regional_inductor returns a boxed-calling GraphModule
    return make_boxed_func(new_gm)
