"""matplotlib, imported on the first plot rather than with the module that plots.

pyplot costs a second or more to import; every rank of a run imports the report module
through the loop, and only rank 0's last step ever draws. ``pyplot()`` picks the
file-only Agg backend (training machines have no screen) and returns the module."""

from __future__ import annotations

from typing import Any


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
