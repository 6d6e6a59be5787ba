"""Rule tables keyed by op type, and where a batch's rows go through an op.

Every op that takes a variable's resource handle must be known here as a
reader, a writer or a handle pass-through; any other op on a variable is an
error that names it (a loud default, never a silent skip).
"""
from __future__ import annotations

import re

import tensorflow as tf

from .. import compat
from ..errors import GraphError

VARIABLE_OPS = frozenset({"VarHandleOp", "VariableV2", "Variable"})

# Ops whose outputs differ between replicas even with equal state.
PER_REPLICA_SOURCES = frozenset({"IteratorGetNext", "IteratorGetNextSync", "OptionalGetValue"})
# queue dequeues and file readers (which take their work from a queue), any version
READ_PREFIXES = ("QueueDequeue", "ReaderRead")

# Ops that forward a resource handle unchanged.
HANDLE_PASSTHROUGH = frozenset({"Identity", "Enter", "Switch", "Merge", "Exit"})

# Ops that forward a reference unchanged (other ops dereference: they read).
REF_PASSTHROUGH = frozenset({"RefIdentity", "RefEnter", "RefSwitch", "RefMerge",
                             "RefExit", "RefNextIteration", "RefSelect"})

# Ops that take a reference argument but only read it.
REF_READERS = frozenset({"IsVariableInitialized"})

# Ops that only read a variable.
READERS = frozenset({
    "ReadVariableOp", "ResourceGather", "ResourceGatherNd", "VarIsInitializedOp",
    "VariableShape", "_ReadVariablesOp",
    # Functional ops receive handles as captured inputs; TensorFlow's own
    # v1 code uses them to read (e.g. ExponentialMovingAverage's init `cond`).
    "If", "StatelessIf", "While", "StatelessWhile", "PartitionedCall",
    "StatefulPartitionedCall", "Case", "StatelessCase",
    # Checkpoint and shape helpers.
    "SaveV2", "Save", "SaveSlices",
})

# Ops that write every resource input they take.
_WRITER_PATTERN = re.compile(
    r"^(AssignVariableOp|AssignAddVariableOp|AssignSubVariableOp|"
    r"ResourceApply\w+|ResourceSparseApply\w+|ResourceScatter\w+|"
    r"ResourceStridedSliceAssign|ResourceCountUpTo|DestroyResourceOp|_VarHandlesOp|"
    r"RngReadAndSkip)$")   # (a tf.random.Generator's draw: graph/generators.py)

# Ops that meet other replicas or workers in a step (TensorFlow's collectives).
COLLECTIVE_OPS = frozenset({
    "CollectiveReduce", "CollectiveReduceV2", "CollectiveReduceV3", "CollectiveGather",
    "CollectiveGatherV2", "CollectiveBcastSend", "CollectiveBcastRecv",
    "CollectiveBcastSendV2", "CollectiveBcastRecvV2", "CollectiveAllToAllV2",
    "CollectiveAllToAllV3", "CollectiveReduceScatterV2"})

# Reads that are cheap enough to force in order to keep replicas race-free.
CHEAP_READERS = frozenset({"ReadVariableOp", "ResourceGather", "ResourceGatherNd",
                           "VariableShape", "VarIsInitializedOp",
                           "Identity", "IsVariableInitialized"})   # reference variables

# Ops that act outside the graph (files): never replicated, run once.
EXTERNAL_EFFECT_OPS = frozenset({
    "SaveV2", "Save", "SaveSlices", "MergeV2Checkpoints", "WriteFile",
    "WriteSummary", "WriteScalarSummary", "WriteHistogramSummary",
    "WriteImageSummary", "WriteAudioSummary", "WriteRawProtoSummary",
    "WriteGraphSummary", "FlushSummaryWriter", "CloseSummaryWriter",
})

# Ops that must run on a host CPU even when the replica device is a GPU.
_HOST_ONLY_PATTERN = re.compile(
    r"(Dataset(V\d)?$|^Iterator|^MakeIterator$|^AnonymousIterator|"
    r"^IteratorGetNext|^OptionalGetValue|^Save|^Restore|^MergeV2Checkpoints$|"
    r"^Print|^ShardedFilename|^StringJoin$|^ParseExample|^DecodeRaw$|"
    r"^TextLineReader|^ReaderRead|^FIFOQueue|^QueueDequeue|^QueueEnqueue)")

# How a replica-dependent value written into mirrored state is combined across
# replicas so that all replicas keep one value (see README, "state").
#   sum:  accumulators (AssignAdd of counts, totals: streaming metrics)
#   mean: moving averages and assignments (batch-norm moving statistics)
STATE_SYNC_REDUCTION = {
    "AssignAddVariableOp": "sum", "AssignAdd": "sum",
    "AssignSubVariableOp": "mean", "AssignSub": "mean",
    "AssignVariableOp": "mean", "Assign": "mean",
}

