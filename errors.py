"""The one exception type for mistakes a user can fix: entry points print it as one line."""


class UserError(Exception):
    """Bad input (config value, data file, checkpoint, prompt); the message says how to fix it."""
