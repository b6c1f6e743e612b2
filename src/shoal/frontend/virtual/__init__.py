"""Virtual models: names that resolve to weighted choices over fleet models and outside
providers (`virtual`), the routes that define them in the store (`routes`) and the provider
secrets they name (`secrets`).
"""