# Ops whose output i is a function of input i alone; other ops' outputs may
# depend on every input.
_ELEMENTWISE_MULTI = frozenset({"IdentityN"})

# tf.gradients' scope, and GradientTape's in a traced TF2 step
AUTODIFF_SCOPE = re.compile(r"(^|/)(gradients(_\d+)?|gradient_tape)/")


# gradients aggregated by TensorFlow's own synchronous replication
# (tf.compat.v1.train.SyncReplicasOptimizer)
ACCUMULATORS = frozenset({"ConditionalAccumulator", "SparseConditionalAccumulator",
                          "ResourceConditionalAccumulator"})


def why_no_update(ir) -> str:
    """Why a graph's trainable variables are written from no gradient."""
    held = sorted(n.name for n in ir.nodes if n.op in ACCUMULATORS)
    if held:
        return (f"the gradients go into accumulators ({held[0]!r}, "
                f"{len(held)} in all) that tf.compat.v1.train.SyncReplicasOptimizer makes, "
                "and the variables are written from what they hand back. That is "
                "TensorFlow's own synchronous replication; parallax_ng makes every step "
                "synchronous itself: use the optimizer SyncReplicasOptimizer wraps "
                "(opt.minimize(loss)) and drop SyncReplicasOptimizer and its hook")
    return ("no trainable variable is written from a gradient of "
            "tf.gradients/compute_gradients outside a loop's body. Build the training op "
            "(e.g. tf.compat.v1.train.AdamOptimizer(...).minimize(loss)) in the graph, once "
            "per step and not inside a loop, before calling get_runner")


def is_writer(op_type: str) -> bool:
    return bool(_WRITER_PATTERN.match(op_type))


def writes_state(op_type: str) -> bool:
    """A resource variable's writer, or an op that writes through a
    reference variable (Assign, Scatter*, Apply*); not tf.scatter_nd's
    ScatterNd, which makes a tensor."""
    return is_writer(op_type) or op_type in ("Assign", "AssignAdd", "AssignSub", "CountUpTo") \
        or op_type.startswith(("Scatter", "Apply", "SparseApply")) and \
        op_type not in ("ScatterNd", "ScatterNdNonAliasingAdd")


def inputs_of_output(op_type: str, index: int, num_inputs: int) -> range:
    """Positions of the inputs that output `index` of an op can depend on."""
    if op_type in _ELEMENTWISE_MULTI:
        return range(index, index + 1)
    return range(num_inputs)


def is_host_only(op_type: str) -> bool:
    return bool(_HOST_ONLY_PATTERN.search(op_type))


def is_autodiff(node_name: str) -> bool:
    """True for ops TensorFlow's autodiff (`tf.gradients`, GradientTape) created."""
    return bool(AUTODIFF_SCOPE.search(node_name))


def past_identities(t):
    """The tensor that tf.Tensor `t` passes on through Identity ops (an
    inlined call's inputs are Identities of the caller's tensors;
    tf.gradients makes no op for an Identity)."""
    while t.op.type == "Identity":
        t = t.op.inputs[0]
    return t


def tails(node_name: str) -> list[str]:
    """`node_name` past each of its scopes, longest first: how the
    gradient of an op in an inlined call names it (`StatefulPartitionedCall/
    dense/MatMul`'s is `PartitionedCall/gradients/dense/MatMul_grad/...`)."""
    parts = node_name.split("/")
    return ["/".join(parts[at:]) for at in range(1, len(parts))]


def from_autodiff(graph) -> set[str]:
    """The names of a tf.Graph's autodiff ops and of every op their outputs
    reach (an optimizer's update math, a write of a gradient), in the
    order made (inputs first)."""
    found: set[str] = set()
    for op in graph.get_operations():
        if is_autodiff(op.name) or any(t.op.name in found for t in op.inputs):
            found.add(op.name)
    return found


# Ops that carry a tensor into a lowered tf.cond or while loop. Grappler's
# lowering names them after the tensor (`adagrad/cond/gradient_tape/.../_7`),
# so a gradient's Switch in a user's cond looks like autodiff by name.
CONTROL_FLOW_ENTRIES = frozenset({"Switch", "RefSwitch", "Enter", "RefEnter"})


def is_autodiff_use(node) -> bool:
    """True if NodeDef `node`, a consumer of an autodiff output, belongs to
    the autodiff (not a user's control flow that the gradient enters)."""
    return is_autodiff(node.name) and node.op not in CONTROL_FLOW_ENTRIES


