"""CUPYTP_DEBUG=1: before each collective, the ranks of its group compare what they are about to
run, so a skipped or mismatched collective is an error naming every rank's call at once instead
of a hang until the timeout.

A fingerprint is the op with the arguments every rank must share, the global shape, the dtype
and the call site: the first frame outside the cupytp package, compared by line (by function
for broadcast, scatter and gather, whose source rank's code naturally differs); the framework's
own frame is shown too, not compared. The ranks exchange them with one small host all-gather
over the group's MPI communicator, polled against the group's timeout.

Point-to-point transfers are compared pairwise: for each send, the two ranks exchange a
fingerprint (shape, dtype, call site) over host messages tagged by direction, so a rank's k-th
send to a peer meets that peer's k-th receive from it, as the data will. A receive of another
shape or dtype is an error on both ranks naming both calls; a receive that no send meets is a
timeout naming the check.
"""
import os
import sys

import numpy

from cupytp.distributed.mpi_group import pending

_SIZE = 1024                    # bytes of one rank's fingerprint text
_DISTRIBUTED = os.path.dirname(os.path.abspath(__file__))
_PACKAGE = os.path.dirname(_DISTRIBUTED)
_ROOT = os.path.dirname(_PACKAGE)


class CollectiveMismatchError(RuntimeError):
    """The ranks of a group reached different collectives (CUPYTP_DEBUG=1 found it)."""


_ROOTED = ("broadcast", "scatter", "gather")
_TAGS = {"send": 7301, "recv": 7302}     # host messages of the point-to-point check, by sender


def _site(frame):
    path = os.path.abspath(frame.f_code.co_filename)
    if path.startswith(_ROOT + os.sep):
        path = os.path.relpath(path, _ROOT)
    return path, frame.f_lineno, frame.f_code.co_name


def call_sites():
    """(path, line, function) of the first frame outside the cupytp package and of the innermost
    frame outside cupytp/distributed, for the current call."""
    frame, inner = sys._getframe(1), None
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if inner is None and not path.startswith(_DISTRIBUTED + os.sep):
            inner = _site(frame)
        if not path.startswith(_PACKAGE + os.sep):
            return _site(frame), inner
        frame = frame.f_back
    return inner, inner


class FingerprintCheck:
    """The observer that `init()` registers under CUPYTP_DEBUG=1."""

    def before(self, call):
        if call.peers is not None:
            return _check_point_to_point(call)
        (path, line, function), inner = call_sites()
        rooted = call.op in _ROOTED
        shape = "" if call.shape is None else f" of {call.shape}"
        where = f"{path} ({function})" if rooted else f"{path}:{line} ({function})"
        notes = ([f"line {line}"] if rooted else []) + \
            ([f"in {inner[0]}:{inner[1]} ({inner[2]})"] if inner[0] != path else [])
        text = f"{call.op}({call.detail}){shape} {call.dtype} at {where}\0"
        send = _encoded(text + (f" [{'; '.join(notes)}]" if notes else ""))
        group = call.group
        received = numpy.empty((group.size, _SIZE), dtype=numpy.uint8)
        request = group.host_comm.Iallgather(send, received)
        pending([request], group, f"the CUPYTP_DEBUG check before {call.op}").wait()
        texts = [bytes(row).rstrip(b"\0").decode(errors="replace") for row in received]
        keys = [t.split("\0")[0] for t in texts]
        if len(set(keys)) > 1:
            ranks = {}                  # each distinct call -> the global ranks making it
            for r, t in enumerate(texts):
                ranks.setdefault(t.replace("\0", ""), []).append(group.ranks[r])
            calls = "; ".join(f"global rank{'s' if len(rs) > 1 else ''} "
                              f"{', '.join(map(str, rs))} call{'' if len(rs) > 1 else 's'} {t}"
                              for t, rs in ranks.items())
            raise CollectiveMismatchError(
                f"collective mismatch on group {group.name!r} (global ranks "
                f"{list(group.ranks)}): {calls}. Every rank of a group must issue the same "
                "collectives in the same order (checked because CUPYTP_DEBUG=1)")

    def after(self, call):
        pass


def _encoded(text):
    buffer = numpy.zeros(_SIZE, dtype=numpy.uint8)
    data = text.encode()[:_SIZE]
    buffer[:len(data)] = numpy.frombuffer(data, dtype=numpy.uint8)
    return buffer


def _check_point_to_point(call):
    """Exchange a fingerprint with the peer of each transfer of `call` and compare: each of
    this rank's sends against the peer's receive it meets, and each receive against the send."""
    (path, line, function), _ = call_sites()
    group = call.group
    requests, exchanged = [], []
    for kind, peer, shape, dtype in call.peers:
        mine = _encoded(f"{shape} {dtype}\0{path}:{line} ({function})")
        theirs = numpy.empty(_SIZE, dtype=numpy.uint8)
        other = "recv" if kind == "send" else "send"
        requests.append(group.host_comm.Isend(mine, dest=peer, tag=_TAGS[kind]))
        requests.append(group.host_comm.Irecv(theirs, source=peer, tag=_TAGS[other]))
        exchanged.append((kind, peer, f"{shape} {dtype}", mine, theirs))
    buffers = [b for *_, mine, theirs in exchanged for b in (mine, theirs)]
    pending(requests, group, f"the CUPYTP_DEBUG check before {call.op} ({call.detail})",
            buffers).wait()
    for kind, peer, key, mine, theirs in exchanged:
        their_key, their_site = bytes(theirs).rstrip(b"\0").decode(errors="replace").split(
            "\0")
        if their_key != key:
            me, them = group.ranks[group.rank], group.ranks[peer]
            sender, receiver = ((me, f"{path}:{line} ({function})", key),
                                (them, their_site, their_key))
            if kind == "recv":
                sender, receiver = receiver, sender
            raise CollectiveMismatchError(
                f"point-to-point mismatch on group {group.name!r}: global rank {sender[0]} "
                f"sends {sender[2]} at {sender[1]}, which global rank {receiver[0]} receives as "
                f"{receiver[2]} at {receiver[1]}. A send must meet a receive of the same shape "
                "and dtype (checked because CUPYTP_DEBUG=1)")
