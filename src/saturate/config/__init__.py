"""The run's configuration: the typed schema every group is checked against (schema), what Hydra
must know before it composes conf/ (registration: the schema and the resolvers), and a run's
readable name (naming). Nothing here imports torch: a config's mistakes and `--help` stay fast."""
