"""specforge_lite: train speculative-decoding drafters for your own target model."""

__version__ = "0.1.0"


class SpecforgeError(Exception):
    """An error the user can fix (bad input, missing package, bad config).

    The CLI prints its message without a traceback and exits with status 2.
    """
