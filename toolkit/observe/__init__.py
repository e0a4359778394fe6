"""What a run measures and reports: metrics, trackers, profiling, the collective counter, versions."""
