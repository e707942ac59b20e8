"""The op table: one :class:`OpDef` per operator of the project's IR.

Lowering, analysis, the verifier and codegen all read this table; adding an op
is one entry here. Ops of the LAX fragment (Mirage §5: linear algebra, exp,
division, and the elementwise / reduction ops built from them) are marked
``lax=True``; everything without an entry lowers to an opaque node, which later
stages never claim and which always runs through the fallback.

What an op is in generated Triton lives in codegen (:mod:`torch_mirage.codegen.stitch_ops`), not here.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

aten = torch.ops.aten
prims = torch.ops.prims


class OpKind(enum.Enum):
    ELEMENTWISE = "elementwise"   # pointwise over broadcast operands
    REDUCTION = "reduction"       # reduces listed dims
    MATMUL = "matmul"             # mm / bmm / addmm
    LAYOUT = "layout"             # view, permute, expand, slice, cat ...: moves no arithmetic
    CREATION = "creation"         # full, iota, scalar_tensor: no tensor inputs
    OPAQUE = "opaque"             # everything else: conv, embedding, RNG, sort ...


@dataclass(frozen=True)
class OpDef:
    name: str
    kind: OpKind
    targets: tuple  # ATen overloads lowered to this op
    lax: bool = False
    flops: int = 1              # per output element (elementwise) / per input element (reduction)

    @property
    def is_memory_bound_candidate(self) -> bool:
        return self.kind in (OpKind.ELEMENTWISE, OpKind.REDUCTION, OpKind.LAYOUT, OpKind.CREATION)


def _t(*names: str) -> tuple:
    out = []
    for n in names:
        ns, op, overload = (n.split(".") + ["default"])[:3]
        packet = getattr(getattr(torch.ops, ns), op, None)
        if packet is not None and hasattr(packet, overload):
            out.append(getattr(packet, overload))
    return tuple(out)


E, R, M, L, C = OpKind.ELEMENTWISE, OpKind.REDUCTION, OpKind.MATMUL, OpKind.LAYOUT, OpKind.CREATION

OPS: tuple[OpDef, ...] = (
    # elementwise, LAX
    OpDef("add", E, _t("aten.add.Tensor", "aten.add.Scalar"), True),
    OpDef("sub", E, _t("aten.sub.Tensor", "aten.sub.Scalar", "aten.rsub.Scalar", "aten.rsub.Tensor"), True),
    OpDef("mul", E, _t("aten.mul.Tensor", "aten.mul.Scalar"), True),
    OpDef("div", E, _t("aten.div.Tensor", "aten.div.Scalar", "prims.div.default"), True),
    OpDef("neg", E, _t("aten.neg.default"), True),
    OpDef("reciprocal", E, _t("aten.reciprocal.default"), True),
    OpDef("exp", E, _t("aten.exp.default"), True, flops=4),
    OpDef("exp2", E, _t("aten.exp2.default"), True, flops=4),
    OpDef("sqrt", E, _t("aten.sqrt.default"), True, flops=4),
    OpDef("rsqrt", E, _t("aten.rsqrt.default"), True, flops=4),
    OpDef("pow", E, _t("aten.pow.Tensor_Scalar", "aten.pow.Tensor_Tensor"), True, flops=4),
    OpDef("silu", E, _t("aten.silu.default"), True, flops=6),
    OpDef("sigmoid", E, _t("aten.sigmoid.default"), True, flops=5),
    OpDef("to_dtype", E, _t("prims.convert_element_type.default", "aten._to_copy.default"), True, flops=0),
    OpDef("copy", E, _t("aten.clone.default", "aten.alias.default", "aten.lift_fresh_copy.default"), True, flops=0),
    # elementwise, non-LAX (the verifier gives them a documented treatment)
    OpDef("tanh", E, _t("aten.tanh.default"), False, flops=6),
    OpDef("erf", E, _t("aten.erf.default"), False, flops=8),
    OpDef("log", E, _t("aten.log.default"), False, flops=4),
    OpDef("abs", E, _t("aten.abs.default"), False),
    OpDef("relu", E, _t("aten.relu.default"), False),
    OpDef("maximum", E, _t("aten.maximum.default", "aten.clamp_min.default"), False),
    OpDef("minimum", E, _t("aten.minimum.default", "aten.clamp_max.default"), False),
    OpDef("where", E, _t("aten.where.self", "aten.where.ScalarSelf", "aten.where.ScalarOther"), False),
    OpDef("eq", E, _t("aten.eq.Tensor", "aten.eq.Scalar"), False),
    OpDef("ne", E, _t("aten.ne.Tensor", "aten.ne.Scalar"), False),
    OpDef("lt", E, _t("aten.lt.Tensor", "aten.lt.Scalar"), False),
    OpDef("le", E, _t("aten.le.Tensor", "aten.le.Scalar"), False),
    OpDef("gt", E, _t("aten.gt.Tensor", "aten.gt.Scalar"), False),
    OpDef("ge", E, _t("aten.ge.Tensor", "aten.ge.Scalar"), False),
    OpDef("logical_not", E, _t("aten.logical_not.default", "aten.bitwise_not.default"), False),
    OpDef("logical_and", E, _t("aten.logical_and.default", "aten.bitwise_and.Tensor"), False),
    OpDef("isnan", E, _t("aten.isnan.default"), False),
    # reductions
    OpDef("sum", R, _t("aten.sum.dim_IntList", "aten.sum.default"), True),
    OpDef("mean", R, _t("aten.mean.dim", "aten.mean.default"), True),
    OpDef("amax", R, _t("aten.amax.default", "aten.max.dim"), False),
    OpDef("amin", R, _t("aten.amin.default", "aten.min.dim"), False),
    OpDef("any", R, _t("aten.any.dim", "aten.any.dims"), False),   # a bool reduction (the all() of _safe_softmax)
    OpDef("var_mean", R, _t("aten.var_mean.correction", "prims.var.default"), False, flops=3),
    # matmul
    OpDef("matmul", M, _t("aten.mm.default", "aten.bmm.default", "aten.addmm.default", "aten.baddbmm.default"), True, flops=2),
    # layout
    OpDef("view", L, _t("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default"), True),
    OpDef("permute", L, _t("aten.permute.default", "aten.t.default", "aten.transpose.int"), True),
    OpDef("expand", L, _t("aten.expand.default"), True),
    OpDef("unsqueeze", L, _t("aten.unsqueeze.default"), True),
    OpDef("squeeze", L, _t("aten.squeeze.dim", "aten.squeeze.dims", "aten.squeeze.default"), True),
    OpDef("slice", L, _t("aten.slice.Tensor", "aten.select.int"), True),
    OpDef("cat", L, _t("aten.cat.default"), True),
    OpDef("split", L, _t("aten.split.Tensor", "aten.split_with_sizes.default"), True),
    # creation
    OpDef("full", C, _t("aten.full.default", "aten.scalar_tensor.default", "aten.zeros.default", "aten.ones.default"), True),
    OpDef("iota", C, _t("prims.iota.default", "aten.arange.start", "aten.arange.default", "aten.arange.start_step"), False),
)

OPAQUE = OpDef("opaque", OpKind.OPAQUE, ())

_BY_TARGET = {t: op for op in OPS for t in op.targets}
_BY_NAME = {op.name: op for op in OPS}


def op_for_target(target) -> OpDef:
    """The table entry an ATen overload lowers to; :data:`OPAQUE` when it has none."""
    return _BY_TARGET.get(target, OPAQUE)


def op_named(name: str) -> OpDef:
    return OPAQUE if name == "opaque" else _BY_NAME[name]
