"""The one exception type that carries a user mistake or an environment problem."""


class FlyspecError(Exception):
    """An error whose message is meant for the user: the CLI prints it as one line, no traceback."""
