"""A rank's traceback as the client shows it: each frame's line, and the columns under which
Python puts its ``^^^^`` markers.

Dask sends a task's traceback through tblib, which keeps each frame's file, function and line
but rebuilds the frame from a one-statement stub (``raise __traceback_maker``). Python 3.11 takes
the markers from the position table of the frame's code object, so the client's markers
underlined the stub's columns, not the user's expression. The rank records each frame's
positions on the exception (which travels with it), and the client gives each rebuilt frame a
position table holding exactly those.
"""

import contextlib
import itertools
from collections.abc import Callable
from types import CodeType, TracebackType

# An attribute of the exception: its ``__dict__`` travels with it (tblib pickles it).
POSITIONS = "_dask_train_positions"

# line, end line, column, end column (the last three None where unknown)
Where = tuple[int, int | None, int | None, int | None]
# file, function, then where
Position = tuple[str, str, int, int | None, int | None, int | None]

# NameError when run: the frame that raises it becomes the rebuilt frame (as in tblib).
_STUB = compile("raise __dask_train_rebuilt_frame__", "<stub>", "exec")
_LONG_FORM, _NO_COLUMNS = 14, 13  # entry kinds of the 3.11 position table (locations.md)
_UNITS_PER_ENTRY = 8


def keep_positions(error: BaseException) -> None:
    """Records where each frame of ``error``'s traceback stood, on ``error`` itself."""
    positions: list[Position] = []
    trace = error.__traceback__
    while trace is not None:
        code = trace.tb_frame.f_code
        known = None
        if trace.tb_lasti >= 0:  # -1: the instruction is unknown
            known = next(itertools.islice(code.co_positions(), trace.tb_lasti // 2, None), None)
        if known is None or known[0] is None:
            known = (trace.tb_lineno, None, None, None)
        positions.append((code.co_filename, code.co_name, *known))
        trace = trace.tb_next
    # An exception that takes no attributes: the client shows its frames without markers.
    with contextlib.suppress(AttributeError, TypeError):
        setattr(error, POSITIONS, positions)


def rebuilt_traceback(
    error: BaseException, file_of: Callable[[str, str], str] = lambda file, _: file
) -> TracebackType | None:
    """``error``'s traceback (as tblib rebuilt it) with each frame at the positions the rank
    recorded, and in the file ``file_of(file, function)`` names.

    A frame without recorded positions keeps its line and shows no markers: better none than
    markers under the wrong columns.
    """
    recorded: list[Position] = list(getattr(error, POSITIONS, None) or [])
    vars(error).pop(POSITIONS, None)  # the user gets their exception as they raised it
    frames = []
    trace = error.__traceback__
    while trace is not None:
        frames.append(trace)
        trace = trace.tb_next
    if not frames:
        return None
    # Dask may leave out frames above the rank's function, never below: align the innermost.
    aligned: list[Position | None] = [None] * (len(frames) - len(recorded))
    aligned += recorded[-len(frames) :]
    head: TracebackType | None = None
    last: TracebackType | None = None
    for trace, position in zip(frames, aligned, strict=True):
        code = trace.tb_frame.f_code
        line = trace.tb_lineno
        where: Where = (line, None, None, None)
        if position is not None and position[:3] == (code.co_filename, code.co_name, line):
            where = position[2:]
        rebuilt = _frame(
            file_of(code.co_filename, code.co_name), code.co_name, where, trace.tb_frame.f_globals
        )
        if last is None:
            head = rebuilt
        else:
            last.tb_next = rebuilt
        last = rebuilt
    return head


def _frame(file: str, function: str, where: Where, f_globals: dict) -> TracebackType:
    """One traceback entry in ``file``'s ``function``, its instruction at ``where``."""
    code = _code(file, function, where)
    try:
        exec(code, {k: f_globals[k] for k in ("__file__", "__name__") if k in f_globals}, {})
    except NameError as raised:
        assert raised.__traceback__ is not None and raised.__traceback__.tb_next is not None
        return raised.__traceback__.tb_next  # the stub's frame, not this one
    raise AssertionError("the stub always raises")


def _code(file: str, function: str, where: Where) -> CodeType:
    line, end_line, column, end_column = where
    units = len(_STUB.co_code) // 2
    base = _STUB.replace(co_filename=file, co_name=function, co_firstlineno=line)
    if end_line is None or column is None or end_column is None or end_line < line:
        end_line = column = end_column = None
    code = base.replace(co_linetable=_table(units, line, end_line, column, end_column))
    wanted = (line, end_line if column is not None else line, column, end_column)
    if all(p == wanted for p in code.co_positions()):
        return code
    # Not the table format this was written for: the right line, and no markers.
    return base.replace(co_linetable=_table(units, line, None, None, None))


def _table(
    units: int, line: int, end_line: int | None, column: int | None, end_column: int | None
) -> bytes:
    """A position table putting each of ``units`` code units at the same place, the first line
    being ``co_firstlineno`` (every line delta is 0)."""
    table = bytearray()
    while units > 0:
        length = min(units, _UNITS_PER_ENTRY)
        units -= length
        if end_line is None or column is None or end_column is None:
            table.append(0x80 | _NO_COLUMNS << 3 | length - 1)
            table += _varint(0)  # line delta, a signed varint: 0 either way
        else:
            table.append(0x80 | _LONG_FORM << 3 | length - 1)
            table += _varint(0) + _varint(end_line - line) + _varint(column + 1)
            table += _varint(end_column + 1)
    return bytes(table)


def _varint(value: int) -> bytes:
    """The position table's unsigned varint: 6 bits a byte, least significant first."""
    out = bytearray()
    while value >= 64:
        out.append(64 | value & 63)
        value >>= 6
    out.append(value)
    return bytes(out)
