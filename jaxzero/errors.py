"""The one base class of jaxzero's user errors (it imports nothing: every layer may use it)."""

from __future__ import annotations


class Error(Exception):
    """A mistake the user fixes; the message is one line saying what was wrong and what to do.

    Every ``jaxzero`` command (:func:`jaxzero.cli.run`) prints it as
    ``jaxzero <command>: error: <message>`` on stderr and exits with status 2, with no
    traceback; a library caller catches ``jaxzero.Error``. Subclasses keep a builtin
    second base where callers catch that (``class CheckpointError(Error, ValueError)``).
    Exceptions that end a command on purpose (a signal, a diverged loss) are not errors
    of the user and do not derive from it.
    """
