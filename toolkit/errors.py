"""User-facing errors: the CLI prints them as one line and exits 2."""


class RecipeError(ValueError):
    """A mistake in what the user asked for (recipe, overrides, data, model path).

    The message names the problem and the fix. Raised anywhere; the CLI turns it
    into one line on stderr and exit code 2, and removes a half-made output dir.
    """


USER_ERROR_EXIT_CODE = 2
INTERRUPTED_EXIT_CODE = 128 + 2  # Ctrl-C (SIGINT), as shells report it
