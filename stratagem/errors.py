"""The exceptions stratagem raises: mistakes a user can fix, and ranks a job lost."""

import difflib


class UsageError(ValueError):
    """Bad input: an unknown model or preset, a malformed cluster spec, degrees that don't divide.

    The message names the bad part, the rule it breaks and, after ``HINT:``, the fix. The
    command line prints it without a traceback and exits with status 2.
    """


class PeerLost(RuntimeError):
    """A rank of a running job stopped answering (its process died, or its host or network
    did), so a collective failed and the job cannot go on: a synchronous plan needs every rank.

    The message names the lost rank (or the store's host), the rank that saw it and the failed
    collective's error and, after ``HINT:``, the way on: a restart from the last checkpoint.
    Raised from the collective's error (``__cause__``).
    """


def describe(err: BaseException) -> str:
    """An exception in one line: its type and message (shortened), or what sys.exit was called with."""
    if isinstance(err, SystemExit):
        return f"SystemExit (it called sys.exit({err.code!r}))"
    try:
        text = " ".join(str(err).split())  # one line, however many the message had
    except Exception:  # an exception whose __str__ fails
        text = ""
    text = text if len(text) <= 300 else f"{text[:297]}..."
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def close_matches(word: str, choices: list[str]) -> str:
    """' (did you mean a, b?)' for the choices close to ``word``, else ''."""
    found = difflib.get_close_matches(word[:100], choices, n=3)
    return f" (did you mean {', '.join(found)}?)" if found else ""
