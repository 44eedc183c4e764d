"""The command line: its errors, `refengine compare`, `refengine eval`."""
