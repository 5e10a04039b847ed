"""The recipe language: the schema, its validation, bounded YAML, the defaults a recipe implies, and the shipped
recipes (*.yaml). It parses and checks recipes only; what runs them is lowbit.app."""
