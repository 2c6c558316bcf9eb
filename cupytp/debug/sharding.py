"""visualize_sharding: which global rank holds which block of a DTensor.

Computed from the Layout alone (no communication), so every rank gets the same picture. A 1-D or
2-D tensor is drawn as a grid of its blocks (rows × columns) with the ranks holding each; other
shapes are listed block by block. A Partial placement is marked `(P)` (`(P max)` for a partial
max): those ranks each hold a part of the block, and its value is their sum (max).
"""
import numpy

from cupytp.tensor.placement import describe


def _blocks(tensor):
    """{(offsets, local shape): [global ranks]} over every mesh coordinate."""
    mesh, layout = tensor.mesh, tensor.layout
    blocks = {}
    for coordinate in numpy.ndindex(*mesh.shape):
        block = layout.local_block(coordinate)
        blocks.setdefault(block, []).append(int(mesh.mesh[coordinate]))
    return blocks


def _span(offset, extent):
    return f"{offset}:{offset + extent}"


def _partial_note(tensor):
    marks = {p.op for p in tensor.placements if p.is_partial()}
    if not marks:
        return "", None
    dims = ", ".join(repr(tensor.mesh.dim_names[d]) for d, p in enumerate(tensor.placements)
                     if p.is_partial())
    mark = " (P)" if marks == {"sum"} else f" (P {'/'.join(sorted(marks))})"
    return mark, (f"(P): the ranks of a block each hold a part; its value is their "
                  f"{' and '.join(sorted(marks))} over mesh dimension {dims}")


def _cell(ranks, mark):
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}{mark}"


def visualize_sharding(tensor, png=None):
    """The text picture of `tensor`'s blocks (print it); with `png`, also draws a 1-D or 2-D
    tensor's blocks into that image file when matplotlib is installed (returns the text
    either way)."""
    blocks = _blocks(tensor)
    mark, note = _partial_note(tensor)
    dims = ", ".join(f"{n}={s}" for n, s in zip(tensor.mesh.dim_names, tensor.mesh.shape))
    lines = [f"DTensor {tensor.shape} {tensor.dtype} {describe(tensor.placements)} on mesh "
             f"({dims})"]
    empty = [rank for (_, shape), ranks in blocks.items() if 0 in shape for rank in ranks]
    held = {block: ranks for block, ranks in blocks.items() if 0 not in block[1]}
    if 1 <= tensor.ndim <= 2:
        lines += _grid(tensor, held, mark)
    else:
        for (offsets, shape), ranks in sorted(held.items()):
            index = ", ".join(_span(o, n) for o, n in zip(offsets, shape))
            lines.append(f"  [{index}]  {_cell(ranks, mark)}")
    if empty:
        lines.append(f"rank{'s' if len(empty) > 1 else ''} {', '.join(map(str, empty))} "
                     "hold an empty block")
    if note:
        lines.append(note)
    if png is not None:
        _draw(tensor, held, mark, png)
    return "\n".join(lines)


def _axes(tensor, held):
    """Distinct (offset, extent) spans of the rows and of the columns."""
    two_d = tensor.ndim == 2
    rows = sorted({(o[0], s[0]) for o, s in held} if two_d else {(0, 1)})
    cols = sorted({(o[-1], s[-1]) for o, s in held})
    return rows, cols


def _at(held, tensor, row, col):
    for (offsets, shape), ranks in held.items():
        if (offsets[-1], shape[-1]) == col and (tensor.ndim == 1 or
                                                 (offsets[0], shape[0]) == row):
            return ranks
    return []


def _grid(tensor, held, mark):
    rows, cols = _axes(tensor, held)
    head = [""] + [f"cols {_span(*c)}" if tensor.ndim == 2 else _span(*c) for c in cols]
    table = [head]
    for row in rows:
        label = f"rows {_span(*row)}" if tensor.ndim == 2 else ""
        table.append([label] + [_cell(_at(held, tensor, row, col), mark) for col in cols])
    widths = [max(len(line[i]) for line in table) for i in range(len(head))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip()
            for line in table]


def _draw(tensor, held, mark, path):
    try:
        from matplotlib.figure import Figure
        from matplotlib.patches import Rectangle
    except ImportError:
        return
    if tensor.ndim not in (1, 2):
        raise ValueError(f"visualize_sharding draws 1-D and 2-D tensors, not shape "
                         f"{tensor.shape}; use its text")
    rows_total = tensor.shape[0] if tensor.ndim == 2 else 1
    figure = Figure(figsize=(6, 6 * min(1.0, max(0.2, rows_total / tensor.shape[-1]))))
    axes = figure.add_subplot()
    for (offsets, shape), ranks in held.items():
        top, height = (offsets[0], shape[0]) if tensor.ndim == 2 else (0, 1)
        axes.add_patch(Rectangle((offsets[-1], top), shape[-1], height, fill=True,
                                 facecolor=f"C{ranks[0] % 10}", alpha=0.35, edgecolor="black"))
        axes.text(offsets[-1] + shape[-1] / 2, top + height / 2, _cell(ranks, mark),
                  ha="center", va="center", fontsize=9)
    axes.set_xlim(0, tensor.shape[-1])
    axes.set_ylim(rows_total, 0)
    axes.set_title(f"{tensor.shape} {describe(tensor.placements)}")
    figure.savefig(path, dpi=100, bbox_inches="tight")
