"""CUPYTP_DEBUG=1: before each collective, the ranks of its group compare what they are about to
run, so a skipped or mismatched collective is an error naming every rank's call at once instead
of a hang until the timeout.

A fingerprint is the op with the arguments every rank must share, the global shape, the dtype
and the call site: the first frame outside the cupytp package, compared by line (by function
for broadcast, scatter and gather, whose source rank's code naturally differs); the framework's
own frame is shown too, not compared. The ranks exchange them with one small host all-gather
over the group's MPI communicator, polled against the group's timeout. Point-to-point sends and
receives (send, recv, sendrecv) are not compared (only two ranks take part in each).
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
        if call.op in ("send", "recv", "sendrecv"):
            return
        (path, line, function), inner = call_sites()
        rooted = call.op in _ROOTED
        shape = "" if call.shape is None else f" of {call.shape}"
        where = f"{path} ({function})" if rooted else f"{path}:{line} ({function})"
        notes = ([f"line {line}"] if rooted else []) + \
            ([f"in {inner[0]}:{inner[1]} ({inner[2]})"] if inner[0] != path else [])
        text = f"{call.op}({call.detail}){shape} {call.dtype} at {where}\0"
        text = (text + (f" [{'; '.join(notes)}]" if notes else "")).encode()[:_SIZE]
        group = call.group
        send = numpy.zeros(_SIZE, dtype=numpy.uint8)
        send[:len(text)] = numpy.frombuffer(text, dtype=numpy.uint8)
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
