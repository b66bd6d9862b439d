"""Run configuration: the typed schema of a run (sections per concern), YAML read with limits, --set overrides, presets and the error messages that point at a key."""
