"""The HTML report: rendering, charts, diagnosis and number formatting. Reads results only."""
