"""Configuration: the schema, typed settings of runs and stages, step identities, the results folder check."""
