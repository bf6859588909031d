"""The exit codes of every ``graphtrim`` command."""

EXIT_OK, EXIT_MISMATCH, EXIT_BAD_INPUT, EXIT_PASS_FAILURE = 0, 1, 2, 3