def classify_ref_use(op_type: str, position: int) -> str:
    """'read', 'write' or 'pass' for an op that takes a reference variable.

    TensorFlow dereferences a reference passed to a value argument, so such
    ops read; ops whose argument is itself a reference write through it.
    """
    if op_type in REF_PASSTHROUGH:
        return "pass"
    if op_type in REF_READERS:
        return "read"
    refs = compat.ref_input_positions(op_type)
    if refs is None:
        raise GraphError(
            f"op type {op_type} takes a reference variable, and TensorFlow has no "
            "registered definition of it in this process, so parallax_ng cannot tell "
            "whether it writes the variable; import the module that registers the op "
            "before get_runner, or use resource variables (tf.Variable under v2 behavior)")
    if position < len(refs) and refs[position]:
        return "write"
    return "read"       # a value argument: TensorFlow dereferences it


def classify_resource_use(op_type: str, node_name: str, variable: str) -> str:
    """'read', 'write' or 'pass' for an op that takes a variable's handle."""
    if is_writer(op_type):
        return "write"
    if op_type in READERS:
        return "read"
    if op_type in HANDLE_PASSTHROUGH:
        return "pass"
    raise GraphError(
        f"op {node_name!r} of type {op_type} uses variable {variable!r}; "
        f"parallax_ng knows how variables are read ({', '.join(sorted(READERS))}), "
        "written (AssignVariableOp, AssignAdd/SubVariableOp, ResourceApply*, "
        "ResourceSparseApply*, ResourceScatter*, ResourceCountUpTo) or passed on "
        f"({', '.join(sorted(HANDLE_PASSTHROUGH))})")


def state_sync_reduction(op_type: str, node_name: str, variable: str, value) -> str:
    """How state_sync combines the replicas' values of a write of type
    `op_type`; refused, naming the variable and the value, where no rule
    makes them one device's (an optimizer's update whose learning rate is
    computed from the replica's batch otherwise than by its row count)."""
    try:
        return STATE_SYNC_REDUCTION[op_type]
    except KeyError:
        raise GraphError(
            f"op {node_name!r} of type {op_type} writes variable {variable!r} with a value "
            f"({value}) computed from one replica's batch, which differs between replicas; "
            f"parallax_ng combines such values only for {', '.join(sorted(STATE_SYNC_REDUCTION))}"
            ", for ScatterAdd and ScatterSub (resource or not) into a variable whose first "
            "dimension is known, for ScatterUpdate, ScatterNdUpdate and ScatterNdAdd of the "
            "batch's rows at ids of its examples (a vector, or a column [n, 1]: a memory "
            "bank's) or at places counted from the batch's row count (a ring buffer's "
            "(ptr + tf.range(n)) % size, or a slice buf[ptr:ptr + n] assigned), outside "
            "tf.cond branches and loops, and, in an "
            "optimizer's update, for a hyperparameter that "
            "reads the batch only through its row count or reductions over it (a learning "
            "rate scaled by tf.shape(x)[0] or by the batch's mean)") from None


# ops that pick or move entries: of a tensor of means over the batch (a matrix's
# diagonal), means (graph/forms.py)
ENTRIES = ("MatrixDiagPart", "MatrixDiagPartV2", "MatrixDiagPartV3", "Transpose", "Squeeze",
           "ExpandDims", "Reshape", "StridedSlice")
