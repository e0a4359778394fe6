"""Recipes: typed, frozen dataclasses, the YAML files they come from, `--set` overrides, the key reference."""
