"""A run folder's life: its lock, each rank's start and exit, metrics, trackers, report."""