# The first dimension of ops' outputs (graph/batch.py, graph/rows.py):
# outputs take the first dimension of their inputs of the output's rank, all joined
ELEMENTWISE = frozenset({
    "Identity", "Snapshot", "StopGradient", "PreventGradient", "Neg", "Abs", "Sign",
    "Sqrt", "Rsqrt", "Square", "Exp", "Log", "Log1p", "Expm1", "Reciprocal", "Inv", "Cast",
    "Floor", "Ceil", "Round", "Tanh", "Sigmoid", "Relu", "Relu6", "Elu", "Selu", "Softplus",
    "Softsign", "LeakyRelu", "Erf", "Sin", "Cos", "ZerosLike", "OnesLike", "Add", "AddV2",
    "AddN", "Sub", "Mul", "MulNoNan", "RealDiv", "Div", "DivNoNan", "FloorDiv", "FloorMod",
    "TruncateDiv", "Maximum", "Minimum", "Pow", "SquaredDifference", "ClipByValue",
    "Select", "SelectV2", "Greater", "GreaterEqual", "Less", "LessEqual", "Equal",
    "NotEqual", "LogicalAnd", "LogicalOr", "LogicalNot", "IsFinite", "IsNan", "BiasAdd",
    "Softmax", "LogSoftmax", "Enter", "Exit", "Merge", "Switch", "NextIteration",
    "CheckNumerics", "CheckNumericsV2", "EnsureShape",
    # the rest of TensorFlow's element-wise math (tf.math, quantization, strings per entry)
    "Tan", "Asin", "Acos", "Atan", "Atan2", "Sinh", "Cosh", "Asinh", "Acosh", "Atanh",
    "Erfc", "Erfinv", "Ndtri", "Lgamma", "Digamma", "Igamma", "Igammac", "Rint", "IsInf",
    "Xlogy", "Xdivy", "Xlog1py", "Mod", "TruncateMod", "ApproximateEqual", "BitwiseAnd",
    "BitwiseOr", "BitwiseXor", "Invert", "LeftShift", "RightShift", "Real", "Imag", "Conj",
    "ComplexAbs", "Angle", "Complex", "BesselI0e", "BesselI1e", "Bucketize",
    "FakeQuantWithMinMaxArgs", "FakeQuantWithMinMaxVars", "QuantizeAndDequantizeV2",
    "QuantizeAndDequantizeV3", "QuantizeAndDequantizeV4", "StringToHashBucketFast",
    "StringToHashBucketStrong", "StringToHashBucket", "StringToNumber", "AsString",
    "StringLower", "StringUpper", "StringStrip", "StringLength", "StaticRegexReplace",
    "RegexReplace", "StaticRegexFullMatch", "RegexFullMatch", "Substr",
})
# outputs take input 0's first dimension
FIRST = frozenset({
    "MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Conv1D", "Conv2D", "Conv3D",
    "DepthwiseConv2dNative", "MaxPool", "MaxPoolV2", "AvgPool", "MaxPool3D", "AvgPool3D",
    "FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3", "LRN",
    "ResizeBilinear", "ResizeNearestNeighbor", "Pad", "PadV2", "MirrorPad", "ArgMax", "ArgMin",
    "TopKV2", "InTopKV2", "Cumsum", "Cumprod", "ReverseV2",
    # images in, the same images out (Keras's augmentation and resizing layers, tf.image)
    "ImageProjectiveTransformV2", "ImageProjectiveTransformV3", "ResizeBicubic", "ResizeArea",
    "ScaleAndTranslate", "AdjustContrastv2", "AdjustHue", "AdjustSaturation", "RGBToHSV",
    "HSVToRGB", "ExtractImagePatches", "ExtractVolumePatches", "DepthToSpace", "SpaceToDepth",
    "DrawBoundingBoxesV2", "MaxPoolWithArgmax", "FractionalMaxPool", "FractionalAvgPool",
    "Dilation2D", "FakeQuantWithMinMaxVarsPerChannel",
    # a dilated convolution's (tf.nn.convolution): the rows tiled by blocks, and back
    "SpaceToBatchND", "BatchToSpaceND",
})
# ops that make a tensor of the shape their first input gives (ones, zeros,
# random draws): it has the batch's rows where that shape's first entry counts them
SHAPED = frozenset({
    "Fill", "RandomStandardNormal", "RandomUniform", "RandomUniformInt", "TruncatedNormal",
    "StatelessRandomNormal", "StatelessRandomUniform", "StatelessTruncatedNormal",
    "StatelessRandomNormalV2", "StatelessRandomUniformV2", "StatelessTruncatedNormalV2",
    "StatelessRandomUniformIntV2", "StatelessRandomUniformFullIntV2"})
# transposed convolutions: input 2 is the data, input 0 the output's shape
TRANSPOSED_CONVOLUTIONS = frozenset({"Conv2DBackpropInput", "Conv3DBackpropInputV2",
                                     "DepthwiseConv2dNativeBackpropInput"})
# the loss ops that line up logits (input 0) and labels (input 1)
LOSSES = frozenset({"SparseSoftmaxCrossEntropyWithLogits", "SoftmaxCrossEntropyWithLogits"})
# CTC's losses and decoders (time-major logits): (the input of the sequence
# lengths, one per example; the output with a row per example)
CTC = {"CTCLoss": (3, 0), "CTCLossV2": (3, 0), "CTCGreedyDecoder": (1, -1),
       "CTCBeamSearchDecoder": (1, -1)}
REDUCTIONS = frozenset({"Sum", "Mean", "Max", "Min", "Prod", "All", "Any", "EuclideanNorm"})


