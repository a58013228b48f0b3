"""The exceptions stratagem raises for mistakes a user can fix."""


class UsageError(ValueError):
    """Bad input: an unknown model or preset, a malformed cluster spec, degrees that don't divide.

    The message names the bad part, the rule it breaks and, after ``HINT:``, the fix. The
    command line prints it without a traceback and exits with status 2.
    """
