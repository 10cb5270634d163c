"""Plans: memory and time of a step before it is queued, inference placement, the checks at DAG time."""
