"""The one exception type that front ends show to users as a single line."""


class QuickdraftError(Exception):
    """A problem the user can fix: the message names the cause and the fix.

    The CLI prints it as one line (no traceback unless --debug) and exits non-zero.
    """