def sparse_batch(shape) -> bool:
    """Whether a SparseTensor's dense shape `shape` (a tf.Tensor) is a
    batch's: a CTC decoder's, or a sparse_placeholder's (fed, it is split
    by rows)."""
    op = shape.op
    while op.type in ("Identity", "Cast"):
        op = op.inputs[0].op
    return op.type in CTC or op.type in ("Placeholder", "PlaceholderWithDefault") and \
        op.name.endswith("/shape")      # (with a shape given in part, one with a default)


def slice_axis(a, rank, strides, begin, end, ellipsis, new, shrink) -> int | None:
    """Where input axis `a` is in a strided slice's output: None if the slice
    drops it or keeps only some of its entries (x[None, :, 1:] puts the
    rows of x on axis 1)."""
    at, out, spec = 0, 0, len(strides)
    for i in range(spec):
        if ellipsis >> i & 1:       # the dims no other entry names, kept whole
            covered = rank - sum(1 for j in range(spec) if not (ellipsis | new) >> j & 1)
            if at <= a < at + covered:
                return out + a - at
            at, out = at + covered, out + covered
        elif new >> i & 1:
            out += 1
        elif at == a:
            whole = (begin & end) >> i & 1 and strides[i] == 1 and not shrink >> i & 1
            return out if whole else None
        else:
            at, out = at + 1, out + (0 if shrink >> i & 1 else 1)
    return out + a - at         # dims past the spec, kept whole


# ops that give a row per row of a sparse batch: tf.sparse.sparse_dense_matmul,
# tf.nn.embedding_lookup_sparse's combiners
SPARSE_LAYERS = frozenset({
    "SparseTensorDenseMatMul", "SparseSegmentSum", "SparseSegmentMean", "SparseSegmentSqrtN",
    "SparseSegmentSumWithNumSegments", "SparseSegmentMeanWithNumSegments",
    "SparseSegmentSqrtNWithNumSegments", "SegmentSum", "SegmentMean"})


def column_zero(op) -> bool:
    """Whether StridedSlice `op` is `x[:, 0]` (a SparseTensor's rows, the
    first column of its coordinates)."""
    begin, strides = (tf.get_static_value(op.inputs[i]) for i in (1, 3))
    return begin is not None and strides is not None and list(begin) == [0, 0] and \
        list(strides) == [1, 1] and op.get_attr("shrink_axis_mask") == 2 and \
        not op.get_attr("ellipsis_mask") | op.get_attr("new_axis_mask")


def row_input(op_type: str) -> int:
    """The input of a sparse layer that holds each value's row."""
    return {"SparseTensorDenseMatMul": 0, "SegmentSum": 1, "SegmentMean": 1}.get(op_type, 2)


def sparse_rows(op, rows) -> bool:
    """Whether sparse layer `op` gives a row per row of a batch: its values'
    rows are a batch's row ids (`row_ids`), or its coordinates a batch's."""
    return row_ids(op.inputs[row_input(op.type)], rows, op.type == "SparseTensorDenseMatMul")


def row_source(op):
    """Where sparse layer `op`'s rows come from: the dense tensor d of
    `tf.where(d)` (a SparseTensor made in the graph), a sparse_placeholder's
    indices, or None (`row_ids`)."""
    return _numbered_by(op.inputs[row_input(op.type)], op.type == "SparseTensorDenseMatMul")


def _vector_reshape(t) -> bool:
    """A vector reshaped to a vector (tf.math.bincount's of its input)."""
    return t.op.type == "Reshape" and t.shape.rank == 1 and t.op.inputs[0].shape.rank == 1


def row_ids(x, rows, column: bool = False) -> bool:
    """Whether `x` numbers each value of a SparseTensor by its row, a row
    of a batch: column 0 of a sparse_placeholder's indices, or of
    `tf.where(d)` where `rows(d)` (d's first dimension is the batch's).
    `column`: x is the coordinates themselves (a sparse matmul's), rows in
    their column 0."""
    source = _numbered_by(x, column)
    return source is not None and (source.op.type == "Placeholder" or rows(source))


def _numbered_by(x, column: bool = False):
    """The tensor whose rows number x's values (`row_ids`), or None."""
    while x.op.type in ("Cast", "Identity") or _vector_reshape(x) or \
            x.op.type == "StridedSlice" and not column:
        if x.op.type == "StridedSlice":
            if not column_zero(x.op):
                return None         # another column of the coordinates, or not shown
            column = True
        x = x.op.inputs[0]
    if not column:
        return None
    if x.op.type == "Where":
        return x.op.inputs[0]
    head = x.op.name.removesuffix("/indices")
    if x.op.type != "Placeholder" or head == x.op.name:
        return None
    try:
        return x if sparse_batch(x.graph.get_tensor_by_name(head + "/shape:0")) else None
    except KeyError:
        return None
