"""The HTML reports: the run's (rendering, charts, diagnosis) and the capacity plan's. Reads results and plans only."""
