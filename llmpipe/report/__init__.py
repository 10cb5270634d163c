"""Reports: tables, plots, a run's page and the summary printed at the end of a chain."""
